"""Step caching under parallelism: diffusers' cache hooks with every skip decision shared by the group.

One spawn (2 gloo ranks) runs every parallel case, at TP=2 and as one CFG pair (cfg=2, tp=1) with true CFG, plus the
`generate` job; the stock single-process references run in this process, with stock `enable_cache` (FLUX.1,
Qwen-Image) or the same `GroupCache` alone (Qwen-Image-2.1, MiniMax-H3, FLUX.2, which stock cannot cache). "Same
decisions" is checked step by step, the outputs to 1e-4 (float32; measured: within 1e-6 of stock, while the cache
itself moves the tiny FLUX.1 image by about 1e-2).
"""

import json
from types import SimpleNamespace

import cache_jobs
import numpy as np
import pytest
import torch

from neuron_diffusers.checkpoint import resolve
from neuron_diffusers.cli import main as cli_main
from neuron_diffusers.parallel.cache import check_cache, check_cache_config, enable_group_cache, parse_cache_spec
from neuron_diffusers.tools.spawn import run_on_cpu_ranks

FAMILIES = ("flux", "flux2", "qwenimage", "qwenimage21", "h3")
TOLERANCE = 1e-4
#: A module inside what each cache skips: did this forward compute the skipped part?
PROBES = {("flux", "first-block"): "single_transformer_blocks.1.norm",
          ("qwenimage", "first-block"): "transformer_blocks.1.img_mod",
          ("flux", "taylorseer"): "single_transformer_blocks.1.attn.to_q"}


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint):
    return {family: tiny_checkpoint(family) for family in FAMILIES}


@pytest.fixture(scope="module")
def job_out(tmp_path_factory):
    return tmp_path_factory.mktemp("cache-job") / "out"


@pytest.fixture(scope="module")
def report(checkpoints, job_out):
    argv = ["--model", str(checkpoints["flux"]), "--prompt", cache_jobs.PROMPT, "--out", str(job_out),
            "--negative-prompt", cache_jobs.NEGATIVE, "--true-cfg-scale", "4", "--cfg-parallel", "--height", "32",
            "--width", "32", "--steps", str(cache_jobs.STEPS), "--cache", f"first-block:{cache_jobs.THRESHOLD}"]
    return run_on_cpu_ranks(cache_jobs.cache_checks, 2, checkpoints, argv, timeout_s=1200)


@pytest.fixture(scope="module")
def stock_pipes(checkpoints):
    """Stock pipelines in this process, loaded once per family."""
    from diffusers import DiffusionPipeline

    pipes = {}

    def get(family):
        if family not in pipes:
            checkpoint = resolve(checkpoints[family])
            pipes[family] = (checkpoint.adapter.load_stock(checkpoint) if family == "h3"
                             else DiffusionPipeline.from_pretrained(checkpoints[family]))
        return pipes[family]

    return get


def _call(pipe, family, **kwargs):
    call = {**cache_jobs.call_of(family), **kwargs}
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        if family == "h3":
            out = pipe(prompt=cache_jobs.PROMPT, generator=generator, output=["videos", "audio"], output_type="pt",
                       **call)
            return {"frames": out["videos"][0].numpy(), "audio": out["audio"][0].numpy()}
        return {"image": pipe(prompt=cache_jobs.PROMPT, generator=generator, **call).images[0]}


def stock_cached(pipe, family, name, **kwargs):
    """Stock `enable_cache` alone: the output and, per transformer forward in call order, whether it computed the
    part the cache skips (the probe module ran)."""
    transformer = pipe.transformer
    transformer.enable_cache(cache_jobs.config_of(name))
    ran = []
    handles = [transformer.register_forward_pre_hook(lambda *_: ran.append(False)),
               transformer.get_submodule(PROBES[family, name]).register_forward_pre_hook(
                   lambda *_: ran.__setitem__(-1, True))]
    try:
        return _call(pipe, family, **kwargs), ran
    finally:
        for handle in handles:
            handle.remove()
        transformer.disable_cache()


def _assert_close(output, expected, what):
    assert output.keys() == expected.keys()
    for name in expected:
        assert output[name].shape == expected[name].shape, what
        difference = np.abs(output[name] - expected[name]).max()
        assert difference < TOLERANCE, f"{what}: {name} differs by {difference:.2e}"


def _shared(rank, context=None):
    return [shared for ctx, _, shared in rank["decisions"] if context is None or ctx == context]


@pytest.mark.parametrize("family, name", list(PROBES))
def test_tp2_cached_image_equals_stock_with_the_same_decisions(report, stock_pipes, family, name):
    expected, ran = stock_cached(stock_pipes(family), family, name)
    leader, other = (rank[f"tp2 {family} {name}"] for rank in report)
    assert other["output"] is None
    _assert_close(leader["output"], expected, f"{family} {name}")
    assert 0 < sum(ran) < len(ran), f"the cache must skip some forwards and compute others: {ran}"
    assert leader["decisions"] == other["decisions"]
    for rank in (leader, other):
        assert rank["counts"]["computed"] == sum(ran) and rank["counts"]["cached"] == len(ran) - sum(ran)
        if name == "first-block":  # one decision per forward
            assert _shared(rank) == ran


@pytest.mark.parametrize("family, name", list(PROBES))
def test_cfg_pair_cached_image_equals_stock_true_cfg(report, stock_pipes, family, name):
    """Each rank computes one guidance branch under its own context, with the stock branch's decisions."""
    expected, ran = stock_cached(stock_pipes(family), family, name, **cache_jobs.TRUE_CFG)
    cond, uncond = (rank[f"cfg2 {family} {name}"] for rank in report)
    _assert_close(cond["output"], expected, f"{family} {name} true CFG")
    assert uncond["output"] is None
    assert {c for c, _, _ in cond["decisions"]} == {"cond"} and {c for c, _, _ in uncond["decisions"]} == {"uncond"}
    if name == "first-block":
        assert _shared(cond) == ran[0::2] and _shared(uncond) == ran[1::2]
    assert cond["counts"] == uncond["counts"]  # the image's forwards, both branches, on both ranks
    assert cond["counts"]["computed"] == sum(ran) and cond["counts"]["cached"] == len(ran) - sum(ran) > 0
    assert set(cond["counts"]["by_context"]) == {"cond", "uncond"}


@pytest.mark.parametrize("family", list(cache_jobs.ALONE_CASES))
def test_tp2_caches_families_stock_cannot(report, stock_pipes, family):
    """Qwen-Image-2.1 and MiniMax-H3 blocks get metadata here, FLUX.2's and H3's pipelines a cache context: TP=2
    equals the same cache in one process."""
    pipe = stock_pipes(family)
    cache = enable_group_cache(pipe.transformer, cache_jobs.config_of(cache_jobs.ALONE_CASES[family]))
    try:
        with cache.pipeline_call():
            expected = _call(pipe, family)
        decisions = [d.shared for d in cache.decisions]
    finally:
        cache.remove()
    leader, other = (rank[f"tp2 {family} {cache_jobs.ALONE_CASES[family]}"] for rank in report)
    _assert_close(leader["output"], expected, family)
    assert _shared(leader) == _shared(other) == decisions
    assert 0 < sum(decisions) < len(decisions), decisions


def test_one_ranks_perturbed_residual_cannot_split_the_group(report):
    """Threshold aimed at step 1's metric; rank 1's residual nudged by 1e-6: its own decision flips, the group's
    does not (without the vote the ranks would take different branches, and TP hangs in a block's collective)."""
    rank0, rank1 = (rank["perturbation"] for rank in report)
    assert rank0["threshold"] == rank1["threshold"] == rank0["metrics"][1]
    local0 = [local for _, local, _ in rank0["decisions"]]
    local1 = [local for _, local, _ in rank1["decisions"]]
    assert local0[1] is False and local1[1] is True
    assert _shared(rank0) == _shared(rank1) and _shared(rank0)[1] is True  # compute if any rank would
    assert np.isfinite(rank0["output"]["image"]).all()  # and the group's latents agreed at the last step


def test_compiled_blocks_with_the_cache_do_not_recompile(report):
    for rank in report:
        result = rank["compiled"]
        assert result["graph_breaks"] == 0
        assert result["graphs_after_warmup"] == 2  # FLUX.1: the double- and the single-stream block
        assert result["new_graphs"] == 0 and result["new_recompiles"] == 0, result
        for compiled in result["compiled"]:
            assert compiled["decisions"] == result["eager"]["decisions"]
            assert compiled["counts"]["cached"] > 0
    leader = report[0]["compiled"]
    for compiled in leader["compiled"]:
        _assert_close(compiled["output"], leader["eager"]["output"], "compiled vs eager")


def test_job_reports_forwards_computed_and_cached(report, job_out, capsys):
    from neuron_diffusers.job import format_phases

    job = report[0]["job"]
    summary = job["summary"]
    (image,) = summary["images"]
    counts = image["cache"]
    assert counts["computed"] + counts["cached"] == 2 * cache_jobs.STEPS and counts["cached"] > 0
    assert set(counts["by_context"]) == {"cond", "uncond"} and image["cfg_parallel"]
    groups = summary["phases_per_tp_group"]  # each group's own branch
    assert sum(g["transformer forwards computed"] for g in groups) == counts["computed"]
    assert sum(g["transformer forwards from cache"] for g in groups) == counts["cached"]
    assert json.loads((job_out / "summary.json").read_text())["images"][0]["cache"] == counts
    assert f"| transformer forwards from cache | {groups[0]['transformer forwards from cache']} |" in \
        format_phases(summary)
    assert job["settings"][image["file"]]["cache"] == f"first-block:{cache_jobs.THRESHOLD}"


# -- in this process: checks before any weight is read, refusals -------------------------------------------------


@pytest.mark.parametrize("config, error", [
    ("SeaCacheConfig", "whole default process group"),
    ("PyramidAttentionBroadcastConfig", "timestep callback"),
    ("dict", "takes a diffusers cache config"),
])
def test_unsupported_caches_are_refused_with_the_reason(config, error):
    import diffusers

    with pytest.raises(ValueError, match=error):
        check_cache_config({} if config == "dict" else getattr(diffusers, config)())


def test_cli_specs_become_diffusers_configs_or_clear_errors():
    from diffusers import FirstBlockCacheConfig, MagCacheConfig, TaylorSeerCacheConfig

    assert parse_cache_spec("first-block:0.08") == FirstBlockCacheConfig(threshold=0.08)
    config = parse_cache_spec("taylorseer:cache_interval=4,max_order=2,use_lite_mode=true")
    assert isinstance(config, TaylorSeerCacheConfig)
    assert (config.cache_interval, config.max_order, config.use_lite_mode) == (4, 2, True)
    config = parse_cache_spec("mag:threshold=0.1,mag_ratios=flux", steps=28)
    assert isinstance(config, MagCacheConfig) and (config.threshold, len(config.mag_ratios)) == (0.1, 28)
    for spec, error in (("teacache:0.1", "unknown cache 'teacache'"), ("taylorseer:4", "KEY=VALUE"),
                        ("first-block:-2", "finite number >= 0"), ("taylorseer:cache_interval=0", "integer >= 1"),
                        ("taylorseer:nope=1", "unexpected keyword"),
                        ("mag:threshold=0.1", "mag_ratios` must be provided")):
        with pytest.raises(ValueError, match=error):
            parse_cache_spec(spec)


@pytest.mark.parametrize("family, argv, error", [
    ("flux", ["--cache", "teacache:0.1"], "unknown cache"),
    ("flux2", ["--cache", "first-block:0.1"], "returns the text and image streams apart"),
    ("flux", ["--cache", "taylorseer:cache_interval=2", "--compile", "aot_eager"], "inside the blocks being compiled"),
])
def test_bad_cache_requests_fail_before_any_weight_is_read(checkpoints, tmp_path, capsys, family, argv, error):
    """`plan_job` parses the spec and tries the cache on the meta-device transformer: no process group, no weight."""
    out = tmp_path / "out"
    status = cli_main(["generate", "--model", str(checkpoints[family]), "--prompt", "a fox", "--out", str(out), *argv])
    assert status == 2 and error in capsys.readouterr().err
    assert not out.exists()


def test_lite_taylorseer_compiles_and_a_failed_enable_leaves_the_model_as_it_was(checkpoints):
    from diffusers import TaylorSeerCacheConfig
    from diffusers.hooks import HookRegistry

    meta = resolve(checkpoints["flux"]).meta("transformer")
    check_cache(TaylorSeerCacheConfig(use_lite_mode=True), meta, list(meta._repeated_blocks))  # whole blocks
    with pytest.raises(ValueError, match="matched no module"):
        enable_group_cache(meta, TaylorSeerCacheConfig(cache_identifiers=["no_such_module"]))
    assert not meta.is_cache_enabled and not hasattr(meta, "_nd_group_cache")
    assert not HookRegistry.check_if_exists_or_initialize(meta).hooks  # no cache hook, no counting hook


def test_compare_reports_psnr_and_ssim(tmp_path, capsys):
    """`compare` on two image folders: scikit-image's PSNR checked against its definition; identical is infinite."""
    from PIL import Image

    from neuron_diffusers.tools.compare import compare_paths
    from neuron_diffusers.tools.compare import main as compare_main

    rng = np.random.default_rng(0)
    reference = rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)
    candidate = np.clip(reference.astype(int) + rng.integers(-8, 9, reference.shape), 0, 255).astype(np.uint8)
    for folder, pixels in (("plain", reference), ("cached", candidate)):
        (tmp_path / folder).mkdir()
        Image.fromarray(pixels).save(tmp_path / folder / "00000-a-fox.png")
    compare_main(SimpleNamespace(reference=tmp_path / "plain", candidate=tmp_path / "cached", json=False))
    assert "| mean |" in capsys.readouterr().out
    metric = compare_paths(tmp_path / "plain", tmp_path / "cached")["pairs"]["00000-a-fox.png"]
    mse = ((reference.astype(float) - candidate) ** 2).mean()
    assert metric["psnr"] == pytest.approx(10 * np.log10(255 ** 2 / mse), rel=1e-9) and 0 < metric["ssim"] < 1
    same = compare_paths(tmp_path / "plain" / "00000-a-fox.png", tmp_path / "plain" / "00000-a-fox.png")
    assert same["pairs"]["00000-a-fox.png"] == {"psnr": float("inf"), "ssim": 1.0}


def test_compare_explains_a_size_mismatch_and_missing_scikit_image(tmp_path, capsys, monkeypatch):
    import sys

    from PIL import Image

    Image.new("RGB", (32, 32)).save(tmp_path / "a.png")
    Image.new("RGB", (16, 16)).save(tmp_path / "b.png")
    assert cli_main(["compare", str(tmp_path / "a.png"), str(tmp_path / "b.png")]) == 2
    assert "same height and width" in capsys.readouterr().err
    monkeypatch.setitem(sys.modules, "skimage.metrics", None)
    assert cli_main(["compare", str(tmp_path / "a.png"), str(tmp_path / "a.png")]) == 2
    assert "pip install 'neuron-diffusers[quality]'" in capsys.readouterr().err


def test_block_metadata_comes_from_the_family_files():
    """Each family's `CACHE_BLOCK_METADATA` reaches the cache through the registry; the old name still reads it."""
    import warnings

    from diffusers.models.transformers.transformer_qwenimage21 import QwenImage21TransformerBlock

    from neuron_diffusers.parallel import cache
    from neuron_diffusers.parallel.blocks import cache_metadata_for
    from neuron_diffusers.tools.plan.meta import meta_transformer

    assert cache_metadata_for(meta_transformer("qwenimage21").module, QwenImage21TransformerBlock) == (0, None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert cache.OWN_BLOCK_METADATA["MiniMaxH3TransformerBlock"] == (0, None)
    assert caught[0].category is DeprecationWarning
