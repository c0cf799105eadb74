"""Stock diffusers TP on CPU meshes after `import neuron_diffusers`: 2 gloo ranks vs one process."""

import pytest
import rank_jobs
from conftest import IMAGE_FAMILIES

from neuron_diffusers.tools.plan.cases import reference_call
from neuron_diffusers.tools.spawn import run_on_cpu_ranks


@pytest.fixture(scope="module")
def spine_report(tiny_checkpoint):
    checkpoints = {family: tiny_checkpoint(family) for family in IMAGE_FAMILIES}
    calls = {family: reference_call(checkpoints[family], family) for family in IMAGE_FAMILIES}
    reports = run_on_cpu_ranks(rank_jobs.spine_checks, 2, checkpoints, calls)
    return reports


def test_init_distributed_builds_dp_tp_mesh(spine_report):
    for report in spine_report:
        assert report["mesh"] == (("dp", "tp"), (1, 2))
        assert report["mesh_tp1"] == (("dp", "tp"), (2, 1))


@pytest.mark.parametrize("family", IMAGE_FAMILIES)
def test_from_pretrained_tp2_matches_single_process(spine_report, family):
    for rank, report in enumerate(spine_report):
        result = report[family]
        assert result["diff"] < 1e-5, f"rank {rank}: max abs diff {result['diff']}"
        assert result["planned"] > 0
        assert result["wrong"] == [], f"rank {rank}: planned weights not halved: {result['wrong'][:5]}"


def test_enable_parallelism_matches_single_process(spine_report):
    for report in spine_report:
        assert report["enable_parallelism_diff"] < 1e-5


def test_failed_enable_parallelism_leaves_model_untouched(spine_report):
    for report in spine_report:
        rollback = report["rollback"]
        assert isinstance(rollback, dict), rollback
        assert "injected failure" in rollback["error"]
        assert rollback["sharded_before_failure"] == 2  # the failure really hit a half-sharded model
        assert rollback["params_restored"] and rollback["config_cleared"]
        assert rollback["hooks_left"] == 0


def test_bad_mesh_rejected_before_any_weight_is_read(spine_report):
    for report in spine_report:
        rejections = report["rejections"]
        assert rejections["2d"].startswith("ValueError") and "mesh['tp']" in rejections["2d"]
        assert rejections["mps"].startswith("ValueError") and "'mps'" in rejections["mps"]
        assert "'mps'" in rejections["enable_mps"]
        assert rejections["enable_mps_untouched"]
