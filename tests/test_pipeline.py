"""Pipeline parallelism: one AccumulatingOptimizer per stage of a
torch.distributed.pipelining schedule (GPipe, 1F1B), on 2 gloo ranks (one
stage each) and on a (pp=2, dp=2) device mesh of 4, against one process
training the whole model on every data-parallel rank's batch; and what a
pipeline must not train silently wrong (tests/pipeline_worker.py runs it)."""

from __future__ import annotations

import pipeline_worker as worker
import pytest
import torch
import torch.distributed as dist
from helpers import assert_within_summation_noise
from test_distributed import spawn

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
pipelining = pytest.importorskip("torch.distributed.pipelining")

CASES_2 = {
    "gpipe": dict(scenario="pipeline_only", schedule="gpipe"),
    "1f1b": dict(scenario="pipeline_only", schedule="1f1b"),
    "refusals": dict(scenario="refusals", schedule="gpipe"),
}
CASES_4 = {"mesh-1f1b": dict(scenario="mesh_pp_dp", schedule="1f1b")}


@pytest.fixture(scope="module")
def runs():
    return {2: spawn(2, CASES_2, worker.main), 4: spawn(4, CASES_4, worker.main)}


def _stage_reference(reference: list[torch.Tensor], stage: int) -> list[torch.Tensor]:
    """The reference params that belong to ``stage`` (the full model's, in order)."""
    count = len(list(worker.stage_module(worker.full_model(), 0).parameters()))
    return reference[:count] if stage == 0 else reference[count:]


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
def test_each_stage_equals_one_process(runs, schedule):
    """Stages of different sizes, the wrapper's defaults: no reduction across
    the pipeline (each stage has no replica), the schedule's scale_grads on the
    fp32 .grad, the big batch's update."""
    reference, alternates = runs[2][0][schedule]["reference"], runs[2][0][schedule]["alternates"]
    for stage, result in enumerate(r[schedule] for r in runs[2]):
        assert result["world_size"] == 1
        assert_within_summation_noise(
            result["params"],
            _stage_reference(reference, stage),
            [_stage_reference(a, stage) for a in alternates],
            worker.WINDOWS,
        )


def test_a_pp_by_dp_mesh_equals_one_process(runs):
    """(pp=2, dp=2): each stage's wrapper reduces over its dp dimension only,
    found on the mesh or given as process_group=mesh['dp']."""
    results = [r["mesh-1f1b"] for r in runs[4]]
    reference, alternates = results[0]["reference"], results[0]["alternates"]
    for result in results:
        assert result["world_size"] == 2 and result["given_world_size"] == 2
        expected = _stage_reference(reference, result["pp_rank"])
        noise = [_stage_reference(a, result["pp_rank"]) for a in alternates]
        assert_within_summation_noise(result["params"], expected, noise, worker.WINDOWS)
        assert_within_summation_noise(result["given"], expected, noise, worker.WINDOWS)


def test_what_a_pipeline_must_not_train_silently(runs):
    for r in runs[2]:
        errors = r["refusals"]
        # Built before its stage, over stages of unequal sizes: refused at construction (no gloo abort).
        assert "other shapes" in errors["before_stage_unequal"] and "PipelineStage" in errors["before_stage_unequal"]
        # Over stages of equal shapes: their values differ, refused at the first step().
        assert "different param values" in errors["before_stage_equal"]
        # intake="hooks" (or accum_steps=N): the schedule's scale_grads cannot divide .grad.
        assert "intake='grad'" in errors["hooks"]
