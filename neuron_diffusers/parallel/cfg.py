"""CFG parallelism for stock pipelines: the cond and uncond transformer calls of one step run on two TP groups at once.

With true classifier-free guidance (a negative prompt and `true_cfg_scale > 1`), stock `QwenImagePipeline`,
`QwenImage21Pipeline` and `FluxPipeline` call their transformer twice per step, cond then uncond, each under
`transformer.cache_context("cond" / "uncond")`, and combine the two predictions. The pipelines stay unchanged:
for the length of one call, `pipe.transformer` is a `CFGParallelTransformer` that, on each rank of a CFG pair,

- at the *cond* call computes one branch (CFG rank 0 the cond branch, CFG rank 1 the uncond branch) on the same
  latents, inside the real model's `cache_context` of the branch it computes, then exchanges the two predictions
  over the pair and returns the cond one;
- at the *uncond* call computes nothing and returns the partner's uncond prediction.

How CFG rank 1 gets the uncond inputs: the runner calls its pipeline with prompt and negative swapped
(`swap_branches`), so the pipeline itself derives every input of the branch that rank computes, exactly as it
would for its uncond call: the text embeddings and masks, FLUX's `txt_ids`, Qwen-Image-2.1's `img_mask` and its
per-branch text KV cache (rank 1's "cond" cache then holds the uncond keys and values, filled and read by the
same calls as in a serial run). A proxy handed the negative embeddings up front would have to re-derive those
pipeline-internal inputs, copying pipeline code. Both ranks then combine the same two predictions with the same
code, so their latents stay bitwise equal, and a step that makes only a cond call (CFG truncation) still returns
the right cond prediction (the exchanged uncond one is dropped).

Checks, once per call of the pipeline (at the first uncond call, before its result is used): each rank's
uncond-call inputs must equal what its partner computed at the cond call (the branch substitution is right),
and both ranks' latents and timestep must be equal (same seed), else a clear error on both ranks. FLUX's
IP-Adapter path is refused: stock writes each branch's image embeddings into the one `joint_attention_kwargs`
dict between the two calls, which the cond call cannot see ahead of time.

Only the real model is ever compiled (`compile.compile_repeated_blocks` runs outside `generate`, where
`pipe.transformer` is the real one): compiling the proxy would recompile every step on its changing state.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..consistency import fingerprint

#: The branch each CFG rank computes, named as the pipelines name their `cache_context`s.
BRANCHES = ("cond", "uncond")
NEGATIVE = "negative_"


class CFGBranchMismatchError(RuntimeError):
    """The two ranks of a CFG pair did not compute the two branches of the same step."""


def swap_branches(embeds: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`embeds` with every `x` and `negative_x` exchanged (a name missing on one side moves as missing): the call
    kwargs that make the pipeline of CFG rank 1 compute the uncond branch at its cond call."""
    names = {name.removeprefix(NEGATIVE) for name in embeds}
    swapped = {}
    for name in names:
        if NEGATIVE + name in embeds:
            swapped[name] = embeds[NEGATIVE + name]
        if name in embeds:
            swapped[NEGATIVE + name] = embeds[name]
    return swapped


def exchange(tensor: torch.Tensor, group) -> list[torch.Tensor]:
    """Every rank's `tensor`, in group-rank order, whatever their shapes.

    Qwen-Image-2.1 returns the whole joint (text + image) sequence when it does not read its text KV cache, so the
    two branches' predictions differ in length by the prompt lengths. Shapes go first (one small all-gather), and
    only when they differ is each tensor zero-padded to the largest and sliced back after the gather.
    """
    size = dist.get_world_size(group)
    shape = torch.tensor([tensor.dim(), *tensor.shape], dtype=torch.int64, device=tensor.device)
    shapes = [torch.empty_like(shape) for _ in range(size)]
    dist.all_gather(shapes, shape, group=group)
    shapes = [tuple(s.tolist()[1:]) for s in shapes]
    if any(len(s) != tensor.dim() for s in shapes):
        raise CFGBranchMismatchError(f"The CFG pair's predictions have different ranks: shapes {shapes}.")
    tensor = tensor.contiguous()
    if len(set(shapes)) == 1:
        gathered = [torch.empty_like(tensor) for _ in range(size)]
        dist.all_gather(gathered, tensor, group=group)
        return gathered
    largest = [max(dims) for dims in zip(*shapes, strict=True)]
    padding = [p for mine, most in zip(reversed(tensor.shape), reversed(largest), strict=True)
               for p in (0, most - mine)]
    padded = F.pad(tensor, padding)
    gathered = [torch.empty_like(padded) for _ in range(size)]
    dist.all_gather(gathered, padded, group=group)
    return [full[tuple(slice(0, n) for n in s)] for full, s in zip(gathered, shapes, strict=True)]


def _same(a, b, rtol: float = 1e-5) -> bool:
    """Two digests match: tensors of equal shape and dtype whose checksums agree up to float32 summation order."""
    if isinstance(a, tuple) and isinstance(b, tuple) and a[:1] == b[:1] == ("tensor",):
        if a[1:3] != b[1:3]:
            return False
        scale = rtol * max(1.0, abs(a[3][1]) if a[3] else 0.0)
        return all(abs(x - y) <= scale for x, y in zip(a[3], b[3], strict=True))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k], rtol) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(_same(x, y, rtol) for x, y in zip(a, b, strict=True))
    return a == b


def _inputs_digest(args: tuple, kwargs: dict) -> dict:
    return {**{f"positional argument {i}": fingerprint(a) for i, a in enumerate(args)},
            **{name: fingerprint(value) for name, value in kwargs.items()}}


# Inputs that carry the latents: they must be equal on both ranks of the pair in both calls.
_LATENT_INPUTS = ("hidden_states", "timestep", "positional argument 0")


def _sample(output) -> torch.Tensor:
    """The prediction in a transformer's output: `(sample,)` with `return_dict=False`, else `.sample`."""
    if isinstance(output, tuple) and len(output) == 1:
        return output[0]
    if hasattr(output, "sample") and len(output) == 1:
        return output.sample
    raise TypeError(
        f"CFG parallelism exchanges the transformer's one prediction, but it returned {type(output).__name__} with "
        f"{len(output)} entries. Run this pipeline without --cfg-parallel."
    )


def _with_sample(output, sample: torch.Tensor):
    if isinstance(output, tuple):
        return (sample,)
    return type(output)(sample=sample)


class CFGParallelTransformer(torch.nn.Module):
    """Stands in for `pipe.transformer` during one pipeline call on one rank of a CFG pair (see the module doc).

    Every attribute it does not define (config, dtype, device, blocks, `compile_repeated_blocks`, ...) is the real
    model's, and `forward` carries the real forward's signature (H3's modular blocks and others inspect it).
    """

    def __init__(self, transformer: torch.nn.Module, group):
        super().__init__()
        self.transformer = transformer
        self._group = group
        self._branch = BRANCHES[dist.get_rank(group)]
        self._context: tuple[str, dict] | None = None
        self._held = None  # (uncond prediction, output of the cond call, digest of its inputs) until the uncond call
        self._verified = False

        @functools.wraps(transformer.forward)
        def forward(*args, **kwargs):
            return self._forward(*args, **kwargs)

        self.forward = forward  # the real signature, for pipelines that inspect it

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["transformer"], name)

    @contextmanager
    def cache_context(self, name: str, **kwargs):
        """Remembers which branch the pipeline is calling; the real context is entered around the real call."""
        self._context = (name, kwargs)
        try:
            yield
        finally:
            self._context = None

    def _forward(self, *args, **kwargs):
        name, context_kwargs = self._context or (None, {})
        if name not in BRANCHES:
            raise CFGBranchMismatchError(
                f"The pipeline called its transformer outside `cache_context('cond')` / `cache_context('uncond')` "
                f"(context: {name!r}), so CFG parallelism cannot tell which branch the call is. Run this pipeline "
                "without --cfg-parallel."
            )
        if "ip_adapter_image_embeds" in (kwargs.get("joint_attention_kwargs") or {}):
            raise ValueError(
                "CFG parallelism does not run FLUX's IP-Adapter: stock FluxPipeline swaps each branch's image "
                "embeddings into the shared `joint_attention_kwargs` between its two calls, which the cond call "
                "cannot see ahead of time. Run IP-Adapter generations without --cfg-parallel."
            )
        if name == "cond":
            return self._compute_both(args, kwargs, context_kwargs)
        return self._serve_uncond(args, kwargs)

    def _compute_both(self, args, kwargs, context_kwargs):
        """Compute this rank's branch, exchange, return cond; hold uncond for the call that should follow."""
        digest = None if self._verified else _inputs_digest(args, kwargs)
        with self.transformer.cache_context(self._branch, **context_kwargs):
            output = self.transformer(*args, **kwargs)
        cond, uncond = exchange(_sample(output), self._group)
        self._held = (uncond, output, digest)  # a cond-only step (CFG truncation) simply overwrites it
        return _with_sample(output, cond)

    def _serve_uncond(self, args, kwargs):
        if self._held is None:
            raise CFGBranchMismatchError(
                "The pipeline made an uncond transformer call with no cond call before it in the same step; CFG "
                "parallelism computes both branches at the cond call. Run this pipeline without --cfg-parallel."
            )
        uncond, output, cond_digest = self._held
        self._held = None
        if not self._verified:
            self._verify(cond_digest, _inputs_digest(args, kwargs))
            self._verified = True
        return _with_sample(output, uncond)

    def _verify(self, computed: dict, requested: dict) -> None:
        """Each rank's uncond-call inputs must be what its partner computed, and the pair's latents equal."""
        gathered = [None, None]
        dist.all_gather_object(gathered, (computed, requested), group=self._group)
        (computed0, requested0), (computed1, requested1) = gathered
        rank0, rank1 = (dist.get_global_rank(self._group, i) for i in (0, 1))
        for name in _LATENT_INPUTS:
            if not _same(computed0.get(name), computed1.get(name)):
                raise CFGBranchMismatchError(
                    f"The CFG pair (ranks {rank0} and {rank1}) holds different `{name}` at its first step: both "
                    "ranks must denoise the same noise, otherwise the image comes out silently wrong. Give both the "
                    "same `seed` (`generate` seeds a CPU generator with seed + index) and do not pass per-rank "
                    "`generator` or `latents`."
                )
        for branch, computed_by, by, wanted, wanted_by in (("uncond", computed1, rank1, requested0, rank0),
                                                           ("cond", computed0, rank0, requested1, rank1)):
            differing = sorted(n for n in set(computed_by) | set(wanted)
                               if not _same(computed_by.get(n), wanted.get(n)))
            if differing:
                raise CFGBranchMismatchError(
                    f"CFG parallelism computed a different {branch} branch than the pipeline asked for: input(s) "
                    f"{', '.join(differing)} that rank {by} computed with differ from what the pipeline on rank "
                    f"{wanted_by} passes for that branch. Both ranks of a CFG pair must call `generate` with the same "
                    "prompt, negative prompt and settings (the runner swaps them for the second rank, see "
                    "`cfg_parallel.swap_branches`)."
                )


@contextmanager
def cfg_parallel_transformer(pipe, group, experts: tuple[str, ...] = ()):
    """`pipe.transformer` (and each expert, e.g. Wan 2.2's `transformer_2`: a step calls one model, cond then
    uncond) is a `CFGParallelTransformer` over the CFG pair `group` inside the block, the real model again after it
    (so compiling, timing hooks and everything outside a generation see only the real model)."""
    reals = {name: getattr(pipe, name) for name in ("transformer", *experts)}
    for name, real in reals.items():
        setattr(pipe, name, CFGParallelTransformer(real, group))
    try:
        yield pipe.transformer
    finally:
        for name, real in reals.items():
            setattr(pipe, name, real)
