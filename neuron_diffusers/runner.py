"""Load a stock pipeline with its transformer sharded over the mesh's `tp` dimension, and generate.

The one data path, per TP group: resolve the checkpoint → read its config (all checks happen here, before any
weight is read) → stream each rank's transformer slice → the leader (TP rank 0) loads the text encoder on CPU,
encodes each prompt once and broadcasts the embeddings → every rank denoises the same CPU-seeded noise with the
stock pipeline, checking that the group's latents agree → the leader decodes and returns the image (with parallel
VAE, every rank of the TP group decodes one piece of it, `parallel/vae.py`).

With `cache=` (a diffusers step-cache config) the transformer runs diffusers' cache hooks with every skip decision
shared by its group (`parallel/cache.py`), and each image's forwards computed vs served from the cache are kept.

On a ("dp", "cfg", "tp") mesh (`init_distributed(cfg=2)`) each replica is a CFG pair of TP groups. A call with true
classifier-free guidance runs each image on both groups, one guidance branch each (`parallel/cfg.py`); a call
without it gives each group its own images, so the second group is extra data parallelism instead of idle.

Image inputs (`generate(image=..., mask_image=..., strength=...)`, any stock class on the family's transformer
via `load_pipeline(..., pipeline_class=...)`) go through the stock call too; the one rank that holds a VAE (with
parallel VAE: the TP group, encoding together; and where the text encoder reads the image, the leader's encoder)
shares its results inside it (`pipelines/image_inputs.py`).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from diffusers import TensorParallelConfig
from torch.distributed.device_mesh import DeviceMesh

from .checkpoint import Checkpoint, resolve
from .consistency import LatentAgreement
from .distributed import (
    broadcast_from_leader,
    cfg_rank,
    cfg_size,
    init_distributed,
    is_replica_leader,
    is_tp_leader,
    mesh_device,
    rank,
)
from .parallel.cache import GroupCache, check_cache, enable_group_cache, group_cache_of, sum_counts
from .parallel.cfg import cfg_parallel_transformer, swap_branches
from .parallel.lora import FusedLoras, check_loras
from .parallel.vae import ParallelVAE, enable_parallel_vae, resolve_parallel_vae
from .pipelines import PipelineAdapter
from .pipelines.image_inputs import check_image_kwargs, reads_image, shared_image_inputs, vae_without_coders
from .timing import PhaseTimes

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
}


@dataclass
class TPPipeline:
    """A stock diffusers pipeline whose transformer is sharded over `mesh["tp"]`.

    `encoder` (the text components, on CPU) exists only on the TP group's leader; `pipe` (transformer, scheduler,
    and the VAE on the leader, or with parallel VAE on every rank) on every rank. On a mesh with a `cfg` dimension
    every TP group of a CFG pair has its own leader with its own encoder and VAE, so either group can also serve
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
    #: With a step cache: per image this rank denoised, its transformer forwards computed and served from the cache
    #: (`{"computed", "cached", "by_context"}`; with CFG parallelism both branches', summed over the pair).
    cache_counts: list = field(default_factory=list)
    #: The VAE split over the TP group (`load_pipeline(parallel_vae=...)`), or None: the leader decodes alone.
    parallel_vae: ParallelVAE | None = None

    def __post_init__(self):
        self.times.time_module(self.adapter.transformer_of(self.pipe), "transformer forward")
        for decoder in self.adapter.decoders(self.pipe):
            self.times.time_module(decoder, "decode")

    @property
    def is_leader(self) -> bool:
        return is_tp_leader(self.mesh)

    def set_loras(self, loras) -> None:
        """Make `loras` (`[(path_or_hub_id, scale), ...]`) the active LoRA set, fused into every rank's shard in place
        (no reload, compiled graphs reused); `[]` restores the base weights bit for bit. Every rank of the replica
        must call it with the same list; a bad request raises the same `LoraError` on each and changes nothing."""
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
        seed: int = 0,
        negative_prompt: str | list[str] | None = None,
        check_latents_every: int | None = None,
        alone: bool = False,
        image=None,
        mask_image=None,
        strength: float | None = None,
        **pipeline_kwargs,
    ) -> list | None:
        """One image (H3: a `VideoWithAudio`) per prompt, on one rank of the replica; `None` on its other ranks.

        Every rank of the replica must call this with the same arguments. Image `i` is denoised from a CPU generator
        seeded with `seed + i`, identical on every rank whatever its device; the group's latents are compared at
        the first and last step (and every `check_latents_every` steps), raising `LatentsDivergedError` on every
        rank if they differ. `pipeline_kwargs` go to the stock pipeline call (height, width, num_inference_steps,
        guidance_scale, true_cfg_scale, ...).

        On a mesh with a `cfg` dimension (CFG pairs of TP groups), the images come back on the pair's leader (TP
        leader of CFG rank 0). With true CFG (a negative prompt and a `true_cfg_scale` above 1) both groups denoise
        each image, one guidance branch each, so each rank runs half the transformer forwards. Without it, image `i`
        is made by group `i % 2` alone: the second group is data parallelism, not a copy of the first.
        `alone=True` leaves the CFG partner out: this TP group makes every image itself (true CFG then runs
        serially) and its leader returns them; the partner must not make the same call (the job uses this to give
        each group of a pair its own requests).

        `image` (a PIL image, or a list of reference images where the class takes several), `mask_image` and
        `strength` go to the stock call for every prompt; the class decides what they mean (Kontext, img2img,
        inpainting, Qwen-Image-Edit-Plus, FLUX.2 references, Qwen-Image-2.1 with an image). They are checked before
        anything runs: a class that takes none of them, one that needs an image, a mask of another size, a
        strength outside (0, 1].
        """
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        negatives = self._negatives(negative_prompt, len(prompts))
        for name, why in _OWNED_KWARGS.items():
            if name in pipeline_kwargs:
                raise ValueError(f"`generate` does not take `{name}`: {why}.")
        image_kwargs = check_image_kwargs(self.adapter, image, mask_image, strength)
        pair = cfg_size(self.mesh) > 1 and not alone
        joint = pair and self.adapter.uses_true_cfg(negatives[0], pipeline_kwargs)
        if joint:
            _check_cfg_parallel_kwargs(self.adapter, pipeline_kwargs)
        mine = range(len(prompts)) if joint or not pair else range(cfg_rank(self.mesh), len(prompts), 2)
        encode_kwargs = {k: pipeline_kwargs[k] for k in self.adapter.encode_kwargs if k in pipeline_kwargs}
        # A vision-language encoder that reads the image encodes inside the call, where the pipeline resized it.
        in_call = bool(image_kwargs) and reads_image(self.adapter.pipeline_cls())
        outputs = {}
        for index in mine:
            with self.times.phase("encode"):
                embeds = (_prompt_strings(prompts[index], negatives[index]) if in_call
                          else self._encode(prompts[index], negatives[index], encode_kwargs))
            outputs[index] = self._denoise(embeds, seed + index, joint, check_latents_every,
                                           {**pipeline_kwargs, **image_kwargs}, image_kwargs, in_call)
        if not pair:
            return [outputs[i] for i in range(len(prompts))] if self.is_leader else None
        return self._collect_pair(outputs, len(prompts), joint)

    def _denoise(self, embeds: dict, seed: int, joint: bool, check_latents_every: int | None, pipeline_kwargs: dict,
                 image_kwargs: dict, in_call: bool):
        """One stock pipeline call; with `joint`, the transformer computes only this rank's guidance branch; with
        `image_kwargs`, one rank's VAE encodes for all, or with parallel VAE the TP group together (and with `in_call`
        the leader's text encoder reads the image)."""
        branch = cfg_rank(self.mesh) if joint else 0
        cfg_group = self.mesh["cfg"].get_group() if joint else None
        generator = torch.Generator("cpu").manual_seed(seed)
        check = LatentAgreement(self.mesh["tp"].get_group(), every=check_latents_every, cfg_group=cfg_group)
        proxy = cfg_parallel_transformer(self.pipe, cfg_group) if joint else nullcontext()
        splits_vae = self._splits_vae(pipeline_kwargs)
        images = nullcontext()
        if image_kwargs:
            tp_mesh = self.mesh["tp"]
            images = shared_image_inputs(self.pipe, vae=self.follower_vae() if self.follower_vae else self.pipe.vae,
                                         encoder=self.encoder, tp_group=tp_mesh.get_group(), pair_group=cfg_group,
                                         device=mesh_device(tp_mesh), decodes=self.is_leader or splits_vae,
                                         text_encode=in_call, vae_splits=splits_vae)
        cache = self.cache
        with torch.no_grad(), self.times.phase("denoise + decode"), proxy, images, \
                cache.pipeline_call() if cache is not None else nullcontext():
            # CFG rank 1 gets prompt and negative swapped: its pipeline derives the uncond inputs for the cond call.
            output = self.adapter(self.pipe, swap_branches(embeds) if branch else embeds, generator=generator,
                                  decodes=self.is_leader and branch == 0, check=check, buckets=self.buckets,
                                  helps_decode=splits_vae and branch == 0, **pipeline_kwargs)
        if cache is not None:
            counts = [cache.counts.as_dict()]
            if joint:  # each rank of the pair computed one branch of this image: count both
                counts = [None, None]
                dist.all_gather_object(counts, cache.counts.as_dict(), group=cfg_group)
            self.cache_counts.append(sum_counts(counts))
        return output

    def _splits_vae(self, pipeline_kwargs: dict) -> bool:
        """Whether this call's decode (and encode) is split over the TP group, telling the VAE: with parallel VAE on
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
        if not self.adapter.takes_negative_prompt:
            raise ValueError(
                f"{self.adapter.pipeline_class} is guidance-distilled and takes no negative prompt: drop "
                "`negative_prompt`."
            )
        negatives = [negative_prompt] * count if isinstance(negative_prompt, str) else list(negative_prompt)
        if len(negatives) != count:
            raise ValueError(f"Got {len(negatives)} negative prompts for {count} prompts: give one, or one per prompt.")
        return negatives

    def _encode(self, prompt: str, negative: str | None, encode_kwargs: dict) -> dict[str, torch.Tensor]:
        """Encode on the leader's CPU, pad to a length bucket, and broadcast to the group on its device.

        With CFG pairs each TP group's leader encodes prompt and negative itself, rather than one leader encoding
        for the pair: the two leaders encode at the same time (no wall time lost), no embeddings cross between
        groups, and each group stays self-sufficient, so the same ranks serve as plain data parallelism for requests
        without true CFG. Both leaders need both texts anyway: the second group's pipeline computes uncond at its
        cond call and checks, at its uncond call, that the cond branch its partner computed was the right one.
        """
        embeds = None
        if self.is_leader:
            with torch.no_grad():
                embeds = self.adapter.pad(self.adapter.encode(self.encoder, prompt, negative, **encode_kwargs),
                                          self.buckets)
        tp_mesh = self.mesh["tp"]
        return broadcast_from_leader(embeds, tp_mesh.get_group(), mesh_device(tp_mesh))


def _prompt_strings(prompt: str, negative: str | None) -> dict:
    """The call kwargs for a class that encodes its prompt inside the call (`image_inputs` shares the encoding)."""
    return {"prompt": prompt} | ({} if negative is None else {"negative_prompt": negative})


def _check_cfg_parallel_kwargs(adapter: PipelineAdapter, pipeline_kwargs: dict) -> None:
    """Refuse what CFG parallelism cannot split, before any step runs."""
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


def load_pipeline(
    model: str | os.PathLike | Checkpoint,
    mesh: DeviceMesh | None = None,
    torch_dtype: torch.dtype | None = None,
    *,
    pipeline_class: str | type | None = None,
    buckets: tuple[int, ...] | None = None,
    loras=(),
    cache=None,
    parallel_vae: bool | None = None,
) -> TPPipeline:
    """The stock pipeline of `model` with its transformer streamed shard-by-shard over `mesh["tp"]`.

    `model` is a checkpoint folder, a Hub id, a tiny family name, or an already resolved `Checkpoint`. `mesh`
    defaults to `init_distributed()` (all ranks in one TP group). Only the TP group's leader loads the text encoder
    (on CPU), and the VAE unless parallel VAE is on; on a ("dp", "cfg", "tp") mesh each TP group of a CFG pair has
    its own leader, so the pair can split requests that do not use true CFG (a ("dp", "tp") mesh of the same size
    loads the same). `buckets` overrides the family's static text lengths (`()` turns padding off). `loras`
    (`[(path_or_hub_id, scale), ...]`) are read and checked before any weight is read, then fused into each rank's
    shard (see `TPPipeline.set_loras`).

    `pipeline_class` (a stock class or its name) runs the folder with another class on the same transformer, e.g.
    FluxKontextPipeline, FluxImg2ImgPipeline or FluxInpaintPipeline on a FLUX.1 folder; default: the class the
    folder's index names. A class built on another transformer, or needing a component the folder lacks, is refused
    before any weight is read. Ranks without a VAE keep its small non-encoder/decoder state for image inputs.

    `cache` is a diffusers step-cache config (`FirstBlockCacheConfig`, `TaylorSeerCacheConfig`, `MagCacheConfig`),
    installed with decisions shared by the TP group (`parallel/cache.py`); it is tried on the meta-device transformer
    before any weight is read.

    `parallel_vae=True` loads the VAE on every rank of the TP group and splits each decode (and each encode of an
    input image) over the group, with the stock result within float32 rounding (`parallel/vae.py`); `False` decodes
    and encodes on the leader alone; `None` (default) loads it on every rank where the VAE class can be split and
    splits the calls where that pays (`parallel.vae.DEFAULT_MIN_PIXELS`: MiniMax-H3 always, the others from 1024 x
    1024). `True` with a VAE it cannot split is refused before any weight is read.
    """
    checkpoint = resolve(model, pipeline_class)
    if cache is not None:
        check_cache(cache, checkpoint.meta("transformer"))
    loras = check_loras(checkpoint, loras)
    adapter = checkpoint.adapter
    mesh = init_distributed() if mesh is None else mesh
    tp_mesh = mesh["tp"]
    device = mesh_device(tp_mesh)
    leader = is_tp_leader(mesh)
    vae_min_pixels = resolve_parallel_vae(parallel_vae, checkpoint.component_class_name("vae"), tp_mesh.size())
    # A TP degree that does not divide the heads is rejected by `from_pretrained` itself, before any weight is
    # read (see `parallel/patches.py`).
    parallel = {"parallel_config": TensorParallelConfig(mesh=tp_mesh)} if tp_mesh.size() > 1 else {}
    times = PhaseTimes()
    with times.phase("load transformer (sharded)"):
        transformer = checkpoint.transformer_class().from_pretrained(
            checkpoint.path, subfolder="transformer", dtype=torch_dtype, **parallel
        )
        if not parallel:
            transformer.to(device)
    if cache is not None:
        # After sharding (the hooks wrap the coalesced block forwards). The group is every rank that computes this
        # transformer's forward: with context parallelism, the CP x TP group.
        enable_group_cache(transformer, cache, tp_mesh.get_group() if tp_mesh.size() > 1 else None)
    with times.phase("load other components"):
        encoder = adapter.load_encoder(checkpoint, torch_dtype) if leader else None
        pipe = adapter.load_denoiser(checkpoint, transformer, torch_dtype, device, decodes=leader,
                                     helps_decode=vae_min_pixels is not None)
        follower_vae = None
        if not leader and vae_min_pixels is None and "image" in adapter.call_parameters():
            dtype = torch_dtype or torch.float32
            follower_vae = functools.cache(functools.partial(vae_without_coders, checkpoint, dtype))
    handle = None
    if vae_min_pixels is not None:
        handle = enable_parallel_vae(adapter.vae(pipe), tp_mesh.get_group(), min_pixels=vae_min_pixels)
    # Per-step bars only where someone reads them; other ranks keep their stdout for real messages.
    pipe.set_progress_bar_config(disable=rank() != 0)
    pipeline = TPPipeline(adapter, pipe, encoder, mesh, adapter.buckets if buckets is None else tuple(buckets), times,
                          follower_vae=follower_vae, parallel_vae=handle)
    if loras:
        with times.phase("fuse LoRAs"):
            pipeline.set_loras(loras)
    return pipeline
