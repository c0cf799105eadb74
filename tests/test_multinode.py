"""The job across nodes on torchrun's own engine: two torchrun agents on loopback form two nodes through c10d
rendezvous (tp=2 inside each node, data parallelism across them, one shared output folder); and torchrun's elastic
restart (`--max-restarts`) after a rank is killed mid-job, resuming from what is on disk. The one-node run is also
the restarted job's uninterrupted reference: the same prompts, steps and TP degree (the pixels do not depend on the
data-parallel split, as the two-node run against it shows), so no third job is launched for it. The one-node run
is the reference, not what is tested: it runs the same job (`plan_job`, `run_job`) on the session's 4 gloo ranks
(`rank_pool`) rather than under a torchrun of its own (an agent and 4 interpreters started for it)."""

import json
import socket
import subprocess
import sys

import numpy as np
import pytest
import rank_jobs
from killing import kill_rank_1_after_first_image
from PIL import Image

#: Eight prompts at 6 steps: slow enough that a kill after the first image lands mid-job (the elastic run below).
PROMPTS = [f"prompt number {i}" for i in range(8)]
STEPS = "6"


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _job_argv(out, prompts) -> list[str]:
    return ["--prompts", str(prompts), "--out", str(out), "--tp", "2", "--steps", STEPS]


def _torchrun(*launch: str, out, prompts) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *launch, "-m", "neuron_diffusers", "generate",
            *_job_argv(out, prompts)]


def _finish(process: subprocess.Popen) -> str:
    stdout, stderr = process.communicate(timeout=600)
    assert process.returncode == 0, stderr[-4000:]
    return stdout + stderr


@pytest.fixture(scope="module")
def runs(tmp_path_factory, rank_pool):
    """The same job as two nodes of 2 ranks (two agents started at once) and as one node of 4 ranks (the pool's)."""
    root = tmp_path_factory.mktemp("multinode")
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    port = _free_port()
    rendezvous = ["--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                  "--rdzv-id=neuron-diffusers-test"]
    agents = [subprocess.Popen(_torchrun(*rendezvous, out=root / "two_nodes", prompts=prompts), text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    logs = [_finish(agent) for agent in agents]
    one_node = rank_pool.run(rank_jobs._job_outputs, 4, _job_argv(out=root / "one_node", prompts=prompts),
                             timeout_s=600)
    assert one_node[0]["summary"]["generated"] == len(PROMPTS), one_node[0]["summary"]
    return root, logs


def _images(folder) -> dict[str, np.ndarray]:
    return {path.name: np.asarray(Image.open(path).convert("RGB")) for path in sorted(folder.glob("*.png"))}


def test_two_nodes_make_every_image_once(runs):
    root, _ = runs
    images = _images(root / "two_nodes")
    assert len(images) == len(PROMPTS) and [name[:5] for name in images] == [f"{i:05d}" for i in range(8)]
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



@pytest.fixture(scope="module")
def restarted(runs):
    """The one-node job's prompts as a 2-rank job with `--max-restarts 1` whose rank 1 is SIGKILLed after the first
    image; what was on disk at the kill (name -> inode and mtime) is kept. Its uninterrupted reference is `runs`'s
    one-node output."""
    root, _ = runs
    out = root / "restarted"
    launcher = subprocess.Popen(
        [*_torchrun("--standalone", "--nproc-per-node=2", "--max-restarts=1", out=out, prompts=root / "prompts.txt"),
         "--timeout", "60"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    kill_rank_1_after_first_image(launcher, out, timeout_s=300)
    at_kill = {path.name: (path.stat().st_ino, path.stat().st_mtime_ns) for path in out.glob("*.png")}
    return root, at_kill, _finish(launcher)


def test_a_killed_rank_restarts_the_group_and_every_image_exists_once(restarted):
    root, at_kill, log = restarted
    images = _images(root / "restarted")
    assert [name[:5] for name in images] == [f"{i:05d}" for i in range(8)]
    assert 0 < len(at_kill) < 8, "the kill did not land mid-job"
    assert not [p.name for p in (root / "restarted").iterdir() if p.name.startswith(".") and "lock" not in p.name]
    summary = json.loads((root / "restarted" / "summary.json").read_text())
    # The restarted attempt made exactly what the killed one had not finished.
    assert summary["restarts"] == 1 and summary["generated"] == 8 - len(at_kill), summary


def test_the_summary_after_a_restart_lists_every_image_of_the_job(restarted):
    root, at_kill, _ = restarted
    images = json.loads((root / "restarted" / "summary.json").read_text())["images"]
    assert [image["file"] for image in images] == sorted(p.name for p in (root / "restarted").glob("*.png"))
    # The killed attempt's images have no timing (it never wrote a summary); the last attempt's have theirs.
    assert {image["file"] for image in images if image["seconds"] is None} == set(at_kill), images
    assert all(image["prompt"] == f"prompt number {image['index']}" for image in images)


def test_images_written_before_the_kill_are_not_made_again(restarted):
    root, at_kill, _ = restarted
    for name, (inode, mtime) in at_kill.items():
        path = root / "restarted" / name
        assert (path.stat().st_ino, path.stat().st_mtime_ns) == (inode, mtime), f"{name} was written again"


def test_a_restarted_job_gives_the_uninterrupted_pixels(restarted):
    root, _, _ = restarted
    ours, reference = _images(root / "restarted"), _images(root / "one_node")  # the same job, uninterrupted
    assert list(ours) == list(reference)
    for name in ours:
        assert np.array_equal(ours[name], reference[name]), name
    first, second = list(ours)[:2]
    assert not np.array_equal(ours[first], reference[second])  # control: the comparison can fail
