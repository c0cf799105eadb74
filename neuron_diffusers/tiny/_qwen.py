"""Qwen tokenizer, Qwen3-VL processor and Qwen-Image scheduler, built in code for the tiny Qwen-family checkpoints.

Shared by every tiny pipeline whose text encoder is a Qwen2.5-VL or Qwen3-VL model.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable

from diffusers import FlowMatchEulerDiscreteScheduler
from tokenizers import models
from transformers import Qwen2Tokenizer, Qwen2VLImageProcessor, Qwen3VLProcessor, Qwen3VLVideoProcessor

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


def _merge_into_one_token(word: str, vocab: dict[str, int], merges: list[tuple[str, str]]) -> None:
    """Append merges (and vocabulary entries) until the byte-level `word` is one token.

    Appended merges rank below every learned one, so they only ever join the pieces the learned merges leave, and
    the tokenization of every other word stays as trained.
    """
    while len(pieces := [t.value for t in models.BPE(vocab, merges).tokenize(word)]) > 1:
        merged = pieces[0] + pieces[1]
        merges.append((pieces[0], pieces[1]))
        vocab.setdefault(merged, len(vocab))
