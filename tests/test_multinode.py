"""The job across nodes on torchrun's own engine: two torchrun agents on loopback form two nodes through c10d
rendezvous; tp=2 inside each node, data parallelism across them, one shared output folder."""

import json
import socket
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

PROMPTS = ["a red fox in the snow", "a blue bird", "a green frog on a leaf", "a yellow boat"]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _torchrun(*launch: str, out, prompts) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launch, "-m", "neuron_diffusers", "generate",
            "--prompts", str(prompts), "--out", str(out), "--tp", "2"]


def _finish(process: subprocess.Popen) -> str:
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-4000:]
    return stdout + stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The same job as two nodes of 2 ranks (two agents started at once) and as one node of 4 ranks."""
    root = tmp_path_factory.mktemp("multinode")
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    port = _free_port()
    rendezvous = ["--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                  "--rdzv-id=neuron-diffusers-test"]
    agents = [subprocess.Popen(_torchrun(*rendezvous, out=root / "two_nodes", prompts=prompts), text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    logs = [_finish(agent) for agent in agents]
    one_node = subprocess.Popen(_torchrun("--nproc-per-node=4", out=root / "one_node", prompts=prompts), text=True,
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    logs.append(_finish(one_node))
    return root, logs


def _images(folder) -> dict[str, np.ndarray]:
    return {path.name: np.asarray(Image.open(path).convert("RGB")) for path in sorted(folder.glob("*.png"))}


def test_two_nodes_make_every_image_once(runs):
    root, _ = runs
    images = _images(root / "two_nodes")
    assert len(images) == len(PROMPTS) and [name[:5] for name in images] == ["00000", "00001", "00002", "00003"]
    summary = json.loads((root / "two_nodes" / "summary.json").read_text())
    assert summary["generated"] == len(PROMPTS), summary


def test_two_nodes_equal_one_node_pixel_for_pixel(runs):
    root, _ = runs
    two, one = _images(root / "two_nodes"), _images(root / "one_node")
    assert list(two) == list(one)
    for name in two:
        assert np.array_equal(two[name], one[name]), name
    # Control: equality this strict fails on another prompt's image (the comparison can fail).
    first, second = list(two)[:2]
    assert not np.array_equal(two[first], one[second])
