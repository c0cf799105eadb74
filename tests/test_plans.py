"""Our plans (registered on import) for all five families, and Qwen-Image-2.1's lean one: TP=2 and TP=4 equal one
process.

One job a family (and one for the refusals) on the session's pool of 4 ranks (`rank_pool`), each (plan, degree) its own
case (`rank_cases`): a failure fails only the tests that read it.
"""

import shutil

import plan_jobs
import pytest
from rank_cases import case
from safetensors.torch import load_file, save_file

from neuron_diffusers import tiny
from neuron_diffusers.tools.plan.cases import reference_call

MISSING_KEY = "transformer_blocks.0.attn.to_q.weight"


def _without_key(checkpoint, destination):
    copy = shutil.copytree(checkpoint, destination)
    weights = next((copy / "transformer").glob("*.safetensors"))
    tensors = load_file(weights)
    del tensors[MISSING_KEY]
    save_file(tensors, weights)
    return copy


@pytest.fixture(scope="module")
def plan_report(tiny_checkpoint, rank_pool):
    """`plan_report(family)` → every rank's per-case report of that family's job (run on first use)."""
    made = {}

    def get(family):
        if family not in made:
            checkpoint = tiny_checkpoint(family)
            made[family] = rank_pool.run(plan_jobs.plan_checks, 4, family, checkpoint,
                                         reference_call(checkpoint, family), timeout_s=900)
        return made[family]

    return get


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("family", [*tiny.FAMILIES, ("qwenimage21", "lean")])
def test_our_plan_matches_single_process(plan_report, family, tp):
    name = family if isinstance(family, str) else family[0]
    for rank, result in enumerate(case(plan_report(name), (family, tp))):
        assert result["ours"], "the class default is not our plan"
        assert result["planned"] > 0
        assert result["diff"] < 1e-5, f"rank {rank}: max abs diff {result['diff']}"
        assert result["wrong"] == [], f"rank {rank}: {result['wrong'][:5]}"


@pytest.mark.parametrize("tp", [2, 4])
def test_h3_attention_splits_local_heads(plan_report, tp):
    for heads in case(plan_report("h3"), ("h3_heads", tp)):
        assert heads == {4 // tp}  # the tiny H3 has 4 heads


@pytest.fixture(scope="module")
def refusals(tiny_checkpoint, tmp_path_factory, rank_pool):
    broken = _without_key(tiny_checkpoint("flux"), tmp_path_factory.mktemp("broken") / "flux")
    return rank_pool.run(plan_jobs.plan_refusals, 4, tiny_checkpoint("flux"), broken, timeout_s=600)


def test_a_typo_in_a_plan_is_rejected_before_any_weight_is_read(refusals):
    typo = case(refusals, "typo")[0]
    assert typo.startswith("ValueError") and "'transformer_blocks.*.attn.to_qq' matches nothing" in typo, typo


def test_a_rule_on_a_module_that_is_not_linear_is_rejected_before_any_weight_is_read(refusals):
    not_linear = case(refusals, "not_linear")[0]
    assert not_linear.startswith("ValueError") and "must match nn.Linear" in not_linear, not_linear


def test_a_degree_the_heads_do_not_allow_is_rejected_before_any_weight_is_read(refusals):
    heads = case(refusals, "heads")[0]
    assert heads.startswith("ValueError") and "Valid degrees for this model: [1, 2, 4]" in heads, heads


def test_a_checkpoint_missing_a_planned_weight_is_rejected(refusals):
    missing = case(refusals, "missing_key")[0]
    assert MISSING_KEY in missing and "does not contain" in missing, missing


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
