"""Run diffusers' own `ContextParallelTesterMixin` (its Ulysses cases) on 2 CPU gloo ranks with neuron_diffusers.

    python tests/upstream_cp/run.py DIFFUSERS_CHECKOUT [pytest args...]

DIFFUSERS_CHECKOUT is a diffusers source tree whose `tests/` match the installed diffusers (the wheel ships no
tests). The mixin is diffusers' test code: it is run from that checkout, not copied here. It selects the context-
parallel tests of the four transformers that ship a `_cp_plan` (FLUX.1, FLUX.2, Qwen-Image, MiniMax-H3), their
Ulysses cases; ring cases skip themselves with the native attention backend (diffusers' rule). Exit status is
pytest's. Without the package, stock divides by `torch.accelerator.device_count()` (0 on a CPU host) and fails.
"""

import os
import subprocess
import sys
from pathlib import Path

MODULES = ("flux", "flux2", "qwenimage", "minimax_h3")


def main(argv: list[str]) -> int:
    if not argv or not (Path(argv[0]) / "tests" / "models" / "testing_utils" / "parallelism.py").exists():
        print(__doc__, file=sys.stderr)
        return 2
    checkout = Path(argv[0]).resolve()
    here = Path(__file__).resolve().parent
    files = [str(checkout / "tests" / "models" / "transformers" / f"test_models_transformer_{m}.py") for m in MODULES]
    env = {**os.environ, "DIFFUSERS_TEST_DEVICE": "cpu", "OMP_NUM_THREADS": "1",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(here), os.environ.get("PYTHONPATH")]))}
    command = [sys.executable, "-m", "pytest", *files, "-p", "cpu_ranks", "-p", "no:cacheprovider",
               "-k", "ContextParallel and not AttnBackends and ulysses", "-rA", *argv[1:]]
    return subprocess.run(command, cwd=checkout, env=env).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
