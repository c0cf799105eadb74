"""Random LoRA files for the tiny models, in formats stock `load_lora_weights` reads, and merging one by hand."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import save_file


def linears(model: torch.nn.Module, suffixes=None, top_level=True) -> dict[str, torch.nn.Linear]:
    """The model's Linears whose name ends with one of `suffixes` inside the blocks (all if None), plus the
    top-level ones (outside any block) if `top_level`."""
    found = {}
    for name, module in model.named_modules():
        if not isinstance(module, torch.nn.Linear):
            continue
        in_blocks = "blocks." in name
        if suffixes is None or (in_blocks and name.endswith(tuple(f".{s}" for s in suffixes))) or (
                top_level and not in_blocks):
            found[name] = module
    return found


def factors(modules: dict[str, torch.nn.Linear], rank: int, seed: int, std: float = 0.1) -> dict[str, torch.Tensor]:
    """`<module>.lora_A.weight` [rank, in] and `<module>.lora_B.weight` [out, rank] for each module, random."""
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, module in modules.items():
        state[f"{name}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=generator) * std
        state[f"{name}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=generator) * std
    return state


def save_peft(path: Path, state: dict, alpha: float | None = None, extra: dict | None = None) -> str:
    """A plain safetensors file of PEFT keys `transformer.<module>.lora_A.weight`, with `.alpha` scalars if `alpha`,
    and the `extra` tensors (e.g. a `text_encoder.` part) as they are."""
    out = {f"transformer.{k}": v for k, v in state.items()} | dict(extra or {})
    if alpha is not None:
        out.update({f"transformer.{k.removesuffix('.lora_A.weight')}.alpha": torch.tensor(float(alpha))
                    for k in state if k.endswith(".lora_A.weight")})
    save_file(out, path)
    return str(path)


def save_diffusers(loader, folder: Path, state: dict, rank: int, alpha: float) -> str:
    """A folder written by the pipeline's own `save_lora_weights`, with adapter metadata (r, lora_alpha, targets)."""
    targets = sorted({k.removesuffix(".lora_A.weight") for k in state if k.endswith(".lora_A.weight")})
    loader.save_lora_weights(folder, transformer_lora_layers=state,
                             transformer_lora_adapter_metadata={"r": rank, "lora_alpha": alpha,
                                                                "target_modules": targets})
    return str(folder)


def kohya_flux(transformer: torch.nn.Module, rank: int, seed: int, alpha: float, std: float = 0.1) -> dict:
    """kohya (sd-scripts) keys for FLUX.1: fused qkv, BFL module names, per-module alphas.

    The single blocks' fused `linear1` is left out: diffusers' converter splits it with FLUX.1-dev's sizes hard-coded.
    """
    generator = torch.Generator().manual_seed(seed)
    inner = transformer.config.num_attention_heads * transformer.config.attention_head_dim
    mlp = transformer.single_transformer_blocks[0].proj_mlp.out_features
    shapes = {}
    for i, block in enumerate(transformer.transformer_blocks):
        ff = block.ff.net[0].proj.out_features
        for stream in ("img", "txt"):
            prefix = f"double_blocks_{i}_{stream}"
            shapes.update({
                f"{prefix}_attn_qkv": (inner, 3 * inner), f"{prefix}_attn_proj": (inner, inner),
                f"{prefix}_mlp_0": (inner, ff), f"{prefix}_mlp_2": (ff, inner), f"{prefix}_mod_lin": (inner, 6 * inner),
            })
    for i, _ in enumerate(transformer.single_transformer_blocks):
        shapes[f"single_blocks_{i}_linear2"] = (inner + mlp, inner)
        shapes[f"single_blocks_{i}_modulation_lin"] = (inner, 3 * inner)
    state = {}
    for name, (fan_in, fan_out) in shapes.items():
        state[f"lora_unet_{name}.lora_down.weight"] = torch.randn(rank, fan_in, generator=generator) * std
        state[f"lora_unet_{name}.lora_up.weight"] = torch.randn(fan_out, rank, generator=generator) * std
        state[f"lora_unet_{name}.alpha"] = torch.tensor(float(alpha))
    return state


@torch.no_grad()
def merge_by_hand(transformer: torch.nn.Module, state: dict, weight: float) -> None:
    """Add `weight * B @ A` (in fp32) to each full weight of an unsharded transformer, in place."""
    for key, a in state.items():
        if key.endswith(".lora_A.weight"):
            target = transformer.get_submodule(key.removesuffix(".lora_A.weight")).weight
            b = state[key.replace("lora_A", "lora_B")]
            target.copy_(target.float() + weight * (b.float() @ a.float()))
