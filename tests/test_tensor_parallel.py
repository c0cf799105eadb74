"""Stock diffusers TP on CPU meshes after `import neuron_diffusers`: 2 gloo ranks vs one process.

Each test runs its own job on the session's pool of ranks (`rank_pool`), so a failure fails that test alone.
"""

import pytest
import rank_jobs
from conftest import IMAGE_FAMILIES

from neuron_diffusers.tools.plan.cases import reference_call


def test_init_distributed_builds_dp_tp_mesh(rank_pool):
    for report in rank_pool.run(rank_jobs.mesh_shapes, 2):
        assert report["mesh"] == (("dp", "tp"), (1, 2))
        assert report["mesh_tp1"] == (("dp", "tp"), (2, 1))


@pytest.mark.parametrize("family", IMAGE_FAMILIES)
def test_from_pretrained_tp2_matches_single_process(rank_pool, tiny_checkpoint, family):
    checkpoint = tiny_checkpoint(family)
    results = rank_pool.run(rank_jobs.tp2_load_check, 2, checkpoint, reference_call(checkpoint, family))
    for rank, result in enumerate(results):
        assert result["diff"] < 1e-5, f"rank {rank}: max abs diff {result['diff']}"
        assert result["planned"] > 0
        assert result["wrong"] == [], f"rank {rank}: planned weights not halved: {result['wrong'][:5]}"


def test_enable_parallelism_matches_single_process(rank_pool, tiny_checkpoint):
    flux = tiny_checkpoint("flux")
    for diff in rank_pool.run(rank_jobs.enable_parallelism_diff, 2, flux, reference_call(flux, "flux")):
        assert diff < 1e-5


def test_failed_enable_parallelism_leaves_model_untouched(rank_pool, tiny_checkpoint):
    flux = tiny_checkpoint("flux")
    for rollback in rank_pool.run(rank_jobs.enable_parallelism_rollback, 2, flux, reference_call(flux, "flux")):
        assert isinstance(rollback, dict), rollback
        assert "injected failure" in rollback["error"]
        assert rollback["sharded_before_failure"] == 2  # the failure really hit a half-sharded model
        assert rollback["params_restored"] and rollback["config_cleared"]
        assert rollback["hooks_left"] == 0
        assert rollback["diff_after"] < 1e-5  # and enabling it again afterwards works


def test_bad_mesh_rejected_before_any_weight_is_read(rank_pool, tiny_checkpoint):
    for rejections in rank_pool.run(rank_jobs.bad_mesh_rejections, 2, tiny_checkpoint("flux")):
        assert rejections["2d"].startswith("ValueError") and "mesh['tp']" in rejections["2d"]
        assert rejections["mps"].startswith("ValueError") and "'mps'" in rejections["mps"]
        assert "'mps'" in rejections["enable_mps"]
        assert rejections["enable_mps_untouched"]
