"""Wan 2.1 (`WanPipeline`, `WanTransformer3DModel`) through `load_pipeline(...).generate(...)`: tp=2 and tp=2 x
ulysses=2 on CPU gloo ranks equal the stock pipeline in one process (latents, float32), with the Q/K norms over all
heads sharded (`ShardedRMSNorm`); the job writes a playable MP4.

One 4-rank job runs both layouts (one pool spawn); the stock references run in this process. Each comparison holds
its control: the other prompt's stock latents, which must differ from the reference by far more than the tolerance.
"""

import subprocess
import sys

import pytest
import torch
import wan_jobs
from rank_cases import case

from neuron_diffusers.checkpoint import resolve

TOL = 1e-4


def _stock(checkpoint, prompt: str, **kwargs) -> torch.Tensor:
    pipe = resolve(checkpoint).adapter.load_stock(resolve(checkpoint))
    with torch.no_grad():
        return pipe(prompt, generator=torch.Generator().manual_seed(0), output_type="latent", **wan_jobs.CALL,
                    **kwargs).frames[0]


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return tiny_checkpoint("wan")


@pytest.fixture(scope="module")
def references(checkpoint):
    return {
        "latents": [_stock(checkpoint, prompt) for prompt in wan_jobs.PROMPTS],
        "negative": [_stock(checkpoint, prompt, negative_prompt=wan_jobs.NEGATIVE, guidance_scale=3.0)
                     for prompt in wan_jobs.PROMPTS],
    }


@pytest.fixture(scope="module")
def reports(rank_pool, checkpoint):
    return rank_pool.run(wan_jobs.wan_job, 4, checkpoint, timeout_s=900)


def _check(results: list, references: list, leaders: list[int]) -> None:
    control = (references[1] - references[0]).abs().max().item()
    assert control > 100 * TOL, f"the other prompt moved the stock latents by only {control}"
    for rank, result in enumerate(results):
        if rank not in leaders:
            assert result is None, f"rank {rank} is no leader but returned latents"
            continue
        for index, (ours, stock) in enumerate(zip(result, references, strict=True)):
            diff = (ours - stock).abs().max().item()
            assert diff < TOL, f"rank {rank}, prompt {index}: max abs diff {diff} to stock (control {control})"


@pytest.mark.parametrize("layout, leaders", [("tp2", [0, 2]), ("tp2u2", [0]), ("tp2cfg2", [0])])
@pytest.mark.parametrize("what", ["latents", "negative"])
def test_generate_equals_stock_single_process(reports, references, layout, leaders, what):
    _check([r[what] for r in case(reports, layout)], references[what], leaders)


def test_cfg_parallel_halves_each_ranks_forwards(reports):
    """Wan guides at every step (cond, then uncond under its `cache_context`s): a CFG pair computes one branch each,
    so each rank runs one forward per step where a TP group alone runs two (2 prompts x 2 steps)."""
    assert [r["forwards"] for r in case(reports, "tp2")] == [8] * 4
    assert [r["forwards"] for r in case(reports, "tp2cfg2")] == [4] * 4


def test_attention_is_head_sharded_with_its_norms(reports):
    for layout in ("tp2", "tp2u2", "tp2cfg2"):
        for result in case(reports, layout):
            assert result["norm_width"] == (24,)  # 4 heads of 12 -> 2 heads per TP rank
            assert result["local_heads"] == 2
            assert result["cp"] == (layout == "tp2u2")
    assert [r["encoder"] for r in case(reports, "tp2")] == [True, False, True, False]  # leader-only text encoding
    assert [r["encoder"] for r in case(reports, "tp2u2")] == [True, False, False, False]
    assert [r["encoder"] for r in case(reports, "tp2cfg2")] == [True, False, True, False]  # each group's leader


@pytest.fixture(scope="module")
def wan22_checkpoint(checkpoint, tmp_path_factory):
    """Wan 2.2 A14B's layout, tiny: the tiny Wan 2.1 pipeline plus a low-noise `transformer_2` (the high-noise one's
    weights, perturbed) below `boundary_ratio=0.8` (of 4 steps, timesteps 999 and 900 go to `transformer`, 750 and
    500 to `transformer_2`), saved and loaded back with stock `from_pretrained`."""
    from diffusers import WanPipeline

    pipe = WanPipeline.from_pretrained(checkpoint)
    expert = type(pipe.transformer).from_config(pipe.transformer.config)
    expert.load_state_dict(pipe.transformer.state_dict())
    generator = torch.Generator().manual_seed(22)
    with torch.no_grad():
        for parameter in expert.parameters():
            parameter.add_(torch.randn(parameter.shape, generator=generator) * 0.05)
    folder = tmp_path_factory.mktemp("wan22")
    WanPipeline(tokenizer=pipe.tokenizer, text_encoder=pipe.text_encoder, vae=pipe.vae, scheduler=pipe.scheduler,
                transformer=pipe.transformer, transformer_2=expert, boundary_ratio=0.8).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def wan22(rank_pool, wan22_checkpoint):
    return rank_pool.run(wan_jobs.wan22_job, 2, wan22_checkpoint, timeout_s=900)


def test_wan22_two_experts_at_tp2_equal_stock(wan22, wan22_checkpoint, checkpoint):
    """Both experts sharded: the latents equal stock single process within `TOL`; another prompt, and the same
    prompt without the low-noise expert (Wan 2.1's one transformer), move stock's latents by more."""
    from diffusers import WanPipeline

    stock = WanPipeline.from_pretrained(wan22_checkpoint)
    with torch.no_grad():
        def run(pipe, prompt):
            return pipe(prompt, generator=torch.Generator().manual_seed(0), output_type="latent",
                        **wan_jobs.CALL_22).frames[0]

        references = [run(stock, prompt) for prompt in wan_jobs.PROMPTS]
        one_expert = run(WanPipeline.from_pretrained(checkpoint), wan_jobs.PROMPTS[0])
    moved = (one_expert - references[0]).abs().max().item()
    assert moved > 100 * TOL, f"the low-noise expert moves the latents by only {moved}: blind"
    for layout in ("tp2", "cfg2"):
        leader, other = case(wan22, layout)
        assert other["latents"] is None, layout
        _check([leader["latents"], None], references, [0])


def test_wan22_each_expert_is_sharded_and_runs_its_steps(wan22):
    for result in case(wan22, "tp2"):
        assert result["expert_sharded"] and result["expert_heads"] == 2  # 4 heads over TP=2
        # 2 prompts x 2 steps per expert x 2 (CFG: cond and uncond)
        assert result["calls"] == {"transformer": 8, "transformer_2": 8}
    for result in case(wan22, "cfg2"):  # each rank computes one branch of every step, on both experts
        assert result["calls"] == {"transformer": 4, "transformer_2": 4}


@pytest.mark.parametrize("extra, named", [(["--cache", "first-block:0.1"], "a step cache (--cache)"),
                                          (["--compile", "aot_eager"], "--compile")])
def test_wan22_refuses_what_would_reach_one_expert_only(wan22_checkpoint, generate_refuses, extra, named):
    generate_refuses(["--prompt", "a fox", "--model", str(wan22_checkpoint), *extra],
                     f"has a second expert (transformer_2), and {named} would apply to its first transformer only")


def test_job_writes_a_playable_mp4(tmp_path):
    import av

    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "-m", "neuron_diffusers",
               "generate", "--out", str(tmp_path), "--prompt", "a red fox", "--model", "wan", "--tp", "2",
               "--steps", "2"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["00000-a-red-fox.mp4", "summary.json"]
    with av.open(str(tmp_path / "00000-a-red-fox.mp4")) as container:
        kinds = [stream.type for stream in container.streams]
        settings = dict(container.metadata)
        frames = [frame.to_ndarray(format="rgb24") for frame in container.decode(video=0)]
    assert kinds == ["video"] and len(frames) == 81  # WanPipeline's default clip length
    assert frames[0].shape == (32, 32, 3)
    assert settings["prompt"] == "a red fox" and settings["tp"] == "2"
    assert max(float(f.std()) for f in frames) > 1, "every frame is flat: nothing was generated"
