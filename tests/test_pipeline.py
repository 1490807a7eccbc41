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
from helpers import assert_windows_within_bound, exact_window_norm
from test_distributed import WORKER_SEED, spawn

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
pipelining = pytest.importorskip("torch.distributed.pipelining")
CLIP = 0.05  # below every window's whole-model gradient norm (asserted): the clip acts

CASES_2 = {
    "gpipe": dict(scenario="pipeline_only", schedule="gpipe"),
    "1f1b": dict(scenario="pipeline_only", schedule="1f1b"),
    "refusals": dict(scenario="refusals", schedule="gpipe"),
    "gpipe-clip": dict(scenario="pipeline_only", schedule="gpipe", clip=CLIP),
}
CASES_4 = {
    "mesh-1f1b": dict(scenario="mesh_pp_dp", schedule="1f1b"),
    "mesh-1f1b-clip": dict(scenario="mesh_pp_dp", schedule="1f1b", clip=CLIP),
}


@pytest.fixture(scope="module")
def runs():
    return {2: spawn(2, CASES_2, worker.main), 4: spawn(4, CASES_4, worker.main)}


def assert_stages_exact_to_fp32(stages: list[list[list[torch.Tensor]]], schedule: str, dp: int, clip=None) -> None:
    """``stages``: stage 0's and stage 1's trajectories. Joined into the whole
    model's, every window is the exact AdamW step of the whole model on all
    data-parallel ranks' batches (clipped to ``clip`` by the whole model's
    norm), to the fp32 error bound (tests/helpers.py)."""
    whole = [first + second for first, second in zip(*stages)]
    gradients = worker.window_gradients(dict(seed=WORKER_SEED), dp)
    if clip is not None:
        for w, params in enumerate(whole[:-1]):
            assert exact_window_norm(*gradients(w, params)) > clip, f"window {w}: the clip would not act"
    assert_windows_within_bound(whole, gradients, worker.make_inner([torch.zeros(1)]), clip=clip)


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "gpipe-clip"])
def test_each_stage_equals_one_process(runs, schedule):
    """Stages of different sizes, the wrapper's defaults: no reduction across
    the pipeline (each stage has no replica), the schedule's scale_grads on the
    fp32 .grad, the big batch's update; with max_grad_norm=, clipped by the
    whole model's norm, every stage's summed over the pipeline (each stage
    clipped by its own before)."""
    results = [r[schedule] for r in runs[2]]
    assert all(result["world_size"] == 1 for result in results)
    clip = CASES_2[schedule].get("clip")
    assert_stages_exact_to_fp32([result["trajectory"] for result in results], schedule, 1, clip)


@pytest.mark.parametrize("case", ["mesh-1f1b", "mesh-1f1b-clip"])
def test_a_pp_by_dp_mesh_equals_one_process(runs, case):
    """(pp=2, dp=2): each stage's wrapper reduces over its dp dimension only,
    found on the mesh or given as process_group=mesh['dp']; the replicas of a
    stage hold the same params; max_grad_norm= clips by the whole model's
    norm over both dimensions."""
    results = [r[case] for r in runs[4]]
    stages = {}
    for result in results:
        assert result["world_size"] == 2 and result["given_world_size"] == 2
        first = stages.setdefault(result["pp_rank"], result)
        for key in ("trajectory", "given"):
            assert all(torch.equal(a, b) for a, b in zip(result[key][-1], first[key][-1])), key
    for key in ("trajectory", "given"):
        assert_stages_exact_to_fp32([stages[0][key], stages[1][key]], case, 2, CASES_4[case].get("clip"))


def test_what_a_pipeline_must_not_train_silently(runs):
    for r in runs[2]:
        errors = r["refusals"]
        # Built before its stage, over stages of unequal sizes: refused at construction (no gloo abort).
        assert "other shapes" in errors["before_stage_unequal"] and "PipelineStage" in errors["before_stage_unequal"]
        # Over stages of equal shapes: their values differ, refused at the first step().
        assert "different param values" in errors["before_stage_equal"]
        # intake="hooks" (or accum_steps=N): the schedule's scale_grads cannot divide .grad.
        assert "intake='grad'" in errors["hooks"]
