"""Several images per stock pipeline call (`ParallelPipeline.generate(batch_size=...)`), each equal to the image made
alone.

A batch is a list of the call's image indices. Each image keeps what it has alone: its own CPU generator seeded with
its own seed (stock `randn_tensor` draws each row of a list of generators on its own, so the noise is the same), and
its own encoding, padded to its own text bucket first; the rows are then made one length with masked positions
(`stack_rows`), which the families that bucket text ignore (FLUX.1 and FLUX.2 pad to `max_sequence_length`
themselves: every row already has one length). Rows never mix inside the transformer, so each image is the one made
alone up to float rounding (tested at 1e-5 on latents, tests/test_batching.py).

Where the text's length moves the image's positions and the batch shares one position table (Qwen-Image-2.1: the
image block starts after the text, numbered without its padding), only rows of one text length are exact together:
the adapter's `batch_key` says which rows may share a call, and a batch of mixed lengths becomes one stock call per
length (`stack_calls`), still each image equal to the image made alone.

Image inputs (`pipelines/image_inputs.py`): a class that takes one input image (and mask) per prompt, as FLUX.1's
Kontext, img2img and inpainting do, gets a list with each row's own image; stock encodes each row alone with that
row's generator, so each row keeps the latents it has alone (tested). A class that takes one set of images for the
whole call, and a batch of input images of different sizes, are refused before anything runs
(`image_inputs.batch_image_refusal`). The parallel VAE splits a batch's decode (and encode) over the image group as it
splits one image's, every band carrying every row (tested per image family).

Step caches: a cache decides once per transformer forward for the whole stock call, as stock does over the batch
tensor (FirstBlockCache's residual means cover every row), and the group shares that decision (`parallel/cache.py`).
A batched image then equals stock's image in the same batch with the same cache (tested at 1e-4 on latents,
tests/test_cache.py), not necessarily the image made alone: the batch may skip a step one of its images alone would
compute. Every image of a call reports the call's counts.

Static shapes: a pipeline loaded with `batch_sizes=(1, 2, 4)` runs every batch at a declared size, a short batch
padded with copies of its last row (their images are dropped), a long one split, so a compiled pipeline meets only
shapes its warm-up compiled.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .pipelines.base import check_seeds
from .pipelines.image_inputs import batch_image_refusal


def batch_refusal(adapter, context_parallel: bool) -> str | None:
    """Why a pipeline cannot make several images per stock call, whatever the call (None: it can): the one rule
    `load_pipeline(batch_sizes=...)`, the shared `--batch-size` / `--max-batch` option (`launch.plan_launch`) and
    `generate` (`check_batchable`) refuse by, before anything runs. A step cache is no reason: it decides once per
    stock call, as stock does over the same batch (the module doc)."""
    if adapter.batch_refusal:
        return adapter.batch_refusal
    if context_parallel and adapter.cp_block_causal:
        return f"{adapter.pipeline_class}'s batches are not verified under context parallelism yet"
    if context_parallel and adapter.cp_batch_refusal:
        return adapter.cp_batch_refusal
    return None


def is_positive_int(value) -> bool:
    """The one positive-integer rule of batch arguments: an int (not a bool) of at least 1."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def check_batch_sizes(batch_sizes, spec=None) -> tuple[int, ...] | None:
    """`load_pipeline(batch_sizes=...)`: None (any batch runs at its own size) or positive integers, sorted; a size
    above 1 refused (before any weight is read) where `spec`'s pipeline cannot batch (`batch_refusal`)."""
    if batch_sizes is None:
        return None
    sizes = tuple(batch_sizes) if isinstance(batch_sizes, (list, tuple)) else None
    if not sizes or not all(is_positive_int(size) for size in sizes):
        raise ValueError(f"`batch_sizes` must be a non-empty list of positive integers (the batch shapes a compiled "
                         f"pipeline declares, e.g. (1, 2, 4)), got {batch_sizes!r:.80}.")
    why = None if spec is None or max(sizes) == 1 else batch_refusal(spec.checkpoint.adapter,
                                                                     spec.ulysses * spec.ring > 1)
    if why:
        raise ValueError(f"`batch_sizes={sizes}`: {why}. Leave `batch_sizes` out.")
    return tuple(sorted(set(sizes)))


def resolve_batch_size(batch_size, declared: tuple[int, ...] | None) -> int:
    """The most images one call makes: `batch_size` (default: the largest declared size, else 1), at most the largest
    declared size (a longer batch is split)."""
    if batch_size is None:
        return declared[-1] if declared else 1
    if not is_positive_int(batch_size):
        raise ValueError(f"`batch_size` must be a positive integer (images per stock pipeline call), got "
                         f"{batch_size!r:.40}.")
    return min(batch_size, declared[-1]) if declared else batch_size


def split(indices: list[int], size: int) -> list[list[int]]:
    """`indices` in order, `size` at a time."""
    return [indices[start:start + size] for start in range(0, len(indices), size)]


def pack(items: list, size: int, key) -> list[list]:
    """`items` in batches of up to `size` that share `key(item)` (None: never shares), each batch where its first
    item was, so the order of first appearances stays (a CFG pair's joint requests stay in the same order on both
    groups)."""
    batches, open_batch = [], {}
    for item in items:
        which = key(item) if size > 1 else None
        batch = open_batch.get(which) if which is not None else None
        if batch is None or len(batch) == size:
            batch = []
            batches.append(batch)
            if which is not None:
                open_batch[which] = batch
        batch.append(item)
    return batches


def declared_sizes(batch_size: int) -> tuple[int, ...]:
    """The batch shapes a compiled job with `--batch-size N` declares: powers of two below N, and N."""
    sizes, size = [], 1
    while size < batch_size:
        sizes.append(size)
        size *= 2
    return (*sizes, batch_size)


def padded_count(count: int, declared: tuple[int, ...] | None) -> int:
    """The rows a batch of `count` images runs with: the smallest declared size that holds it (or `count`)."""
    if not declared:
        return count
    return next(size for size in declared if size >= count)


def seeds_for(seed, count: int) -> list[int]:
    """Image i's seed: `seed + i`, as the unbatched path seeds it, or `seed[i]` for a list (the job: each request's
    own seed). Checked: each one a valid generator seed."""
    if isinstance(seed, (list, tuple)):
        if len(seed) != count:
            raise ValueError(f"Got {len(seed)} seeds for {count} prompts: give one seed (image i then uses seed + i) "
                             "or one per prompt.")
        for index, value in enumerate(seed):
            check_seeds(value, 1, f"seed {index}")
        return list(seed)
    check_seeds(seed, count, "`seed`")
    return [seed + index for index in range(count)]


def check_batchable(adapter, *, image_rows: list[list[dict]], context_parallel: bool) -> None:
    """Refuse, before anything runs, a batch of more than one image where this path is not shown exact: what refuses
    any batch of this pipeline (`batch_refusal`), and what refuses this call's (`image_rows`: each multi-row call's
    image inputs, one dict per row, `image_inputs.batch_image_refusal`). The parallel VAE splits a batch's decode
    (and encode) as it splits one image's: every band carries every row (tested, `tests/test_batching.py`)."""
    reasons = [batch_refusal(adapter, context_parallel)]
    reasons += [batch_image_refusal(adapter, rows) for rows in image_rows]
    reasons = list(dict.fromkeys(reason for reason in reasons if reason))
    if reasons:
        raise ValueError("`generate` cannot batch this call (batch_size > 1): " + "; ".join(reasons) +
                         ". Generate with batch_size=1.")


def stack_calls(rows: list[dict[str, torch.Tensor]], keys: list, declared: tuple[int, ...] | None) -> dict:
    """The stock calls of one batch, flattened into one dict of tensors for one broadcast (`unstack_calls`): rows
    with equal `keys` share a call, each call padded to a declared batch size with copies of its last row."""
    calls: dict = {}
    for position, key in enumerate(keys):
        calls.setdefault(key, []).append(position)
    flat = {}
    for number, positions in enumerate(calls.values()):
        members = [rows[position] for position in positions]
        members += members[-1:] * (padded_count(len(members), declared) - len(members))
        embeds = members[0] if len(members) == 1 else stack_rows(members)
        flat[f"{number}/rows"] = torch.tensor(positions)
        flat.update({f"{number}/{name}": value for name, value in embeds.items()})
    return flat


def unstack_calls(flat: dict) -> list[tuple[list[int], dict]]:
    """`stack_calls`'s calls again: (the batch positions each call makes, its embeddings), in order."""
    calls: dict = {}
    for name, value in flat.items():
        number, key = name.split("/", 1)
        calls.setdefault(int(number), {})[key] = value
    return [(calls[number].pop("rows").tolist(), calls[number]) for number in sorted(calls)]


def stack_rows(rows: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The call kwargs of a batch: every row's tensors concatenated; sequence embeddings (`*prompt_embeds`, 3-D) of
    different lengths, or with masks, right-padded with masked positions to the longest."""
    if any(row.keys() != rows[0].keys() for row in rows):
        raise ValueError("The rows of a batch carry different embeddings (a negative prompt for some only): batch "
                         "prompts that all have a negative prompt, or none.")
    stacked = {}
    for name in rows[0]:
        if name.endswith("_mask") and name.removesuffix("_mask") in rows[0]:
            continue  # stacked with its embeddings
        values = [row[name] for row in rows]
        masks = [row.get(f"{name}_mask") for row in rows]
        sequence = name.endswith("prompt_embeds") and values[0].dim() == 3
        if sequence and (len({v.shape[1] for v in values}) > 1 or any(m is not None for m in masks)):
            length = max(v.shape[1] for v in values)
            padded = [_pad_row(v, m, length) for v, m in zip(values, masks, strict=True)]
            values = [v for v, _ in padded]
            stacked[f"{name}_mask"] = torch.cat([m for _, m in padded])
        stacked[name] = torch.cat(values)
    return stacked


def _pad_row(value: torch.Tensor, mask: torch.Tensor | None, length: int):
    """One row's embeddings and mask (ones where there is none) right-padded to `length` positions, masked out."""
    if mask is None:
        mask = torch.ones(value.shape[:2], dtype=torch.long, device=value.device)
    extra = length - value.shape[1]
    return F.pad(value, (0, 0, 0, extra)), F.pad(mask, (0, extra))
