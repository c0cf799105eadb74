"""Must-show of issue #33: a family added from outside the package (`tests/house_family`: its plan, adapter and tiny
files, plus one `families.register` call) runs `plan verify` and `generate` with nothing else changed."""

import importlib
import sys

import pytest

from neuron_diffusers import families, tiny
from neuron_diffusers.cli import main
from neuron_diffusers.tools.spawn import run_on_cpu_ranks

FAMILY = "house_family"  # importing it is the one registry call


def _generate_on_rank(argv: list[str]) -> dict:
    """On a spawned rank: register the family (a fresh interpreter knows only ours), then run the job."""
    importlib.import_module(FAMILY)
    import rank_jobs

    outputs = rank_jobs._job_outputs(argv)
    return None if outputs is None else {"images": len(outputs["summary"]["images"]),
                                         "shape": next(iter(outputs["pixels"].values())).shape}


@pytest.fixture(scope="module")
def registered():
    """The family registered for this module's tests, and the registry restored after them (later tests see ours)."""
    with pytest.MonkeyPatch.context() as patch:
        for name in ("FAMILIES", "PIPELINE_FAMILIES", "TINY_CHECKPOINTS"):
            patch.setattr(families, name, getattr(families, name))
        patch.setattr(families, "_BY_NAME", dict(families._BY_NAME))
        module = sys.modules.get(FAMILY)
        importlib.reload(module) if module is not None else importlib.import_module(FAMILY)
        yield families.get("chroma")


def test_the_registry_knows_the_family_from_its_one_line(registered):
    assert registered.adapter.pipeline_class == "ChromaPipeline"
    assert "chroma" in tiny.FAMILIES and "chroma" in families.PIPELINE_FAMILIES
    assert families.by_pipeline_class("ChromaPipeline") is registered
    assert families.by_model_class("ChromaTransformer2DModel") is registered
    with pytest.raises(ValueError, match="registered already"):
        families.register(families.Family("chroma", "Another"))


def test_plan_verify_runs_on_it(registered, capsys):
    assert main(["plan", "verify", "chroma", "--tp", "2"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("at every degree")


def test_generate_runs_on_it(registered, tmp_path):
    checkpoint = tiny.build_tiny("chroma", tmp_path / "chroma")
    argv = ["--model", str(checkpoint), "--prompt", "a fox", "--tp", "2", "--steps", "2", "--height", "32",
            "--width", "32", "--out", str(tmp_path / "out")]
    reports = run_on_cpu_ranks(_generate_on_rank, 2, argv, timeout_s=600)
    assert reports[0] == {"images": 1, "shape": (32, 32, 3)}
