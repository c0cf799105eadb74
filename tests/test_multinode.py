"""The job across nodes on torchrun's own engine, in one launch: two torchrun agents on loopback form two nodes
through c10d rendezvous (tp=2 inside each node, data parallelism across them, one shared output folder) with
`--max-restarts 1`, and rank 1 is SIGKILLed after the first image: torchrun restarts the whole two-node group (the
other node's agent restarts on the membership change, without spending a restart) and the job resumes from what is
on disk. Its reference is the same job uninterrupted as one node of 4 ranks, run on the session's gloo ranks
(`rank_pool`: `plan_job`, `run_job`, as torchrun would run them): the pixels do not depend on the data-parallel
split nor on the restart."""

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
    """The job as two nodes of 2 ranks (two agents started at once, `--max-restarts 1`) whose rank 1 is SIGKILLed
    after the first image (what was on disk then, name -> inode and mtime, is kept), and as one node of 4 ranks (the
    pool's), uninterrupted."""
    root = tmp_path_factory.mktemp("multinode")
    prompts = root / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    port = _free_port()
    rendezvous = ["--nnodes=2", "--nproc-per-node=2", "--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{port}",
                  "--rdzv-id=neuron-diffusers-test", "--max-restarts=1"]
    out = root / "two_nodes"
    agents = [subprocess.Popen([*_torchrun(*rendezvous, out=out, prompts=prompts), "--timeout", "60"], text=True,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE) for _ in range(2)]
    kill_rank_1_after_first_image(agents[0], out, timeout_s=300)  # the agent holding ranks 0 and 1, or 2 and 3
    at_kill = {path.name: (path.stat().st_ino, path.stat().st_mtime_ns) for path in out.glob("*.png")}
    logs = [_finish(agent) for agent in agents]
    one_node = rank_pool.run(rank_jobs._job_outputs, 4, _job_argv(out=root / "one_node", prompts=prompts),
                             timeout_s=600)
    assert one_node[0]["summary"]["generated"] == len(PROMPTS), one_node[0]["summary"]
    return root, at_kill, logs


def _images(folder) -> dict[str, np.ndarray]:
    return {path.name: np.asarray(Image.open(path).convert("RGB")) for path in sorted(folder.glob("*.png"))}


def test_two_nodes_make_every_image_once(runs):
    root, _, _ = runs
    images = _images(root / "two_nodes")
    assert len(images) == len(PROMPTS) and [name[:5] for name in images] == [f"{i:05d}" for i in range(8)]


def test_a_killed_rank_restarts_the_two_node_group_which_makes_the_rest(runs):
    root, at_kill, _ = runs
    assert 0 < len(at_kill) < 8, "the kill did not land mid-job"
    assert not [p.name for p in (root / "two_nodes").iterdir() if p.name.startswith(".") and "lock" not in p.name]
    summary = json.loads((root / "two_nodes" / "summary.json").read_text())
    # The restarted attempt made exactly what the killed one had not finished: the other node's replica may have
    # finished an image after the kill (its TP group does not talk to the dead rank), so count from the summary.
    killed_attempt = {image["file"] for image in summary["images"] if image["seconds"] is None}
    assert summary["restarts"] == 1 and summary["generated"] == 8 - len(killed_attempt) > 0, summary
    assert summary["mesh"]["nodes"] == 2, summary["mesh"]


def test_the_summary_after_a_restart_lists_every_image_of_the_job(runs):
    root, at_kill, _ = runs
    images = json.loads((root / "two_nodes" / "summary.json").read_text())["images"]
    assert [image["file"] for image in images] == sorted(p.name for p in (root / "two_nodes").glob("*.png"))
    # The killed attempt's images have no timing (it never wrote a summary); the last attempt's have theirs. Those on
    # disk at the kill are the killed attempt's (the other node's replica may have finished one more after it).
    assert {image["file"] for image in images if image["seconds"] is None} >= set(at_kill), images
    assert all(image["prompt"] == f"prompt number {image['index']}" for image in images)


def test_images_written_before_the_kill_are_not_made_again(runs):
    root, at_kill, _ = runs
    for name, (inode, mtime) in at_kill.items():
        path = root / "two_nodes" / name
        assert (path.stat().st_ino, path.stat().st_mtime_ns) == (inode, mtime), f"{name} was written again"


def test_two_restarted_nodes_equal_one_uninterrupted_node_pixel_for_pixel(runs):
    root, _, _ = runs
    two, one = _images(root / "two_nodes"), _images(root / "one_node")
    assert list(two) == list(one)
    for name in two:
        assert np.array_equal(two[name], one[name]), name
    # Control: equality this strict fails on another prompt's image (the comparison can fail).
    first, second = list(two)[:2]
    assert not np.array_equal(two[first], one[second])
