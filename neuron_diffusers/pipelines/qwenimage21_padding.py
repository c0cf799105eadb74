"""Exact text padding for Qwen-Image-2.1 (`pipelines/qwenimage21.py`).

`QwenImage21Rope` numbers the joint sequence's RoPE positions from the image-slot mask alone, so right-padded text
would move the image's positions. `exact_text_padding` hooks one transformer's `pos_embed` (a `QwenImage21Rope`,
reached through `compat.privates`) so that padded text rows, masked out as keys anyway, take no position of their own.
"""

from __future__ import annotations

import inspect
import weakref

import torch

from ..compat import privates


class _UnpaddedPositions:
    """Stock `QwenImage21Rope.forward(img_shapes, image_pad_mask, device)` walks `image_pad_mask`: every text row
    advances the position, each image block starts after the text before it, padding included, so right-padded text
    would move the image. Padded rows are masked out as keys (the forward's `encoder_hidden_states_mask`, laid out on
    the joint sequence as stock lays out `joint_key_valid`), so their positions change nothing: the rope runs on the
    sequence without them, and each padded row takes the position of the row before it. Real rows get exactly their
    unpadded positions; shapes stay static. Rows of a batch padded differently keep stock's positions."""

    def __init__(self, transformer: torch.nn.Module):
        # The classes' signatures: what a call passes, whatever hooks wrap the instances' `forward` later.
        self._forward = inspect.signature(type(transformer).forward)
        self._rope = inspect.signature(type(transformer.pos_embed).forward)
        self.masks = None  # (encoder_hidden_states_mask, img_mask) of the transformer forward in flight
        self.kept = None  # the joint rows the rope numbered, between its pre-hook and its hook

    def capture(self, module, args, kwargs):
        arguments = self._forward.bind_partial(module, *args, **kwargs).arguments
        self.masks = arguments.get("encoder_hidden_states_mask"), arguments.get("img_mask")

    def release(self, module, args, kwargs, output):
        self.masks = None

    def drop_padding(self, rope, args, kwargs):
        self.kept = None
        text_mask, img_mask = self.masks or (None, None)
        if text_mask is None or img_mask is None:
            return None
        bound = self._rope.bind(rope, *args, **kwargs)
        image_pad_mask = bound.arguments["image_pad_mask"]
        valid = text_mask.bool()[:, ~img_mask[0][: text_mask.shape[1]]]  # the joint text rows, in order
        if valid.all() or not (valid == valid[:1]).all():
            return None
        kept = torch.ones_like(image_pad_mask)
        kept[~image_pad_mask] = valid[0]
        bound.arguments["image_pad_mask"] = image_pad_mask[kept]
        self.kept = kept
        return bound.args[1:], bound.kwargs

    def spread(self, rope, args, kwargs, output):
        if self.kept is None:
            return None
        kept, self.kept = self.kept, None
        return output[(kept.cumsum(0) - 1).clamp(min=0)]


class ExactTextPadding:
    """The hooks `exact_text_padding` installed on one Qwen-Image-2.1 transformer; `remove()` takes them off."""

    def __init__(self, transformer: torch.nn.Module):
        positions = _UnpaddedPositions(transformer)
        rope = transformer.pos_embed
        self._transformer = weakref.ref(transformer)
        self._handles = [
            transformer.register_forward_pre_hook(positions.capture, with_kwargs=True),
            transformer.register_forward_hook(positions.release, with_kwargs=True, always_call=True),
            rope.register_forward_pre_hook(positions.drop_padding, with_kwargs=True),
            rope.register_forward_hook(positions.spread, with_kwargs=True),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        transformer = self._transformer()
        if transformer is not None and _EXACT_TEXT_PADDING.get(transformer) is self:
            del _EXACT_TEXT_PADDING[transformer]


_EXACT_TEXT_PADDING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def exact_text_padding(transformer: torch.nn.Module) -> ExactTextPadding:
    """Make right-padded text (masked rows) give a Qwen-Image-2.1 transformer the unpadded output; idempotent."""
    rope_class = privates.internal("diffusers.models.transformers.transformer_qwenimage21", "QwenImage21Rope")
    if not isinstance(getattr(transformer, "pos_embed", None), rope_class):
        raise TypeError("exact_text_padding needs a Qwen-Image-2.1 transformer (its `pos_embed` a QwenImage21Rope), "
                        f"got {type(transformer).__name__}.")
    if transformer not in _EXACT_TEXT_PADDING:
        _EXACT_TEXT_PADDING[transformer] = ExactTextPadding(transformer)
    return _EXACT_TEXT_PADDING[transformer]
