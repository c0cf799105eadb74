"""Load a stock pipeline with its transformer split over the mesh's image group, and generate.

The one data path, per image group (the mesh's "tp" ranks, times its "ring" and "ulysses" ranks under context
parallelism): resolve the checkpoint → read its config (all checks happen here, before any weight is read) →
stream each rank's transformer slice → the leader (group rank 0) loads the text encoder on CPU, encodes each prompt
once and broadcasts the embeddings to the group → every rank denoises the same CPU-seeded noise with the stock
pipeline, checking that the group's latents agree (under context parallelism every rank holds the whole latents:
the transformer's output is gathered) → the leader decodes and returns the image (with parallel VAE,
every rank of the image group decodes one piece of it, `parallel/vae.py`).

With `cache=` (a diffusers step-cache config) the transformer runs diffusers' cache hooks with every skip decision
shared by its group (`parallel/cache.py`), and each image's forwards computed vs served from the cache are kept.

On a mesh with a "cfg" dimension (`init_distributed(cfg=2)`) each replica is a CFG pair of image groups. A call with
true classifier-free guidance runs each image on both groups, one guidance branch each (`parallel/cfg.py`); a call
without it gives each group its own images, so the second group is extra data parallelism instead of idle.

Image inputs (`generate(image=..., mask_image=..., strength=...)`, any stock class on the family's transformer
via `load_pipeline(..., pipeline_class=...)`) go through the stock call too; the one rank that holds a VAE (with
parallel VAE: the image group, encoding together; and where the text encoder reads the image, the leader's encoder)
shares its results inside it (`pipelines/image_inputs.py`).
"""

from __future__ import annotations

import functools
import os
import warnings
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from diffusers import ContextParallelConfig, ParallelConfig, TensorParallelConfig
from torch.distributed.device_mesh import DeviceMesh

from .batching import (
    check_batch_sizes,
    check_batchable,
    padded_count,
    resolve_batch_size,
    seeds_for,
    split,
    stack_calls,
    unstack_calls,
)
from .checkpoint import Checkpoint, set_drafter
from .compat.plans import record_tp_plan, using_cp_plan, using_plan
from .compile import compile_repeated_blocks
from .consistency import ENTRY_TIMEOUT_S, CallEntry, LatentAgreement, agree, raise_agreed, shareable
from .distributed import (
    broadcast_from_leader,
    cfg_rank,
    cfg_size,
    dim_size,
    image_group,
    init_distributed,
    is_group_leader,
    is_replica_leader,
    mesh_device,
    rank,
    replica_ranks,
)
from .launch import LaunchSpec, check_experts, check_guidance, runner_mode, spec_for
from .parallel import context
from .parallel.cache import GroupCache, enable_group_cache, group_cache_of, sum_counts
from .parallel.cfg import cfg_parallel_transformer, swap_branches
from .parallel.lora import FusedLoras
from .parallel.quantize import check_launch_quantize, quantize_model, quantize_rules
from .parallel.vae import ParallelVAE, enable_parallel_vae, resolve_parallel_vae
from .pipelines import PipelineAdapter
from .pipelines.base import SizeLimits, check_text
from .pipelines.drafted import drafted_family
from .pipelines.generic import shared_encoding
from .pipelines.image_inputs import (
    call_image_kwargs,
    check_image_kwargs,
    image_rows,
    reads_image,
    shared_image_inputs,
    vae_without_coders,
)
from .timing import PhaseTimes

set_drafter(drafted_family)  # any other stock pipeline resolves to a plan drafted from its transformer

# Inputs `generate` owns (passing them would bypass the one-rank encoding or the rank-consistent noise), and
# FLUX.2's prompt upsampling, which it cannot run.
_OWNED_KWARGS = {
    "prompt": "pass prompts as the first argument",
    "prompt_embeds": "`generate` encodes each prompt once on the group leader and broadcasts the embeddings",
    "negative_prompt_embeds": "pass `negative_prompt`; it is encoded once on the group leader",
    "generator": "pass `seed`: image i uses a CPU generator seeded with seed + i on every rank of the group",
    "latents": "pass `seed`: every rank of the group must start from the same noise",
    "num_images_per_prompt": "repeat the prompt: each image gets its own seed (seed + index)",
    "callback_on_step_end": "`generate` uses the step callback to check that the group's latents agree",
    "caption_upsample_temperature": "FLUX.2 upsamples the prompt with its text encoder before encoding it, but "
                                    "`generate` encodes the prompt first (on the leader only). Upsample it "
                                    "beforehand (stock `Flux2Pipeline.upsample_prompt`, in one process) and pass the "
                                    "result as the prompt",
    "return_dict": "`generate` returns the outputs themselves, one per prompt",
    "output": "`generate` returns the outputs themselves (MiniMax-H3: a `VideoWithAudio` per prompt)",
}


@dataclass
class ParallelPipeline:
    """A stock diffusers pipeline whose transformer is split over the mesh's image group (TP, and context parallelism
    when the mesh has "ring" / "ulysses" dimensions).

    `encoder` (the text components, on CPU) exists only on the image group's leader; `pipe` (transformer, scheduler,
    and the VAE on the leader, or with parallel VAE on every rank) on every rank. On a mesh with a `cfg` dimension
    every image group of a CFG pair has its own leader with its own encoder and VAE, so either group can also serve
    requests alone.
    """

    adapter: PipelineAdapter
    pipe: object
    encoder: object | None
    mesh: DeviceMesh
    buckets: tuple[int, ...]
    #: Seconds per phase: load, encode, transformer forwards, decode (see `timing.PhaseTimes`).
    times: PhaseTimes = field(default_factory=PhaseTimes)
    #: The LoRAs fused into this rank's shards (`parallel/lora.py`; `loras.active` lists them), made by `set_loras`.
    loras: FusedLoras | None = field(default=None, repr=False)
    #: On ranks without a VAE, for classes that take images: loads (once, at the first call with images) what
    #: `pipe.vae` answers with there (`vae_without_coders`), so text-to-image calls read nothing more.
    follower_vae: Callable[[], torch.nn.Module] | None = None
    #: With a step cache: per image this rank denoised, in the call's image order, its transformer forwards computed
    #: and served from the cache (`{"computed", "cached", "by_context"}`; with CFG parallelism both branches', summed
    #: over the pair). The images of one stock call (a batch) share its forwards, so each gets the call's counts.
    cache_counts: list = field(default_factory=list)
    #: The sizes the checkpoint can make (`height` / `width` are checked against it before a call does anything).
    size_limits: SizeLimits | None = None
    #: Seconds a rank waits in `generate` for the rest of its group to make the same call (`consistency.CallEntry`).
    entry_timeout_s: float = ENTRY_TIMEOUT_S
    #: The checkpoint it was loaded from, and how context parallelism runs it (None without).
    checkpoint: Checkpoint | None = None
    cp_mode: context.RunnerMode | None = None
    #: The VAE split over the image group (`load_pipeline(parallel_vae=...)`), or None: the leader decodes alone.
    parallel_vae: ParallelVAE | None = None
    #: The batch sizes a call's stock calls run at (`load_pipeline(batch_sizes=...)`: static shapes for compiled
    #: graphs), or None: each batch at its own size.
    batch_sizes: tuple[int, ...] | None = None

    def __post_init__(self):
        self.times.time_module(self.adapter.transformer_of(self.pipe), "transformer forward")
        for decoder in self.adapter.decoders(self.pipe):
            self.times.time_module(decoder, "decode")

    @property
    def is_leader(self) -> bool:
        return is_group_leader(self.mesh)

    def set_loras(self, loras) -> None:
        """Make `loras` (`[(path_or_hub_id, scale), ...]`) the active LoRA set, fused into every rank's shard in place
        (no reload, compiled graphs reused); `[]` restores the base weights bit for bit. Every rank of the replica
        must call it with the same list; a bad request raises the same `LoraError` on each and changes nothing."""
        if self.checkpoint is not None:
            check_experts(self.checkpoint, loras=loras)
        if self.loras is None:
            self.loras = FusedLoras.for_pipeline(self.adapter, self.pipe, self.encoder, self.mesh)
        self.loras.set(loras)
    @property
    def cache(self) -> GroupCache | None:
        """The step cache `load_pipeline(cache=...)` installed (decisions, counts), or None."""
        return group_cache_of(self.adapter.transformer_of(self.pipe))

    def generate(
        self,
        prompts: str | list[str],
        *,
        seed: int | list[int] = 0,
        negative_prompt: str | list[str] | None = None,
        check_latents_every: int | None = None, alone: bool = False,
        image=None, mask_image=None, strength: float | None = None,
        batch_size: int | None = None,
        **pipeline_kwargs,
    ) -> list | None:
        """One image (H3: a `VideoWithAudio`) per prompt, on one rank of the replica; `None` on its other ranks.

        Every rank of the replica must call this with the same arguments: a rank that does not make the call within
        `entry_timeout_s` is named in a `GroupOutOfStepError` on the others, and so are arguments that differ. Every
        check of the arguments runs on every rank, and a failure on one rank (the leader encodes and decodes) is
        raised on all of them: every rank raises the same exception, and the group stays usable for the next call.

        Image `i` is denoised from a CPU generator seeded with `seed + i`, identical on every rank; the group's latents
        are compared at the first and last step (and every `check_latents_every` steps), raising
        `LatentsDivergedError` on every rank if they differ. `pipeline_kwargs` go to the stock pipeline call
        (height, width, num_inference_steps, guidance_scale, true_cfg_scale, ...).

        On a mesh with a `cfg` dimension (CFG pairs of TP groups), the images come back on the pair's leader (TP
        leader of CFG rank 0). With true CFG (a negative prompt and a `true_cfg_scale` above 1) both groups denoise
        each image, one guidance branch each, so each rank runs half the transformer forwards. Without it, image `i`
        is made by group `i % 2` alone: the second group is data parallelism, not a copy of the first.
        `alone=True` leaves the CFG partner out: this TP group makes every image itself (true CFG then runs
        serially) and its leader returns them; the partner must not make the same call (the job uses this to give
        each group of a pair its own requests).

        `image` (a PIL image, or a list of reference images where the class takes several), `mask_image` and
        `strength` go to the stock call for every prompt; the class decides what they mean (Kontext, img2img,
        inpainting, Qwen-Image-Edit-Plus, FLUX.2 references, Qwen-Image-2.1 with an image); FLUX.1's classes take
        lists with one image (and mask) per prompt too. They are checked before anything runs: a class that takes
        none of them, one that needs an image, a mask of another size, a strength outside (0, 1].
        `batch_size` images share a stock call (default: the largest `load_pipeline(batch_sizes=...)`, else 1), each
        equal to the image made alone (`batching.py`); `seed` may be a list, one seed per prompt.
        """
        pair = cfg_size(self.mesh) > 1 and not alone
        CallEntry(replica_ranks(self.mesh, with_cfg=pair), "generate", self.entry_timeout_s).enter(
            [self.adapter.pipeline_class, prompts, seed, negative_prompt, check_latents_every, alone, image,
             mask_image, strength, batch_size, pipeline_kwargs])
        prompts, seeds = self._check_call(prompts, seed, pipeline_kwargs)
        negatives = self._negatives(negative_prompt, len(prompts))
        rows = image_rows(self.adapter, check_image_kwargs(self.adapter, image, mask_image, strength, len(prompts)),
                          len(prompts))
        self._check_context_parallel(pipeline_kwargs)
        joint = pair and _check_cfg_parallel_kwargs(self.adapter, negatives[0], pipeline_kwargs)
        mine = list(range(len(prompts)) if joint or not pair else range(cfg_rank(self.mesh), len(prompts), 2))
        outputs, error = self._make_mine(self._batches(mine, batch_size, rows),
                                         list(zip(prompts, negatives, strict=True)), seeds, joint,
                                         check_latents_every, pipeline_kwargs, rows)
        if pair and not joint:  # the two groups made different images: the pair agrees before it exchanges them
            error = agree(error, self.mesh["cfg"].get_group())
        if error is not None:
            raise error
        if not pair:
            return [outputs[i] for i in range(len(prompts))] if self.is_leader else None
        return self._collect_pair(outputs, len(prompts), joint)

    def _batches(self, mine: list[int], batch_size, rows: list[dict]) -> list[list[int]]:
        """This group's images, a stock call's worth at a time; a call of several rows (a batch, or one image padded
        to a declared batch size) is refused up front where it is not shown exact (`batching.check_batchable`).
        `rows`: each prompt's image inputs (`image_inputs.image_rows`, [] without)."""
        batches = split(mine, resolve_batch_size(batch_size, self.batch_sizes))
        several = [batch for batch in batches if padded_count(len(batch), self.batch_sizes) > 1]
        if several:
            check_batchable(self.adapter, image_rows=[[rows[i] for i in batch] for batch in several] if rows else [],
                            context_parallel=self.cp_mode is not None)
        return batches

    def _make_mine(self, batches, texts, seeds, joint, check_latents_every, pipeline_kwargs,
                   rows: list[dict]) -> tuple[dict, Exception | None]:
        """This group's images of the call (index -> output), and the first error, kept for the pair to agree on.
        `texts`: (prompt, negative prompt) per image; `rows`: its image inputs per image ([] without)."""
        encode_kwargs = {k: pipeline_kwargs[k] for k in self.adapter.encode_kwargs if k in pipeline_kwargs}
        # A vision-language encoder that reads the image encodes inside the call, where the pipeline resized it.
        in_call = self.adapter.prompt_in_call or (bool(rows) and reads_image(self.adapter.pipeline_cls()))
        outputs, error = {}, None
        try:
            for batch in batches:
                made = self._make([texts[i] for i in batch], [seeds[i] for i in batch], encode_kwargs, joint,
                                  check_latents_every, pipeline_kwargs, [rows[i] for i in batch] if rows else [],
                                  in_call)
                outputs.update(zip(batch, made, strict=True))
        except dist.DistError:  # a peer is gone: no agreement is possible, the group is dead
            raise
        except Exception as caught:
            error = caught
        return outputs, error

    def _check_call(self, prompts, seed, pipeline_kwargs: dict) -> tuple[list[str], list[int]]:
        """Every check of a call's own arguments; it runs on every rank alike, so every rank raises the same error.
        The prompts as a list, and each image's seed (`batching.seeds_for`)."""
        prompts = [prompts] if isinstance(prompts, str) else prompts
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError(f"`prompts` must be a string or a non-empty list of strings, got {prompts!r:.80}.")
        for index, prompt in enumerate(prompts):
            check_text(prompt, f"prompt {index}")
        for name, why in _OWNED_KWARGS.items():
            if name in pipeline_kwargs:
                raise ValueError(f"`generate` does not take `{name}`: {why}.")
        self.adapter.check_call_kwargs(pipeline_kwargs)
        if self.size_limits is not None:
            if {"height", "width"} & pipeline_kwargs.keys():
                # A side left out takes the pipeline's default; the smallest valid side stands in for it here.
                smallest = self.size_limits.multiple
                self.size_limits.check(pipeline_kwargs.get("height", smallest),
                                       pipeline_kwargs.get("width", smallest), "`generate`")
            self.size_limits.check_steps(pipeline_kwargs.get("num_inference_steps"), "`generate`")
        return list(prompts), seeds_for(seed, len(prompts))

    def _make(self, texts: list[tuple], seeds: list[int], encode_kwargs: dict, joint: bool,
              check_latents_every: int | None, pipeline_kwargs: dict, rows: list[dict], in_call: bool) -> list:
        """Encode and denoise a batch's images (one per (prompt, negative) of `texts`, with its image inputs in
        `rows`): one stock call, or one per group of rows the adapter lets share a call (`batching.stack_calls`), each
        padded to a declared batch size with copies of its last row (dropped); whatever fails on some rank of the
        group fails on all of them."""
        made, counts, error = {}, {}, None
        try:
            with self.times.phase("encode"):
                calls = [([0], _prompt_strings(*texts[0]))] if in_call else self._encode(texts, encode_kwargs)
            for positions, embeds in calls:
                padded = positions + positions[-1:] * (padded_count(len(positions), self.batch_sizes) - len(positions))
                images = call_image_kwargs([rows[p] for p in padded]) if rows else {}
                output = self._denoise(embeds, [seeds[p] for p in padded], joint, check_latents_every,
                                       {**pipeline_kwargs, **images}, images, in_call)
                counts.update(dict.fromkeys(positions, self._call_counts(joint)))
                if output is not None:
                    made.update(zip(positions, [output] if len(padded) == 1 else output, strict=False))
        except dist.DistError:
            raise
        except Exception as caught:
            error = caught
        raise_agreed(error, image_group(self.mesh), self.mesh["cfg"].get_group() if joint else None)
        if self.cache is not None:  # in image order (Qwen-Image-2.1 makes a batch's text lengths one call each)
            self.cache_counts.extend(counts[position] for position in sorted(counts))
        return [made.get(position) for position in range(len(texts))]

    def _denoise(self, embeds: dict, seeds: list[int], joint: bool, check_latents_every: int | None,
                 pipeline_kwargs: dict, image_kwargs: dict, in_call: bool):
        """One stock pipeline call; with `joint`, the transformer computes only this rank's guidance branch; with
        `image_kwargs`, one rank's VAE encodes for all, or with parallel VAE the image group together (and with
        `in_call` the leader's text encoder reads the image)."""
        branch = cfg_rank(self.mesh) if joint else 0
        cfg_group = self.mesh["cfg"].get_group() if joint else None
        # One CPU generator per row, seeded as the image alone is: stock draws each row of a list on its own.
        generators = [torch.Generator("cpu").manual_seed(seed) for seed in seeds]
        generator = generators[0] if len(generators) == 1 else generators
        check = LatentAgreement(image_group(self.mesh), every=check_latents_every, cfg_group=cfg_group,
                                group_name="image group (TP x context parallel)" if self.cp_mode else None)
        experts = self.checkpoint.experts if self.checkpoint is not None else ()
        proxy = cfg_parallel_transformer(self.pipe, cfg_group, experts) if joint else nullcontext()
        splits_vae = self._splits_vae(pipeline_kwargs)
        images = nullcontext()
        if image_kwargs:
            # The image group's leader (its VAE, its encoder) shares with every rank of the group, CP ranks included;
            # with parallel VAE the group encodes together.
            images = shared_image_inputs(self.pipe, vae=self.follower_vae() if self.follower_vae else self.pipe.vae,
                                         encoder=self.encoder, tp_group=image_group(self.mesh), pair_group=cfg_group,
                                         device=mesh_device(self.mesh), decodes=self.is_leader or splits_vae,
                                         text_encode=in_call and self.adapter.leader_encodes, vae_splits=splits_vae,
                                         pad_encoded=lambda encoded: self.adapter.pad_encoded(encoded, self.buckets))
        elif in_call and self.adapter.leader_encodes:  # the generic adapter: the leader's encoder for the group
            images = shared_encoding(self.pipe, self.encoder, image_group(self.mesh), mesh_device(self.mesh))
        cache = self.cache
        with torch.no_grad(), self.times.phase("denoise + decode"), proxy, images, \
                cache.pipeline_call() if cache is not None else nullcontext():
            # CFG rank 1 gets prompt and negative swapped: its pipeline derives the uncond inputs for the cond call.
            output = self.adapter(self.pipe, swap_branches(embeds) if branch else embeds, generator=generator,
                                  decodes=self.is_leader and branch == 0, check=check, buckets=self.buckets,
                                  helps_decode=splits_vae and branch == 0, **pipeline_kwargs)
        return output

    def _call_counts(self, joint: bool) -> dict | None:
        """The last stock call's transformer forwards, computed and served from the cache (None without a cache): one
        decision per forward for the call's whole batch, so every image of it shares them."""
        cache = self.cache
        if cache is None:
            return None
        counts = [cache.counts.as_dict()]
        if joint:  # each rank of the pair computed one branch of these images: count both
            counts = [None, None]
            dist.all_gather_object(counts, cache.counts.as_dict(), group=self.mesh["cfg"].get_group())
        return sum_counts(counts)

    def _check_context_parallel(self, pipeline_kwargs: dict) -> None:
        """Under the plain context-parallel modes, refuse a call whose sequences do not split evenly, before a step."""
        if self.cp_mode is not None and not self.cp_mode.any_length:
            check_context_parallel_call(self.adapter, self.checkpoint, pipeline_kwargs, context_degree(self.mesh))

    def _splits_vae(self, pipeline_kwargs: dict) -> bool:
        """Whether this call's decode (and encode) is split over the image group, telling the VAE: with parallel VAE on
        and an image large enough (`ParallelVAE.splits`); otherwise the leader decodes alone."""
        if self.parallel_vae is None:
            return False
        self.parallel_vae.enabled = self.parallel_vae.splits(pipeline_kwargs.get("height"),
                                                             pipeline_kwargs.get("width"))
        return self.parallel_vae.enabled

    def _collect_pair(self, outputs: dict, count: int, joint: bool) -> list | None:
        """Every image of the call, in order, on the pair's leader (the other group's leader sends its share)."""
        if not self.is_leader:
            return None
        if not joint:
            shares = [None, None] if cfg_rank(self.mesh) == 0 else None
            dist.gather_object(outputs, shares, group=self.mesh["cfg"].get_group(), group_dst=0)
            outputs = {} if shares is None else {**shares[0], **shares[1]}
        return [outputs[i] for i in range(count)] if is_replica_leader(self.mesh) else None

    def _negatives(self, negative_prompt, count: int) -> list:
        if negative_prompt is None:
            return [None] * count
        check_guidance(self.adapter, {"`negative_prompt`": negative_prompt, "guidance": None, "true_cfg_scale": None})
        if not isinstance(negative_prompt, (str, list, tuple)):
            raise ValueError(f"`negative_prompt` must be a string or a list of strings, got {negative_prompt!r:.80}.")
        negatives = [negative_prompt] * count if isinstance(negative_prompt, str) else list(negative_prompt)
        if len(negatives) != count:
            raise ValueError(f"Got {len(negatives)} negative prompts for {count} prompts: give one, or one per prompt.")
        for index, negative in enumerate(negatives):
            check_text(negative, f"negative prompt {index}")
        return negatives

    def _encode(self, texts: list[tuple], encode_kwargs: dict) -> list[tuple[list[int], dict]]:
        """Encode on the leader's CPU, pad to a length bucket, and broadcast to the group on its device: the stock
        calls of the batch, (positions in `texts`, embeddings) each. Each (prompt, negative) of `texts` is encoded
        alone, as an unbatched call encodes it; the rows of a call are then stacked to one length with masked
        positions (`batching.stack_calls`).

        With CFG pairs each TP group's leader encodes prompt and negative itself, rather than one leader encoding
        for the pair: the two leaders encode at the same time (no wall time lost), no embeddings cross between
        groups, and each group stays self-sufficient, so the same ranks serve as plain data parallelism for requests
        without true CFG. Both leaders need both texts anyway: the second group's pipeline computes uncond at its
        cond call and checks, at its uncond call, that the cond branch its partner computed was the right one.
        """
        embeds = None
        if self.is_leader:
            try:
                with torch.no_grad():
                    made = [self.adapter.pad(self.adapter.encode(self.encoder, prompt, negative, **encode_kwargs),
                                             self.buckets) for prompt, negative in texts]
                    embeds = stack_calls(made, [self.adapter.batch_key(row) for row in made], self.batch_sizes)
            except Exception as error:  # too long for the largest bucket, a tokenizer error: every rank raises it
                embeds = shareable(error)
        return unstack_calls(broadcast_from_leader(embeds, image_group(self.mesh), mesh_device(self.mesh)))


def _prompt_strings(prompt: str, negative: str | None) -> dict:
    """The call kwargs for a class that encodes its prompt inside the call (`image_inputs` shares the encoding)."""
    return {"prompt": prompt} | ({} if negative is None else {"negative_prompt": negative})


def _check_cfg_parallel_kwargs(adapter: PipelineAdapter, negative: str | None, pipeline_kwargs: dict) -> bool:
    """Whether a CFG pair's call runs true CFG jointly (`adapter.uses_true_cfg`), refusing what CFG parallelism cannot
    split, before any step runs."""
    if not adapter.uses_true_cfg(negative, pipeline_kwargs):
        return False
    if not adapter.names_cfg_branches:
        raise ValueError(
            f"CFG parallelism does not run {adapter.pipeline_class}'s true CFG: it calls its transformer outside "
            "`cache_context('cond' / 'uncond')`, so the two branches cannot be told apart. Generate with "
            "`alone=True` (the job: without --cfg-parallel), or without a negative prompt."
        )
    adapter_kwargs = sorted(name for name in pipeline_kwargs if "ip_adapter" in name)
    if adapter_kwargs:
        raise ValueError(
            f"CFG parallelism does not run FLUX's IP-Adapter ({', '.join(adapter_kwargs)}): stock FluxPipeline swaps "
            "each branch's image embeddings into one shared `joint_attention_kwargs` between its cond and uncond "
            "calls. Generate these images on a mesh without a `cfg` dimension (or pass `alone=True`)."
        )
    return True


def context_degree(mesh: DeviceMesh) -> int:
    """Ranks that split one image's sequence: ulysses x ring (1 without context parallelism)."""
    return dim_size(mesh, "ulysses") * dim_size(mesh, "ring")


def check_context_parallel_call(adapter: PipelineAdapter, checkpoint: Checkpoint, call_kwargs: dict,
                                degree: int) -> None:
    """The sequences the plain context-parallel modes split at this call must be multiples of `degree`; the error
    names nearby image sizes that split."""
    lengths = adapter.split_lengths(checkpoint, call_kwargs)
    suggestion = ""
    if "image tokens" in lengths and lengths["image tokens"] % degree:
        multiple = adapter.size_multiple(checkpoint)
        sizes = context.valid_sizes(call_kwargs["height"], call_kwargs["width"], multiple, degree)
        suggestion = (f"Image tokens are (height / {multiple}) x (width / {multiple}); sizes near "
                      f"{call_kwargs['height']}x{call_kwargs['width']} that split: "
                      f"{', '.join(f'{h}x{w}' for h, w in sizes)}. ")
    context.check_split_lengths(checkpoint.family.display_name, lengths, degree, suggestion)


def _parallel_config(mesh: DeviceMesh, mode: context.RunnerMode | None) -> dict:
    """The `from_pretrained` kwargs that split the transformer over `mesh`: TP over "tp", CP over "ring" x "ulysses"."""
    tp = TensorParallelConfig(mesh=mesh["tp"]) if dim_size(mesh, "tp") > 1 else None
    if mode is None:
        return {"parallel_config": tp} if tp is not None else {}
    cp = ContextParallelConfig(ulysses_degree=dim_size(mesh, "ulysses"), ring_degree=dim_size(mesh, "ring"),
                               ulysses_anything=mode.ulysses_anything, ring_anything=mode.ring_anything, mesh=mesh)
    return {"parallel_config": ParallelConfig(context_parallel_config=cp, tensor_parallel_config=tp)}


def _check_prebuilt(transformer: torch.nn.Module, checkpoint: Checkpoint, mesh: DeviceMesh | None) -> None:
    """A prebuilt transformer (`load_pipeline(transformer=...)`): the folder's class, on a one-rank image group."""
    wanted = checkpoint.transformer_class()
    if type(transformer) is not wanted:
        raise ValueError(f"`transformer` is a {type(transformer).__name__}, but {checkpoint.path} holds a "
                         f"{wanted.__name__}: pass an instance of the folder's transformer class, or leave "
                         "`transformer` out to load the folder's own.")
    degree = 1 if mesh is None else dim_size(mesh, "tp") * context_degree(mesh)
    if degree > 1 or (mesh is None and dist.is_initialized() and dist.get_world_size() > 1):
        raise ValueError("`transformer` (a prebuilt, unsharded module) runs on a one-rank image group only, but this "
                         "mesh splits the transformer over several ranks (TP or context parallelism): each rank must "
                         "stream its own slice from the checkpoint. Leave `transformer` out, or use a mesh with tp=1 "
                         "and no ulysses / ring dimension.")


#: `load_pipeline`'s keyword arguments that a `LaunchSpec` holds, with their defaults.
_FRONT_DEFAULTS = dict(pipeline_class=None, buckets=None, loras=[], cache=None, cp_any_length=False,
                       parallel_vae=None, plan="default", quantize=None)


def load_pipeline(
    model: str | os.PathLike | Checkpoint | LaunchSpec,
    mesh: DeviceMesh | None = None,
    torch_dtype: torch.dtype | None = None,
    *,
    pipeline_class: str | type | None = None,
    buckets: tuple[int, ...] | None = None,
    loras=(),
    cache=None,
    cp_any_length: bool = False,
    parallel_vae: bool | None = None,
    plan: str = "default",
    transformer: torch.nn.Module | None = None,
    quantize=None,
    batch_sizes: tuple[int, ...] | None = None,
) -> ParallelPipeline:
    """The stock pipeline of `model` with its transformer streamed shard-by-shard over the mesh's image group.

    `model` is a checkpoint folder, a Hub id, a tiny family name, an already resolved `Checkpoint`, or a `LaunchSpec`
    (`launch.plan_launch`: checked once, so nothing is checked here again; leave the keyword arguments out; its
    `compile` backend compiles the repeated blocks as the last step, else call `compile_repeated_blocks`). `mesh`
    defaults to `init_distributed()` (all ranks in one TP group); a mesh with "ring" / "ulysses" dimensions
    (`init_distributed(ulysses=..., ring=...)`) adds context parallelism. Only the image group's leader loads the
    text encoder (on CPU) and the VAE; on a mesh with a `cfg` dimension each image group of a CFG pair has its own
    leader, so the pair can split requests that do not use true CFG. `buckets` overrides the family's static text
    lengths (`()` turns padding off). `loras` (`[(path_or_hub_id, scale), ...]`) are read and checked before any
    weight is read, then fused into each rank's shard (see `ParallelPipeline.set_loras`).

    Under context parallelism the padding (text buckets, MiniMax-H3's packed rows) is rounded up to multiples of
    ulysses x ring, and `generate` refuses image sizes whose token count does not split, naming sizes that do;
    `cp_any_length=True` takes any size and prompt length exactly with diffusers' *_anything modes instead (not for
    compiled static shapes). Qwen-Image-2.1 runs that way with `buckets=()` (see `pipelines/qwenimage21_context.py`).

    `pipeline_class` (a stock class or its name) runs the folder with another class on the same transformer, e.g.
    FluxKontextPipeline, FluxImg2ImgPipeline or FluxInpaintPipeline on a FLUX.1 folder; default: the class the
    folder's index names. A class built on another transformer, or needing a component the folder lacks, is refused
    before any weight is read. Ranks without a VAE keep its small non-encoder/decoder state for image inputs.

    `plan` names the tensor-parallel plan: "default" (no more collectives per forward than stock, then the least
    memory), "lean" (less memory for more collectives: Qwen-Image-2.1) or "stock" (`plan_variants.py`). `cache` is a
    diffusers step-cache config, installed with decisions shared by the image group (`parallel/cache.py`). `quantize`
    ("fp8", "int8", "fp8:64") quantizes each rank's own shards with one process's scales (docs/quantization.md).

    `parallel_vae=True` loads the VAE on every rank of the image group (TP x ring x Ulysses) and splits each decode
    (and each encode of an input image) over the group, with the stock result within float32 rounding
    (`parallel/vae.py`); `False` decodes and encodes on the leader alone; `None` (default) loads it on every rank
    where the VAE class can be split and splits the calls where that pays (`parallel.vae.DEFAULT_MIN_PIXELS`:
    MiniMax-H3 always, the others from 1024 x 1024). `True` with a VAE it cannot split is refused before loading.

    `transformer`: a prebuilt unsharded instance of the folder's class instead of its weights (`bench device`), for
    a one-rank image group only. `batch_sizes` (e.g. `(1, 2, 4)`): the only batch shapes `generate` runs, a short
    batch padded up (extra images dropped), a longer one split; `compile.warmup` compiles each (`batching.py`).
    """
    spec, torch_dtype = _spec(model, torch_dtype, dict(
        pipeline_class=pipeline_class, buckets=buckets, loras=loras, cache=cache, cp_any_length=cp_any_length,
        parallel_vae=parallel_vae, plan=plan, quantize=quantize))
    if transformer is not None:
        _check_prebuilt(transformer, spec.checkpoint, mesh)
    batch_sizes = spec.batch_sizes if batch_sizes is None else check_batch_sizes(batch_sizes, spec)
    return _Recipe(spec, init_distributed() if mesh is None else mesh, torch_dtype, batch_sizes).run(transformer)


def _spec(model, torch_dtype, front: dict) -> tuple[LaunchSpec, torch.dtype | None]:
    """A spec handed in (checked by `launch.plan_launch`: nothing is checked again), or one built from the keyword
    arguments (`launch.spec_for`, which checks them)."""
    if not isinstance(model, LaunchSpec):
        return spec_for(model, torch_dtype=torch_dtype, **front), torch_dtype
    given = sorted(name for name, value in front.items()
                   if (list(value) if name == "loras" else value) != _FRONT_DEFAULTS[name])
    if given:
        raise ValueError(f"`load_pipeline` got a LaunchSpec and {', '.join(given)}: the spec already says them. Leave "
                         "them out, or pass the model instead of a spec.")
    return model, model.torch_dtype if torch_dtype is None else torch_dtype


class _Recipe:
    """`load_pipeline`'s steps, in the one order they work in: the transformer is sharded first (context parallelism
    and the cache wrap the sharded module), the cache hooks wrap its coalesced block forwards, the other components
    take the finished transformer, parallel VAE needs the loaded VAE, LoRAs fuse into the final shards, and compiling
    (a spec's `compile`; else the caller's `compile.compile_repeated_blocks`) comes last, over the fused weights and
    every hook."""

    def __init__(self, spec: LaunchSpec, mesh: DeviceMesh, torch_dtype, batch_sizes: tuple[int, ...] | None = None):
        self.spec, self.mesh, self.torch_dtype, self.batch_sizes = spec, mesh, torch_dtype, batch_sizes
        self.checkpoint, self.adapter = spec.checkpoint, spec.checkpoint.adapter
        self.device = mesh_device(mesh)
        image_group(mesh)  # created here, where every rank comes: creating it is a collective over the world
        self.leader = is_group_leader(mesh)
        self.degree = context_degree(mesh)
        self.times = PhaseTimes()

    def run(self, transformer: torch.nn.Module | None) -> ParallelPipeline:
        self.context_parallel_mode()
        transformer = self.shard_transformer(transformer)
        self.quantize(transformer)
        self.install_cache(transformer)
        pipe, encoder, follower_vae = self.load_other_components(transformer)
        handle = self.split_vae(pipe)
        self.configure_context_parallel(pipe)
        pipeline = self.assemble(pipe, encoder, follower_vae, handle)
        self.fuse_loras(pipeline)
        self.compile(pipeline)
        return pipeline

    def context_parallel_mode(self) -> None:
        """The text buckets and, under context parallelism, how it runs (padding rounded to the degree)."""
        adapter, spec = self.adapter, self.spec
        self.buckets = adapter.buckets if spec.buckets is None else tuple(spec.buckets)
        self.mode = None
        if self.degree > 1:
            self.mode = runner_mode(self.checkpoint, self.buckets, dim_size(self.mesh, "ulysses"),
                                    dim_size(self.mesh, "ring"), spec.cp_any_length)
            self.buckets = context.round_buckets(self.buckets, self.degree) if self.mode.pad else ()
        self.vae_min_pixels = resolve_parallel_vae(spec.parallel_vae, self.checkpoint.component_class_name("vae"),
                                                   dim_size(self.mesh, "tp") * self.degree)

    def shard_transformer(self, transformer: torch.nn.Module | None) -> torch.nn.Module:
        """Each rank streams its own slice (TP over "tp", CP over "ring" x "ulysses"); a degree that does not divide
        the heads is rejected by `from_pretrained` itself, before any weight is read (see `compat/`). The experts
        (Wan 2.2's `transformer_2`) are sharded the same way, with the same plan."""
        check_launch_quantize(self.checkpoint, self.spec.tp_plan, dim_size(self.mesh, "tp"), self.spec.quantize)
        with self.times.phase("load transformer (sharded)"):
            transformer = self._sharded("transformer") if transformer is None else transformer.to(self.device)
            self.experts = {name: self._sharded(name) for name in self.checkpoint.experts}
        return transformer

    def _sharded(self, component: str) -> torch.nn.Module:
        parallel = _parallel_config(self.mesh, self.mode)
        cls, tp_plan, family = self.checkpoint.transformer_class(), self.spec.tp_plan, self.checkpoint.family
        # Under context parallelism, a drafted family's verified CP plan (and the attention routing it was proven
        # with); the registered families' plans are the class's own.
        cp = (family.cp_plan, family.routes_attention) if self.mode is not None else (None, False)
        with using_plan(cls, tp_plan), using_cp_plan(cls, *cp):
            model = cls.from_pretrained(self.checkpoint.path, subfolder=component, dtype=self.torch_dtype, **parallel)
        record_tp_plan(model, tp_plan)
        return model if parallel else model.to(self.device)

    def quantize(self, transformer: torch.nn.Module) -> None:
        """Each rank's own shards quantized, with the scales one process would use (`parallel/quantize.py`); the
        blocks were checked against the mesh's TP degree in `shard_transformer`, before any weight was read."""
        if self.spec.quantize is not None:
            with self.times.phase("quantize"):
                for model in (transformer, *self.experts.values()):
                    quantize_model(model, self.spec.quantize, self.spec.tp_plan,
                                   quantize_rules(self.checkpoint.family))

    def install_cache(self, transformer: torch.nn.Module) -> None:
        """After sharding (the hooks wrap the coalesced block forwards). The group is every rank that computes this
        transformer's forward: with context parallelism, the CP x TP group."""
        if self.spec.cache is not None:
            group = image_group(self.mesh)
            enable_group_cache(transformer, self.spec.cache, group if dist.get_world_size(group) > 1 else None)

    def load_other_components(self, transformer: torch.nn.Module):
        """The text encoder (leader only, CPU), the denoiser pipeline around the transformer, and on ranks without a
        VAE what image inputs need of it."""
        adapter, leader = self.adapter, self.leader
        with self.times.phase("load other components"):
            encoder = adapter.load_encoder(self.checkpoint, self.torch_dtype) if leader else None
            pipe = adapter.load_denoiser(self.checkpoint, transformer, self.torch_dtype, self.device, decodes=leader,
                                         helps_decode=self.vae_min_pixels is not None)
            if self.experts:
                pipe.register_modules(**self.experts)
            follower_vae = None
            if not leader and self.vae_min_pixels is None and "image" in adapter.call_parameters():
                dtype = self.torch_dtype or torch.float32
                follower_vae = functools.cache(functools.partial(vae_without_coders, self.checkpoint, dtype))
        return pipe, encoder, follower_vae

    def split_vae(self, pipe) -> ParallelVAE | None:
        if self.vae_min_pixels is None:
            return None
        return enable_parallel_vae(self.adapter.vae(pipe), image_group(self.mesh), min_pixels=self.vae_min_pixels)

    def configure_context_parallel(self, pipe) -> None:
        """Static splits: the family pads what it must (packed rows, text) to multiples of the degree."""
        if self.mode is not None and self.mode.pad and not self.mode.any_length:
            self.adapter.configure_context_parallel(pipe, self.degree)

    def assemble(self, pipe, encoder, follower_vae, handle) -> ParallelPipeline:
        """The `ParallelPipeline`, once the image group has finished loading together."""
        # Per-step bars only where someone reads them; other ranks keep their stdout for real messages.
        pipe.set_progress_bar_config(disable=rank() != 0)
        # The leader loads more (text encoder, VAE) than the others: the group leaves together, so the first call's
        # entry handshake measures how late a rank is to the call, not to the end of loading. (The image group only:
        # a job gives a CFG pair's second group nothing to load when every request it has left is made by the first.)
        CallEntry(replica_ranks(self.mesh, with_cfg=False), "load_pipeline", timeout_s=None).enter(
            [self.checkpoint.source, str(self.torch_dtype)])
        return ParallelPipeline(self.adapter, pipe, encoder, self.mesh, self.buckets, self.times,
                          checkpoint=self.checkpoint, cp_mode=self.mode, follower_vae=follower_vae,
                          size_limits=self.adapter.size_limits(self.checkpoint), parallel_vae=handle,
                          batch_sizes=self.batch_sizes)

    def fuse_loras(self, pipeline: ParallelPipeline) -> None:
        """The LoRAs read at planning, fused into each rank's final shards (no file is read again)."""
        if self.spec.loras:
            with self.times.phase("fuse LoRAs"):
                pipeline.set_loras(list(self.spec.loras))

    def compile(self, pipeline: ParallelPipeline) -> None:
        """Last: the graphs trace the final weights and every hook (TP, CP, cache) around the blocks. Lazy: the
        graphs are built at the first call (or by `compile.warmup`)."""
        if self.spec.compile:
            compile_repeated_blocks(pipeline, backend=self.spec.compile)


def __getattr__(name: str):
    """`TPPipeline`, the old name of `ParallelPipeline` (it runs context and CFG parallelism too), kept one release."""
    if name == "TPPipeline":
        warnings.warn("`TPPipeline` is now `ParallelPipeline`.", DeprecationWarning, stacklevel=2)
        return ParallelPipeline
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
