"""Shared fixtures: tiny checkpoints built once per session, a hermetic model cache, and the bad-input check of
the `generate` command."""

import contextlib
import os

# One intra-op thread per process, as torchrun sets for several ranks: the suite's ranks, CLI children and this process
# share 2 cores in CI, where each process's default thread per core made them spin against each other (measured on a
# busy machine: tests/test_tensor_parallel.py's rank jobs 2-3x faster, 25% less CPU in all). Set before torch is
# imported, so it holds in this process too.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402

from neuron_diffusers import families, tiny  # noqa: E402
from neuron_diffusers.cli import main  # noqa: E402
from neuron_diffusers.tools.spawn import RankPools  # noqa: E402

IMAGE_FAMILIES = ("flux", "flux2", "qwenimage", "qwenimage21")


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory):
    """`tiny_checkpoint(family)` → folder of that family's tiny pipeline (seed 0), built on first use."""
    built = {}
    root = tmp_path_factory.mktemp("tiny")

    def get(family: str):
        if family not in built:
            built[family] = tiny.build_tiny(family, root / family, seed=0)
        return built[family]

    return get


def _session_cache(tmp_path_factory):
    return tmp_path_factory.getbasetemp() / "cache"


@pytest.fixture(scope="session")
def rank_pool(tmp_path_factory):
    """`rank_pool.run(fn, world_size, *args, timeout_s=...)` → each rank's `fn(*args)`, on gloo ranks spawned once
    per world size for the whole session (a spawn costs a minute of imports on a busy machine). A job that fails
    raises with its ranks' tracebacks and fails only its own test; a dead or hung rank gets the pool restarted.

    The session's cached tiny checkpoints are built first, here: a rank inside a process group builds one in an
    interpreter of its own (`tiny.cached_tiny`), every rank of the pool at once, seconds of imports each; this
    process builds each once, in a second or two of CPU for all of them."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("NEURON_DIFFUSERS_CACHE", str(_session_cache(tmp_path_factory)))
        for name in families.TINY_CHECKPOINTS:
            tiny.cached_tiny(name)
    pools = RankPools(collective_timeout_s=300.0)
    yield pools
    pools.close()


@pytest.fixture(scope="session")
def pooled(rank_pool):
    """`with pooled(module):` a tool's own spawn (`module.run_on_cpu_ranks`, e.g. `plan verify`'s) runs its rank job on
    the session's `rank_pool` instead: the same function on as many gloo ranks, minus a spawn's imports. For tools
    whose rank jobs only compute and return (not those that measure a fresh process's memory)."""
    @contextlib.contextmanager
    def on_pool(module):
        def run(fn, world_size, *args, timeout_s: float = 300.0, collective_timeout_s: float | None = None):
            return rank_pool.run(fn, world_size, *args, timeout_s=timeout_s)

        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(module, "run_on_cpu_ranks", run)
            yield

    return on_pool


@pytest.fixture(autouse=True)
def _hermetic_cache(tmp_path_factory, monkeypatch):
    """Embedded tiny models go to a per-session cache, never the user's ~/.cache."""
    monkeypatch.setenv("NEURON_DIFFUSERS_CACHE", str(_session_cache(tmp_path_factory)))


@pytest.fixture
def generate_refuses(tmp_path, capsys):
    """`generate_refuses(args, message)`: `generate ARGS` exits 2 with `message` in its one error line, and writes
    nothing: no `--out` (given, or `tmp_path / "out"`) that was not there before, no `tmp_path / "out"`."""
    def check(args: list[str], message: str) -> None:
        out = tmp_path / "out"
        if "--out" not in args:
            args = [*args, "--out", str(out)]
        target = args[args.index("--out") + 1]
        existed = os.path.exists(target)  # e.g. a file given as --out: refused, and left as it was
        assert main(["generate", *args]) == 2
        lines = [line for line in capsys.readouterr().err.splitlines() if "error:" in line]
        assert len(lines) == 1 and message in lines[0], lines
        assert (existed or not os.path.exists(target)) and not out.exists()

    return check
