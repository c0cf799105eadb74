"""Parallel VAE by rows: each rank runs the decoder (encoder) on one horizontal band, with the stock result.

A hook on the decoder (encoder) cuts its input into bands of rows, one per rank. Every module inside that looks
across rows gets a handler, chosen by module type: a convolution receives the rows its kernel reaches over the
band edge from its neighbours (a halo exchange per convolution), a GroupNorm reduces its statistics over the whole
image, and the mid-block self-attention, which relates every position to every other, runs on the gathered
lowest-resolution map for this band's queries. Any other leaf module type is refused at install: it might mix rows.
The bands are gathered at the exit, to the group's leader (decode: only it keeps the image) or to every rank
(encode: every rank denoises from the latents).

Equal to stock within float32 rounding, not bitwise: a convolution over a band may accumulate in another order than
over the whole image, and the GroupNorm statistics combine per-band moments (see `GlobalGroupNorm`).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from diffusers.hooks import ModelHook
from torch import nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

from ..compat.vae import vae_blocks
from ..distributed import is_main_process

logger = logging.getLogger(__name__)

ROW_DIM = -2  # the height axis of every 4D (B, C, H, W) and 5D (B, C, T, H, W) tensor these VAEs pass around
#: torch leaves whose output row r depends only on input row r (diffusers' own: `compat.vae.VAE_BLOCKS["row_local"]`).
TORCH_ROW_LOCAL = (nn.SiLU, nn.Dropout, nn.Identity)


@dataclass(frozen=True)
class RowGeometry:
    """What a convolution-like unit does along the rows: kernel, stride and the rows it pads at each end itself.

    Output row i reads input rows [i * stride - pad_top, i * stride - pad_top + kernel). On a band starting at a
    multiple of `stride`, only the first `top_fix` and last `bottom_fix` output rows read past the band's edges.
    """

    kernel: int
    stride: int
    pad_top: int
    pad_bottom: int

    @classmethod
    def of_conv(cls, conv: nn.Module, pad_top: int | None = None, pad_bottom: int | None = None) -> RowGeometry:
        if conv.dilation[ROW_DIM] != 1:
            raise ValueError(f"Parallel VAE cannot split rows through a dilated convolution ({conv}).")
        kernel, stride = conv.kernel_size[ROW_DIM], conv.stride[ROW_DIM]
        if pad_top is None:
            padding = conv.padding
            same = {"same": (kernel - 1) // 2, "valid": 0}
            pad_top = pad_bottom = same[padding] if isinstance(padding, str) else padding[ROW_DIM]
        # A band of n rows (n a multiple of stride) must give n / stride rows, as in the whole image.
        if not kernel - stride <= pad_top + pad_bottom < kernel:
            raise ValueError(f"Parallel VAE cannot split rows through {conv}: its padding does not keep the size.")
        return cls(kernel, stride, pad_top, pad_bottom)

    @property
    def pointwise(self) -> bool:
        return self.kernel == 1 and self.stride == 1

    @property
    def top_fix(self) -> int:
        return -(-self.pad_top // self.stride)

    @property
    def bottom_fix(self) -> int:
        return -(-(self.kernel - self.pad_top) // self.stride) - 1

    @property
    def halo_top(self) -> int:
        """Rows taken from the rank above: a multiple of `stride`, so the neighbour's rows keep the alignment."""
        return self.top_fix * self.stride

    @property
    def halo_bottom(self) -> int:
        return max(0, self.kernel - self.stride - self.pad_top)


def _unit_geometry(module: nn.Module) -> RowGeometry | None:
    """The geometry of a module that convolves across rows as one unit, or None if it is not such a unit."""
    if isinstance(module, vae_blocks("bottom_padded_downsample")) and module.use_conv and module.padding == 0:
        return RowGeometry.of_conv(module.conv, pad_top=0, pad_bottom=1)  # pads one zero row below, then convolves
    if isinstance(module, nn.Sequential) and len(module) == 2 and type(module[0]) is nn.ZeroPad2d:
        pad, conv = module[0], module[1]
        if type(conv) in (nn.Conv2d, nn.Conv3d):  # a pad that only this conv sees: pad and conv are one unit
            own = conv.padding[ROW_DIM]
            return RowGeometry.of_conv(conv, pad_top=pad.padding[2] + own, pad_bottom=pad.padding[3] + own)
    if type(module) in (nn.Conv2d, nn.Conv3d):
        return RowGeometry.of_conv(module)
    if type(module) in vae_blocks("self_padding_convs"):
        if module.stride[ROW_DIM] != 1:
            raise ValueError(f"Parallel VAE expects {type(module).__name__} to have stride 1 along rows.")
        kernel = module.kernel_size[ROW_DIM]
        return RowGeometry(kernel, 1, (kernel - 1) // 2, (kernel - 1) // 2)
    return None


# --- the split, and the collectives on it ---------------------------------------------------------------------


def split_rows(length: int, world_size: int, multiple: int = 1) -> list[tuple[int, int]] | None:
    """Row bands [start, stop) per rank, as even as `multiple`-aligned starts allow; the last takes any remainder.

    None when there are fewer whole `multiple`s than ranks: then every rank runs the whole input (exact, not split).
    """
    units, remainder = divmod(length, multiple)
    if units < world_size:
        return None
    base, extra = divmod(units, world_size)
    bounds, start = [], 0
    for rank in range(world_size):
        stop = start + (base + (rank < extra)) * multiple
        bounds.append((start, stop))
        start = stop
    bounds[-1] = (bounds[-1][0], bounds[-1][1] + remainder)
    return bounds


class RowSplit:
    """One entry module's split: which band this rank holds, and the exchanges between bands.

    `to_leader`: the entry's output is gathered on the group's rank 0 only; the other ranks get zeros of its shape,
    so the stock code after the entry (clamping, concatenating frames) still runs on them, on nothing of value.
    """

    def __init__(self, group, to_leader: bool, is_on):
        self.group = group
        self.is_on = is_on  # whether calls are split now (else every hook passes through: stock)
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.to_leader = to_leader
        self.multiple = 1  # the product of the entry's row strides: bands start at multiples of it
        self.active = False

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.world_size - 1

    def exchange_halos(self, tensors: list[torch.Tensor], top: int, bottom: int):
        """The `top` rows above and `bottom` rows below this band, per tensor (None at the image's edges).

        One all-gather of every rank's edge rows: a collective every backend has, and halos are a row or two.
        """
        parts = []
        for tensor in tensors:
            rows = tensor.shape[ROW_DIM]
            if rows < max(top, bottom):
                raise RuntimeError(f"Rank {self.rank} holds {rows} rows, fewer than the {max(top, bottom)}-row halo.")
            head, tail = tensor.narrow(ROW_DIM, 0, bottom), tensor.narrow(ROW_DIM, rows - top, top)
            parts += [head.reshape(-1), tail.reshape(-1)]
        sent = torch.cat(parts)
        received = [torch.empty_like(sent) for _ in range(self.world_size)]
        dist.all_gather(received, sent, group=self.group)
        above = None if self.first else _unpack(received[self.rank - 1], tensors, top, bottom, want_tail=True)
        below = None if self.last else _unpack(received[self.rank + 1], tensors, top, bottom, want_tail=False)
        return above, below

    def gather_rows(self, tensor: torch.Tensor, to_leader: bool = False) -> tuple[torch.Tensor, int]:
        """Every band, concatenated in rank order (zeros of that shape off the leader when `to_leader`), and where
        this rank's band starts in it."""
        rows = tensor.shape[ROW_DIM]
        sizes = [torch.zeros(1, dtype=torch.int64, device=tensor.device) for _ in range(self.world_size)]
        dist.all_gather(sizes, torch.tensor([rows], dtype=torch.int64, device=tensor.device), group=self.group)
        sizes = [int(size) for size in sizes]
        start = sum(sizes[:self.rank])
        padded = tensor
        if rows < max(sizes):  # collectives move equal shapes: the shorter bands travel padded
            padded = tensor.new_zeros(_with_rows(tensor.shape, max(sizes)))
            padded.narrow(ROW_DIM, 0, rows).copy_(tensor)
        padded = padded.contiguous()
        if to_leader and not self.first:
            dist.gather(padded, None, group=self.group, group_dst=0)
            return tensor.new_zeros(_with_rows(tensor.shape, sum(sizes))), start
        bands = [torch.empty_like(padded) for _ in range(self.world_size)]
        if to_leader:
            dist.gather(padded, bands, group=self.group, group_dst=0)
        else:
            dist.all_gather(bands, padded, group=self.group)
        whole = torch.cat([band.narrow(ROW_DIM, 0, size) for band, size in zip(bands, sizes, strict=True)], dim=ROW_DIM)
        return whole, start


def _unpack(flat: torch.Tensor, tensors: list[torch.Tensor], top: int, bottom: int, want_tail: bool):
    """A neighbour's head (`bottom` rows) or tail (`top` rows) of each tensor, out of its flat halo message."""
    halos, offset = [], 0
    for tensor in tensors:
        head_shape, tail_shape = _with_rows(tensor.shape, bottom), _with_rows(tensor.shape, top)
        head_size, tail_size = math.prod(head_shape), math.prod(tail_shape)
        if want_tail:
            halos.append(flat[offset + head_size:offset + head_size + tail_size].view(tail_shape))
        else:
            halos.append(flat[offset:offset + head_size].view(head_shape))
        offset += head_size + tail_size
    return halos


def _with_rows(shape, rows: int) -> tuple[int, ...]:
    shape = list(shape)
    shape[ROW_DIM] = rows
    return tuple(shape)


# --- the handlers ---------------------------------------------------------------------------------------------


class _RowHook(ModelHook):
    """A handler that acts only while its split is active (inside the decoder's or encoder's call)."""

    def __init__(self, split: RowSplit):
        super().__init__()
        self.split = split

    def new_forward(self, module, *args, **kwargs):
        if not self.split.active:
            return self.fn_ref.original_forward(*args, **kwargs)
        return self.split_forward(module, *args, **kwargs)


class SplitAtEntry(_RowHook):
    """On the decoder (encoder): run it on this rank's band of rows; gather the output (see `RowSplit`)."""

    def new_forward(self, module, *args, **kwargs):
        if not self.split.is_on():
            return self.fn_ref.original_forward(*args, **kwargs)
        x = args[0]
        bounds = split_rows(x.shape[ROW_DIM], self.split.world_size, self.split.multiple)
        if bounds is None:
            if is_main_process():
                logger.info("Parallel VAE: %d rows do not split over %d ranks in multiples of %d; every rank runs "
                            "them whole.", x.shape[ROW_DIM], self.split.world_size, self.split.multiple)
            out = self.fn_ref.original_forward(*args, **kwargs)
            if not self.split.to_leader:  # every rank goes on from it: the leader's, so they are equal by construction
                out = out.contiguous()
                dist.broadcast(out, group_src=0, group=self.split.group)
            return out
        start, stop = bounds[self.split.rank]
        band = x.narrow(ROW_DIM, start, stop - start).contiguous()
        self.split.active = True
        try:
            out = self.fn_ref.original_forward(band, *args[1:], **kwargs)
        finally:
            self.split.active = False
        return self.split.gather_rows(out, to_leader=self.split.to_leader)[0]


class HaloConv(_RowHook):
    """A convolution unit whose output rows on a band equal the whole image's.

    The unit runs on the band as is (its own padding at both band edges), then the few rows next to an inner edge,
    which read the padding instead of the neighbour's rows, are recomputed from a thin strip: the neighbour's halo
    rows plus a few of ours. Unlike concatenating the halos to the band, this never copies the band (measured: per-rank
    peak 0.50x one rank instead of 0.62x); a band too thin for strips is extended and cropped instead. Tensor
    arguments with the band's rows (a causal conv's cached frames) are extended alongside.
    """

    def __init__(self, split: RowSplit, geometry: RowGeometry):
        super().__init__(split)
        self.geometry = geometry

    def split_forward(self, module, *args, **kwargs):
        g, split, forward = self.geometry, self.split, self.fn_ref.original_forward
        x = args[0]
        rows = x.shape[ROW_DIM]
        banded = [i for i, arg in enumerate(args) if _same_band(arg, x)]
        above, below = split.exchange_halos([args[i] for i in banded], g.halo_top, g.halo_bottom)
        if not split.last and rows % g.stride:
            raise RuntimeError(f"Parallel VAE: a band of {rows} rows reached a stride-{g.stride} unit; bands must "
                               f"be multiples of {split.multiple} rows at the entry.")
        out_rows = rows // g.stride
        if out_rows < g.top_fix + g.bottom_fix + 1:
            return self._extended(forward, args, kwargs, banded, above, below, out_rows)
        out = forward(*args, **kwargs)
        if not split.last and out.shape[ROW_DIM] != out_rows:
            raise RuntimeError(f"Parallel VAE: {type(module).__name__} gave {out.shape[ROW_DIM]} rows for a band of "
                               f"{rows}; expected {out_rows}. Its row geometry is not the one assumed ({g}).")
        if above is not None and g.top_fix:
            reach = (g.top_fix - 1) * g.stride - g.pad_top + g.kernel  # our rows the top rows' kernels reach
            strip = _replace(args, banded, [torch.cat([h, args[i].narrow(ROW_DIM, 0, reach)], ROW_DIM)
                                            for i, h in zip(banded, above, strict=True)])
            fixed = forward(*strip, **kwargs).narrow(ROW_DIM, g.top_fix, g.top_fix)
            out.narrow(ROW_DIM, 0, g.top_fix).copy_(fixed)
        if below is not None and g.bottom_fix:
            start = (out_rows - g.bottom_fix - g.top_fix) * g.stride
            strip = _replace(args, banded, [torch.cat([args[i].narrow(ROW_DIM, start, rows - start), h], ROW_DIM)
                                            for i, h in zip(banded, below, strict=True)])
            fixed = forward(*strip, **kwargs).narrow(ROW_DIM, g.top_fix, g.bottom_fix)
            out.narrow(ROW_DIM, out_rows - g.bottom_fix, g.bottom_fix).copy_(fixed)
        return out

    def _extended(self, forward, args, kwargs, banded, above, below, out_rows):
        extended = []
        for k, i in enumerate(banded):
            pieces = ([] if above is None else [above[k]]) + [args[i]] + ([] if below is None else [below[k]])
            extended.append(torch.cat(pieces, ROW_DIM))
        out = forward(*_replace(args, banded, extended), **kwargs)
        skip = 0 if above is None else self.geometry.top_fix
        keep = out_rows if below is not None else out.shape[ROW_DIM] - skip
        return out.narrow(ROW_DIM, skip, keep)


def _same_band(arg, x: torch.Tensor) -> bool:
    return isinstance(arg, torch.Tensor) and arg.ndim == x.ndim and arg.shape[ROW_DIM] == x.shape[ROW_DIM]


def _replace(args: tuple, indices: list[int], values: list) -> tuple:
    args = list(args)
    for i, value in zip(indices, values, strict=True):
        args[i] = value
    return tuple(args)


class GlobalGroupNorm(_RowHook):
    """`nn.GroupNorm` with the statistics of the whole image: the classic source of seams in tiled VAEs.

    Each rank takes its band's per-group mean and variance (`var_mean`, no temporary of the band's size), one
    all-gather exchanges them with the element counts, and they are combined exactly (Chan et al.'s pairwise
    formula) in float64 on CPU/CUDA. Like ATen's kernel, the output is x * scale + shift per channel.
    """

    def split_forward(self, module, x):
        batch, channels = x.shape[:2]
        groups = module.num_groups
        grouped = x.reshape(batch, groups, -1)
        if grouped.dtype not in (torch.float32, torch.float64):
            grouped = grouped.float()
        var, mean = torch.var_mean(grouped, dim=-1, correction=0)
        stats_dtype = torch.float64 if x.device.type in ("cpu", "cuda") else torch.float32
        count = torch.full_like(mean, grouped.shape[-1])
        local = torch.stack([count, mean, var]).to(stats_dtype)
        gathered = [torch.empty_like(local) for _ in range(self.split.world_size)]
        dist.all_gather(gathered, local, group=self.split.group)
        counts, means, variances = torch.stack(gathered).unbind(1)  # each (ranks, batch, groups)
        total = counts.sum(0)
        mean = (counts * means).sum(0) / total
        var = ((counts * variances).sum(0) + (counts * (means - mean) ** 2).sum(0)) / total
        scale = torch.rsqrt(var + module.eps).repeat_interleave(channels // groups, dim=1)
        shift = -mean.repeat_interleave(channels // groups, dim=1) * scale
        if module.affine:
            shift = shift * module.weight + module.bias
            scale = scale * module.weight
        view = (batch, channels) + (1,) * (x.ndim - 2)
        return torch.addcmul(shift.to(x.dtype).view(view), x, scale.to(x.dtype).view(view))


class GatheredModule(_RowHook):
    """Self-attention over every position: run on the gathered map, keep our band.

    It sits at the lowest resolution, so the gathered map is small. Its one costly step, the attention itself, is
    computed for this band's queries only (`QueriesOfBand`) against every key; the rows outside the band come out
    wrong and are cut off, and the rows inside only ever see their own queries (everything after the attention in
    these blocks is per position).
    """

    def split_forward(self, module, x, *args, **kwargs):
        whole, start = self.split.gather_rows(x)
        rows, width = x.shape[ROW_DIM], x.shape[-1]
        with QueriesOfBand(start * width, (start + rows) * width, whole.shape[ROW_DIM] * width):
            out = self.fn_ref.original_forward(whole, *args, **kwargs)
        return out.narrow(ROW_DIM, start, rows).contiguous()


class QueriesOfBand(TorchFunctionMode):
    """Runs `scaled_dot_product_attention` over the whole sequence for the queries [start, stop) alone.

    The queries of a flattened (H, W) map are row-major, so a band of rows is a contiguous run of queries. The
    other queries' outputs are left zero. Calls with a mask or another sequence length run whole.
    """

    def __init__(self, start: int, stop: int, length: int):
        super().__init__()
        self.start, self.stop, self.length = start, stop, length

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            return func(*args, **kwargs)
        query, key, value, *rest = args
        if rest or kwargs.get("attn_mask") is not None or query.shape[-2] != self.length:
            return func(*args, **kwargs)
        band = func(query[..., self.start:self.stop, :], key, value, **kwargs)
        out = band.new_zeros(query.shape[:-1] + band.shape[-1:])
        out[..., self.start:self.stop, :] = band
        return out


def plan_rows(entry: nn.Module, split: RowSplit) -> list[tuple[nn.Module, ModelHook]]:
    """The handlers of one entry module (decoder or encoder), each with the module it goes on; sets the row
    multiple the entry's strided units need. Raises `ValueError`, naming the module, for a leaf that might mix
    rows and has no handler."""
    plan, strides = [], []
    gathered, row_local = vae_blocks("gathered"), TORCH_ROW_LOCAL + vae_blocks("row_local")

    def visit(module: nn.Module, path: str):
        if type(module) in gathered:
            plan.append((module, GatheredModule(split)))
            return
        geometry = _unit_geometry(module)
        if geometry is not None:
            if not geometry.pointwise:
                plan.append((module, HaloConv(split, geometry)))
                strides.append(geometry.stride)
            return
        if type(module) is nn.GroupNorm:
            plan.append((module, GlobalGroupNorm(split)))
            return
        children = list(module.named_children())
        if not children and type(module) not in row_local:
            raise ValueError(f"Parallel VAE does not know whether {path} ({type(module).__name__}) mixes rows, so it "
                             "cannot split this VAE exactly. Run without parallel_vae, or teach "
                             "parallel/vae_rows.py this module.")
        for child_name, child in children:
            visit(child, f"{path}.{child_name}")

    visit(entry, type(entry).__name__)
    split.multiple = math.prod(strides)
    return [(entry, SplitAtEntry(split))] + plan
