"""Rank jobs for tests/test_compile.py (and the compiled case of tests/cp_jobs.py), run on the session's pool of ranks
(`rank_pool`): one family a case (`rank_cases.record`), so a family that fails fails only its own tests.

A pool's rank runs other jobs next: the recompile guard is removed and the thread count restored whatever happens,
and dynamo's state is reset before each family (its counters are per process)."""

from __future__ import annotations

import torch
from rank_cases import one_thread, record


def compile_checks(checkpoints: dict, call_kwargs: dict, load_kwargs: dict, prompts: list, backend: str,
                   mesh_kwargs: dict | None = None) -> dict:
    """On `init_distributed(**mesh_kwargs)` (default TP=2), per family: warm up, then count graphs, breaks and
    recompiles over `prompts` (a list, or a list per family); compare to eager. A family that raises is recorded
    as its case's error."""
    import neuron_diffusers as nd

    report = {}
    with one_thread():
        mesh = nd.init_distributed(**(mesh_kwargs or {"tp": 2}))
        for family, checkpoint in checkpoints.items():
            family_prompts = prompts[family] if isinstance(prompts, dict) else prompts
            record(report, family, _compile_family, mesh, checkpoint, call_kwargs[family],
                   load_kwargs.get(family, {}), family_prompts, backend, family == "h3")
    return report


def _compile_family(mesh, checkpoint, call: dict, load_kwargs: dict, prompts: list, backend: str,
                    video: bool) -> dict:
    """One family: eager output, compile and warm up (a recompile raises), then the prompts compiled."""
    import neuron_diffusers as nd
    from neuron_diffusers.compile import compile_repeated_blocks, compile_report, warmup

    torch._dynamo.reset()
    start = compile_report()  # dynamo's counters are per process: count this family's graphs from here
    pipe = nd.load_pipeline(checkpoint, mesh, **load_kwargs)
    kwargs = dict(call) if video else {**call, "output_type": "pt"}
    eager = pipe.generate(prompts[0], seed=0, **kwargs)
    compile_repeated_blocks(pipe, backend=backend)
    guard = warmup(pipe, [(kwargs["height"], kwargs["width"])], on_recompile="raise",
                   **{k: v for k, v in kwargs.items() if k not in ("height", "width")})
    try:
        warm = compile_report()
        compiled = [pipe.generate(prompt, seed=0, **kwargs) for prompt in prompts]
    finally:
        guard.remove()
    after = compile_report()
    return {
        "graphs_after_warmup": warm["graphs"] - start["graphs"],
        "new_graphs": after["graphs"] - warm["graphs"],
        "new_recompiles": after["recompiles"] - warm["recompiles"],
        "graph_breaks": after["graph_breaks"] - start["graph_breaks"],
        "diff": None if eager is None else _max_output_diff(compiled[0][0], eager[0]),
        # The last prompt's compiled output against the first's eager one: a control for "diff".
        "control": None if eager is None or len(prompts) < 2 else _max_output_diff(compiled[-1][0], eager[0]),
    }


def _max_output_diff(a, b) -> float:
    if hasattr(a, "frames"):
        audio = 0.0 if a.audio is None else (a.audio - b.audio).abs().max().item()  # Wan makes no audio
        return max((a.frames - b.frames).abs().max().item(), audio)
    return (a - b).abs().max().item()
