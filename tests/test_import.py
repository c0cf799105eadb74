"""`import neuron_diffusers` must be lean: no device, no process group, no TorchNeuron import."""

import subprocess
import sys

PROBE = """
import sys, torch
import neuron_diffusers
from diffusers.hooks import tensor_parallel
assert not torch.distributed.is_initialized(), "a process group was started"
assert not torch.cuda.is_initialized(), "CUDA was initialized"
assert "torch_neuronx" not in sys.modules, "TorchNeuron was imported"
assert "cpu" in tensor_parallel._SUPPORTED_TP_DEVICES, "CPU meshes were not enabled"
print("lean")
"""


def test_import_touches_no_device_or_process_group():
    # No visible GPU, as on a CPU-only host; the package must not try to find one at import.
    env = {"CUDA_VISIBLE_DEVICES": ""}
    result = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "lean"


def test_module_entry_point_shows_help():
    result = subprocess.run([sys.executable, "-m", "neuron_diffusers", "--help"], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 0, result.stderr
    assert "generate" in result.stdout and "tiny" in result.stdout
