"""CFG parallelism on the session's rank pool (tests/test_cfg_parallel.py): each check a case of its own
(`rank_cases.record`), so a failure fails only the test that reads it.

Generations return latents (`output_type="latent"`), and the jobs the latents their last step checked
(`final_latents`): the tests compare them with stock's at a float32 tolerance, where decoded 8-bit images of the
tiny random checkpoints could not tell one prompt from another.
"""

from __future__ import annotations

import contextlib

import torch
from rank_cases import CaseError, one_thread, record
from rank_jobs import CFG_NEGATIVE, CFG_PROMPT, _job_outputs
from runner_jobs import _past_the_entry_check


def _forwards(pipe) -> int:
    return pipe.times.calls.get("transformer forward", 0)


@contextlib.contextmanager
def final_latents(found: list):
    """Appends to `found`, per image this rank denoised (in order), the tensors its group's latent check compared at
    the last step: the packed latents a stock `output_type="latent"` call returns (MiniMax-H3: video and audio
    latents). The job offers no latent output: this is how its images are compared before 8-bit rounding."""
    from neuron_diffusers.consistency import LatentAgreement

    check = LatentAgreement.check

    def recording(self, tensors, where):
        check(self, tensors, where)
        if where in ("step 0", "transformer call 0") or not found:  # a new image starts
            found.append(None)
        found[-1] = [t.detach().clone().numpy() for t in tensors]

    LatentAgreement.check = recording
    try:
        yield found
    finally:
        LatentAgreement.check = check


def job_with_latents(argv: list[str]) -> dict:
    """`rank_jobs._job_outputs` (rank 0's summary and PNGs, else None), plus every rank's final latents per image."""
    with final_latents([]) as found:
        outputs = _job_outputs(argv)
    return {"outputs": outputs, "latents": found}


def _cfg_generation(mesh, pipes: dict, checkpoint, family: str, call: dict) -> dict:
    """One case: the CFG-parallel latents (on the pair's leader, else None), whether the same call made serially by
    this rank's TP group alone gives the same latents bit for bit, and the real transformer forwards each took."""
    import neuron_diffusers as nd

    if family not in pipes:
        pipes.clear()  # consecutive cases of one family share the pipeline
        pipes[family] = nd.load_pipeline(checkpoint, mesh)
    pipe = pipes[family]
    kwargs = dict(call, negative_prompt=CFG_NEGATIVE, true_cfg_scale=4.0, output_type="latent")
    before = _forwards(pipe)
    parallel = pipe.generate(CFG_PROMPT, seed=0, **kwargs)
    middle = _forwards(pipe)
    serial = pipe.generate(CFG_PROMPT, seed=0, alone=True, **kwargs)
    return {
        "latents": None if parallel is None else parallel[0].numpy(),
        "equals_serial": None if parallel is None else bool(torch.equal(parallel[0], serial[0])),
        "forwards": middle - before,
        "serial_forwards": _forwards(pipe) - middle,
        "transformer_is_real": type(pipe.pipe.transformer).__name__ != "CFGParallelTransformer",
    }


def _cfg_generations(report: dict, mesh, checkpoints: dict, cases: dict) -> None:
    """`report[("case", name)]` for every case of `cases` (name -> (family, call))."""
    import gc

    pipes = {}
    for name, (family, call) in cases.items():
        record(report, ("case", name), _cfg_generation, mesh, pipes, checkpoints[family], family, call)
        gc.collect()
    pipes.clear()


class _EchoTransformer(torch.nn.Module):
    """A stand-in transformer whose output spans text + image, so cond and uncond differ in length (as
    Qwen-Image-2.1's do when it does not read its text KV cache); it records the cache contexts it is called in."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.proj = torch.nn.Linear(4, 4)
        self.contexts = []

    def cache_context(self, name: str, **kwargs):
        self.contexts.append(name)
        return contextlib.nullcontext()

    def forward(self, hidden_states, encoder_hidden_states, return_dict: bool = False):
        joint = torch.cat([encoder_hidden_states, hidden_states], dim=1)
        return (self.proj(joint) * joint.mean(),)


def _echo_denoise(pipe, latents, text, negative, guided_steps, steps=3, **call):
    """A stock-style loop: cond, then uncond on `guided_steps` only (the others are CFG-truncated steps)."""
    for step in range(steps):
        with pipe.transformer.cache_context("cond"):
            pred = pipe.transformer(hidden_states=latents, encoder_hidden_states=text, **call)[0][:, -latents.shape[1]:]
        if step in guided_steps:
            with pipe.transformer.cache_context("uncond"):
                uncond = pipe.transformer(hidden_states=latents, encoder_hidden_states=negative)[0]
            uncond = uncond[:, -latents.shape[1]:]
            pred = uncond + 4.0 * (pred - uncond)
        latents = latents - 0.1 * pred
    return latents


def _proxy_checks(real_transformer, group) -> dict:
    """`CFGParallelTransformer` on its own, on the 2-rank CFG pair: exactness with a truncated step and unequal
    branch lengths, the contexts and forwards of the real model, attribute forwarding, and every refusal."""
    import inspect
    import types

    import torch.distributed as dist

    from neuron_diffusers.parallel.cfg import CFGParallelTransformer, cfg_parallel_transformer

    rank = dist.get_rank()
    text, negative = torch.randn(1, 3, 4, generator=torch.Generator().manual_seed(1)), torch.randn(
        1, 5, 4, generator=torch.Generator().manual_seed(2))
    latents = torch.randn(1, 6, 4, generator=torch.Generator().manual_seed(3))
    mine = (text, negative) if rank == 0 else (negative, text)  # what the runner's swap does for CFG rank 1
    pipe = types.SimpleNamespace(transformer=_EchoTransformer())
    reference = _echo_denoise(pipe, latents, text, negative, guided_steps={0, 2})
    pipe.transformer.contexts.clear()
    with cfg_parallel_transformer(pipe, group):
        parallel = _echo_denoise(pipe, latents, *mine, guided_steps={0, 2})
    report = {"exact": torch.equal(parallel, reference), "contexts": list(pipe.transformer.contexts)}

    proxy = CFGParallelTransformer(real_transformer, group)
    report["forwarded"] = {
        "config": proxy.config is real_transformer.config,
        "dtype": proxy.dtype == real_transformer.dtype,
        "blocks": proxy.transformer_blocks is real_transformer.transformer_blocks,
        "signature": inspect.signature(proxy.forward) == inspect.signature(real_transformer.forward),
        "device": proxy.device == real_transformer.device,
        "compile_repeated_blocks": proxy.compile_repeated_blocks.__self__ is real_transformer,
    }

    def error_of(run) -> str:
        try:
            with cfg_parallel_transformer(pipe, group):
                run()
            return "no error"
        except (RuntimeError, ValueError) as error:
            return f"{type(error).__name__}: {error}"

    wrong_negative = negative + 1.0
    report["errors"] = {
        "wrong_branch": error_of(lambda: _echo_denoise(
            pipe, latents, *((text, negative) if rank == 0 else (wrong_negative, text)), guided_steps={0})),
        "diverged": error_of(lambda: _echo_denoise(pipe, latents + rank, *mine, guided_steps={0})),
        "no_context": error_of(lambda: pipe.transformer(hidden_states=latents, encoder_hidden_states=text)),
        "uncond_first": error_of(lambda: _uncond_first(pipe, latents, text)),
        "ip_adapter": error_of(lambda: _echo_denoise(
            pipe, latents, *mine, guided_steps={0}, joint_attention_kwargs={"ip_adapter_image_embeds": [text]})),
    }
    return report


def _uncond_first(pipe, latents, text):
    with pipe.transformer.cache_context("uncond"):
        pipe.transformer(hidden_states=latents, encoder_hidden_states=text)


def _compiled_cfg_parallel(pipe, call: dict) -> dict:
    """The real model's blocks compiled and warmed up (no negative prompt), then a CFG-parallel call: no recompile,
    and the latents of the uncompiled model, bit for bit."""
    from neuron_diffusers.compile import compile_repeated_blocks, compile_report, warmup

    torch._dynamo.reset()  # a pool's rank may have compiled these blocks' code in an earlier job
    kwargs = dict(call, negative_prompt=CFG_NEGATIVE, output_type="latent")
    eager = pipe.generate(CFG_PROMPT, seed=0, **kwargs)
    start = compile_report()
    compile_repeated_blocks(pipe, backend="eager")
    guard = warmup(pipe, [(call["height"], call["width"])], on_recompile="raise",
                   num_inference_steps=call["num_inference_steps"])
    before = compile_report()
    compiled = pipe.generate(CFG_PROMPT, seed=0, **kwargs)
    guard.remove()
    after = compile_report()
    return {"warm_up_graphs": before["graphs"] - start["graphs"], "new_graphs": after["graphs"] - before["graphs"],
            "recompiles": after["recompiles"] - before["recompiles"],
            "equal": None if eager is None else bool(torch.equal(eager[0], compiled[0]))}


def _split(pipe, split_call: dict) -> dict:
    """Two prompts without true CFG: one per group of the pair, both back on the leader (latents), in order."""
    before = _forwards(pipe)
    split = pipe.generate([CFG_PROMPT, "a blue bird"], seed=0, output_type="latent", **split_call)
    return {"latents": None if split is None else [latents.numpy() for latents in split],
            "forwards": _forwards(pipe) - before}


def _divergence(pipe, split_call: dict) -> str:
    import torch.distributed as dist

    from neuron_diffusers.parallel.cfg import CFGBranchMismatchError

    try:
        with _past_the_entry_check():
            pipe.generate(CFG_PROMPT, seed=dist.get_rank(), negative_prompt=CFG_NEGATIVE, **split_call)
        return "not caught"
    except CFGBranchMismatchError as error:
        return str(error)


def _ip_adapter(pipe, split_call: dict) -> str:
    try:
        pipe.generate(CFG_PROMPT, negative_prompt=CFG_NEGATIVE, ip_adapter_image=object(), **split_call)
        return "accepted"
    except ValueError as error:
        return str(error)


PAIR_QWEN_CASES = ("split", "divergence", "ip_adapter", "proxy", "compiled")


def cfg_pair_checks(checkpoints: dict, cases: dict, split_call: dict, jobs: dict) -> dict:
    """On 2 CPU ranks (one CFG pair, tp=1), one case a key: CFG-parallel latents and forwards per case
    (`("case", name)`), the pair splitting prompts without true CFG, a divergent seed, the IP-Adapter refusal, the
    proxy alone, compiled blocks, and the job per family (`("job", family)`) with a rerun of Qwen-Image's."""
    import neuron_diffusers as nd

    with one_thread():  # as torchrun does: ranks share the cores
        mesh = nd.init_distributed(tp=1, cfg=2)
        report = {"mesh": (mesh.mesh_dim_names, tuple(mesh.shape))}
        _cfg_generations(report, mesh, checkpoints, cases)
        pipe = record(report, "qwen", nd.load_pipeline, checkpoints["qwenimage"], mesh)
        if isinstance(pipe, CaseError):
            report.update(dict.fromkeys(PAIR_QWEN_CASES, pipe))
        else:
            record(report, "split", _split, pipe, split_call)
            record(report, "divergence", _divergence, pipe, split_call)
            record(report, "ip_adapter", _ip_adapter, pipe, split_call)
            record(report, "proxy", _proxy_checks, pipe.adapter.transformer_of(pipe.pipe), mesh["cfg"].get_group())
            record(report, "compiled", _compiled_cfg_parallel, pipe, split_call)
        del report["qwen"], pipe
        for family, argv in jobs.items():
            record(report, ("job", family), job_with_latents, argv)
        record(report, "rerun", _job_outputs, jobs["qwenimage"])  # every output exists: nothing left to do
    return report


def cfg_tp_checks(checkpoints: dict, cases: dict, jobs: dict) -> dict:
    """On 4 CPU ranks (one CFG pair of TP=2 groups): CFG-parallel latents per case, and the job per family."""
    import neuron_diffusers as nd

    with one_thread():
        mesh = nd.init_distributed(tp=2, cfg=2)
        report = {"mesh": (mesh.mesh_dim_names, tuple(mesh.shape))}
        _cfg_generations(report, mesh, checkpoints, cases)
        for family, argv in jobs.items():
            record(report, ("job", family), job_with_latents, argv)
    return report
