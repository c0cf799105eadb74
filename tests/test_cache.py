"""Step caching under parallelism: diffusers' cache hooks with every skip decision shared by the group.

Each parallel case runs as its own job on the session's gloo rank pool (`rank_pool`), at TP=2 or as one CFG pair
(cfg=2, tp=1) with true CFG, plus the `generate` job (its final latents against stock's, not only its counts);
each result is recorded on its own (`rank_cases`). The stock
single-process references run in this process, with stock `enable_cache` (FLUX.1, Qwen-Image) or the same
`GroupCache` alone (Qwen-Image-2.1, MiniMax-H3, FLUX.2, which stock cannot cache). "Same decisions" is checked step
by step, the float outputs (before the 8-bit rounding) to 1e-4 max: float32 rounding of O(1) values through reordered
TP sums (measured within 1e-6 of stock). The control: the same cache at another threshold (0: nothing skipped)
moves stock's output by more than that (the cache itself moves the tiny FLUX.1 image by about 1e-2).
"""

import json
from types import SimpleNamespace

import cache_jobs
import numpy as np
import pytest
import torch
from rank_cases import case

from neuron_diffusers import tiny
from neuron_diffusers.checkpoint import resolve
from neuron_diffusers.cli import main as cli_main
from neuron_diffusers.parallel.cache import check_cache, check_cache_config, enable_group_cache, parse_cache_spec

FAMILIES = ("flux", "flux2", "qwenimage", "qwenimage21", "h3")
TOLERANCE = 1e-4
#: A module inside what each cache skips: did this forward compute the skipped part?
PROBES = {("flux", "first-block"): "single_transformer_blocks.1.norm",
          ("qwenimage", "first-block"): "transformer_blocks.1.img_mod",
          ("flux", "taylorseer"): "single_transformer_blocks.1.attn.to_q"}
ALONE = list(cache_jobs.ALONE_CASES.items())


@pytest.fixture(scope="module")
def checkpoints(tiny_checkpoint):
    return {family: tiny_checkpoint(family) for family in FAMILIES}


@pytest.fixture(scope="module")
def job_out(tmp_path_factory):
    return tmp_path_factory.mktemp("cache-job") / "out"


@pytest.fixture(scope="module")
def cases(checkpoints, rank_pool):
    """`cases(layout, family, name)` → both ranks' reports of that case's job ("tp2" or "cfg2"), run on first use."""
    made = {}
    jobs = {"tp2": cache_jobs.tp2_case_check, "cfg2": cache_jobs.cfg_pair_case_check}

    def get(layout, family, name):
        if (layout, family, name) not in made:
            made[layout, family, name] = rank_pool.run(jobs[layout], 2, checkpoints[family], family, name,
                                                       timeout_s=900)
        return made[layout, family, name]

    return get


@pytest.fixture(scope="module")
def job_report(checkpoints, job_out, rank_pool):
    argv = ["--model", str(checkpoints["flux"]), "--prompt", cache_jobs.PROMPT, "--out", str(job_out),
            "--negative-prompt", cache_jobs.NEGATIVE, "--true-cfg-scale", "4", "--cfg-parallel", "--height", "32",
            "--width", "32", "--steps", str(cache_jobs.STEPS), "--cache", f"first-block:{cache_jobs.THRESHOLD}"]
    return rank_pool.run(cache_jobs.job_check, 2, argv, timeout_s=900)


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


def _batch_call(pipe, family, prompts=cache_jobs.BATCH):
    """Stock's own batch: `prompts` as one prompt list, image i's generator seeded i; each row's latents."""
    generators = [torch.Generator().manual_seed(index) for index in range(len(prompts))]
    with torch.no_grad():
        latents = pipe(prompt=list(prompts), generator=generators,
                       **{**cache_jobs.call_of(family), "output_type": "latent"}).images
    return [row.float().numpy() for row in latents]


_STOCK = {}


def _probed(pipe, family, name, control, run, config=None):
    """`run()` under stock `enable_cache`, and per transformer forward in call order whether it computed the part the
    cache skips (the probe module ran). `control`: the same cache at another threshold; `config`: this one."""
    transformer = pipe.transformer
    if config is None:
        config = cache_jobs.control_config_of(name) if control else cache_jobs.config_of(name)
    transformer.enable_cache(config)
    ran = []
    handles = [transformer.register_forward_pre_hook(lambda *_: ran.append(False)),
               transformer.get_submodule(PROBES[family, name]).register_forward_pre_hook(
                   lambda *_: ran.__setitem__(-1, True))]
    try:
        return run(), ran
    finally:
        for handle in handles:
            handle.remove()
        transformer.disable_cache()


def stock_cached(pipe, family, name, control=False, **kwargs):
    """Stock `enable_cache` alone (once per argument set): the output and, per transformer forward in call order,
    whether it computed the part the cache skips. `control`: the same cache at another threshold
    (`cache_jobs.control_config_of`), the output only."""
    key = (family, name, control, tuple(sorted(kwargs.items())))
    if key not in _STOCK:
        _STOCK[key] = _probed(pipe, family, name, control, lambda: _call(pipe, family, **kwargs))
    return _STOCK[key]


def stock_batch(pipe, family, name, control=False):
    """Stock `enable_cache` on stock's batch of `cache_jobs.BATCH` (once): each row's latents, and per forward of the
    one call whether it computed the skipped part."""
    key = (family, name, control, "batch")
    if key not in _STOCK:
        _STOCK[key] = _probed(pipe, family, name, control, lambda: _batch_call(pipe, family))
    return _STOCK[key]


def stock_alone(pipe, family, name, control=False):
    """The same `GroupCache` in one process, for families stock cannot cache: the output and its shared decisions."""
    key = (family, name, control, "alone")
    if key not in _STOCK:
        config = cache_jobs.control_config_of(name) if control else cache_jobs.config_of(name)
        cache = enable_group_cache(pipe.transformer, config)
        try:
            with cache.pipeline_call():
                expected = _call(pipe, family)
            _STOCK[key] = expected, [d.shared for d in cache.decisions]
        finally:
            cache.remove()
    return _STOCK[key]


def _assert_close_with_control(output, expected, control, what):
    """Every array of `output` within `TOLERANCE` of stock's, and the control (another threshold) further."""
    assert output.keys() == expected.keys()
    for name in expected:
        assert output[name].shape == expected[name].shape, what
        moved = np.abs(control[name] - expected[name]).max()
        assert moved > TOLERANCE, f"{what}: another threshold moves {name} by only {moved:.2e}: blind"
        difference = np.abs(output[name] - expected[name]).max()
        assert difference < TOLERANCE, f"{what}: {name} differs by {difference:.2e}"


def _shared(rank, context=None):
    return [shared for ctx, _, shared in rank["decisions"] if context is None or ctx == context]


def _generations(cases, layout, family, name):
    return case(cases(layout, family, name), "generation")


# -- TP=2 against stock enable_cache ---------------------------------------------------------------------------------


@pytest.mark.parametrize("family, name", list(PROBES))
def test_tp2_cached_image_equals_stock(cases, stock_pipes, family, name):
    expected, _ = stock_cached(stock_pipes(family), family, name)
    control, _ = stock_cached(stock_pipes(family), family, name, control=True)
    leader, other = _generations(cases, "tp2", family, name)
    assert other["output"] is None
    _assert_close_with_control(leader["output"], expected, control, f"{family} {name}")


@pytest.mark.parametrize("family, name", list(PROBES))
def test_tp2_ranks_share_every_decision(cases, stock_pipes, family, name):
    _, ran = stock_cached(stock_pipes(family), family, name)
    leader, other = _generations(cases, "tp2", family, name)
    assert 0 < sum(ran) < len(ran), f"the cache must skip some forwards and compute others: {ran}"
    assert leader["decisions"] == other["decisions"]


@pytest.mark.parametrize("family, name", list(PROBES))
def test_tp2_computes_the_forwards_stock_computes(cases, stock_pipes, family, name):
    _, ran = stock_cached(stock_pipes(family), family, name)
    for rank in _generations(cases, "tp2", family, name):
        assert rank["counts"]["computed"] == sum(ran) and rank["counts"]["cached"] == len(ran) - sum(ran)
        if name == "first-block":  # one decision per forward
            assert _shared(rank) == ran


# -- a batch at TP=2 against stock's batch --------------------------------------------------------------------------


@pytest.mark.parametrize("family, name", cache_jobs.BATCHED)
def test_tp2_cached_batch_equals_stock_with_the_same_batch(cases, stock_pipes, family, name):
    """A batch of three prompts in one `generate` call under a cache: each image's latents are stock's, run on the
    same batch (one prompt list, generators seeded 0, 1, 2) with the same cache, within 1e-4; the control: stock's
    batch at another threshold (nothing skipped) lies further."""
    expected, _ = stock_batch(stock_pipes(family), family, name)
    control, _ = stock_batch(stock_pipes(family), family, name, control=True)
    leader, other = case(cases("tp2", family, name), "batched")
    assert other["latents"] is None and len(leader["latents"]) == len(expected) == len(cache_jobs.BATCH)
    for index, (ours, stock, moved) in enumerate(zip(leader["latents"], expected, control, strict=True)):
        _assert_close_with_control({"latents": ours}, {"latents": stock}, {"latents": moved},
                                   f"{family} {name} batch image {index}")


@pytest.mark.parametrize("family, name", cache_jobs.BATCHED)
def test_tp2_cached_batch_takes_stocks_decisions_for_the_whole_batch(cases, stock_pipes, family, name):
    """One decision per forward for the whole batch, shared by both ranks: stock's, on the same batch; each image of
    the batch counts the call's forwards. The control: the same cache at another threshold skips nothing."""
    _, ran = stock_batch(stock_pipes(family), family, name)
    _, ran_control = stock_batch(stock_pipes(family), family, name, control=True)
    assert 0 < sum(ran) < len(ran), f"the cache must skip some of the batch's forwards and compute others: {ran}"
    assert all(ran_control), f"the control skips too: {ran_control}"
    leader, other = case(cases("tp2", family, name), "batched")
    assert leader["decisions"] == other["decisions"]
    for rank in (leader, other):
        for counts in rank["counts"]:
            assert counts["computed"] == sum(ran) and counts["cached"] == len(ran) - sum(ran)
        if name == "first-block":
            assert _shared(rank) == ran


def test_a_batch_decides_once_so_its_image_can_differ_from_the_image_made_alone(stock_pipes):
    """Why "equals stock with the same batch" and not "equals the image made alone": stock FirstBlockCache takes one
    decision per forward from the whole batch's residual. At a threshold between the batch's step-1 metric (0.3335
    here) and image 0's own (0.3377), stock's batch skips step 1 where image 0 alone computes it, and image 0's
    latents move by more than the tolerance; at `THRESHOLD` (0.5) the two decide alike (the control)."""
    from diffusers import FirstBlockCacheConfig

    pipe, between = stock_pipes("flux"), FirstBlockCacheConfig(threshold=0.335)
    made = {}
    for threshold, config in (("between", between), ("control", cache_jobs.config_of("first-block"))):
        made[threshold] = [_probed(pipe, "flux", "first-block", False, lambda p=prompts: _batch_call(pipe, "flux", p),
                                   config) for prompts in (cache_jobs.BATCH, cache_jobs.BATCH[:1])]
    (batch, ran_batch), (alone, ran_alone) = made["between"]
    assert ran_batch[1] is False and ran_alone[1] is True, (ran_batch, ran_alone)
    assert float(np.abs(batch[0] - alone[0]).max()) > TOLERANCE
    (batch, ran_batch), (alone, ran_alone) = made["control"]
    assert ran_batch == ran_alone and float(np.abs(batch[0] - alone[0]).max()) < TOLERANCE


# -- a CFG pair with true CFG ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family, name", list(PROBES))
def test_cfg_pair_cached_image_equals_stock_true_cfg(cases, stock_pipes, family, name):
    expected, _ = stock_cached(stock_pipes(family), family, name, **cache_jobs.TRUE_CFG)
    control, _ = stock_cached(stock_pipes(family), family, name, control=True, **cache_jobs.TRUE_CFG)
    cond, uncond = _generations(cases, "cfg2", family, name)
    assert uncond["output"] is None
    _assert_close_with_control(cond["output"], expected, control, f"{family} {name} true CFG")


@pytest.mark.parametrize("family, name", list(PROBES))
def test_cfg_pair_each_rank_decides_its_own_branch_as_stock(cases, stock_pipes, family, name):
    """Each rank computes one guidance branch under its own context, with the stock branch's decisions."""
    _, ran = stock_cached(stock_pipes(family), family, name, **cache_jobs.TRUE_CFG)
    cond, uncond = _generations(cases, "cfg2", family, name)
    assert {c for c, _, _ in cond["decisions"]} == {"cond"} and {c for c, _, _ in uncond["decisions"]} == {"uncond"}
    if name == "first-block":
        assert _shared(cond) == ran[0::2] and _shared(uncond) == ran[1::2]


@pytest.mark.parametrize("family, name", list(PROBES))
def test_cfg_pair_counts_both_branches_on_both_ranks(cases, stock_pipes, family, name):
    _, ran = stock_cached(stock_pipes(family), family, name, **cache_jobs.TRUE_CFG)
    cond, uncond = _generations(cases, "cfg2", family, name)
    assert cond["counts"] == uncond["counts"]  # the image's forwards, both branches, on both ranks
    assert cond["counts"]["computed"] == sum(ran) and cond["counts"]["cached"] == len(ran) - sum(ran) > 0
    assert set(cond["counts"]["by_context"]) == {"cond", "uncond"}


# -- families stock cannot cache ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("family, name", ALONE)
def test_tp2_caches_families_stock_cannot_as_one_process(cases, stock_pipes, family, name):
    """Qwen-Image-2.1 and MiniMax-H3 blocks get metadata here, FLUX.2's and H3's pipelines a cache context: TP=2
    equals the same cache in one process."""
    expected, _ = stock_alone(stock_pipes(family), family, name)
    control, _ = stock_alone(stock_pipes(family), family, name, control=True)
    leader, _ = _generations(cases, "tp2", family, name)
    _assert_close_with_control(leader["output"], expected, control, family)


@pytest.mark.parametrize("family, name", ALONE)
def test_tp2_caches_families_stock_cannot_with_the_same_decisions(cases, stock_pipes, family, name):
    _, decisions = stock_alone(stock_pipes(family), family, name)
    leader, other = _generations(cases, "tp2", family, name)
    assert 0 < sum(decisions) < len(decisions), decisions
    assert _shared(leader) == _shared(other) == decisions


# -- FLUX.1's first-block case at TP=2: a perturbed rank, compiled blocks ------------------------------------------


def _perturbation(cases):
    return case(cases("tp2", "flux", "first-block"), "perturbation")


def test_one_ranks_perturbed_residual_flips_its_own_decision(cases):
    """Threshold aimed at step 1's metric; rank 1's residual nudged by 1e-6: its own decision flips."""
    rank0, rank1 = _perturbation(cases)
    assert rank0["threshold"] == rank1["threshold"] == rank0["metrics"][1]
    local0 = [local for _, local, _ in rank0["decisions"]]
    local1 = [local for _, local, _ in rank1["decisions"]]
    assert local0[1] is False and local1[1] is True


def test_one_ranks_perturbed_residual_cannot_split_the_group(cases):
    """The group's decision does not flip apart (without the vote the ranks would take different branches, and TP
    hangs in a block's collective): compute if any rank would."""
    rank0, rank1 = _perturbation(cases)
    assert _shared(rank0) == _shared(rank1) and _shared(rank0)[1] is True
    assert np.isfinite(rank0["output"]["image"]).all()  # and the group's latents agreed at the last step


def test_compiled_blocks_with_the_cache_do_not_recompile(cases):
    for result in case(cases("tp2", "flux", "first-block"), "compiled"):
        assert result["graph_breaks"] == 0
        assert result["graphs_after_warmup"] == 2  # FLUX.1: the double- and the single-stream block
        assert result["new_graphs"] == 0 and result["new_recompiles"] == 0, result


def test_compiled_blocks_with_the_cache_take_eager_decisions(cases):
    for result in case(cases("tp2", "flux", "first-block"), "compiled"):
        for compiled in result["compiled"]:
            assert compiled["decisions"] == result["eager"]["decisions"]
            assert compiled["counts"]["cached"] > 0


def test_compiled_blocks_with_the_cache_give_the_eager_image(cases, stock_pipes):
    leader = case(cases("tp2", "flux", "first-block"), "compiled")[0]
    control, _ = stock_cached(stock_pipes("flux"), "flux", "first-block", control=True)
    for compiled in leader["compiled"]:
        _assert_close_with_control(compiled["output"], leader["eager"]["output"], control, "compiled vs eager")


# -- the job ------------------------------------------------------------------------------------------------------


def _stock_job_latents(pipe, config, prompt=cache_jobs.PROMPT):
    """Stock FLUX.1 with `enable_cache(config)` and the job's call (its stock 512 text tokens, true CFG, seed 0): the
    final latents, read at the last step's callback (what `output_type="latent"` returns)."""
    final = {}

    def keep(pipe, step, timestep, kwargs):
        final["latents"] = kwargs["latents"].clone()
        return {}

    pipe.transformer.enable_cache(config)
    try:
        with torch.no_grad():
            pipe(prompt=prompt, generator=torch.Generator().manual_seed(0), output_type="latent",
                 **{**tiny.smallest_call("flux"), "num_inference_steps": cache_jobs.STEPS}, **cache_jobs.TRUE_CFG,
                 callback_on_step_end=keep, callback_on_step_end_tensor_inputs=["latents"])
    finally:
        pipe.transformer.disable_cache()
    return final["latents"][0].numpy()


def test_job_cached_latents_equal_stock_enable_cache(job_report, stock_pipes):
    """The job's own output before the 8-bit rounding (its final latents) against stock `enable_cache` at the job's
    threshold, and the control: stock at threshold 0 (nothing skipped) lies further than the tolerance."""
    leader = case(job_report, "job")[0]
    ours = np.asarray(leader["latents"][0][0][0])
    expected = _stock_job_latents(stock_pipes("flux"), cache_jobs.config_of("first-block"))
    control = _stock_job_latents(stock_pipes("flux"), cache_jobs.control_config_of("first-block"))
    assert ours.shape == expected.shape
    moved = float(np.abs(control - expected).max())
    assert moved > TOLERANCE, f"threshold 0 moves stock's latents by only {moved:.2e}: the check is blind"
    difference = float(np.abs(ours - expected).max())
    assert difference < TOLERANCE, f"the cached job's latents differ from stock's by {difference:.2e}"


def test_job_reports_forwards_computed_and_cached(job_report, job_out, capsys):
    from neuron_diffusers.job import format_phases

    job = case(job_report, "job")[0]["outputs"]
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
