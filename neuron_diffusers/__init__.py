"""Stock Hugging Face Diffusers pipelines, parallel across accelerator cores: Trainium (TorchNeuron), CUDA, CPU.

Importing the package extends diffusers' own `TensorParallelConfig` path (CPU meshes, checks before any weight is
read, all-or-nothing setup, our plans as the classes' defaults; see `compat/`). It touches no device
and starts no process group. The short path: `init_distributed` -> `load_pipeline` -> `compile_repeated_blocks`
-> `warmup` -> `pipe.generate`.
"""

from importlib.metadata import PackageNotFoundError, version

from . import compat, families  # noqa: F401  -- compat first: refuses an unpinned diffusers before any private
from .compat import install as _install
from .compat.plans import stock_plan, using_plan  # noqa: E402
from .compile import compile_repeated_blocks, compile_report, warmup  # noqa: E402
from .distributed import init_distributed, is_group_leader, is_main_process, is_replica_leader, is_tp_leader, rank  # noqa: E402
from .runner import load_pipeline  # noqa: E402

try:
    __version__ = version("neuron-diffusers")
except PackageNotFoundError:  # running from a source tree that was not pip-installed
    __version__ = "0.0.0+unknown"


def _install_families() -> None:
    """Push every family's plans into `compat` and `parallel` (which name no family): `families.install`, the one
    function `families.register` also calls for a family from outside."""
    for family in families.FAMILIES:
        families.install(family)


_install.install()
_install_families()

__all__ = ["compile_report", "compile_repeated_blocks", "init_distributed", "is_group_leader", "is_main_process",
           "is_replica_leader", "is_tp_leader", "load_pipeline", "rank", "stock_plan", "using_plan", "warmup",
           "__version__"]
