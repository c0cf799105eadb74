"""LoRAs fused into each rank's shard of a tensor-parallel transformer (tiny models, fp32): stock's output for all five
families, switching in place without recompiles, exact restore, CFG parallelism, the job, and every bad request
refused before any weight changes.

One spawn (2 gloo ranks) runs every TP check (`lora_jobs.lora_checks`); the references run in this process: stock
`load_lora_weights` + `set_adapters` on the single-process pipeline (PEFT adapters, unfused), and the LoRA merged into
the weights by hand.
"""

import hashlib
import json
import os
import shutil

import lora_files
import lora_jobs
import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from neuron_diffusers import families, tiny
from neuron_diffusers.checkpoint import resolve
from neuron_diffusers.cli import main
from neuron_diffusers.parallel import rules
from neuron_diffusers.parallel.lora import FusedLoras, LoraError, LoraSpec, lora_loader, parse_lora_option
from neuron_diffusers.tools.plan.cases import PROMPT, reference_call
from neuron_diffusers.tools.spawn import run_on_cpu_ranks

FAMILIES = ("flux", *lora_jobs.OTHER_FAMILIES)
RANK, ALPHA, SCALE = 4, 8.0, 0.6  # every family's LoRA over all Linears (FLUX.1's "A": network alphas, a CLIP part)
SCALE_A = 0.7
#: Transformer outputs are O(1); TP=2 and one process differ by reduction order only.
TOL = 2e-5


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint):
    return {family: str(tiny_checkpoint(family)) for family in FAMILIES}


@pytest.fixture(scope="module")
def calls(checkpoints):
    """Each family's first real transformer call in its stock pipeline, and the outputs without a LoRA."""
    return {family: reference_call(checkpoints[family], family) for family in FAMILIES}


def _transformer(checkpoint):
    return resolve(checkpoint).transformer_class().from_pretrained(checkpoint, subfolder="transformer")


@pytest.fixture(scope="module")
def files(checkpoints, tmp_path_factory):
    """Per family a LoRA on every Linear of its transformer (written by the pipeline's own `save_lora_weights`; FLUX.1:
    PEFT keys with `.alpha` network alphas and a CLIP part), and for FLUX.1 also B (diffusers' writer, 3 Linear
    kinds, alpha 4 at rank 8), a kohya file and one naming a module FLUX.1 lacks."""
    from transformers import CLIPTextModel

    root = tmp_path_factory.mktemp("loras")
    found = {"root": root, "scale": SCALE, "scale_a": SCALE_A, "state": {}}
    for family in lora_jobs.OTHER_FAMILIES:
        state = lora_files.factors(lora_files.linears(_transformer(checkpoints[family])), RANK, seed=1)
        found["state"][family] = state
        found[family] = lora_files.save_diffusers(lora_loader(resolve(checkpoints[family]).adapter), root / family,
                                                  state, RANK, ALPHA)
    transformer = _transformer(checkpoints["flux"])
    found["state"]["flux"] = state = lora_files.factors(lora_files.linears(transformer), RANK, seed=1)
    clip = CLIPTextModel.from_pretrained(checkpoints["flux"], subfolder="text_encoder")
    text = {f"text_encoder.{k}": v for k, v in lora_files.factors(lora_files.linears(clip), 2, seed=2).items()}
    found["a"] = lora_files.save_peft(root / "a.safetensors", state, alpha=ALPHA, extra=text)
    state_b = lora_files.factors(lora_files.linears(transformer, ("attn.to_q", "proj_out", "ff.net.2"), False), 8, 3)
    found["b"] = lora_files.save_diffusers(lora_loader(resolve(checkpoints["flux"]).adapter), root / "b", state_b, 8, 4)
    found["kohya"] = str(root / "kohya.safetensors")
    save_file(lora_files.kohya_flux(transformer, 4, seed=4, alpha=2.0), found["kohya"])
    bad = lora_files.factors({"transformer_blocks.0.attn.to_qq": transformer.transformer_blocks[0].attn.to_q}, 4, 5)
    found["bad_key"] = lora_files.save_peft(root / "bad_key.safetensors", bad)
    return found


@pytest.fixture(scope="module")
def tp_report(checkpoints, files, calls, tmp_path_factory):
    paths = {k: v for k, v in files.items() if k not in ("root", "state")}
    two_calls = {family: calls[family][:2] for family in FAMILIES}
    out = str(tmp_path_factory.mktemp("job") / "out")
    return run_on_cpu_ranks(lora_jobs.lora_checks, 2, checkpoints, paths, two_calls, tiny.smallest_call("flux"), out,
                            timeout_s=1200)


@pytest.fixture(scope="module")
def stock_flux(checkpoints, files):
    """Stock single-process FluxPipeline with A, B and the kohya LoRA loaded by `load_lora_weights` (PEFT, unfused)."""
    pipe = resolve(checkpoints["flux"]).adapter.load_stock(resolve(checkpoints["flux"]))
    for name in ("a", "b", "kohya"):
        pipe.load_lora_weights(files[name], adapter_name=name)
    return pipe


def _stock_flux_output(stock_flux, calls, adapters: dict):
    stock_flux.set_adapters(list(adapters), adapter_weights=list(adapters.values()))
    return lora_jobs.outputs(stock_flux.transformer, calls["flux"][:2])


def _diff(x, y) -> float:
    return max((a - b).abs().max().item() for a, b in zip(x, y, strict=True))


# -- every family at TP=2 against stock and a hand merge --------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_on_every_linear_at_tp2_equals_stock_load_lora_weights_and_a_hand_merge(
        tp_report, checkpoints, files, calls, stock_flux, family):
    """Stock diffusers has a LoRA loader for all five (MiniMax-H3: `MiniMaxH3ModularPipeline`), so each is compared
    with it, and with the transformer whose weights got `scale * alpha / rank * B @ A` added by hand."""
    checkpoint = resolve(checkpoints[family])
    transformer = _transformer(checkpoints[family])
    planned = {t.name for t in rules.expand(transformer, families.get(family).plan)}
    targeted = {k.removesuffix(".lora_A.weight") for k in files["state"][family] if k.endswith(".lora_A.weight")}
    assert planned <= targeted, "the LoRA must cover every Linear kind the plan shards"

    if family == "flux":
        stock = _stock_flux_output(stock_flux, calls, {"a": SCALE_A})
        ours, scale = tp_report[0]["a"], SCALE_A
    else:
        pipe = checkpoint.adapter.load_stock(checkpoint)
        pipe.load_lora_weights(files[family], adapter_name="x")
        pipe.set_adapters(["x"], adapter_weights=[SCALE])
        stock = lora_jobs.outputs(pipe.transformer, calls[family][:2])
        ours, scale = tp_report[0][family], SCALE
    lora_files.merge_by_hand(transformer, files["state"][family], scale * ALPHA / RANK)
    merged = lora_jobs.outputs(transformer, calls[family][:2])

    assert _diff(stock, calls[family][2]) > 1000 * TOL, "the LoRA must change the output"
    for report in tp_report:
        assert _diff(report["a"] if family == "flux" else report[family], ours) == 0, "ranks must agree"
    assert _diff(ours, stock) < TOL
    assert _diff(ours, merged) < TOL


@pytest.mark.parametrize("case", ["b", "a+b", "kohya"])
def test_flux_formats_and_sets_at_tp2_equal_stock(tp_report, stock_flux, calls, case):
    adapters = {"b": {"b": 1.0}, "a+b": {"a": SCALE_A, "b": 1.0}, "kohya": {"kohya": 1.0}}[case]
    stock = _stock_flux_output(stock_flux, calls, adapters)
    assert _diff(stock, calls["flux"][2]) > 100 * TOL, "the LoRA must change the output"
    for report in tp_report:
        assert _diff(report[case], stock) < TOL, case


def test_scale_is_respected(tp_report, stock_flux, calls):
    at_one = _stock_flux_output(stock_flux, calls, {"a": 1.0})
    assert _diff(tp_report[0]["a"], at_one) > 1000 * TOL, "scale 0.7 must differ from scale 1"


def test_text_encoder_part_goes_to_the_leader_encoder_as_stock_applies_it(tp_report, stock_flux):
    leader, other = tp_report
    stock_flux.set_adapters(["a"], adapter_weights=[SCALE_A])
    with torch.no_grad():
        stock = stock_flux.encode_prompt(PROMPT, None, device="cpu")
        stock_flux.disable_lora()
        plain = stock_flux.encode_prompt(PROMPT, None, device="cpu")
        stock_flux.enable_lora()
    pooled = leader["embeds_a"]["pooled_prompt_embeds"]
    assert torch.equal(pooled, stock[1])
    assert (pooled - plain[1]).abs().max() > 1000 * TOL, "the text-encoder part must change the pooled embedding"
    assert torch.equal(leader["embeds_a"]["prompt_embeds"], stock[0])  # T5: no LoRA part
    assert other["encoder_adapters_a"] is None and "embeds_a" not in other
    assert list(leader["encoder_adapters_a"]) == ["text_encoder"]
    assert not any(leader["encoder_adapters_none"].values()), "set_loras([]) must remove the text adapters"


# -- switching --------------------------------------------------------------------------------------------------------


def test_switching_equals_fresh_loads_and_none_restores_the_base_bitwise(tp_report):
    for report in tp_report:
        assert _diff(report["b"], report["fresh_b"]) == 0, "B after A must equal B loaded fresh, bit for bit"
        assert report["fresh_none_bitwise"], "set_loras([]) must restore every local weight bit for bit"
        assert _diff(report["none"], report["fresh_none"]) == 0


def test_compiled_switches_reuse_the_graphs(tp_report):
    for report in tp_report:
        compiled, counts = report["compiled"], report["compile"]
        assert counts["graphs_warm"] > 0
        assert counts["new_graphs"] == 0 and counts["new_recompiles"] == 0, counts
        for name, eager in (("none", "none"), ("a", "a"), ("b", "b"), ("none2", "none"), ("a2", "a")):
            assert _diff(compiled[name], report[eager]) < TOL, name


def test_no_rank_materialises_a_full_weight_while_fusing(tp_report, files):
    """While B is fused (to_q, ff.net.2, the packed single-block proj_out), the largest tensor any op allocates is one
    local shard in fp32, below the full ff.net.2 and proj_out weights; the only other buffer is the file's contents."""
    for report in tp_report:
        assert report["largest_op_allocation"] <= report["largest_local_fp32"], report["largest_op_allocation"]
        assert sum(size > report["largest_local_fp32"] for size in report["full_fp32"]) >= 2, report["full_fp32"]
        assert report["largest_other_allocation"] <= os.path.getsize(files["b"] + "/pytorch_lora_weights.safetensors")


def test_failure_while_fusing_on_one_rank_rolls_every_rank_back(tp_report):
    first, second = tp_report
    assert first["fuse_error"] == second["fuse_error"] == (
        "LoRA setup failed on rank 1: RuntimeError: simulated out of memory")
    for report in tp_report:
        assert report["fuse_failure_restored"], "the previous set must be back, bit for bit"


def test_bad_request_on_tp_ranks_same_error_and_previous_set_kept(tp_report, files):
    first, second = tp_report
    assert "transformer_blocks.0.attn.to_qq" in first["bad_error"]
    assert first["bad_error"] == second["bad_error"]
    for report in tp_report:
        assert report["bad_unchanged"] and report["bad_active"] == [files["a"]]


# -- images: CFG parallelism and the job ------------------------------------------------------------------------------


def _stock_image(stock_flux, adapters, **kwargs) -> np.ndarray:
    if adapters:
        stock_flux.set_adapters(list(adapters), adapter_weights=list(adapters.values()))
    else:
        stock_flux.disable_lora()
    with torch.no_grad():
        image = stock_flux(prompt=PROMPT, generator=torch.Generator().manual_seed(0), **tiny.smallest_call("flux"),
                           **kwargs).images[0]
    stock_flux.enable_lora()
    return np.asarray(image, dtype=np.float32) / 255.0


def _assert_image_equals_stock(ours, stock_flux, **kwargs):
    stock, plain = (_stock_image(stock_flux, adapters, **kwargs) for adapters in ({"a": SCALE_A}, {}))
    assert np.abs(ours - stock).mean() < 1 / 255 and np.abs(ours - stock).max() <= 2 / 255
    assert np.abs(plain - stock).mean() > 2 / 255, "the LoRA must change the image"


def test_cfg_parallel_image_equals_stock_with_the_lora(tp_report, stock_flux):
    leader, other = tp_report
    assert other["image_cfg_a"] is None
    _assert_image_equals_stock(leader["image_cfg_a"], stock_flux, negative_prompt=lora_jobs.NEGATIVE,
                               true_cfg_scale=2.0)


def test_job_with_lora_makes_stock_image_and_records_the_lora(tp_report, stock_flux, files):
    job = tp_report[0]["job"]
    assert tp_report[1]["job"] is None
    (name,) = job["pixels"]
    _assert_image_equals_stock(job["pixels"][name].astype(np.float32) / 255.0, stock_flux)
    with open(files["a"], "rb") as handle:
        record = {"source": files["a"], "scale": SCALE_A, "sha256": hashlib.sha256(handle.read()).hexdigest()}
    assert json.loads(job["settings"][name]["loras"]) == [record]
    assert job["summary"]["loras"] == [record]
    assert all(group["fuse LoRAs"] > 0 for group in job["summary"]["phases_per_tp_group"])


# -- bad input, one process -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def plain(checkpoints, files):
    """An unsharded FLUX.1 transformer with LoRA A active (a failed request must keep it)."""
    loras = FusedLoras(_transformer(checkpoints["flux"]), lora_loader(resolve(checkpoints["flux"]).adapter))
    loras.set([(files["a"], SCALE_A)])
    return loras


def _refused(loras, *sources) -> str:
    before = {n: p.detach().clone() for n, p in loras.transformer.named_parameters()}
    active = list(loras.active)
    with pytest.raises(LoraError) as error:
        loras.set(list(sources))
    assert all(torch.equal(before[n], p) for n, p in loras.transformer.named_parameters()), "weights changed"
    assert loras.active == active
    return str(error.value)


def _save(files, name, state) -> str:
    return lora_files.save_peft(files["root"] / name, state)


def test_keys_matching_no_module_are_named(plain, files):
    message = _refused(plain, files["bad_key"])
    assert "transformer_blocks.0.attn.to_qq" in message and "not Linears of this model" in message


def test_lora_for_another_family_is_named(plain, files):
    state = {k: v for k, v in files["state"]["qwenimage"].items() if "img_mod" in k or "img_mlp" in k}
    message = _refused(plain, _save(files, "qwen.safetensors", state))
    assert "transformer_blocks.0.img_mod.1" in message and "'qwenimage' family" in message


def test_shape_mismatch_is_refused(plain, files):
    state = lora_files.factors({"transformer_blocks.0.attn.to_q": torch.nn.Linear(48, 64)}, 4, 7)
    message = _refused(plain, _save(files, "shape.safetensors", state))
    assert "is a Linear 64 -> 64" in message and "48 -> 64" in message


def test_rank_mismatch_is_refused(plain, files):
    state = lora_files.factors({"transformer_blocks.0.attn.to_q": torch.nn.Linear(64, 64)}, 4, 8)
    state["transformer_blocks.0.attn.to_q.lora_B.weight"] = torch.randn(64, 8)
    message = _refused(plain, _save(files, "rank.safetensors", state))
    assert "not [rank, in] and [out, rank] of one rank" in message


@pytest.mark.parametrize("kind", ["pickle", "text"])
def test_file_that_is_not_safetensors_is_refused(plain, files, kind):
    path = files["root"] / f"{kind}.safetensors"
    if kind == "pickle":
        torch.save(lora_files.factors({"x_embedder": torch.nn.Linear(16, 64)}, 4, 9), path)
    else:
        path.write_text("not a tensor file")
    assert "is not a safetensors file" in _refused(plain, str(path))


def test_unsupported_adapter_kinds_are_refused(plain, files):
    state = lora_files.factors({"x_embedder": torch.nn.Linear(16, 64)}, 4, 10)
    state["x_embedder.lora_B.bias"] = torch.zeros(64)
    assert "not LoRA factors" in _refused(plain, _save(files, "bias.safetensors", state))


def test_missing_path_ambiguous_folder_and_bad_scale_are_refused(plain, files):
    assert "neither a file, a folder nor a Hub id" in _refused(plain, str(files["root"] / "nope.safetensors"))
    folder = files["root"] / "two"
    folder.mkdir()
    for name in ("x.safetensors", "y.safetensors"):
        shutil.copy(files["a"], folder / name)
    assert "exactly one .safetensors" in _refused(plain, str(folder))
    assert "the scale must be a number" in _refused(plain, (files["b"], "0.5"))


def test_a_set_of_good_and_bad_is_refused_whole(plain, files):
    assert "to_qq" in _refused(plain, files["b"], files["bad_key"]) and plain.active[0].scale == SCALE_A


def test_load_pipeline_refuses_a_bad_lora_before_starting_anything(checkpoints, files, monkeypatch):
    from neuron_diffusers import runner

    def too_late(*args, **kwargs):
        raise AssertionError("the LoRA must be refused before the process group starts and any weight is read")

    monkeypatch.setattr(runner, "init_distributed", too_late)
    with pytest.raises(LoraError, match="to_qq"):
        runner.load_pipeline(checkpoints["flux"], loras=[files["bad_key"]])


def test_job_refuses_bad_loras_and_per_line_loras_before_anything_runs(tmp_path, capsys, checkpoints, files):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a fox", "lora": files["b"]}) + "\n")
    for args, message in (
        (["--prompt", "a fox", "--lora", f"{files['root']}/missing.safetensors:0.5"], "neither a file, a folder"),
        (["--prompt", "a fox", "--lora", files["bad_key"]], "transformer_blocks.0.attn.to_qq"),
        (["--prompts", str(prompts)], "p.jsonl, line 1: LoRAs cannot change per line"),
    ):
        assert main(["generate", "--model", checkpoints["flux"], "--out", str(tmp_path / "out"), *args]) == 2
        assert message in capsys.readouterr().err
        assert not (tmp_path / "out").exists()


def test_lora_option_parsing():
    assert parse_lora_option("style.safetensors:0.8") == LoraSpec("style.safetensors", 0.8)
    assert parse_lora_option("C:/loras/x.safetensors") == LoraSpec("C:/loras/x.safetensors", 1.0)
    assert parse_lora_option("owner/name:1e-1") == LoraSpec("owner/name", 0.1)
    assert LoraSpec.of(("x", 2)) == LoraSpec("x", 2.0)


def test_a_read_file_is_reused_until_it_changes(checkpoints, files, monkeypatch):
    loader = lora_loader(resolve(checkpoints["flux"]).adapter)
    loras = FusedLoras(_transformer(checkpoints["flux"]), loader)
    loras.set([(files["kohya"], 1.0)])
    fused = {n: p.detach().clone() for n, p in loras.transformer.named_parameters()}
    loras.set([])
    reads = []
    real = loader.lora_state_dict.__func__
    monkeypatch.setattr(loader, "lora_state_dict",
                        classmethod(lambda cls, *a, **k: reads.append(a) or real(cls, *a, **k)))
    loras.set([(files["kohya"], 1.0)])
    assert reads == [] and all(torch.equal(fused[n], p) for n, p in loras.transformer.named_parameters())
    os.utime(files["kohya"], ns=(0, 0))  # a changed file is read again
    loras.set([(files["kohya"], 0.5)])
    assert len(reads) == 1


def test_bf16_fuses_with_one_rounding_and_restores_bitwise(checkpoints, files):
    """In bf16 (what accelerators run) a fused weight is `(W + sum of deltas in fp32)` rounded once, and switching back
    to no LoRA gives the loaded weights bit for bit (subtracting the delta again would not)."""
    transformer = _transformer(checkpoints["flux"]).to(torch.bfloat16)
    base = {n: p.detach().clone() for n, p in transformer.named_parameters()}
    loras = FusedLoras(transformer, lora_loader(resolve(checkpoints["flux"]).adapter))
    loras.set([(files["a"], SCALE_A), (files["b"], 1.0)])
    loras.set([(files["a"], SCALE_A)])
    expected = {n: w.float() for n, w in base.items()}
    for name, weight in expected.items():
        key = name.removesuffix(".weight") + ".lora_A.weight"
        if key in files["state"]["flux"]:
            a, b = files["state"]["flux"][key], files["state"]["flux"][key.replace("lora_A", "lora_B")]
            weight.addmm_(b, a, alpha=SCALE_A * ALPHA / RANK)
    assert all(torch.equal(p, expected[n].to(torch.bfloat16)) for n, p in transformer.named_parameters())
    loras.set([])
    assert all(torch.equal(p, base[n]) for n, p in transformer.named_parameters())
