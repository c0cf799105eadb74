"""Tiny offline checkpoints: built deterministically, loaded back by the stock loaders, runnable."""

import json
import os
import time
from unittest import mock

import pytest
import torch
from safetensors.torch import load_file

from neuron_diffusers import tiny
from neuron_diffusers.cli import main

PIPELINE_CLASSES = {
    "flux": "FluxPipeline",
    "flux2": "Flux2Pipeline",
    "qwenimage": "QwenImagePipeline",
    "qwenimage21": "QwenImage21Pipeline",
}


def _transformer_weights(path):
    return load_file(next((path / "transformer").glob("*.safetensors")))


@pytest.mark.parametrize("family", tiny.FAMILIES)
def test_build_is_deterministic_and_seeded(tmp_path, tiny_checkpoint, family):
    started = time.perf_counter()
    again = tiny.build_tiny(family, tmp_path / "again", seed=0)
    print(f"{family}: built in {time.perf_counter() - started:.2f} s")
    other = tiny.build_tiny(family, tmp_path / "other", seed=1)
    reference = _transformer_weights(tiny_checkpoint(family))
    same, different = _transformer_weights(again), _transformer_weights(other)
    assert reference.keys() == same.keys() == different.keys()
    assert all(torch.equal(reference[k], same[k]) for k in reference)
    assert not all(torch.equal(reference[k], different[k]) for k in reference)


@pytest.mark.parametrize("family", sorted(PIPELINE_CLASSES))
def test_stock_loader_round_trip_generates(tiny_checkpoint, family):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(tiny_checkpoint(family))
    assert type(pipe).__name__ == PIPELINE_CLASSES[family]
    missing = [name for name, c in pipe.components.items() if c is None and name not in pipe._optional_components]
    assert missing == []
    height, width = tiny.default_size(family)
    image = pipe(prompt="a red fox", height=height, width=width, num_inference_steps=2,
                 generator=torch.Generator().manual_seed(0), output_type="np").images[0]
    assert image.shape[:2] == (height, width)
    assert torch.isfinite(torch.as_tensor(image)).all()


def test_cli_builds_into_a_new_folder_only(tmp_path, capsys):
    target = tmp_path / "flux"
    assert main(["tiny", "flux", str(target)]) == 0
    assert (target / "model_index.json").is_file()
    assert main(["tiny", "flux", str(target)]) == 2
    assert "exists and is not empty" in capsys.readouterr().err
    assert main(["tiny", "sd3", str(tmp_path / "sd3")]) == 2
    assert "Unknown tiny family 'sd3'" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["flux"]  # no staging folder left behind


def test_cli_takes_the_hyphenated_name_of_a_stock_class_checkpoint(tmp_path):
    target = tmp_path / "edit"
    assert main(["tiny", "qwenimage-edit", str(target)]) == 0
    index = json.loads((target / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImageEditPlusPipeline" and "processor" in index


def test_h3_modular_round_trip_generates_video_and_audio(tiny_checkpoint):
    from neuron_diffusers.checkpoint import resolve
    from neuron_diffusers.tiny import h3

    checkpoint = resolve(tiny_checkpoint("h3"))
    pipe = checkpoint.adapter.load_stock(checkpoint)
    assert type(pipe.transformer).__name__ == "MiniMaxH3Transformer3DModel"
    height, width = h3.DEFAULT_SIZE
    out = pipe(prompt="a red fox", height=height, width=width, num_frames=h3.DEFAULT_NUM_FRAMES,
               num_inference_steps=3, generator=torch.Generator().manual_seed(0), output_type="pt",
               output=["videos", "audio"])
    videos, audio = out["videos"], out["audio"]
    assert videos.shape == (1, h3.DEFAULT_NUM_FRAMES, 3, height, width)
    assert audio.ndim == 3 and audio.shape[1] == 2  # stereo
    assert torch.isfinite(videos).all() and torch.isfinite(audio).all()


def test_h3_load_names_a_component_that_did_not_load(tmp_path, tiny_checkpoint):
    import shutil

    from neuron_diffusers.checkpoint import resolve

    broken = shutil.copytree(tiny_checkpoint("h3"), tmp_path / "h3")
    for weights in (broken / "vae").glob("*.safetensors"):
        weights.write_bytes(b"not safetensors")
    with pytest.raises(RuntimeError, match="did not load vae"):
        checkpoint = resolve(broken)
        checkpoint.adapter.load_stock(checkpoint)


def _build_on_rank_1(cache: str):
    """Rank 1 builds the tiny FLUX.1 into the empty `cache` (this rank's cache for the job only: a pool rank runs
    other jobs next)."""
    import torch.distributed as dist

    from neuron_diffusers import tiny

    if dist.get_rank() != 1:  # rank 1 alone builds: the rank whose weights transformers would not write
        return None
    with mock.patch.dict(os.environ, {"NEURON_DIFFUSERS_CACHE": cache}):
        path = tiny.cached_tiny("flux")
    return sorted(p.name for p in (path / "text_encoder").iterdir())


def test_cached_tiny_inside_a_process_group_writes_every_weight(tmp_path, rank_pool):
    """transformers' `save_pretrained` skips weights on ranks != 0 inside a process group; the cache must not."""
    _, files = rank_pool.run(_build_on_rank_1, 2, str(tmp_path / "cache"))
    assert "model.safetensors" in files
