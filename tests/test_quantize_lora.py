"""Quantized shards (issue 30) with LoRAs, compiled, and served, at TP=2 on the tiny models (float32 compute).

- A LoRA fused into fp8 shards (FLUX.1: and int8) at TP=2, for FLUX.1, FLUX.2, Qwen-Image, Qwen-Image-2.1 and
  MiniMax-H3, gives the output of one process with the same LoRA fused into the same quantized model, within 1e-5;
  the same LoRA at another scale moves that output by more (the control). Each fused shard is the one-process fused
  weight's slice bit for bit, and removing the LoRA gives back every quantized tensor and scale bit for bit (while
  fused they differ: the control).
- Compiled under quantization on FLUX.1 (`aot_eager` for fp8 and int8, `inductor` for fp8): no graph break, and no
  recompile after warm-up over prompts and LoRA switches (in place); each LoRA set's latents equal eager's. The other
  four families in fp8 on `aot_eager` (no LoRA): no graph break, no recompile after warm-up, compiled equals eager.
- `generate --quantize` and the server's path for `serve --quantize` (its planning, request checks and replica loop,
  minus HTTP) make the same PNG; another seed's differs (the control).

Multi-rank bodies run on the session's 2-rank pool (`rank_pool`), one job per topic, each case recorded on its own.
"""

import io
import json

import lora_files
import numpy as np
import pytest
import quantize_lora_jobs as jobs
from lora_jobs import OTHER_FAMILIES
from PIL import Image
from rank_cases import case

from neuron_diffusers import tiny
from neuron_diffusers.checkpoint import resolve
from neuron_diffusers.cli import _parser
from neuron_diffusers.job import plan_job
from neuron_diffusers.parallel.lora import lora_loader
from neuron_diffusers.tools.plan.cases import reference_call

RANK, ALPHA, SCALE, OTHER_SCALE = 4, 8.0, 0.6, 1.0
#: Transformer outputs are O(1); TP=2 and one process compute the same quantized products, summed in another order.
TOL = 1e-5


def _diff(x, y) -> float:
    return max((a - b).abs().max().item() for a, b in zip(x, y, strict=True))


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint):
    return str(tiny_checkpoint("flux"))


@pytest.fixture(scope="module")
def call(checkpoint):
    """The stock pipeline's first transformer call: (args, kwargs)."""
    return reference_call(checkpoint, "flux")[:2]


def _transformer(checkpoint):
    return resolve(checkpoint).transformer_class().from_pretrained(checkpoint, subfolder="transformer")


@pytest.fixture(scope="module")
def lora_file(checkpoint, tmp_path_factory):
    """A LoRA on every Linear of FLUX.1 (the blocks' quantized ones and the unquantized ones outside), PEFT keys with
    network alphas."""
    state = lora_files.factors(lora_files.linears(_transformer(checkpoint)), RANK, seed=1)
    return lora_files.save_peft(tmp_path_factory.mktemp("qlora") / "lora.safetensors", state, alpha=ALPHA)


#: FLUX.1 in fp8 and int8; the other families of issue 30 in fp8, each with a LoRA on every Linear written by its
#: pipeline's own `save_lora_weights` (as tests/test_lora.py makes them).
LORA_CASES = [("flux", "fp8"), ("flux", "int8"), *((family, "fp8") for family in OTHER_FAMILIES)]


@pytest.fixture(scope="module")
def lora_setups(tiny_checkpoint, checkpoint, call, lora_file, tmp_path_factory):
    """Per family: (checkpoint, its LoRA file, its first transformer call, its kinds)."""
    root = tmp_path_factory.mktemp("qlora_families")
    setups = {"flux": (checkpoint, lora_file, call, [k for f, k in LORA_CASES if f == "flux"])}
    for family in OTHER_FAMILIES:
        path = str(tiny_checkpoint(family))
        state = lora_files.factors(lora_files.linears(_transformer(path)), RANK, seed=1)
        file = lora_files.save_diffusers(lora_loader(resolve(path).adapter), root / family, state, RANK, ALPHA)
        setups[family] = (path, file, reference_call(path, family)[:2], ["fp8"])
    return setups


@pytest.fixture(scope="module")
def one_process(lora_setups):
    """`one_process(family, kind, scale)` → one process's output with the family's LoRA at `scale` fused into the
    quantized model."""
    made = {}

    def get(family, kind, scale):
        if (family, kind, scale) not in made:
            checkpoint, file, call, _ = lora_setups[family]
            model = jobs.one_process_fused(checkpoint, kind, [(file, scale)])
            made[family, kind, scale] = jobs.outputs(model, call)
        return made[family, kind, scale]

    return get


@pytest.fixture(scope="module")
def lora_reports(lora_setups, rank_pool):
    return rank_pool.run(jobs.lora_job, 2, lora_setups, SCALE, timeout_s=900)


# -- LoRAs on quantized shards ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("family, kind", LORA_CASES)
def test_lora_on_quantized_shards_at_tp2_equals_one_process(lora_reports, one_process, family, kind):
    reference = one_process(family, kind, SCALE)
    moved = _diff(one_process(family, kind, OTHER_SCALE), reference)
    assert moved > TOL, f"blind: another LoRA scale moves the one-process output by only {moved:.1e}"
    for rank, ours in enumerate(case(lora_reports, (family, kind, "outputs"))):
        assert _diff(ours, reference) < TOL, f"rank {rank}: {_diff(ours, reference):.1e}"


@pytest.mark.parametrize("family, kind", LORA_CASES)
def test_fused_quantized_shards_are_the_one_process_fused_slices_bitwise(lora_reports, family, kind):
    for report in case(lora_reports, (family, kind, "shards")):
        assert report["compared"] > 0 and report["unequal"] == [], report


@pytest.mark.parametrize("family, kind", LORA_CASES)
def test_removing_the_lora_restores_every_quantized_tensor_and_scale_bitwise(lora_reports, family, kind):
    for report in case(lora_reports, (family, kind, "restored")):
        assert report["equal_while_fused"] < report["tensors"], "the LoRA must change the quantized tensors"
        assert report["equal_after_removal"] == report["tensors"] > 0, report


@pytest.mark.parametrize("family, kind", LORA_CASES)
def test_the_restoring_copy_is_the_touched_quantized_bytes_and_scales(lora_reports, family, kind):
    """Host memory kept for `set_loras([])`: one byte per touched weight plus one float32 scale per block."""
    for report in case(lora_reports, (family, kind, "memory")):
        assert report["copies"] == report["touched_data"] + report["touched_scales"], report
        assert report["touched_data"] == report["touched_weights"] > 0
        assert report["touched_scales"] == 4 * report["touched_weights"] // jobs.BLOCK


def test_generate_plans_loras_with_quantize(checkpoint, lora_file, tmp_path):
    """The former refusal is gone: `generate --lora ... --quantize ...` plans (nothing loaded), keeping both."""
    args = _parser().parse_args(["generate", "--model", checkpoint, "--prompt", "a fox", "--quantize", "fp8:16",
                                 "--tp", "2", "--out", str(tmp_path / "out"), "--lora", f"{lora_file}:{SCALE}"])
    launch = plan_job(args, 2, "cpu").launch
    assert str(launch.quantize) == "fp8:16" and [lora.spec.scale for lora in launch.loras] == [SCALE]


# -- compiled under quantization --------------------------------------------------------------------------------------

#: Prompts of 1, 15 and 45 words (FLUX.1 pads its text to one length: one shape each).
PROMPTS = ["fox", " ".join(["red fox in the snow"] * 3), " ".join(["a red fox in the snow at dawn light"] * 5)]
COMPILED = [("aot_eager", "fp8"), ("aot_eager", "int8"), ("inductor", "fp8")]


#: The other families of issue 30, compiled with `aot_eager` in fp8 (no LoRA): one text bucket each, which the
#: prompts fit, so warm-up compiles one graph per block class and step kind (Qwen-Image-2.1: KV-cache prefill and
#: cached steps; MiniMax-H3: its first step's two noise levels); FLUX.2 pads its text itself.
OTHER_BUCKETS = {"qwenimage": (64,), "qwenimage21": (64,), "h3": (64,)}
OTHER_GRAPHS = {"flux2": 2, "qwenimage": 1, "qwenimage21": 2, "h3": 2}
OTHER_PROMPTS = PROMPTS[:2]


@pytest.fixture(scope="module")
def compile_reports(checkpoint, lora_file, rank_pool, tiny_checkpoint):
    """`compile_reports(backend)` → both ranks' cases (one per kind) of that backend's job (run on first use): eager
    latents with no LoRA, the LoRA at `SCALE` and at `OTHER_SCALE`; compiled, warmed up, the prompts, then each set
    switched in twice. The `aot_eager` job also compiles the other families in fp8 (a case each)."""
    made = {}
    loras = {"none": [], "lora": [(lora_file, SCALE)], "other": [(lora_file, OTHER_SCALE)]}

    def get(backend):
        if backend not in made:
            kinds = [kind for b, kind in COMPILED if b == backend]
            others = {family: (str(tiny_checkpoint(family)), tiny.smallest_call(family),
                               {"buckets": OTHER_BUCKETS[family]} if family in OTHER_BUCKETS else {}, OTHER_PROMPTS)
                      for family in OTHER_FAMILIES} if backend == "aot_eager" else None
            made[backend] = rank_pool.run(jobs.compile_job, 2, checkpoint, tiny.smallest_call("flux"), kinds,
                                          PROMPTS if backend == "aot_eager" else PROMPTS[:1], backend, loras, others,
                                          timeout_s=1200)
        return made[backend]

    return get


@pytest.mark.parametrize("backend, kind", COMPILED)
def test_quantized_compiled_at_tp2_no_graph_breaks_no_recompiles(compile_reports, backend, kind):
    """After warm-up: prompts of several lengths and LoRA switches (in place) add no graph and no recompile."""
    for rank, result in enumerate(case(compile_reports(backend), kind)):
        assert result["graph_breaks"] == 0, f"rank {rank}: {result}"
        assert result["graphs_after_warmup"] == 2, f"rank {rank}: one graph per block class, {result}"
        assert result["new_graphs"] == 0 and result["new_recompiles"] == 0, f"rank {rank}: {result}"


@pytest.mark.parametrize("backend, kind", COMPILED)
def test_quantized_compiled_at_tp2_equals_eager(compile_reports, backend, kind):
    """Each LoRA set's compiled latents (switched in, away and back) equal its eager latents; the LoRA, and another
    scale of it, move the eager latents by more than the tolerance (the controls)."""
    leader = case(compile_reports(backend), kind)[0]
    eager, compiled = leader["eager"], leader["compiled"]
    assert (eager["lora"] - eager["none"]).abs().max() > TOL and (eager["other"] - eager["lora"]).abs().max() > TOL
    for name, latents in compiled.items():
        differences = [(made - eager[name]).abs().max().item() for made in latents]
        assert len(differences) == 2 and max(differences) < TOL, f"{name}: {differences}"


@pytest.mark.parametrize("family", OTHER_FAMILIES)
def test_other_families_fp8_compiled_at_tp2_no_graph_breaks_no_recompiles(compile_reports, family):
    """`aot_eager`, fp8: warm-up compiles every graph; the prompts after it add none and recompile nothing."""
    for rank, result in enumerate(case(compile_reports("aot_eager"), family)):
        assert result["graph_breaks"] == 0, f"rank {rank}: {result}"
        assert result["graphs_after_warmup"] == OTHER_GRAPHS[family], f"rank {rank}: {result}"
        assert result["new_graphs"] == 0 and result["new_recompiles"] == 0, f"rank {rank}: {result}"


@pytest.mark.parametrize("family", OTHER_FAMILIES)
def test_other_families_fp8_compiled_at_tp2_equals_eager(compile_reports, family):
    """The first prompt's compiled output equals its eager one; the second prompt's differs by more (the control)."""
    leader = case(compile_reports("aot_eager"), family)[0]
    assert leader["diff"] < TOL < leader["control"], leader


# -- the job and the server ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def job_and_served(tmp_path_factory, rank_pool):
    """`generate --quantize fp8:16` at TP=2 (seed 7), and the server's path for `serve --quantize fp8:16` with the
    same request and with seed 8."""
    out = tmp_path_factory.mktemp("qjob") / "out"
    shared = ["--tp", "2", "--steps", "2", "--quantize", jobs.scheme("fp8")]
    bodies = {"same": {"prompt": "a red fox", "seed": 7}, "other_seed": {"prompt": "a red fox", "seed": 8}}
    return rank_pool.run(jobs.job_and_served, 2, ["--prompt", "a red fox", "--seed", "7", *shared, "--out", str(out)],
                         shared, bodies, timeout_s=600)


def _png(data: bytes) -> tuple[np.ndarray, dict]:
    image = Image.open(io.BytesIO(data))
    return np.asarray(image.convert("RGB")), dict(image.text)


def test_generate_and_serve_with_quantize_make_the_same_image(job_and_served):
    job, served = case(job_and_served, "job")[0], case(job_and_served, "served")[0]
    ((name, job_pixels),) = job["pixels"].items()
    pixels, text = _png(served["same"])
    other_seed, _ = _png(served["other_seed"])
    assert not np.array_equal(other_seed, job_pixels), "blind: another seed must change the served image"
    assert np.array_equal(pixels, np.asarray(Image.fromarray(job_pixels).convert("RGB"))), "not the job's image"
    assert text["settings_digest"] == job["settings"][name]["settings_digest"]
    assert json.loads(job["settings"][name]["settings_key"])["quantize"] == jobs.scheme("fp8")
