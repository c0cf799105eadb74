"""Encodings longer than the largest length bucket run, as stock runs them (issue #34).

Qwen-Image-2.1's vision-language encoder reads an input image into its prompt: a 64x64 picture at the default
`output_resolution` encodes to ~1046 tokens, past the largest text bucket (1024), which used to be refused. It now
pads to a larger static length; at TP=2 it must give the stock single-process latents, compared before any 8-bit
rounding, with a control (another input image) that moves them by more than the tolerance.
"""

import numpy as np
import pytest
import torch
from image_jobs import PROMPT, input_image

from neuron_diffusers import tiny
from neuron_diffusers.pipelines.qwenimage21 import QwenImage21Adapter

#: The issue's case: a 64x64 input image and the stock call's own image sizing (no `output_resolution`).
CALL = {"height": 32, "width": 32, "num_inference_steps": 2}
IMAGE_SIZE = (64, 64)
#: float32, the ranks summing in another order than this process: latents, and the transformer's first call.
TOLERANCE = {"latents": 1e-4, "hidden_states": 1e-5, "encoder_hidden_states": 1e-5, "output": 1e-5}


class FirstCall:
    """A test probe: the transformer's inputs and output at its first call (plain torch hooks, removed on exit)."""

    def __init__(self, transformer):
        self.seen = {}
        self.handles = [transformer.register_forward_pre_hook(self._inputs, with_kwargs=True),
                        transformer.register_forward_hook(self._output)]

    def _inputs(self, module, args, kwargs):
        if "hidden_states" not in self.seen:
            self.seen.update({name: kwargs[name].detach().cpu().float().numpy().copy()
                              for name in ("hidden_states", "encoder_hidden_states")})

    def _output(self, module, args, output):
        if "output" not in self.seen:
            self.seen["output"] = output[0].detach().cpu().float().numpy().copy()

    def __enter__(self):
        return self.seen

    def __exit__(self, *exc):
        for handle in self.handles:
            handle.remove()


def _tp2_run(checkpoint: str, image_seed: int) -> dict:
    import neuron_diffusers as nd

    torch.set_num_threads(1)
    mesh = nd.init_distributed(tp=2)
    pipe = nd.load_pipeline(checkpoint, mesh)
    with FirstCall(pipe.adapter.transformer_of(pipe.pipe)) as seen:
        latents = pipe.generate([PROMPT], seed=0, image=input_image(image_seed, IMAGE_SIZE), output_type="latent",
                                **CALL)
    return {"latents": None if latents is None else np.asarray(latents[0], dtype=np.float32), **seen}


def _stock_run(checkpoint: str, image_seed: int) -> dict:
    import diffusers

    pipe = diffusers.QwenImage21Pipeline.from_pretrained(checkpoint)
    pipe.set_progress_bar_config(disable=True)
    with torch.no_grad(), FirstCall(pipe.transformer) as seen:
        latents = pipe(prompt=PROMPT, image=input_image(image_seed, IMAGE_SIZE), output_type="latent",
                       generator=torch.Generator().manual_seed(0), **CALL).images[0]
    return {"latents": np.asarray(latents, dtype=np.float32), **seen}


#: The target image's tokens (one per 16 x 16 pixels): the last rows of the transformer's output.
TARGET_TOKENS = (CALL["height"] // 16) * (CALL["width"] // 16)


def _unpadded(run: dict, stock: dict) -> dict:
    """`run` without its padded text rows: zeros past stock's text length at the input, and at the output the rows
    just before the target image's (the joint sequence is text, then the target, which the pipeline reads last)."""
    length = stock["encoder_hidden_states"].shape[1]
    text = run["encoder_hidden_states"]
    assert not text[:, length:].any(), "padded text rows are zeros"
    output, kept = run["output"], stock["output"].shape[1] - TARGET_TOKENS
    return {**run, "encoder_hidden_states": text[:, :length],
            "output": np.concatenate([output[:, :kept], output[:, -TARGET_TOKENS:]], axis=1)}


def _differences(run: dict, stock: dict) -> dict:
    """Max abs difference per compared tensor."""
    return {name: float(np.abs(run[name] - stock[name]).max()) for name in TOLERANCE}


@pytest.fixture(scope="module")
def checkpoint():
    return str(tiny.cached_tiny("qwenimage21"))


@pytest.fixture(scope="module")
def stock(checkpoint):
    return _stock_run(checkpoint, 1)


@pytest.fixture(scope="module")
def tp2(checkpoint, rank_pool):
    return rank_pool.run(_tp2_run, 2, checkpoint, 1, timeout_s=600)


def test_qwenimage21_encoding_past_the_largest_bucket_is_padded_not_refused(stock, tp2):
    stock_length = stock["encoder_hidden_states"].shape[1]
    assert stock_length > QwenImage21Adapter.buckets[-1], f"the case must overflow the buckets: {stock_length}"
    assert tp2[0]["encoder_hidden_states"].shape[1] > stock_length, "padded to a static length of its own"
    assert tp2[1]["latents"] is None and tp2[0]["latents"].shape == stock["latents"].shape


def test_qwenimage21_encoding_past_the_largest_bucket_equals_stock_at_tp2(checkpoint, stock, tp2):
    differences = _differences(_unpadded(tp2[0], stock), stock)
    assert all(differences[name] < TOLERANCE[name] for name in TOLERANCE), differences
    # Control: another input image moves the transformer's inputs and output past the tolerance (the latents of
    # these random tiny models barely move, ~1e-5: they alone could not tell one image from another).
    control = _differences(_stock_run(checkpoint, 11), stock)
    moved = {"hidden_states", "encoder_hidden_states", "output"}
    assert all(control[name] > 10 * TOLERANCE[name] for name in moved), control
