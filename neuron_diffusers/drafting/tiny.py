"""A tiny random instance of any transformer class and one forward call of it, to prove a draft by numbers.

The config is the class's own default config shrunk by one rule over its keys: block counts to 2, heads to 4 of 16
features, every width that scales with the model to the same share of the tiny inner width, rotary axes (a tuple
summing to the head size) rescaled to the tiny head. The forward inputs come from the forward signature's parameter
names and the config (latents, text states, timestep, pooled text, position ids, guidance). Where a class needs more
than the rule, the exception is a line of data in `CONFIG_EXCEPTIONS` / `INPUT_EXCEPTIONS`, not code.
The latent layout (image `[B, C, H, W]`, video `[B, C, F, H, W]` or `[B, F, C, H, W]`, packed tokens `[B, S, C]`,
audio `[B, C, L]`) is not in the signature, so each is tried in that order and the first that runs is the call.
"""

from __future__ import annotations

import inspect
import math
import re
from pathlib import Path

import torch

from ..tools.plan.cases import Case, predictions

TINY_HEADS, TINY_HEAD_DIM, TINY_BLOCKS, BATCH, TEXT_LEN = 4, 16, 2, 2, 16
#: A tiny instance larger than this is refused before it is built (a config the rule could not shrink).
TINY_MAX_PARAMS = 50_000_000
_BLOCKS = re.compile(r"^(num_)?(\w+_)?(layers|blocks|depth)$")
_HEADS = re.compile(r"^(num_)?(\w+_)?heads$")
_HEAD_DIM = re.compile(r"^(\w+_)?head_dim$")
#: Keys that hold the model's width when the config names no head size (width = heads x head size).
_MODEL_WIDTH = re.compile(r"^\w+_dim$")
_WIDTH = re.compile(r"(dim|dims|size|channels|features|width)$")
#: Keys that end like a width but are positions, patch geometry or table sizes: never scaled.
_KEEP = re.compile(r"sample_size|patch_size|max_|pos_embed|freq|num_positions|seq_len|vocab|rope_theta|_len$")
#: Config keys that hold the text states' width, most specific first.
TEXT_KEYS = ("joint_attention_dim", "text_embed_dim", "text_dim", "caption_channels", "cross_attention_dim",
             "context_in_dim", "text_hidden_dim", "encoder_hidden_dim", "text_states_dim", "cap_feat_dim",
             "cond_token_dim", "dit_text_dim")
#: Full-size config values some classes' defaults leave unset (None: diffusers expects a checkpoint's config), taken
#: from their public checkpoints: data, applied before the drafter reads the class and before shrinking. They shape
#: only the full-size columns (TP=8 weights and collectives), never the tiny instance a plan is verified on.
DEFAULT_CONFIG_GAPS: dict[str, dict] = {
    "HunyuanDiT2DModel": {"in_channels": 4, "patch_size": 2, "hidden_size": 1408},  # 16 heads x 88
    "LatteTransformer3DModel": {"attention_head_dim": 72, "in_channels": 4, "out_channels": 8, "patch_size": 2,
                                "cross_attention_dim": 1152,
                                "caption_channels": 4096, "num_embeds_ada_norm": 1000},
    "LuminaNextDiT2DModel": {"num_kv_heads": 8},
    "Transformer2DModel": {"in_channels": 320, "cross_attention_dim": 768},  # a Stable Diffusion UNet stage
    # DreamLiteUNetModel's defaults: its first stage (320 channels) cross-attends to 2048-wide text
    "DreamLiteTransformer2DModel": {"in_channels": 320, "cross_attention_dim": 2048},
    # UNet3DConditionModel's `transformer_in`: in_channels = block_out_channels[0], 320 by default
    "TransformerTemporalModel": {"in_channels": 320},
    "EasyAnimateTransformer3DModel": {"in_channels": 16, "out_channels": 16, "patch_size": 2},  # its docstring
    # Phi-3's rotary scaling: one factor per rotary frequency (head size 96 / 2)
    "OmniGenTransformer2DModel": {"rope_scaling": {"short_factor": [1.0] * 48, "long_factor": [1.0] * 48}},
    # T5 and Llama-3 text widths; which Llama layer feeds each of the 16 + 32 blocks changes no module
    "HiDreamImageTransformer2DModel": {"patch_size": 2, "in_channels": 16, "out_channels": 16,
                                       "caption_channels": [4096, 4096], "llama_layers": list(range(48)),
                                       "axes_dims_rope": (64, 32, 32)},
}
#: Gaps above that the installed diffusers (docstrings, the models that build the class) does not confirm: the
#: coverage table marks their full-size columns unconfirmed. Class -> which values.
UNCONFIRMED_GAPS: dict[str, str] = {
    "HunyuanDiT2DModel": "hidden_size 1408, in_channels 4, patch_size 2 (the public checkpoint's, not stated by "
                         "diffusers; its default hidden_size is 1152)",
}
#: Per-class config values the rule cannot derive (data, not code): class -> {key: value}.
CONFIG_EXCEPTIONS: dict[str, dict] = {
    "HunyuanVideoTransformer3DModel": {"rope_axes_dim": (4, 6, 6)},
    # FramePack's image projection and clean-latent embedder (what its checkpoint turns on)
    "HunyuanVideoFramepackTransformer3DModel": {"has_image_proj": True, "has_clean_x_embedder": True},
    "LatteTransformer3DModel": {"video_length": 2},  # its temporal positions are sized for the sample's frames
    # Learned/sincos positions sized for the sample: a sample as small as the tiny latents (2 latent frames).
    "CogVideoXTransformer3DModel": {"sample_width": 8, "sample_height": 8, "sample_frames": 5,
                                    "max_text_seq_length": TEXT_LEN},
    "ConsisIDTransformer3DModel": {"sample_width": 8, "sample_height": 8, "sample_frames": 5,
                                   "max_text_seq_length": TEXT_LEN},
    "PRXTransformer2DModel": {"axes_dim": [8, 8]},  # None by default: derived from the full-size head
    "WanVACETransformer3DModel": {"vace_layers": [0]},  # must name blocks the tiny model has
    "PixArtTransformer2DModel": {"attention_head_dim": 24},  # its size conditioning splits the width in 3 parts
    "Transformer2DModel": {"in_channels": 32},  # its GroupNorm has 32 groups
    "DreamLiteTransformer2DModel": {"in_channels": 32},
    "TransformerTemporalModel": {"in_channels": 32},
    "OmniGenTransformer2DModel": {"rope_scaling": {"short_factor": [1.0] * 8, "long_factor": [1.0] * 8}},
    # two Llama layers, each feeding one joint and one single block; T5 and Llama widths kept small
    "HiDreamImageTransformer2DModel": {"llama_layers": (0, 1, 0, 1), "caption_channels": (48, 48),
                                       "axes_dims_rope": (8, 4, 4)},
    "AceStepTransformer1DModel": {"in_channels": 192},  # acoustic (64) + context (128) latents, not a width
    # rotary sections summing to half the tiny head; a modulation width unlike the latent channels (48), or the final
    # layer's two Linears (64 -> 48, 48 -> 64) read as an MLP pair (they are not one at full size)
    "Ideogram4Transformer2DModel": {"mrope_section": (4, 2, 2), "adaln_dim": 32},
    # 8 latent channels: with 16, the final layer's 2 x 2 patch output (64) equals the tiny width, and its two
    # Linears read as an MLP pair (they are not one at full size)
    "ZImageTransformer2DModel": {"in_channels": 8},
    "HunyuanDiT2DModel": {"text_len": 8, "text_len_t5": 8, "cross_attention_dim_t5": 48},  # its learned text padding
    "Lumina2Transformer2DModel": {"in_channels": 8},  # as Z-Image: its output norm's two Linears, else a false pair
}
#: Per-class forward inputs the rule cannot derive: class -> {parameter: value, or a function of the generator}.
INPUT_EXCEPTIONS: dict[str, dict] = {
    # sample_size 128 turns on the resolution / aspect-ratio conditioning
    "PixArtTransformer2DModel": {"added_cond_kwargs": lambda g: {"resolution": torch.tensor([[32.0, 32.0]] * BATCH),
                                                                 "aspect_ratio": torch.ones(BATCH, 1)}},
    "WanVACETransformer3DModel": {"control_hidden_states": lambda g: torch.randn(BATCH, 96, 2, 8, 8, generator=g)},
    # lists of per-sample tensors: latents [C, F, H, W] and caption features [L, cap_feat_dim]
    "ZImageTransformer2DModel": {"x": lambda g: [torch.randn(8, 1, 8, 8, generator=g) for _ in range(BATCH)],
                                 "t": lambda g: torch.tensor([0.5, 0.25]),
                                 "cap_feats": lambda g: [torch.randn(TEXT_LEN, 48, generator=g) for _ in range(BATCH)]},
    "NucleusMoEImageTransformer2DModel": {"img_shapes": [[(1, 4, 4)]] * BATCH},  # 16 packed tokens, 4 x 4
    "CosmosTransformer3DModel": {"padding_mask": lambda g: torch.zeros(1, 1, 8, 8)},
    # text states [B, T, text_in_dim] and each prompt's length
    "ErnieImageTransformer2DModel": {"text_bth": lambda g: torch.randn(BATCH, TEXT_LEN, 96, generator=g),
                                     "text_lens": torch.tensor([TEXT_LEN, TEXT_LEN - 4])},
    # one image embedding per sample [B, embedding_dim], its projection, and CLIP text tokens
    "PriorTransformer": {"hidden_states": lambda g: torch.randn(BATCH, 48, generator=g),
                         "proj_embedding": lambda g: torch.randn(BATCH, 48, generator=g),
                         "encoder_hidden_states": lambda g: torch.randn(BATCH, 77, 48, generator=g)},
    # one packed sequence: 8 text tokens (indicator 3) then 8 image tokens (indicator 2), one segment, 3-axis positions
    "Ideogram4Transformer2DModel": {
        "encoder_hidden_states": lambda g: torch.randn(BATCH, 16, 768, generator=g),
        "position_ids": torch.stack([torch.arange(16) // 8, torch.arange(16) % 4, torch.arange(16) // 4], -1)
        .expand(BATCH, 16, 3),
        "segment_ids": torch.zeros(BATCH, 16, dtype=torch.long),
        "indicator": torch.tensor([3] * 8 + [2] * 8).expand(BATCH, 16)},
    # 16 prior (VQ) tokens, one per 2 x 2 patch of the 8 x 8 latents, none dropped
    "GlmImageTransformer2DModel": {"prior_token_id": lambda g: torch.randint(0, 432, (BATCH, 16), generator=g),
                                   "prior_token_drop": torch.zeros(BATCH, dtype=torch.bool)},
    "HunyuanVideo15Transformer3DModel": {"timestep_r": None,  # no mean-flow timestep without use_meanflow
                                         "image_embeds": lambda g: torch.randn(BATCH, 4, 48, generator=g),  # i2v
                                         "encoder_hidden_states_2": lambda g: torch.randn(BATCH, 4, 48, generator=g),
                                         "encoder_attention_mask_2": torch.ones(BATCH, 4)},
    "StableAudio3DiTModel": {"global_hidden_states": lambda g: torch.randn(BATCH, 48, generator=g)},  # [B, width]
    # text states of every text-encoder layer [B, T, layers, width]
    "Krea2Transformer2DModel": {"encoder_hidden_states": lambda g: torch.randn(BATCH, TEXT_LEN, 2, 48, generator=g)},
    # one text-encoder layer's states per block (2 joint + 2 single)
    "BriaFiboTransformer2DModel": {"text_encoder_layers": lambda g: [torch.randn(BATCH, TEXT_LEN, 48, generator=g)
                                                                     for _ in range(4)], "guidance": None},
    # per-frame timesteps [B, frames] (the flow map's start time too), frames-first latents of 2 frames
    "AnyFlowTransformer3DModel": {"timestep": torch.full((BATCH, 2), 500.0),
                                  "r_timestep": torch.full((BATCH, 2), 250.0)},
    "AnyFlowFARTransformer3DModel": {"timestep": torch.full((BATCH, 2), 500.0),
                                     "r_timestep": torch.full((BATCH, 2), 250.0), "chunk_partition": [1, 1]},
    # packed patches [B, patches, C, pt, ph, pw] and each sample's patch grids
    "JoyImageEditPlusTransformer3DModel": {"hidden_states": lambda g: torch.randn(BATCH, 2, 16, 1, 2, 2, generator=g),
                                           "shape_list": [[(1, 1, 1), (1, 1, 1)]] * BATCH},
    # image-encoder states [B, L, image_proj_dim] and the latent frames' indices (2 frames)
    "HunyuanVideoFramepackTransformer3DModel": {"image_embeds": lambda g: torch.randn(BATCH, TEXT_LEN, 48, generator=g),
                                                "indices_latents": torch.ones(2),
                                                # the clean and history latents it conditions on (1, 1, 4 frames)
                                                "latents_clean": lambda g: torch.randn(BATCH, 16, 1, 8, 8, generator=g),
                                                "indices_latents_clean": torch.ones(1),
                                                "latents_history_2x": lambda g: torch.randn(BATCH, 16, 1, 8, 8,
                                                                                            generator=g),
                                                "indices_latents_history_2x": torch.ones(1),
                                                "latents_history_4x": lambda g: torch.randn(BATCH, 16, 4, 8, 8,
                                                                                            generator=g),
                                                "indices_latents_history_4x": torch.ones(4)},
    # its masks reshape per head (not a [B, T] padding mask); temporal attention on
    "LatteTransformer3DModel": {"attention_mask": None, "encoder_attention_mask": None,
                                "enable_temporal_attentions": True},
    # 24 prompt tokens, one input image of 16 patches, a joint mask and positions over 24 + 1 + 16 positions
    "OmniGenTransformer2DModel": {"input_ids": lambda g: torch.randint(0, 10, (BATCH, 24), generator=g),
                                  "input_img_latents": lambda g: [torch.randn(1, 4, 8, 8, generator=g)],
                                  "input_image_sizes": {0: [[0, 16]]}, "attention_mask": torch.ones(BATCH, 41, 41),
                                  "position_ids": torch.arange(41).expand(BATCH, 41),
                                  "timestep": torch.tensor([0.5, 0.25])},
    "HiDreamImageTransformer2DModel": {
        "encoder_hidden_states_t5": lambda g: torch.randn(BATCH, 8, 48, generator=g),
        "encoder_hidden_states_llama3": lambda g: torch.randn(2, BATCH, 8, 48, generator=g),
        "pooled_embeds": lambda g: torch.randn(BATCH, 96, generator=g), "timesteps": torch.tensor([500.0, 250.0])},
    # CLIP and T5 states (8 tokens each) with masks, size/crop conditioning, style, rotary (cos, sin) per patch
    "HunyuanDiT2DModel": {"encoder_hidden_states": lambda g: torch.randn(BATCH, 8, 48, generator=g),
                          "text_embedding_mask": torch.ones(BATCH, 8),
                          "encoder_hidden_states_t5": lambda g: torch.randn(BATCH, 8, 48, generator=g),
                          "text_embedding_mask_t5": torch.ones(BATCH, 8),
                          "image_meta_size": torch.tensor([[1024.0, 1024, 16, 16, 0, 0]] * BATCH),
                          "style": torch.zeros(BATCH, dtype=torch.long),
                          "image_rotary_emb": lambda g: (torch.randn(16, 16, generator=g),
                                                         torch.randn(16, 16, generator=g))},
    "EasyAnimateTransformer3DModel": {"timestep_cond": None},  # no timestep-condition projection by default
    "TransformerTemporalModel": {"encoder_hidden_states": None},  # temporal self-attention only (no text width)
    # acoustic latents [B, L, 64] and the context latents concatenated to them (192 input channels in all)
    "AceStepTransformer1DModel": {"hidden_states": lambda g: torch.randn(BATCH, 16, 64, generator=g),
                                  "context_latents": lambda g: torch.randn(BATCH, 16, 128, generator=g),
                                  "encoder_hidden_states": lambda g: torch.randn(BATCH, TEXT_LEN, 64, generator=g)},
}
#: Inputs passed even when the call is retried without the optional conditioning.
CORE_INPUTS = ("hidden_states", "encoder_hidden_states", "timestep", "img_ids", "txt_ids")
#: The latent layouts tried, in order: image, video, video frames-first (CogVideoX-style), packed tokens, a 1-D
#: signal (audio: channels x length).
LAYOUTS = ("image", "video", "frames", "tokens", "signal")


def _scaled_axes(value, head_dim: int):
    """Rotary axes (even parts summing to the head size) rescaled to the tiny head size."""
    parts = [max(2, 2 * round(v * TINY_HEAD_DIM / head_dim / 2)) for v in value]
    parts[-1] += TINY_HEAD_DIM - sum(parts)
    return type(value)(parts) if parts[-1] > 0 else value


def _shrunk_value(key: str, value, heads: int | None, head_dim: int | None):
    """The tiny value of one config entry (unchanged where the rule has nothing to say)."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int) and _BLOCKS.match(key):
        return min(value, TINY_BLOCKS)
    if isinstance(value, int) and _HEADS.match(key) and heads:  # fewer K/V heads stay fewer, but 2 (TP=2)
        return max(2, value * TINY_HEADS // heads) if value < heads else TINY_HEADS
    if isinstance(value, int) and _HEAD_DIM.match(key):
        return TINY_HEAD_DIM
    inner = heads * head_dim if heads and head_dim else None
    if isinstance(value, (tuple, list)) and head_dim and value and all(isinstance(v, int) for v in value) \
            and sum(value) == head_dim:
        return _scaled_axes(value, head_dim)
    if isinstance(value, int) and inner and value >= 128 and _WIDTH.search(key) and not _KEEP.search(key):
        tiny_inner = TINY_HEADS * TINY_HEAD_DIM
        if value % inner == 0:  # k x the inner width stays k x the tiny one
            return value // inner * tiny_inner
        # else the same share of the tiny width, a multiple of 48 so that 2/3 (SwiGLU hidden) of 4 x it stays even
        return 48 * math.ceil(value * tiny_inner / inner / 48)
    return value


def _heads(config: dict) -> tuple[int | None, int | None]:
    heads = next((v for k, v in config.items() if isinstance(v, int) and _HEADS.match(k)
                  and "kv" not in k and "key_value" not in k), None)
    head_dim = next((v for k, v in config.items() if isinstance(v, int) and _HEAD_DIM.match(k)), None)
    if heads and not head_dim:
        named = [config.get(k) for k in ("hidden_size", "inner_dim", "dim", "hidden_dim", "model_dim")]
        named += [v for k, v in config.items() if _MODEL_WIDTH.search(k)]  # then any "<x>_dim"
        width = next((v for v in named if isinstance(v, int) and not isinstance(v, bool) and v >= 128
                      and v % heads == 0), None)
        head_dim = width // heads if width and width % heads == 0 else None
    return heads, head_dim


def full_size_config(cls) -> dict:
    """`cls`'s default config, with the values its defaults leave unset (`DEFAULT_CONFIG_GAPS`)."""
    return {**_default_config(cls), **DEFAULT_CONFIG_GAPS.get(cls.__name__, {})}


def tiny_config(cls, base: dict | None = None) -> dict:
    """`cls`'s default config (or `base`, a checkpoint's config) shrunk by the rule, then its exceptions applied."""
    config = full_size_config(cls) if base is None else {k: v for k, v in base.items() if not k.startswith("_")}
    heads, head_dim = _heads(config)
    tiny = {key: _shrunk_value(key, value, heads, head_dim) for key, value in config.items()}
    return {**tiny, **CONFIG_EXCEPTIONS.get(cls.__name__, {})}


def _default_config(cls) -> dict:
    """The defaults of the class's `__init__` (what `cls()` builds)."""
    signature = inspect.signature(cls.__init__)
    return {name: p.default for name, p in signature.parameters.items()
            if name != "self" and p.default is not inspect.Parameter.empty
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)}


def _config_int(config, *keys, default=None):
    return next((config[k] for k in keys if isinstance(config.get(k), int) and not isinstance(config[k], bool)),
                default)


def _patch(config) -> tuple[int, int]:
    patch = config.get("patch_size", 1)
    patch = patch if isinstance(patch, int) else (patch[-1] if patch else 1)
    temporal = config.get("patch_size_t") or (config["patch_size"][0] if isinstance(config.get("patch_size"),
                                                                                     (tuple, list)) else 1)
    return patch or 1, temporal or 1


def _latents(layout: str, config, generator) -> torch.Tensor:
    channels = _config_int(config, "in_channels", "in_dim", "input_dim", "latent_channels", "io_channels", "latent_dim",
                           default=16)
    patch, temporal = _patch(config)
    side = 4 * patch
    shapes = {"image": (BATCH, channels, side, side), "video": (BATCH, channels, 2 * temporal, side, side),
              "frames": (BATCH, 2 * temporal, channels, side, side), "tokens": (BATCH, 16, channels),
              "signal": (BATCH, channels, 16)}
    return torch.randn(*shapes[layout], generator=generator)


def _axes(config) -> int:
    """How many position axes the rotary embedding has (its axes' tuple in the config), for position ids."""
    return next((len(v) for k, v in config.items() if ("axes" in k or "rope" in k) and isinstance(v, (tuple, list))
                 and v and all(isinstance(x, int) for x in v)), 3)


def _ids(rows: int, axes: int) -> torch.Tensor:
    ids = torch.zeros(rows, axes)
    ids[:, -1] = torch.arange(rows) % 4
    ids[:, -2 if axes > 1 else -1] = torch.arange(rows) // 4
    return ids


_TEXT = re.compile(r"(text|context|caption|cross|encoder).*(dim|channels)$")


def _text_width(config) -> int:
    """The text states' width: a known key, else any key that reads like one, else 32."""
    known = _config_int(config, *TEXT_KEYS)
    if known is not None:
        return known
    return next((v for k, v in config.items() if _TEXT.search(k) and isinstance(v, int) and not isinstance(v, bool)),
                32)


def _builders(config, layout, generator) -> dict:
    """Inputs by parameter name (callables, built only for the parameters the forward takes)."""
    text = _text_width(config)
    pooled = _config_int(config, "pooled_projection_dim", "pooled_dim", default=32)
    axes = _axes(config)
    mask = lambda: torch.ones(BATCH, TEXT_LEN, dtype=torch.bool)  # noqa: E731
    sizes = lambda: torch.tensor([[32.0, 32.0]] * BATCH)  # noqa: E731
    return {
        "hidden_states": lambda: _latents(layout, config, generator),
        "encoder_hidden_states": lambda: torch.randn(BATCH, TEXT_LEN, text, generator=generator),
        "timestep": lambda: torch.tensor([500.0, 250.0]),
        "pooled_projections": lambda: torch.randn(BATCH, pooled, generator=generator),
        "guidance": lambda: torch.tensor([3.5, 3.5]),
        "img_ids": lambda: _ids(16, axes),
        "txt_ids": lambda: _ids(TEXT_LEN, axes) * 0,
        "position_ids": lambda: _ids(TEXT_LEN + 16, axes),  # text and 4 x 4 image tokens, one joint sequence
        "encoder_attention_mask": mask, "attention_mask": mask, "encoder_hidden_states_mask": mask,
        "encoder_mask": mask,
        "class_labels": lambda: torch.tensor([1, 2]),
        # packed tokens carry no shape: 16 tokens are one frame of 4 x 4 (LTX-Video-style forwards ask for it)
        **({"num_frames": lambda: 1, "height": lambda: 4, "width": lambda: 4} if layout == "tokens" else {}),
        "original_size": sizes, "target_size": sizes, "crop_coords": lambda: torch.zeros(BATCH, 2),
    }


def _builder(builders: dict, name: str, config: dict, generator):
    if name in builders:
        return builders[name]
    if "timestep" in name:  # a second timestep (e.g. the flow map's start time) reads like the first
        return builders["timestep"]
    if name.endswith("_hidden_states"):  # extra states ("global_hidden_states"): width from "<prefix>...dim"
        prefix = name.removesuffix("_hidden_states")
        width = next((v for k, v in config.items() if k.startswith(prefix) and _WIDTH.search(k)
                      and isinstance(v, int) and not isinstance(v, bool)), None)
        return (lambda: torch.randn(BATCH, 1, width, generator=generator)) if width else None
    return None


def forward_inputs(model: torch.nn.Module, layout: str, generator: torch.Generator, optional: bool = True) -> dict:
    """The call for `layout`: every required forward parameter (a `ValueError` names one it cannot build) and, with
    `optional`, the optional conditioning it can build."""
    config = dict(model.config)
    builders = _builders(config, layout, generator)
    exceptions = INPUT_EXCEPTIONS.get(type(model).__name__, {})
    kwargs = {}
    for name, param in inspect.signature(model.forward).parameters.items():
        required = param.default is inspect.Parameter.empty and param.kind not in (param.VAR_POSITIONAL,
                                                                                   param.VAR_KEYWORD)
        build = _builder(builders, name, config, generator)
        if name in exceptions:
            kwargs[name] = exceptions[name](generator) if callable(exceptions[name]) else exceptions[name]
        elif build is not None and (required or optional or name in CORE_INPUTS):
            kwargs[name] = build()
        elif required:
            raise ValueError(f"cannot synthesize the forward input '{name}' (no rule for it: add an "
                             "INPUT_EXCEPTIONS line)")
    if "return_dict" in inspect.signature(model.forward).parameters:
        kwargs["return_dict"] = False
    return kwargs


def _first_call(model: torch.nn.Module, seed: int) -> tuple[dict, tuple]:
    """The first synthesized call that runs: each layout with the optional conditioning, then without it."""
    errors = []
    for layout in LAYOUTS:
        for optional in (True, False):
            try:
                kwargs = forward_inputs(model, layout, torch.Generator().manual_seed(seed), optional)
                with torch.no_grad():
                    return kwargs, predictions(model(**kwargs))
            except Exception as error:  # the next try may fit; if none does, each layout's first reason is named
                if optional:
                    errors.append(f"{layout}: {type(error).__name__}: {str(error)[:120]}")
    raise ValueError("no synthesized forward call runs the tiny model (" + "; ".join(errors) + ")")


def _redraw_zeros(model: torch.nn.Module) -> None:
    """Zero-initialized parameters (output projections, gates) drawn at random instead: a model whose output is
    constant matches any plan, so it would prove nothing."""
    with torch.no_grad():
        for param in model.parameters():
            if param.is_floating_point() and param.numel() and not param.count_nonzero():
                param.normal_(std=0.02)


def tiny_case(cls, workdir: Path, seed: int = 0, base: dict | None = None) -> Case:
    """A tiny random `cls` (its default config, or `base` shrunk) saved under `workdir/transformer`, and the first
    synthesized call that runs it."""
    config = tiny_config(cls, base)
    with torch.device("meta"):
        size = sum(p.numel() for p in cls.from_config(config).parameters())
    if size > TINY_MAX_PARAMS:
        raise ValueError(f"the shrinking rule leaves {size / 1e6:.0f} M parameters (widths it does not recognize): "
                         "add a CONFIG_EXCEPTIONS line")
    torch.manual_seed(seed)
    model = cls.from_config(config).eval()
    _redraw_zeros(model)
    kwargs, expected = _first_call(model, seed)
    model.save_pretrained(workdir / "transformer")
    return Case(cls.__name__, workdir, (), kwargs, expected)
