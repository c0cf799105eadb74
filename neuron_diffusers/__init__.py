"""Tensor-parallel stock Hugging Face Diffusers pipelines on Trainium (TorchNeuron), CUDA and CPU.

Importing the package extends diffusers' own `TensorParallelConfig` path (CPU meshes, checks before
any weight is read, all-or-nothing setup; see `integration.py`). It touches no device and starts no
process group.
"""

from importlib.metadata import PackageNotFoundError, version

from . import integration
from .distributed import init_distributed, is_main_process, is_replica_leader, is_tp_leader, rank
from .runner import load_pipeline

try:
    __version__ = version("neuron-diffusers")
except PackageNotFoundError:  # running from a source tree that was not pip-installed
    __version__ = "0.0.0+unknown"

integration.install()

__all__ = ["init_distributed", "is_main_process", "is_replica_leader", "is_tp_leader", "load_pipeline", "rank",
           "__version__"]
