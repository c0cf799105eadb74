"""Rank jobs for tests/test_pipelines.py, run on the session's pool of 2 ranks (`rank_pool`): Qwen-Image-2.1's exact
text buckets, one job a layout, each (KV cache, prompt) its own case (`rank_cases.record`)."""

from __future__ import annotations

from rank_cases import CaseError, one_thread, record

#: The layouts bucketed Qwen-Image-2.1 must match its unpadded self on, two ranks each.
QI21_LAYOUTS = {"tp2": {"tp": 2}, "cfg2": {"tp": 1, "cfg": 2}, "tp1 x ulysses2": {"tp": 1, "ulysses": 2}}
#: The negative prompt of every case (true CFG).
NEGATIVE = "blurry, low quality"


def _recording_outputs(transformer, seen: list):
    """Per forward: the text length it saw and its target-image rows (what the pipeline keeps of its output)."""
    def hook(module, args, kwargs, output):
        rows = kwargs["hidden_states"].shape[1]
        seen.append((kwargs["encoder_hidden_states"].shape[1], output[0][:, -rows:].detach().clone()))
    return transformer.register_forward_hook(hook, with_kwargs=True)


def _bucket_case(pipes: dict, call: dict, prompt: str, use_kv_cache: bool) -> dict:
    """One prompt through the bucketed and the unpadded pipeline: the text lengths each transformer saw, the largest
    difference of its outputs (target rows, this rank's forwards), and on the leader the float image (before 8-bit
    rounding) and its largest difference from the unpadded one."""
    import numpy as np

    seen, images = {}, {}
    for label, pipe in pipes.items():
        seen[label] = []
        handle = _recording_outputs(pipe.adapter.transformer_of(pipe.pipe), seen[label])
        try:
            images[label] = pipe.generate(prompt, seed=0, negative_prompt=NEGATIVE, true_cfg_scale=4.0,
                                          use_kv_cache=use_kv_cache, output_type="np", **call)
        finally:
            handle.remove()
    pairs = list(zip(seen["bucketed"], seen["unpadded"], strict=True))
    return {
        "text_lengths": {label: sorted({length for length, _ in rows}) for label, rows in seen.items()},
        "output_diff": max((a - b).abs().max().item() for (_, a), (_, b) in pairs),
        "image_diff": None if images["bucketed"] is None else float(np.abs(
            images["bucketed"][0].astype(np.float64) - images["unpadded"][0]).max()),
        "image": None if images["bucketed"] is None else images["bucketed"][0],
        "modes": {label: pipe.cp_mode and tuple(pipe.cp_mode) for label, pipe in pipes.items()},
    }


def qwenimage21_bucket_checks(layout: str, checkpoint, call: dict, prompts: list) -> dict:
    """On one layout (`QI21_LAYOUTS`), KV cache on and off, each prompt (with a negative, true CFG): the default
    (bucketed) pipeline against `buckets=()` on the same ranks, under `report[use_kv_cache, index]`."""
    import neuron_diffusers as nd

    cases = [(use_kv_cache, index) for use_kv_cache in (True, False) for index in range(len(prompts))]
    report = {}
    with one_thread():
        mesh = nd.init_distributed(**QI21_LAYOUTS[layout])
        pipes = record(report, "load", lambda: {"bucketed": nd.load_pipeline(checkpoint, mesh),
                                                "unpadded": nd.load_pipeline(checkpoint, mesh, buckets=())})
        if isinstance(pipes, CaseError):
            return dict.fromkeys(cases, pipes)
        del report["load"]
        for use_kv_cache, index in cases:
            record(report, (use_kv_cache, index), _bucket_case, pipes, call, prompts[index], use_kv_cache)
    return report
