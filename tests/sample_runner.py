"""Run several sample scripts one after another in this one interpreter, each as `__main__` with its own argv, cwd
and captured stdout / stderr (file descriptors 1 and 2, so C++ and logging output are caught too): what a plain
`python samples/X.py ...` of each does, minus an interpreter start (seconds of imports) per script.

    python tests/sample_runner.py RUNS.json   # [[script, out, [extra args...], log_prefix], ...]

Each run's exit status goes to `log_prefix.code`, its output to `log_prefix.out` / `.err`. A run that fails does
not stop the next one (its process group, if left open, is closed first)."""

import json
import os
import runpy
import sys
import traceback


def _run(script: str, out: str, extra: list[str]) -> int:
    sys.argv = [script, "--out", out, *extra]
    os.chdir(os.path.dirname(out))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as leaving:
        return leaving.code if isinstance(leaving.code, int) else int(leaving.code is not None)
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        import torch.distributed as dist

        if dist.is_initialized():  # a failed script's group: the next script starts its own
            dist.destroy_process_group()
    return 0


def main(runs_file: str) -> None:
    for script, out, extra, log in json.loads(open(runs_file).read()):
        with open(f"{log}.out", "w") as stdout, open(f"{log}.err", "w") as stderr:
            sys.stdout.flush(), sys.stderr.flush()
            saved = os.dup(1), os.dup(2)
            os.dup2(stdout.fileno(), 1), os.dup2(stderr.fileno(), 2)
            try:
                code = _run(script, out, extra)
            finally:
                sys.stdout.flush(), sys.stderr.flush()
                os.dup2(saved[0], 1), os.dup2(saved[1], 2)
                os.close(saved[0]), os.close(saved[1])
        with open(f"{log}.code", "w") as status:
            status.write(str(code))


if __name__ == "__main__":
    main(sys.argv[1])
