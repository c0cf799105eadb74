"""One launch spec: `generate` and `serve` offer the same launch options, and a job reads each LoRA file once."""

from __future__ import annotations

import argparse
import builtins
import json
from collections import OrderedDict

import lora_files
import pytest
import safetensors
import safetensors.torch

from neuron_diffusers import job, launch
from neuron_diffusers.checkpoint import resolve
from neuron_diffusers.cli import main
from neuron_diffusers.parallel import lora
from neuron_diffusers.serve import command


def _options(add_arguments) -> dict[str, argparse.Action]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return {option: action for action in parser._actions for option in action.option_strings}


def test_generate_and_serve_offer_the_same_launch_options():
    generate, serve = _options(job.add_arguments), _options(command.add_arguments)
    shared = launch.launch_options()
    assert {"--tp", "--ulysses", "--ring", "--cfg-parallel", "--cp-any-length", "--mesh-order", "--plan", "--cache",
            "--parallel-vae", "--no-parallel-vae", "--lora", "--compile", "--warmup", "--dtype"} <= shared
    assert shared <= set(generate) and shared <= set(serve), (shared - set(generate), shared - set(serve))
    for option in shared - {"--lora"}:  # the server names its LoRAs: the one option whose syntax differs
        a, b = generate[option], serve[option]
        assert (a.dest, a.default, a.choices, a.nargs, a.const, a.type) == (b.dest, b.default, b.choices, b.nargs,
                                                                            b.const, b.type), option


def test_serve_takes_the_options_it_lacked():
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(["--plan", "stock", "--cache", "first-block:0.1", "--no-parallel-vae", "--mesh-order",
                              "tp-inner", "--lora", "ink=x.safetensors:0.5"])
    assert (args.plan, args.cache, args.parallel_vae, args.mesh_order) == ("stock", "first-block:0.1", False,
                                                                           "tp-inner")
    assert args.lora[0][0] == "ink"


def test_the_spec_is_frozen_and_planned_before_any_weight(tiny_checkpoint):
    parser = argparse.ArgumentParser()
    job.add_arguments(parser)
    args = parser.parse_args(["--model", str(tiny_checkpoint("flux")), "--out", "x", "--plan", "stock"])
    spec = launch.plan_launch(args, 1, "cpu", steps=4)
    assert (spec.tp, spec.plan, spec.dtype, spec.cfg) == (1, "stock", "float32", 1)
    with pytest.raises(AttributeError):
        spec.tp = 2


def test_guidance_distilled_rule_is_one_function(tiny_checkpoint):
    adapter = resolve(str(tiny_checkpoint("flux2"))).adapter
    with pytest.raises(ValueError, match="guidance-distilled and takes no negative prompt: drop --negative-prompt"):
        launch.check_guidance(adapter, {"--negative-prompt": "x", "--guidance": None, "--true-cfg-scale": None})


def test_each_lora_file_is_opened_once_per_rank_per_job(tmp_path, tiny_checkpoint, monkeypatch):
    """Planning (check, sha256 for the settings), loading and fusing all use one read of the file."""
    checkpoint = str(tiny_checkpoint("flux"))
    transformer = resolve(checkpoint).transformer_class().from_pretrained(checkpoint, subfolder="transformer")
    path = lora_files.save_peft(tmp_path / "ink.safetensors",
                                lora_files.factors(lora_files.linears(transformer, ("to_q",), False), 2, seed=1))
    monkeypatch.setattr(lora, "_cache", OrderedDict())
    opens = []

    def counting(real, name):
        def wrapper(file, *args, **kwargs):
            if str(file) == str(path):
                opens.append(name)
            return real(file, *args, **kwargs)
        return wrapper

    monkeypatch.setattr(builtins, "open", counting(builtins.open, "open"))
    monkeypatch.setattr(safetensors, "safe_open", counting(safetensors.safe_open, "safe_open"))
    monkeypatch.setattr(safetensors.torch, "load_file", counting(safetensors.torch.load_file, "load_file"))
    out = tmp_path / "out"
    assert main(["generate", "--model", checkpoint, "--prompt", "a fox", "--steps", "1", "--lora", f"{path}:0.5",
                 "--out", str(out)]) == 0
    assert opens == ["open"], opens
    summary = json.loads((out / "summary.json").read_text())
    assert summary["loras"][0]["scale"] == 0.5 and len(summary["loras"][0]["sha256"]) == 64


@pytest.mark.parametrize("budget, kept", [(1, 1), (1 << 30, 2)])
def test_a_lora_file_and_its_read_share_one_cache(tmp_path, tiny_checkpoint, monkeypatch, budget, kept):
    """A file's tensors and its checked read are kept, and dropped, together: over the byte budget only the latest
    file stays, and reading the dropped one again opens it again. Control: within the budget both stay, unopened."""
    checkpoint = resolve(str(tiny_checkpoint("flux")))
    transformer = checkpoint.transformer_class().from_pretrained(checkpoint.path, subfolder="transformer")
    paths = [lora_files.save_peft(tmp_path / f"{name}.safetensors", lora_files.factors(
        lora_files.linears(transformer, ("to_q",), False), 2, seed=seed)) for seed, name in enumerate("ab")]
    monkeypatch.setattr(lora, "_cache", OrderedDict())
    monkeypatch.setattr(lora, "_CACHED_BYTES", budget)
    lora.check_loras(checkpoint, paths)
    assert [len(entry.reads) for entry in lora._cache.values()] == [1] * kept
    opens = []
    real_open = builtins.open
    monkeypatch.setattr(builtins, "open", lambda file, *a, **k: opens.append(str(file)) or real_open(file, *a, **k))
    lora.check_loras(checkpoint, paths[:1])
    assert opens.count(str(paths[0])) == (1 if kept == 1 else 0)


def test_serve_plans_plan_cache_vae_and_mesh_order_with_the_jobs_checks(tiny_checkpoint):
    pytest.importorskip("fastapi")
    parser = argparse.ArgumentParser()
    command.add_arguments(parser)
    args = parser.parse_args(["--model", str(tiny_checkpoint("flux")), "--plan", "stock", "--cache", "first-block:0.1",
                              "--no-parallel-vae", "--mesh-order", "tp-inner", "--port", "0"])
    config = command.plan_server(args, 2, "cpu")
    assert (config.launch.plan, config.launch.mesh_order, config.launch.parallel_vae) == ("stock", "tp-inner", False)
    assert config.cache == "first-block:0.1" and config.launch.cache is not None and config.tp == 2
    args.warmup = True  # --warmup without --compile: refused as the job refuses it
    with pytest.raises(ValueError, match="--warmup compiles shapes up front"):
        command.plan_server(args, 2, "cpu")
