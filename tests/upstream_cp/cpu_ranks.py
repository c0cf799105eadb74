"""pytest plugin (`-p cpu_ranks`): run diffusers' multi-accelerator parallelism tests on CPU gloo ranks.

Those tests are marked `skipif(no multiple accelerators)` at import; this drops exactly that mark, so they run on
the CPU with the ranks the mixins spawn themselves (two, over gloo; see `sitecustomize.py`).
"""

_REASON = "test requires multiple hardware accelerators"


def pytest_collection_modifyitems(items):
    for item in items:
        for node in item.listchain():
            node.own_markers[:] = [mark for mark in node.own_markers
                                   if not (mark.name == "skipif" and mark.kwargs.get("reason") == _REASON)]
