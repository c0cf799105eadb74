"""Context parallelism on CPU ranks over gloo (gaps 15 and 16 of `compat/__init__.py`): ring attention's log-sum-exp
from ATen's CPU flash-attention kernel, and the `*_anything` modes' gathers of unequal lengths."""

from __future__ import annotations

import functools

import torch
from diffusers.models import _modeling_parallel


def wrap_native_forward_op(stock):
    """The native backend's forward op with the log-sum-exp ring attention needs, on CPU (gap 15)."""

    @functools.wraps(stock)
    def _native_attention_forward_op(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                                     scale=None, enable_gqa=False, return_lse=False, _save_ctx=True,
                                     _parallel_config=None):
        if not return_lse or query.device.type != "cpu":
            return stock(ctx, query, key, value, attn_mask, dropout_p, is_causal, scale, enable_gqa, return_lse,
                         _save_ctx=_save_ctx, _parallel_config=_parallel_config)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value)):
            raise NotImplementedError("Ring attention on CPU is inference only: run it under torch.no_grad().")
        if attn_mask is not None and attn_mask.dtype == torch.bool:
            attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype).masked_fill(~attn_mask, float("-inf"))
        q, k, v = (x.permute(0, 2, 1, 3) for x in (query, key, value))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q, k, v, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)
        return out.permute(0, 2, 1, 3), lse.permute(0, 2, 1)

    return _native_attention_forward_op


def wrap_gather_size_by_comm(stock):
    """Per-rank lengths gathered on the CPU over gloo (gap 16)."""

    @functools.wraps(stock)
    def gather_size_by_comm(size: int, group) -> list[int]:
        if torch.distributed.get_backend(group) != "gloo":
            return stock(size, group)
        sizes = [torch.empty(1, dtype=torch.int64) for _ in range(torch.distributed.get_world_size(group))]
        torch.distributed.all_gather(sizes, torch.tensor([size], dtype=torch.int64), group=group)
        return [s[0].item() for s in sizes]

    return gather_size_by_comm


def wrap_all_gather_anything(stock):
    """Unequal lengths over gloo: pad to the longest, gather, trim (gap 16)."""

    @functools.wraps(stock)
    def _all_gather_anything(tensor: torch.Tensor, dim: int, group) -> torch.Tensor:
        if torch.distributed.get_backend(group) != "gloo":
            return stock(tensor, dim, group)
        sizes = _modeling_parallel.gather_size_by_comm(tensor.shape[dim], group)  # looked up: ours once installed
        pad = [0, 0] * (tensor.dim() - 1 - dim % tensor.dim()) + [0, max(sizes) - tensor.shape[dim]]
        padded = torch.nn.functional.pad(tensor, pad).contiguous()
        gathered = [torch.empty_like(padded) for _ in sizes]
        torch.distributed.all_gather(gathered, padded, group=group)
        return torch.cat([part.narrow(dim, 0, size) for part, size in zip(gathered, sizes, strict=True)], dim=dim)

    return _all_gather_anything
