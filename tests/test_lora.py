"""LoRAs fused into each rank's shard of a tensor-parallel transformer (tiny models, fp32): stock's output for all five
families, switching in place without recompiles, exact restore, CFG parallelism, the job, and every bad request
refused before any weight changes.

The TP checks run on the session's gloo rank pool (`rank_pool`), one job per family, one for FLUX.1's switching and
one for the images, each case recorded on its own (`rank_cases`); the references run in this process: stock
`load_lora_weights` + `set_adapters` on the single-process pipeline (PEFT adapters, unfused), and the LoRA merged into
the weights by hand. Every comparison with stock holds its control: the same LoRA at another scale moves stock's
output by more than the tolerance.
"""

import hashlib
import json
import os
import shutil

import lora_files
import lora_jobs
import pytest
import torch
from rank_cases import case
from safetensors.torch import save_file
from test_runner import LATENT_TOLERANCE, max_diff, png_difference, png_matches, stock_latents

from neuron_diffusers import families, tiny
from neuron_diffusers.checkpoint import resolve
from neuron_diffusers.cli import main
from neuron_diffusers.parallel import rules
from neuron_diffusers.parallel.lora import FusedLoras, LoraError, LoraSpec, lora_loader, parse_lora_option
from neuron_diffusers.tools.plan.cases import PROMPT, reference_call

FAMILIES = ("flux", *lora_jobs.OTHER_FAMILIES)
RANK, ALPHA, SCALE = 4, 8.0, 0.6  # every family's LoRA over all Linears (FLUX.1's "A": network alphas, a CLIP part)
SCALE_A = 0.7
OTHER_SCALE = 1.0  # the controls: the same LoRA at another scale
#: Transformer outputs are O(1); TP=2 and one process differ by reduction order only (float32 eps 1.2e-7 times the
#: few hundred terms a sharded matmul or all-reduce sums in another order).
TOL = 2e-5
#: Float images in [0, 1] after two steps and the VAE: the same rounding, one order of magnitude of headroom more.
IMAGE_TOL = 1e-4


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


def _paths(files) -> dict:
    return {k: v for k, v in files.items() if k not in ("root", "state")}


@pytest.fixture(scope="module")
def family_reports(checkpoints, files, calls, rank_pool):
    """`family_reports(family)` → both ranks' cases of that family's TP=2 job with its LoRA (run on first use)."""
    made = {}

    def get(family):
        if family not in made:
            made[family] = rank_pool.run(lora_jobs.lora_family_check, 2, checkpoints[family], files[family], SCALE,
                                         calls[family][:2], timeout_s=600)
        return made[family]

    return get


@pytest.fixture(scope="module")
def flux_reports(checkpoints, files, calls, rank_pool):
    """Both ranks' cases of FLUX.1's TP=2 job: A, its text part, switching, restore, refusals, compiled."""
    return rank_pool.run(lora_jobs.lora_flux_checks, 2, checkpoints["flux"], _paths(files), calls["flux"][:2],
                         timeout_s=900)


@pytest.fixture(scope="module")
def job_out(tmp_path_factory):
    return tmp_path_factory.mktemp("job") / "out"


@pytest.fixture(scope="module")
def image_reports(checkpoints, files, rank_pool, job_out, tmp_path_factory):
    """Both ranks' cases of the image job: CFG parallelism's float image, the `generate --lora` job, and the job's
    configuration (planned from the same arguments) as latents."""
    call = tiny.smallest_call("flux")
    argv = ["--model", checkpoints["flux"], "--prompt", PROMPT, "--tp", "2", "--lora", f"{files['a']}:{SCALE_A}",
            *(f"--{k}={v}" for k, v in (("height", call["height"]), ("width", call["width"]),
                                        ("steps", call["num_inference_steps"])))]
    latents_out = str(tmp_path_factory.mktemp("job-latents") / "out")
    return rank_pool.run(lora_jobs.lora_image_checks, 2, checkpoints["flux"], _paths(files), call,
                         [*argv, "--out", str(job_out)], [*argv, "--out", latents_out], timeout_s=900)


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


@pytest.fixture(scope="module")
def stock_outputs(checkpoints, files, calls, stock_flux):
    """`stock_outputs(family)` → the stock single-process transformer's outputs on the family's first call with its
    LoRA at its scale ("lora") and at `OTHER_SCALE` ("other_scale")."""
    made = {}

    def get(family):
        if family not in made:
            if family == "flux":
                made[family] = {"lora": _stock_flux_output(stock_flux, calls, {"a": SCALE_A}),
                                "other_scale": _stock_flux_output(stock_flux, calls, {"a": OTHER_SCALE})}
            else:
                checkpoint = resolve(checkpoints[family])
                pipe = checkpoint.adapter.load_stock(checkpoint)
                pipe.load_lora_weights(files[family], adapter_name="x")
                made[family] = {}
                for name, scale in (("lora", SCALE), ("other_scale", OTHER_SCALE)):
                    pipe.set_adapters(["x"], adapter_weights=[scale])
                    made[family][name] = lora_jobs.outputs(pipe.transformer, calls[family][:2])
        return made[family]

    return get


def _diff(x, y) -> float:
    return max((a - b).abs().max().item() for a, b in zip(x, y, strict=True))


def _ours(family_reports, flux_reports, family) -> list:
    """Both ranks' TP=2 outputs with the family's LoRA (FLUX.1: A at `SCALE_A`)."""
    return case(flux_reports, "a") if family == "flux" else case(family_reports(family), "outputs")


def _assert_blind_check_would_fail(stock: dict, what: str, tol: float = TOL):
    moved = _diff(stock["other_scale"], stock["lora"])
    assert moved > tol, f"{what}: another scale moves stock's output by only {moved:.1e}: the check is blind"


# -- every family at TP=2 against stock and a hand merge --------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_covers_every_linear_kind_the_plan_shards(checkpoints, files, family):
    planned = {t.name for t in rules.expand(_transformer(checkpoints[family]), families.get(family).plan)}
    targeted = {k.removesuffix(".lora_A.weight") for k in files["state"][family] if k.endswith(".lora_A.weight")}
    assert planned <= targeted, f"the LoRA must cover every Linear kind the plan shards: {planned - targeted}"


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_on_every_linear_at_tp2_equals_stock_load_lora_weights(family_reports, flux_reports, stock_outputs,
                                                                    calls, family):
    """Stock diffusers has a LoRA loader for all five (MiniMax-H3: `MiniMaxH3ModularPipeline`); the LoRA moves the
    output (against no LoRA) and so does another scale: both controls exceed the tolerance."""
    stock = stock_outputs(family)
    assert _diff(stock["lora"], calls[family][2]) > 1000 * TOL, "the LoRA must change the output"
    _assert_blind_check_would_fail(stock, family)
    difference = _diff(_ours(family_reports, flux_reports, family)[0], stock["lora"])
    assert difference < TOL, f"{family}: differs from stock by {difference:.1e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_on_every_linear_at_tp2_equals_a_hand_merge(family_reports, flux_reports, stock_outputs, checkpoints,
                                                         files, calls, family):
    """The transformer whose weights got `scale * alpha / rank * B @ A` added by hand gives the same output."""
    transformer = _transformer(checkpoints[family])
    scale = SCALE_A if family == "flux" else SCALE
    lora_files.merge_by_hand(transformer, files["state"][family], scale * ALPHA / RANK)
    merged = lora_jobs.outputs(transformer, calls[family][:2])
    _assert_blind_check_would_fail(stock_outputs(family), family)
    difference = _diff(_ours(family_reports, flux_reports, family)[0], merged)
    assert difference < TOL, f"{family}: differs from the hand merge by {difference:.1e}"


@pytest.mark.parametrize("family", FAMILIES)
def test_lora_ranks_agree_bitwise(family_reports, flux_reports, family):
    leader, other = _ours(family_reports, flux_reports, family)
    assert _diff(leader, other) == 0, "ranks must agree"


FORMATS = {"b": ({"b": 1.0}, {"b": 0.5}), "a+b": ({"a": SCALE_A, "b": 1.0}, {"a": SCALE_A, "b": 0.5}),
           "kohya": ({"kohya": 1.0}, {"kohya": 0.5})}


@pytest.mark.parametrize("name", list(FORMATS))
def test_flux_formats_and_sets_at_tp2_equal_stock(flux_reports, stock_flux, calls, name):
    adapters, other_scale = FORMATS[name]
    stock = _stock_flux_output(stock_flux, calls, adapters)
    assert _diff(stock, calls["flux"][2]) > 100 * TOL, "the LoRA must change the output"
    _assert_blind_check_would_fail({"lora": stock, "other_scale": _stock_flux_output(stock_flux, calls, other_scale)},
                                   name)
    for rank, ours in enumerate(case(flux_reports, name)):
        assert _diff(ours, stock) < TOL, f"{name} on rank {rank}: {_diff(ours, stock):.1e}"


def test_scale_is_respected(flux_reports, stock_outputs):
    assert _diff(case(flux_reports, "a")[0], stock_outputs("flux")["other_scale"]) > 1000 * TOL, \
        "scale 0.7 must differ from scale 1"


def _stock_embeds(stock_flux):
    stock_flux.set_adapters(["a"], adapter_weights=[SCALE_A])
    with torch.no_grad():
        stock = stock_flux.encode_prompt(PROMPT, None, device="cpu")
        stock_flux.disable_lora()
        plain = stock_flux.encode_prompt(PROMPT, None, device="cpu")
        stock_flux.enable_lora()
    return stock, plain


def test_text_encoder_part_gives_the_leader_stock_embeddings(flux_reports, stock_flux):
    """The leader's embeddings with A's CLIP part: pooled bitwise equal to stock's, which the part moves (control);
    T5 has no LoRA part, its embeddings equal stock's too."""
    embeds = case(flux_reports, "encoder")[0]["embeds"]
    stock, plain = _stock_embeds(stock_flux)
    pooled = embeds["pooled_prompt_embeds"]
    assert (stock[1] - plain[1]).abs().max() > 1000 * TOL, "the text-encoder part must change the pooled embedding"
    assert torch.equal(pooled, stock[1]) and torch.equal(embeds["prompt_embeds"], stock[0])


def test_text_encoder_part_goes_to_the_leader_only(flux_reports):
    leader, other = case(flux_reports, "encoder")
    assert other == {"adapters": None, "embeds": None} and list(leader["adapters"]) == ["text_encoder"]


def test_no_lora_removes_the_text_adapters(flux_reports):
    leader, _ = case(flux_reports, "encoder_none")
    assert not any(leader.values()), "set_loras([]) must remove the text adapters"


# -- switching --------------------------------------------------------------------------------------------------------


def test_switching_a_to_b_equals_b_loaded_fresh_bitwise(flux_reports):
    for b, fresh in zip(case(flux_reports, "b"), case(flux_reports, "fresh"), strict=True):
        assert _diff(b, fresh["b"]) == 0, "B after A must equal B loaded fresh, bit for bit"


def test_no_lora_restores_every_local_weight_bitwise(flux_reports):
    for fresh in case(flux_reports, "fresh"):
        assert fresh["none_bitwise"], "set_loras([]) must restore every local weight bit for bit"


def test_no_lora_outputs_equal_a_fresh_load(flux_reports):
    for none, fresh in zip(case(flux_reports, "none"), case(flux_reports, "fresh"), strict=True):
        assert _diff(none, fresh["none"]) == 0


def test_compiled_switches_reuse_the_graphs(flux_reports):
    for compiled in case(flux_reports, "compiled"):
        assert compiled["graphs_warm"] > 0
        assert compiled["new_graphs"] == 0 and compiled["new_recompiles"] == 0, compiled


def test_compiled_switches_equal_eager(flux_reports):
    eager = {name: case(flux_reports, name) for name in ("none", "a", "b")}
    for rank, compiled in enumerate(case(flux_reports, "compiled")):
        for name, reference in (("none", "none"), ("a", "a"), ("b", "b"), ("none2", "none"), ("a2", "a")):
            assert _diff(compiled["outputs"][name], eager[reference][rank]) < TOL, name


def test_no_rank_materialises_a_full_weight_while_fusing(flux_reports, files):
    """While B is fused (to_q, ff.net.2, the packed single-block proj_out), the largest tensor any op allocates is one
    local shard in fp32, below the full ff.net.2 and proj_out weights; the only other buffer is the file's contents."""
    for report in case(flux_reports, "fuse_memory"):
        assert report["largest_op_allocation"] <= report["largest_local_fp32"], report["largest_op_allocation"]
        assert sum(size > report["largest_local_fp32"] for size in report["full_fp32"]) >= 2, report["full_fp32"]
        assert report["largest_other_allocation"] <= os.path.getsize(files["b"] + "/pytorch_lora_weights.safetensors")


def test_failure_while_fusing_on_one_rank_raises_the_same_error_on_every_rank(flux_reports):
    first, second = case(flux_reports, "fuse_failure")
    assert first["error"] == second["error"] == "LoRA setup failed on rank 1: RuntimeError: simulated out of memory"


def test_failure_while_fusing_on_one_rank_rolls_every_rank_back(flux_reports):
    for report in case(flux_reports, "fuse_failure"):
        assert report["restored"], "the previous set must be back, bit for bit"


def test_bad_request_on_tp_ranks_raises_the_same_error(flux_reports):
    first, second = case(flux_reports, "bad")
    assert "transformer_blocks.0.attn.to_qq" in first["error"] and first["error"] == second["error"]


def test_bad_request_on_tp_ranks_keeps_the_previous_set(flux_reports, files):
    for report in case(flux_reports, "bad"):
        assert report["unchanged"] and report["active"] == [files["a"]]


# -- images: CFG parallelism and the job ------------------------------------------------------------------------------


def _stock_image(stock_flux, adapters, **kwargs):
    """Stock's image with `adapters` (none: LoRAs disabled), as the pipeline returns it for `kwargs`."""
    if adapters:
        stock_flux.set_adapters(list(adapters), adapter_weights=list(adapters.values()))
    else:
        stock_flux.disable_lora()
    with torch.no_grad():
        image = stock_flux(prompt=PROMPT, generator=torch.Generator().manual_seed(0), **tiny.smallest_call("flux"),
                           **kwargs).images[0]
    stock_flux.enable_lora()
    return image


def test_cfg_parallel_float_image_equals_stock_with_the_lora(image_reports, stock_flux):
    """cfg=2 with A: the float image within `IMAGE_TOL` of stock's, which A at another scale, and no LoRA, move by
    more (the controls)."""
    kwargs = {"negative_prompt": lora_jobs.NEGATIVE, "true_cfg_scale": 2.0, "output_type": "np"}
    stock, other_scale, plain = (_stock_image(stock_flux, adapters, **kwargs)
                                 for adapters in ({"a": SCALE_A}, {"a": OTHER_SCALE}, {}))
    assert max_diff(plain, stock) > IMAGE_TOL, "the LoRA must change the image"
    assert max_diff(other_scale, stock) > IMAGE_TOL, "blind: another scale must change the image"
    ours, other = case(image_reports, "cfg_image")
    assert other is None and max_diff(ours, stock) < IMAGE_TOL, max_diff(ours, stock)


def test_job_png_equals_stock_with_the_lora(image_reports, stock_flux):
    """The job's PNG within one level per value (at most 0.5% differing) of stock's 8-bit image with A; stock's with
    A at another scale falls outside that bar (the control)."""
    job, other = case(image_reports, "job")
    assert other is None
    (pixels,) = job["pixels"].values()
    stock, other_scale = (_stock_image(stock_flux, adapters) for adapters in ({"a": SCALE_A}, {"a": OTHER_SCALE}))
    assert not png_matches(other_scale, stock), f"blind: another scale {png_difference(other_scale, stock)}"
    assert png_matches(pixels, stock), f"{png_difference(pixels, stock)} (levels, fraction differing)"


def test_job_configuration_gives_stock_latents_with_the_lora(image_reports, stock_flux):
    """The job's request, planned from the same arguments and made through `load_pipeline`, at latent level; A at
    another scale moves stock's latents by more than the tolerance."""
    (made,), other = case(image_reports, "job_latents")
    assert other == []
    stock_flux.set_adapters(["a"], adapter_weights=[OTHER_SCALE])
    other_scale = stock_latents(stock_flux, made)
    stock_flux.set_adapters(["a"], adapter_weights=[SCALE_A])
    stock = stock_latents(stock_flux, made)
    assert max_diff(other_scale, stock) > LATENT_TOLERANCE, "blind: another scale must move the latents"
    assert max_diff(made["latents"], stock) < LATENT_TOLERANCE, max_diff(made["latents"], stock)


def test_job_records_the_lora(image_reports, files):
    job = case(image_reports, "job")[0]
    (name,) = job["pixels"]
    with open(files["a"], "rb") as handle:
        record = {"source": files["a"], "scale": SCALE_A, "sha256": hashlib.sha256(handle.read()).hexdigest()}
    assert json.loads(job["settings"][name]["loras"]) == [record] and job["summary"]["loras"] == [record]
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
