"""Must-show of issue #33: a family added from outside the package (`tests/house_family`: its plan, adapter and tiny
files, plus one `families.register` call) runs `plan verify` and `generate` with nothing else changed."""

import importlib
import sys

import pytest
from diffusers import ChromaTransformer2DModel
from diffusers.models.transformers.transformer_chroma import ChromaTransformerBlock

from neuron_diffusers import families, tiny
from neuron_diffusers.cli import main
from neuron_diffusers.compat import plans
from neuron_diffusers.parallel import blocks, coalesce
from neuron_diffusers.tools.spawn import run_on_cpu_ranks

FAMILY = "house_family"  # importing it is the one registry call


def _generate_on_rank(argv: list[str]) -> dict:
    """On a spawned rank: register the family (a fresh interpreter knows only ours), then run the job."""
    importlib.import_module(FAMILY)
    import rank_jobs

    outputs = rank_jobs._job_outputs(argv)
    return None if outputs is None else {"images": len(outputs["summary"]["images"]),
                                         "shape": next(iter(outputs["pixels"].values())).shape}


def _pushed() -> dict:
    """What the mechanisms (which name no family) know of Chroma: its class's TP plan, its block's coalesced forward
    and cache metadata."""
    return {"plan": plans.tp_plan_of(ChromaTransformer2DModel), "forward": coalesce.forward_for(ChromaTransformerBlock),
            "metadata": blocks.cache_metadata_names().get("ChromaTransformerBlock")}


@pytest.fixture(scope="module")
def registered():
    """The family registered for this module's tests, what the mechanisms knew of it before, and the registry and
    mechanisms restored after them (later tests see ours only)."""
    with pytest.MonkeyPatch.context() as patch:
        for name in ("FAMILIES", "PIPELINE_FAMILIES", "TINY_CHECKPOINTS"):
            patch.setattr(families, name, getattr(families, name))
        patch.setattr(families, "_BY_NAME", dict(families._BY_NAME))
        for module, name in ((coalesce, "COALESCED_FORWARDS"), (blocks, "_CACHE_METADATA"), (plans, "_STOCK_PLANS"),
                             (plans, "_CP_QUIRKS")):
            patch.setattr(module, name, dict(getattr(module, name)))
        patch.setattr(ChromaTransformer2DModel, "_tp_plan", ChromaTransformer2DModel._tp_plan)
        before = _pushed()
        module = sys.modules.get(FAMILY)
        importlib.reload(module) if module is not None else importlib.import_module(FAMILY)
        yield families.get("chroma"), before


def test_the_registry_knows_the_family_from_its_one_line(registered):
    registered, _ = registered
    assert registered.adapter.pipeline_class == "ChromaPipeline"
    assert "chroma" in tiny.FAMILIES and "chroma" in families.PIPELINE_FAMILIES
    assert families.by_pipeline_class("ChromaPipeline") is registered
    assert families.by_model_class("ChromaTransformer2DModel") is registered
    with pytest.raises(ValueError, match="registered already"):
        families.register(families.Family("chroma", "Another"))


def test_registering_pushes_its_plans_where_ours_go(registered):
    """`register` pushes what `neuron_diffusers/__init__.py` pushes for ours (`families.install`): the TP plan as the
    class default (stock's kept), the coalesced block forward, the cache metadata. Control: none was there before."""
    family, before = registered
    house = importlib.import_module(f"{FAMILY}.pipelines.chroma_blocks").FORWARDS[ChromaTransformerBlock]
    assert before == {"plan": plans.stock_plan(ChromaTransformer2DModel), "forward": None, "metadata": None}
    assert _pushed() == {"plan": family.plan, "forward": house, "metadata": (1, 0)}
    assert plans.stock_plan(ChromaTransformer2DModel) is before["plan"]


def test_a_family_whose_files_do_not_import_is_not_registered(registered):
    with pytest.raises(ModuleNotFoundError, match="no_such_package"):
        families.register(families.Family("nowhere", "Nowhere", package="no_such_package"))
    assert not families.is_family("nowhere")


def test_plan_verify_runs_on_it(registered, capsys):
    """On spawned ranks (which register the family again), with its coalesced forward: equal to one process."""
    assert main(["plan", "verify", "chroma", "--tp", "2"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("at every degree")


def test_generate_runs_on_it(registered, tmp_path):
    checkpoint = tiny.build_tiny("chroma", tmp_path / "chroma")
    argv = ["--model", str(checkpoint), "--prompt", "a fox", "--tp", "2", "--steps", "2", "--height", "32",
            "--width", "32", "--out", str(tmp_path / "out")]
    reports = run_on_cpu_ranks(_generate_on_rank, 2, argv, timeout_s=600)
    assert reports[0] == {"images": 1, "shape": (32, 32, 3)}
