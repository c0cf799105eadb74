"""Our plans (registered on import) for all five families, and Qwen-Image-2.1's lean one: TP=2 and TP=4 equal one
process."""

import shutil

import pytest
import rank_jobs
from safetensors.torch import load_file, save_file

from neuron_diffusers import tiny
from neuron_diffusers.tools.plan.cases import reference_call
from neuron_diffusers.tools.spawn import run_on_cpu_ranks

MISSING_KEY = "transformer_blocks.0.attn.to_q.weight"


def _without_key(checkpoint, destination):
    copy = shutil.copytree(checkpoint, destination)
    weights = next((copy / "transformer").glob("*.safetensors"))
    tensors = load_file(weights)
    del tensors[MISSING_KEY]
    save_file(tensors, weights)
    return copy


@pytest.fixture(scope="module")
def plan_report(tiny_checkpoint, tmp_path_factory):
    checkpoints = {family: tiny_checkpoint(family) for family in tiny.FAMILIES}
    calls = {family: reference_call(checkpoints[family], family) for family in tiny.FAMILIES}
    broken = _without_key(checkpoints["flux"], tmp_path_factory.mktemp("broken") / "flux")
    return run_on_cpu_ranks(rank_jobs.plan_checks, 4, checkpoints, calls, broken)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("family", [*tiny.FAMILIES, ("qwenimage21", "lean")])
def test_our_plan_matches_single_process(plan_report, family, tp):
    for rank, report in enumerate(plan_report):
        result = report[family, tp]
        assert result["ours"], "the class default is not our plan"
        assert result["planned"] > 0
        assert result["diff"] < 1e-5, f"rank {rank}: max abs diff {result['diff']}"
        assert result["wrong"] == [], f"rank {rank}: {result['wrong'][:5]}"


@pytest.mark.parametrize("tp", [2, 4])
def test_h3_attention_splits_local_heads(plan_report, tp):
    for report in plan_report:
        assert report["h3_heads", tp] == {4 // tp}  # the tiny H3 has 4 heads


def test_bad_plans_and_degrees_rejected_before_any_weight_is_read(plan_report):
    errors = plan_report[0]["errors"]
    assert errors["typo"].startswith("ValueError")
    assert "'transformer_blocks.*.attn.to_qq' matches nothing" in errors["typo"]
    assert errors["not_linear"].startswith("ValueError") and "must match nn.Linear" in errors["not_linear"]
    assert errors["heads"].startswith("ValueError") and "Valid degrees for this model: [1, 2, 4]" in errors["heads"]
    assert MISSING_KEY in errors["missing_key"] and "does not contain" in errors["missing_key"]


def test_non_safetensors_checkpoint_rejected_before_loading(tiny_checkpoint, tmp_path):
    import torch
    from diffusers import TensorParallelConfig

    from neuron_diffusers.checkpoint import resolve

    checkpoint = shutil.copytree(tiny_checkpoint("flux"), tmp_path / "flux")
    weights = next((checkpoint / "transformer").glob("*.safetensors"))
    torch.save(load_file(weights), weights.with_name("diffusion_pytorch_model.bin"))
    weights.unlink()

    class _TwoRankMesh:  # checked before a process group is needed
        device_type, ndim = "cpu", 1

        def size(self):
            return 2

    with pytest.raises(ValueError, match="requires safetensors weights"):
        resolve(checkpoint).transformer_class().from_pretrained(
            checkpoint, subfolder="transformer", use_safetensors=None,
            parallel_config=TensorParallelConfig(mesh=_TwoRankMesh()))
