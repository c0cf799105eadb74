"""Parallel-VAE checks that run on gloo ranks (module level, so the rank pool can import them), one job a test:
generation through `load_pipeline` and the VAEs alone."""

from __future__ import annotations

import torch
import torch.distributed as dist
from diffusers.hooks import HookRegistry
from rank_cases import one_thread
from runner_jobs import _as_arrays, _loaded_models

from neuron_diffusers.parallel.vae import HOOK_NAME, enable_parallel_vae
from neuron_diffusers.parallel.vae_rows import split_rows


def _load_vae(checkpoint):
    import diffusers

    from neuron_diffusers.checkpoint import resolve

    cls = getattr(diffusers, resolve(checkpoint).component_class_name("vae"))
    return cls.from_pretrained(checkpoint, subfolder="vae").eval()


def _diff(parallel: torch.Tensor, stock: torch.Tensor) -> dict:
    assert parallel.shape == stock.shape, (parallel.shape, stock.shape)
    diff = (parallel - stock).abs()
    report = {"max": diff.max().item(), "mean": diff.mean().item()}
    if diff.ndim == 5:  # video: the worst frame's mean
        report["worst_frame_mean"] = diff.mean(dim=(0, 1, 3, 4)).max().item()
    return report


def _hooks_left(vae) -> int:
    return sum(HookRegistry.check_if_exists_or_initialize(m).get_hook(HOOK_NAME) is not None for m in vae.modules())


def _naive_bands(vae, latent) -> torch.Tensor:
    """Each rank's band decoded on its own by the stock VAE (no halos, local norms): what the handlers prevent."""
    bounds = split_rows(latent.shape[-2], 2)
    return torch.cat([vae.decode(latent[..., a:b, :]).sample for a, b in bounds], dim=-2)


def _controls(vae, case: dict, stock_decoded, stock_moments) -> dict:
    """Stock's decode of another latent and encode of another image (drawn from their own generator, so the cases'
    inputs stay as they were), against the case's: how far a wrong input moves what the case compares."""
    generator = torch.Generator().manual_seed(1)
    latent = torch.randn(case["latent"], generator=generator)
    image = torch.rand(case["image"], generator=generator) * 2 - 1
    return {"decode": _diff(vae.decode(latent).sample, stock_decoded),
            "encode": _diff(vae.encode(image).latent_dist.parameters, stock_moments)}


def _vae_case(vae, case: dict, generator) -> dict:
    """Stock decode and encode, then the same with parallel VAE: the leader's image, every rank's posterior, and
    the controls (another latent, another image)."""
    if case.get("tiling"):
        vae.enable_tiling(**case["tiling"])
    latent = torch.randn(case["latent"], generator=generator)
    image = torch.rand(case["image"], generator=generator) * 2 - 1
    stock_decoded = vae.decode(latent).sample
    stock_moments = vae.encode(image).latent_dist.parameters
    controls = _controls(vae, case, stock_decoded, stock_moments)
    with enable_parallel_vae(vae) as handle:
        decoded = vae.decode(latent).sample
        moments = vae.encode(image).latent_dist.parameters
        calls_run = handle.turns.calls_run if handle.turns else None
    leader_moments = moments.clone()
    dist.broadcast(leader_moments, src=0)
    report = {
        "decode": _diff(decoded, stock_decoded) if dist.get_rank() == 0 else None,
        "encode": _diff(moments, stock_moments),
        "same_posterior_on_every_rank": torch.equal(moments, leader_moments),
        "removed_is_stock": torch.equal(vae.decode(latent).sample, stock_decoded),
        "hooks_left": _hooks_left(vae),
        "calls_run": calls_run,
        "control": controls,
    }
    if case.get("naive"):
        report["naive_bands"] = _diff(_naive_bands(vae, latent), stock_decoded)
    return report


def _refusal(vae) -> dict:
    """A module the handlers do not know is refused at install, and the VAE is left as it was."""
    block = vae.decoder.up_blocks[0].resnets[0]
    stock_act = block.nonlinearity
    block.nonlinearity = torch.nn.GELU()
    try:
        enable_parallel_vae(vae)
        message = None
    except ValueError as error:
        message = str(error)
    finally:
        block.nonlinearity = stock_act
    return {"message": message, "hooks_left": _hooks_left(vae)}


def _generation(checkpoint, mesh, call: dict) -> dict:
    import neuron_diffusers as nd

    pipe = nd.load_pipeline(checkpoint, mesh, parallel_vae=True)
    outputs = pipe.generate("a red fox in the snow", seed=0, **call)
    return {"output": None if outputs is None else _as_arrays(outputs[0]),
            "decode_calls": pipe.times.calls.get("decode", 0),
            "models_in_memory": _loaded_models()}


def generation_check(checkpoint, layout: str, call: dict) -> dict:
    """`generate` with `parallel_vae=True` at TP=2 (`layout` ""), or at Ulysses=2 ("ulysses2 ": the
    context-parallel ranks decode a piece too)."""
    import neuron_diffusers as nd

    with one_thread():
        mesh = nd.init_distributed(tp=1, ulysses=2) if layout else nd.init_distributed(tp=2)
        return _generation(checkpoint, mesh, call)


def vae_case_check(checkpoint, cases: dict, name: str, seed: int = 0) -> dict:
    """VAE case `name` alone (stock vs parallel decode and encode), on the inputs it drew when every case of `cases`
    ran in order from one generator seeded `seed`."""
    generator = torch.Generator().manual_seed(seed)
    for earlier, case in cases.items():
        if earlier == name:
            break
        torch.randn(case["latent"], generator=generator)  # the draws of the cases before it
        torch.rand(case["image"], generator=generator)
    with one_thread(), torch.no_grad():
        return _vae_case(_load_vae(checkpoint), cases[name], generator)


def refusal_check(flux) -> dict:
    with one_thread(), torch.no_grad():
        return _refusal(_load_vae(flux))
