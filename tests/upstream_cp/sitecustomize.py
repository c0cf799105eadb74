"""Loaded by every Python process started with this folder on PYTHONPATH (`run.py` does that), the rank processes
that diffusers' test mixins spawn included. Two import hooks:

1. Right after `diffusers` is imported, `neuron_diffusers` is: the package's patches are in place in each rank, as
   they are in a user's program (processes that never import diffusers, such as multiprocessing's manager, skip
   the cost).
2. diffusers' parallelism test helpers pick a process-group backend from `DEVICE_CONFIG[torch_device]`, which
   knows only "cuda" and "xpu"; with `torch_device == "cpu"` they fall back to NCCL. Once that module is imported,
   a "cpu" entry (gloo, no device to select) is added; the ranks import it afresh, hence a hook.
"""

import importlib
import importlib.abc
import importlib.util
import sys
import types

_CPU = {"backend": "gloo", "module": types.SimpleNamespace(set_device=lambda index: None)}


def _after_diffusers(module):
    importlib.import_module("neuron_diffusers")


def _after_parallelism_helpers(module):
    module.DEVICE_CONFIG.setdefault("cpu", _CPU)


_AFTER = {"diffusers": _after_diffusers, "models.testing_utils.parallelism": _after_parallelism_helpers}


class _AfterImport(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        after = next((fn for suffix, fn in _AFTER.items() if name == suffix or name.endswith("." + suffix)), None)
        if after is None:
            return None
        sys.meta_path.remove(self)
        try:
            spec = importlib.util.find_spec(name)
        finally:
            sys.meta_path.insert(0, self)
        exec_module = spec.loader.exec_module

        def exec_then(module):
            exec_module(module)
            after(module)

        spec.loader.exec_module = exec_then
        return spec


sys.meta_path.insert(0, _AfterImport())
