"""`neuron-diffusers ARGV` (or a sample script) on the session's pool ranks: the command's own body (`cli.main`, the
same parser and job) on as many gloo ranks as `torchrun --nproc_per_node=N` would start, minus the launcher's
interpreter starts.

What torchrun itself adds (its environment, SIGTERM, exit codes, a dead rank) is tested with real launches elsewhere:
.ci/run's README command, tests/test_cli.py's killed rank, tests/test_multinode*.py, tests/test_serve.py. Here the
job runs on ranks whose process group outlives it, so its last two steps are held back: `leave_together` becomes a
barrier (the store keys it sets would be stale for the next job) and the group is not destroyed (the pool's next job
needs it). Its output is captured per rank.
"""

from __future__ import annotations

import contextlib
import io
import os


def run_cli(argv: list[str], cwd: str | None = None, script: str | None = None, env: dict | None = None) -> dict:
    """This rank's `neuron-diffusers ARGV` (or `python SCRIPT ARGV`) run in `cwd` with `env` added:
    {"code", "out", "err"} (argparse's exits included)."""
    import runpy
    import sys

    import pytest
    import torch.distributed as dist

    from neuron_diffusers import cli, job

    out, err = io.StringIO(), io.StringIO()
    with pytest.MonkeyPatch.context() as patch:  # everything set here is undone when the job ends
        patch.setattr(dist, "destroy_process_group", lambda *args, **kwargs: None)
        patch.setattr(job, "leave_together", lambda timeout_s=None: dist.barrier() or True)
        patch.setattr(sys, "argv", [script, *argv] if script else sys.argv)
        for name, value in (env or {}).items():
            patch.setenv(name, value)
        patch.chdir(cwd or os.getcwd())
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                if script is None:
                    code = cli.main(argv)
                else:
                    runpy.run_path(script, run_name="__main__")
                    code = 0
            except SystemExit as leaving:
                code = leaving.code if isinstance(leaving.code, int) else int(leaving.code is not None)
    return {"code": code, "out": out.getvalue(), "err": err.getvalue()}


def on_pool(rank_pool, argv: list[str], ranks: int, cwd=None, timeout_s: float = 600.0, script=None,
            env: dict | None = None) -> dict:
    """`neuron-diffusers ARGV` (or `python SCRIPT ARGV`) on `ranks` pool ranks, as a torchrun launch reports it:
    the highest rank's exit code wins as torchrun's does (any failing rank fails the launch), stdout and stderr of
    every rank in rank order."""
    results = rank_pool.run(run_cli, ranks, list(argv), None if cwd is None else str(cwd),
                            None if script is None else str(script), env, timeout_s=timeout_s)
    return {"code": max(result["code"] for result in results),
            "out": "".join(result["out"] for result in results),
            "err": "".join(result["err"] for result in results)}
