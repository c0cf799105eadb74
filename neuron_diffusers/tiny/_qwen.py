"""Qwen tokenizer, Qwen3-VL processor, Qwen-Image scheduler, and the tiny Qwen-Image VAE, transformer and Qwen2.5-VL
text encoder config, built in code for the tiny Qwen-family checkpoints.

Shared by every tiny pipeline whose text encoder is a Qwen2.5-VL or Qwen3-VL model (Qwen-Image and
Qwen-Image-Edit-Plus share the Qwen-Image parts).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

import torch
from diffusers import AutoencoderKLQwenImage, FlowMatchEulerDiscreteScheduler, QwenImageTransformer2DModel
from tokenizers import models
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2Tokenizer,
    Qwen2VLImageProcessor,
    Qwen3VLProcessor,
    Qwen3VLVideoProcessor,
)

from ._tokenizers import train_byte_level_bpe

# The special tokens the Qwen pipelines, processors and chat template name. `<|endoftext|>` comes first and is the
# pad token; `<|im_end|>` is eos, as in the real Qwen-VL tokenizers.
SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# The ChatML shape of the Qwen3-VL template, without the tool-calling and reasoning branches no pipeline uses.
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{%- for part in message.content %}"
    "{%- if part.type == 'image' %}{{- '<|vision_start|><|image_pad|><|vision_end|>' }}"
    "{%- elif part.type == 'video' %}{{- '<|vision_start|><|video_pad|><|vision_end|>' }}"
    "{%- elif part.type == 'text' %}{{- part.text }}"
    "{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

_SPECIAL_TOKEN_RE = re.compile("|".join(re.escape(token) for token in SPECIAL_TOKENS))

# Width of the Qwen2.5-VL text encoder's hidden states, which the Qwen-Image transformer reads as
# `joint_attention_dim`. Kept unlike the transformer's width so a mixed-up projection fails loudly.
QWEN_IMAGE_TEXT_DIM = 32


def qwen2_tokenizer(whole_words: Iterable[str] = ()) -> Qwen2Tokenizer:
    """A `Qwen2Tokenizer` (byte-level BPE, Qwen pre-tokenizer) over a vocabulary of a few hundred tokens.

    Every word of the `whole_words` texts becomes a single token, as it is in the real 151k vocabulary. Pipelines that
    drop a hard-coded number of template tokens from the text embeddings (Qwen-Image drops 34) count on that, so pass
    the pipeline's prompt template here. Special tokens in those texts are skipped: they are added whole anyway. The
    ChatML role names are always whole, so every chat turn opens with the real three-token header.
    """
    trained = train_byte_level_bpe(SPECIAL_TOKENS)
    vocab = trained.get_vocab()
    merges = [tuple(merge) for merge in json.loads(trained.to_str())["model"]["merges"]]
    # `Qwen2Tokenizer` brings the Qwen pre-tokenizer, which splits text slightly differently from the trainer's GPT-2
    # regex, so the words are cut here the way the final tokenizer will cut them.
    pre_tokenizer = Qwen2Tokenizer(vocab=vocab, merges=merges).backend_tokenizer.pre_tokenizer
    for text in ["system", "user", "assistant", *whole_words]:
        for chunk in _SPECIAL_TOKEN_RE.split(text):
            for word, _ in pre_tokenizer.pre_tokenize_str(chunk):
                _merge_into_one_token(word, vocab, merges)

    return Qwen2Tokenizer(
        vocab=vocab,
        merges=merges,
        eos_token="<|im_end|>",
        extra_special_tokens=SPECIAL_TOKENS[1:],
        chat_template=CHAT_TEMPLATE,
        model_max_length=131072,
    )


def qwen3_vl_processor(whole_words: Iterable[str] = ()) -> Qwen3VLProcessor:
    """A `Qwen3VLProcessor` with the real checkpoints' patching (16 px patches, 2x2 merge, 2-frame temporal patches).

    The pixel floor is lowered from the real 256x256 to one merged token (32x32), so that small condition images reach
    the vision tower at their own size rather than upscaled; the token budget is the real one.
    `whole_words` is forwarded to `qwen2_tokenizer`.
    """
    patching = dict(patch_size=16, temporal_patch_size=2, merge_size=2, image_mean=[0.5] * 3, image_std=[0.5] * 3)
    return Qwen3VLProcessor(
        image_processor=Qwen2VLImageProcessor(size={"shortest_edge": 32 * 32, "longest_edge": 16777216}, **patching),
        tokenizer=qwen2_tokenizer(whole_words),
        video_processor=Qwen3VLVideoProcessor(size={"shortest_edge": 32 * 32, "longest_edge": 25165824}, **patching),
        chat_template=CHAT_TEMPLATE,
    )


def vl_token_ids(tokenizer: Qwen2Tokenizer) -> dict[str, int]:
    """The token-id fields of a Qwen-VL model config, for `tokenizer`'s vocabulary instead of the real one."""
    ids = tokenizer.convert_tokens_to_ids
    return dict(
        image_token_id=ids("<|image_pad|>"),
        video_token_id=ids("<|video_pad|>"),
        vision_start_token_id=ids("<|vision_start|>"),
        vision_end_token_id=ids("<|vision_end|>"),
    )


def qwen_image_scheduler() -> FlowMatchEulerDiscreteScheduler:
    """The scheduler Qwen-Image and Qwen-Image-2.1 ship: resolution-dependent exponential shift, 0.02 terminal sigma."""
    return FlowMatchEulerDiscreteScheduler(
        base_image_seq_len=256,
        max_image_seq_len=8192,
        base_shift=0.5,
        max_shift=0.9,
        shift_terminal=0.02,
        time_shift_type="exponential",
        use_dynamic_shifting=True,
    )


def template_tokenizer(pipeline, whole_words: Iterable[str] = ()) -> Qwen2Tokenizer:
    """A `qwen2_tokenizer` for a Qwen-Image pipeline that drops a hard-coded number of leading tokens (its system
    prompt, which the real vocabulary tokenizes word by word) from the text embeddings: every word of its template is
    kept whole, so the drop removes exactly the system prompt here too (checked)."""
    template = pipeline.prompt_template_encode
    tokenizer = qwen2_tokenizer([template, *whole_words])
    prefix_len = len(tokenizer(template.split("{}")[0]).input_ids)
    if prefix_len != pipeline.prompt_template_encode_start_idx:
        raise RuntimeError(
            f"the prompt template prefix is {prefix_len} tokens, the pipeline drops "
            f"{pipeline.prompt_template_encode_start_idx}"
        )
    return tokenizer


def qwen_image_denoiser(seed: int) -> tuple[AutoencoderKLQwenImage, QwenImageTransformer2DModel]:
    """The tiny Qwen-Image VAE (8x, 16 latent channels) and 2x2-patched MMDiT, each seeded with `seed`."""
    torch.manual_seed(seed)
    vae = AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=1)
    torch.manual_seed(seed)
    transformer = QwenImageTransformer2DModel(
        patch_size=2,
        in_channels=16 * 4,  # 2x2 patches of the VAE's 16 latent channels
        out_channels=16,
        num_layers=2,
        # 4 heads so TP=2 and TP=4 shard whole heads; 4 x 16 = 64 wide, and every sharded projection (64, the 4x MLP's
        # 256) divides by 4.
        num_attention_heads=4,
        attention_head_dim=16,
        joint_attention_dim=QWEN_IMAGE_TEXT_DIM,
        axes_dims_rope=(4, 6, 6),  # frame/height/width split of the head dim, each even, summing to 16
    )
    return vae, transformer


def qwen2_5_vl_config(tokenizer: Qwen2Tokenizer) -> Qwen2_5_VLConfig:
    """Qwen2.5-VL at two text layers and one full-attention vision block with the real patching (14 px patches, 2x2
    merge, 2-frame temporal patches): Qwen-Image never runs the tower, Qwen-Image-Edit-Plus reads images with it."""
    head_dim = 16
    return Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=QWEN_IMAGE_TEXT_DIM,
            intermediate_size=2 * QWEN_IMAGE_TEXT_DIM,
            num_hidden_layers=2,
            num_attention_heads=QWEN_IMAGE_TEXT_DIM // head_dim,
            num_key_value_heads=1,
            # Multimodal RoPE splits the head's 8 rotary frequencies over (time, height, width), as [16, 24, 24]
            # splits the real 64.
            rope_parameters=dict(rope_type="default", rope_theta=1_000_000.0, mrope_section=[2, 3, 3]),
            bos_token_id=tokenizer.pad_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(
            depth=1,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            # Vision tokens are spliced into the text sequence, so they share its width.
            out_hidden_size=QWEN_IMAGE_TEXT_DIM,
            fullatt_block_indexes=[0],
        ),
        **vl_token_ids(tokenizer),
    )


def _merge_into_one_token(word: str, vocab: dict[str, int], merges: list[tuple[str, str]]) -> None:
    """Append merges (and vocabulary entries) until the byte-level `word` is one token.

    Appended merges rank below every learned one, so they only ever join the pieces the learned merges leave, and
    the tokenization of every other word stays as trained.
    """
    while len(pieces := [t.value for t in models.BPE(vocab, merges).tokenize(word)]) > 1:
        merged = pieces[0] + pieces[1]
        merges.append((pieces[0], pieces[1]))
        vocab.setdefault(merged, len(vocab))
