"""Context parallelism for Qwen-Image-2.1, which diffusers ships without a plan (Ulysses only): the block-causal
hooks its plan (`CP_PLAN` in `tp_plans/qwenimage21.py`) needs, registered as the class's context-parallel quirks.

Qwen-Image-2.1 runs one joint sequence: text and condition images (the prefix), then the target image. Attention is
block-causal: text is causal, each image block bidirectional, the target sees everything. Its stock processor
expresses that as per-segment attention calls that slice the *query by global position*, which a sequence split
breaks. But once Ulysses has exchanged heads for sequence, every rank holds the *whole* sequence (for its heads),
in order, so one attention call with the dense block-causal mask is exact. So a pre-hook on each block turns the
segments into that mask (full size: Ulysses uses a mask of the full key length as it is), and the stock
processor's own mask path does the rest. What is split, exactly:

- the joint hidden states at block 0, and per block the rows indexed by sequence position: `rotary_emb` and
  `target_token_mask`; `norm_out`'s `target_token_mask`; `proj_out` gathers the rows back.
- The prefix KV cache (`use_kv_cache=True`, the pipeline's default) becomes rank-local: at the extract step each
  rank stores the prefix rows of its own chunk, padded with masked rows to the most any rank holds, and at the
  cached steps it attends with them; all ranks' keys together are the whole prefix (and padding), in another
  order, and attention does not depend on key order (the key mask is laid out to match). Every rank holds as many
  keys, so plain Ulysses (static shapes) works when the joint and target lengths divide; `ulysses_anything` takes
  any length.

Ring attention is refused: it would apply each rank's slice of this mask to every rotated key block.

The hooks are torch pre-hooks, not diffusers' hook registry: they must see the block's inputs before diffusers'
context-parallel hook (registered in that registry, which wraps the block's forward) splits them.
"""

from __future__ import annotations

import weakref

import torch
import torch.nn.functional as F

RING_REFUSAL = ("Qwen-Image-2.1's block-causal attention needs Ulysses: ring attention would apply one rank's part of "
                "the mask to every rotated key block. Use ContextParallelConfig(ulysses_degree=N).")


def check(cp_config) -> None:
    """Refuse ring attention before any weight is read (`compat.context` calls it for the registered class)."""
    if cp_config.ring_degree > 1:
        raise ValueError(RING_REFUSAL)


def chunk(n: int, parts: int, index: int) -> tuple[int, int]:
    """Rows [start, end) of chunk `index` when `n` rows are `tensor_split` into `parts` (as both sharders cut)."""
    size, extra = divmod(n, parts)
    start = index * size + min(index, extra)
    return start, start + size + (index < extra)


def block_causal_mask(segments, seq_len: int, key_valid: torch.Tensor | None, device) -> torch.Tensor:
    """The dense (batch, 1, seq_len, seq_len) bool mask of the stock per-segment prefill: each prefix segment sees
    keys [0, end), text segments causally within themselves, target rows see every key; padded keys never."""
    limit = torch.full((seq_len,), seq_len, dtype=torch.long)
    start = torch.zeros(seq_len, dtype=torch.long)
    causal = torch.zeros(seq_len, dtype=torch.bool)
    for seg_start, seg_end, is_text in segments:
        limit[seg_start:seg_end], start[seg_start:seg_end], causal[seg_start:seg_end] = seg_end, seg_start, is_text
    rows, keys = torch.arange(seq_len)[:, None], torch.arange(seq_len)[None, :]
    allowed = (keys < limit[:, None]) & (~causal[:, None] | (keys < start[:, None]) | (keys <= rows))
    mask = allowed.to(device)[None, None]
    return mask if key_valid is None else mask & key_valid[:, None, None, :].bool()


class _PaddedStore:
    """A layer cache whose `store` pads the rows it is given to `rows` with zeros (masked out at the cached steps),
    so that every rank of the group caches as many rows; anything else is the real layer cache's."""

    def __init__(self, cache, rows: int):
        self._cache, self._rows = cache, rows

    def store(self, k: torch.Tensor, v: torch.Tensor):
        pad = (0, 0, 0, 0, 0, self._rows - k.shape[1])  # (batch, rows, heads, head_dim): pad the rows
        self._cache.store(F.pad(k, pad), F.pad(v, pad))

    def __getattr__(self, name):
        return getattr(self._cache, name)


class BlockCausalUnderUlysses:
    """The per-block pre-hook described above; one per model, its per-forward state reset by a model pre-hook.

    The KV cache layout: at the extract step, rank r's chunk of the joint sequence holds `mine` prefix rows; each rank
    stores them padded to the most any rank holds (`padded`), so at the cached steps every rank attends with the same
    number of keys (plain Ulysses needs equal lengths; compiled shapes stay static), the padding masked out.
    """

    def __init__(self, cp_rank: int, cp_size: int):
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.state = None
        #: Per layer cache, from its extract step: (prefix length, this rank's prefix rows, the rows stored).
        self._layouts: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    @torch.compiler.disable  # bookkeeping around the compiled blocks, not part of them
    def reset(self, module, args, kwargs):
        self.state = None

    def _prefix_rows(self, full_len: int, prefix_len: int, rank: int) -> tuple[int, int]:
        start, end = chunk(full_len, self.cp_size, rank)
        return min(start, prefix_len), min(end, prefix_len)

    @torch.compiler.disable  # bookkeeping around the compiled blocks: one graph serves every block
    def __call__(self, block, args, kwargs):
        if self.state is None:  # block 0, before its split: the whole sequence
            self.state = self._first_block(kwargs)
        kwargs = {**kwargs, **{k: v for k, v in self.state.items() if k != "layout"}}
        cache = kwargs.get("layer_cache")
        if kwargs.get("kv_cache_mode") == "extract" and cache is not None:
            self._layouts[cache] = self.state["layout"]
            kwargs["layer_cache"] = _PaddedStore(cache, self.state["layout"][2])
        return args, kwargs

    def _first_block(self, kwargs) -> dict:
        rows = kwargs["hidden_states"].shape[1]
        segments, mode = kwargs.get("segments"), kwargs.get("kv_cache_mode")
        if segments is not None:  # prefill: the whole joint sequence
            prefix_len = segments[-1][1] if segments else 0
            state = {"segments": None, "key_valid": None, "attention_mask": block_causal_mask(
                segments, rows, kwargs.get("key_valid"), kwargs["hidden_states"].device)}
            if mode == "extract":
                counts = [end - start for start, end in
                          (self._prefix_rows(rows, prefix_len, r) for r in range(self.cp_size))]
                state["cache_write_slice"] = slice(0, counts[self.cp_rank])  # the chunk's prefix rows come first
                state["layout"] = (prefix_len, counts[self.cp_rank], max(counts))
            return state
        if mode != "cached" or kwargs["layer_cache"].k is None:
            return {}  # nothing to lay out (stock raises its own error for an empty cache)
        layout = self._layouts.get(kwargs["layer_cache"])
        if layout is None:
            raise ValueError(
                "Qwen-Image-2.1's KV cache was filled without context parallelism, but this model splits the sequence: "
                "fill it (kv_cache_mode='extract') with the same parallel model."
            )
        prefix_len, mine, padded = layout
        start, end = self._prefix_rows(prefix_len + rows, prefix_len, self.cp_rank)
        t_start, t_end = chunk(rows, self.cp_size, self.cp_rank)
        valid = kwargs.get("attention_mask")  # the full-length key mask, or None: every key valid
        if valid is None:
            valid = torch.ones(kwargs["hidden_states"].shape[0], 1, 1, prefix_len + rows, dtype=torch.bool,
                               device=kwargs["hidden_states"].device)
        # This rank's keys: its prefix rows, their padding, its target rows; Ulysses gathers the ranks' masks in the
        # order it gathers their keys.
        local = torch.cat([valid[..., start:end], valid.new_zeros(*valid.shape[:-1], padded - mine),
                           valid[..., prefix_len + t_start:prefix_len + t_end]], dim=-1)
        return {"attention_mask": local}


def install(model: torch.nn.Module, cp_config, cp_rank: int, cp_size: int) -> None:
    """Register the block pre-hooks on `model` (call before diffusers' `apply_context_parallel`)."""
    check(cp_config)
    hook = BlockCausalUnderUlysses(cp_rank, cp_size)
    model.register_forward_pre_hook(hook.reset, with_kwargs=True)
    for block in model.transformer_blocks:
        block.register_forward_pre_hook(hook, with_kwargs=True)
