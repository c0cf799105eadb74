"""Tokenizers built in code, so tiny checkpoints need no Hub download.

Real checkpoints ship tokenizers trained on terabytes; a tiny random pipeline only needs one that
round-trips text, knows the special tokens the stock pipeline code asks for, and is deterministic.
"""

from __future__ import annotations

import re
import string

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import CLIPTokenizer, T5Tokenizer

# A few sentences in the style of real prompts, so merges look like words and common prompt
# lengths stay in the tens of tokens rather than one token per byte.
_CORPUS = [
    "a photo of a red fox in the snow, detailed fur, golden hour",
    "a capybara in a wizard hat reading a book, studio lighting",
    "an astronaut riding a horse on the moon, cinematic, 35mm film",
    "a bowl of ramen with a soft boiled egg, top view, high detail",
    "a watercolor painting of a lighthouse on a cliff at sunset",
    "Describe the image by detailing the color, shape, size, texture, quantity, text, spatial relationships",
    "You are a helpful assistant. The user will describe an image or a video to generate.",
]


def train_byte_level_bpe(special_tokens: list[str], vocab_size: int = 512) -> Tokenizer:
    """A byte-level BPE (the GPT-2 / Qwen / Mistral-Tekken family), trained in milliseconds.

    Byte-level means every string encodes without an unknown token, which is what the Qwen and
    Mistral chat templates rely on. `special_tokens` get the first ids, in the given order.
    Training on a fixed corpus makes the result identical on every call.
    """
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(special_tokens),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_CORPUS, trainer=trainer)
    return tokenizer


def clip_tokenizer(model_max_length: int = 77) -> CLIPTokenizer:
    """A CLIP tokenizer whose vocabulary is just the 256 byte symbols, each with and without `</w>`.

    CLIP's BPE marks the last symbol of every word with `</w>`, so both forms are needed for any
    string to encode. With no merges every character is one token, which is plenty for a random
    text encoder. The layout mirrors real CLIP (bytes, then bytes + `</w>`, then the two special
    tokens last), so `bos` / `eos` are 512 / 513; the text encoder's config must use those ids,
    because CLIP pools the hidden state at the first `eos`. `model_max_length` must be set: the
    pipelines truncate and pad to it, and the transformers default is effectively unbounded.
    """
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    symbols = sorted(alphabet) + [s + "</w>" for s in sorted(alphabet)] + ["<|startoftext|>", "<|endoftext|>"]
    return CLIPTokenizer(
        vocab={symbol: i for i, symbol in enumerate(symbols)}, merges=[], model_max_length=model_max_length
    )


def t5_tokenizer(model_max_length: int = 512) -> T5Tokenizer:
    """A T5 (SentencePiece-Unigram) tokenizer over printable ASCII plus the corpus words.

    T5 fixes `<pad>`, `</s>`, `<unk>` at ids 0, 1, 2 (its config's pad / eos / decoder-start ids).
    Whole words score far above single characters, so corpus words stay one token and anything
    else spells out per character; characters outside ASCII map to `<unk>`, as in real T5. No
    sentinel `extra_ids`: they only matter for span-corruption training, not for encoding prompts.
    """
    words = sorted({"▁" + word for text in _CORPUS for word in re.findall(r"\w+", text)})
    chars = sorted(set(string.printable) - set(string.whitespace))
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("▁", -2.0)]
    vocab += [(word, -5.0) for word in words] + [(char, -10.0) for char in chars]
    return T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=model_max_length)
