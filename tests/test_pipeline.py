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
from test_contract import _assert_fused_close
from test_distributed import WORKER_SEED, spawn

pytestmark = pytest.mark.skipif(not dist.is_available() or not dist.is_gloo_available(), reason="needs gloo")
pipelining = pytest.importorskip("torch.distributed.pipelining")
CLIP = 0.05  # below every window's whole-model gradient norm (asserted): the clip acts

CASES_2 = {
    "gpipe": dict(scenario="pipeline_only", schedule="gpipe"),
    "1f1b": dict(scenario="pipeline_only", schedule="1f1b"),
    "refusals": dict(scenario="refusals", schedule="gpipe"),
    "gpipe-clip": dict(scenario="pipeline_only", schedule="gpipe", clip=CLIP),
    "gpipe-torch-clip": dict(scenario="pipeline_only", schedule="gpipe", torch_clip=CLIP),
    "gpipe-hooks": dict(scenario="pipeline_only", schedule="gpipe", intake="hooks"),
    "1f1b-hooks-clip": dict(scenario="pipeline_only", schedule="1f1b", intake="hooks", clip=CLIP),
}
CASES_4 = {
    "stale-meshes": dict(scenario="stale_meshes"),  # first: no earlier case's mesh may live on
    "mesh-1f1b": dict(scenario="mesh_pp_dp", schedule="1f1b"),
    "mesh-1f1b-clip": dict(scenario="mesh_pp_dp", schedule="1f1b", clip=CLIP),
    "mesh-1f1b-torch-clip": dict(scenario="mesh_pp_dp", schedule="1f1b", torch_clip=CLIP),
    "mesh-against-ddp": dict(
        scenario="mesh_against_ddp", schedule="1f1b", torch_clip=CLIP, schedule_steps=2, scale_grads=False
    ),
    "mesh-interleaved": dict(scenario="mesh_stages", interleaved=True, torch_clip=CLIP),
    "mesh-1f1b-hooks-clip": dict(scenario="mesh_pp_dp", schedule="1f1b", intake="hooks", clip=CLIP),
    "mesh-1f1b-zero1-clip": dict(scenario="mesh_pp_dp", schedule="1f1b", intake="hooks", sharded=True, clip=CLIP),
    "mesh-fsdp": dict(scenario="mesh_stages", schedule="1f1b", fsdp=True, torch_clip=CLIP),
    "mesh-interleaved-fsdp": dict(scenario="mesh_stages", interleaved=True, fsdp=True, torch_clip=CLIP),
    "mesh-multi-loop": dict(scenario="mesh_stages", interleaved=True, multi_loop=True, torch_clip=CLIP),
}


@pytest.fixture(scope="module")
def runs():
    return {2: spawn(2, CASES_2, worker.main), 4: spawn(4, CASES_4, worker.main)}


def _clip(case: dict):
    """The norm a case clips to: by the wrapper's max_grad_norm= or by torch's clip on .grad."""
    return case.get("clip") or case.get("torch_clip")


def assert_stages_exact_to_fp32(stages: list[list[list[torch.Tensor]]], dp: int, clip=None, logged=()) -> None:
    """``stages``: stage 0's and stage 1's trajectories. Joined into the whole
    model's, every window is the exact AdamW step of the whole model on all
    data-parallel ranks' batches (clipped to ``clip`` by the whole model's
    norm), to the fp32 error bound (tests/helpers.py). ``logged``: each rank's
    norms from torch's clip, each the exact window norm to 1e-5 (a sum within
    gamma_{n+2} of the exact one, its norm computed in fp32 over 1,603 elements)."""
    whole = [first + second for first, second in zip(*stages)]
    gradients = worker.window_gradients(dict(seed=WORKER_SEED), dp)
    exact_norms = [exact_window_norm(*gradients(w, params)) for w, params in enumerate(whole[:-1])]
    if clip is not None:
        assert min(exact_norms) > clip, "the clip would not act"
    for norms in logged:
        torch.testing.assert_close(torch.tensor(norms), torch.tensor(exact_norms), rtol=1e-5, atol=0)
    assert_windows_within_bound(whole, gradients, worker.make_inner([torch.zeros(1)]), clip=clip)


@pytest.mark.parametrize("schedule", [name for name in CASES_2 if name != "refusals"])
def test_each_stage_equals_one_process(runs, schedule):
    """Stages of different sizes, the wrapper's defaults: no reduction across
    the pipeline (each stage has no replica), the schedule's scale_grads on the
    fp32 .grad, the big batch's update; with max_grad_norm=, clipped by the
    whole model's norm, every stage's summed over the pipeline (each stage
    clipped by its own before); likewise by torch's clip on .grad. Intake
    "hooks" alike: scale_grads divides each marker's window sum (refused
    before)."""
    results = [r[schedule] for r in runs[2]]
    assert all(result["world_size"] == 1 for result in results)
    logged = [result["norms"] for result in results if result["norms"]]
    assert len(logged) == (2 if "torch_clip" in CASES_2[schedule] else 0)
    assert_stages_exact_to_fp32([result["trajectory"] for result in results], 1, _clip(CASES_2[schedule]), logged)


@pytest.mark.parametrize("case", [name for name, case in CASES_4.items() if case["scenario"] == "mesh_pp_dp"])
def test_a_pp_by_dp_mesh_equals_one_process(runs, case):
    """(pp=2, dp=2): each stage's wrapper reduces over its dp dimension only,
    found on the mesh or given as process_group=mesh['dp']; the replicas of a
    stage hold the same params; max_grad_norm= clips by the whole model's
    norm over both dimensions. So does torch's clip between schedule.step()
    and step(): the window is reduced over dp when the schedule's backwards
    end, as DDP's or FSDP's is (before, it waited for step(), and each dp rank
    clipped its own gradient by its own norm)."""
    results = [r[case] for r in runs[4]]
    stages = {}
    for result in results:
        assert result["world_size"] == 2 and result["given_world_size"] == 2
        first = stages.setdefault(result["pp_rank"], result)
        for key in ("trajectory", "given"):
            assert all(torch.equal(a, b) for a, b in zip(result[key][-1], first[key][-1])), key
    torch_clip = "torch_clip" in CASES_4[case]
    for key, norms in (("trajectory", "norms"), ("given", "given_norms")):
        logged = [result[norms] for result in results]
        assert all(bool(n) == torch_clip for n in logged)
        assert_stages_exact_to_fp32([stages[0][key], stages[1][key]], 2, _clip(CASES_4[case]), logged * torch_clip)


@pytest.mark.parametrize(
    "case", ["mesh-against-ddp", "mesh-interleaved", "mesh-multi-loop", "mesh-fsdp", "mesh-interleaved-fsdp"]
)
def test_a_pp_by_dp_mesh_trains_as_torch(runs, case):
    """Torch's clip between schedule.step() and step(), against torch's AdamW
    on the .grad torch's data-parallel stages give: two schedule steps per
    window on stages wrapped in DDP (the wrapper's second schedule step adds
    into the reduced window, which is reduced again); and Interleaved1F1B,
    two stages per rank (.grad averaged over dp by hand: DDP stages fail
    there inside torch), also run by PipelineScheduleMulti's own step loop
    (custom schedules' loop: it calls each stage's scale_grads, not
    perform_reduce_grad, and the wrapper reduces after it); and stages
    FSDP2-sharded over dp (torchtitan's PP x FSDP: FSDP2 reduce-scatters
    when the backwards end, then scale_grads divides .grad, our markers'
    window sums included; ours clips with max_grad_norm=, by the whole
    model's norm summed over pp and dp: before, scale_grads was refused and
    max_grad_norm= clipped each stage by its own norm), one stage per rank
    (1F1B) and two (Interleaved1F1B, one wrapper over both). The runs'
    gradients are bitwise alike (W=2: halving is exact), so each window
    differs by the fused step's operation order, STEP_ULPS ulps of a
    tensor's largest value per step; the logged norms are of params that
    differ by that much (1e-5 relative). Refused: the wrapper over a DDP
    stage (the schedule prepares DDP's reducer itself, which would reduce
    .grad a second time, in bf16 for bf16 params), and max_grad_norm= on a
    wrapper over one of a rank's two stages (its norm, summed over pp, would
    leave out the other's: each stage was clipped by half the model's norm
    before)."""
    for result in (r[case] for r in runs[4]):
        ours, reference = result["ours"], result["torch"]
        torch.testing.assert_close(torch.tensor(ours["norms"]), torch.tensor(reference["norms"]), rtol=1e-5, atol=0)
        for w, (a, b) in enumerate(zip(ours["trajectory"], reference["trajectory"])):
            _assert_fused_close(a, b, steps=w)
        if case == "mesh-against-ddp":
            assert "plain module (ddp.module)" in result["ddp_stage"]
        if case == "mesh-interleaved-fsdp":
            assert "one optimizer over the params of all of this process's stages" in ours["one_per_stage"]


def test_a_stage_reduces_over_the_mesh_it_was_built_on(runs):
    """The stage's wrapper takes the dp group of the mesh whose pp group the
    stage was built with, where younger (2, 2) meshes live beside it (the
    scan meets them first: before, each rank took the first with a pp group
    of the same ranks, and 4-rank runs of this module hung beside other
    tests); a stage over a pipeline group of the user's own is found by its
    ranks where one mesh has them, and refused, naming process_group=,
    where several do; so are two live stages over the same module on
    different pipeline groups."""
    for result in (r["stale-meshes"] for r in runs[4]):
        assert result["meant"] and result["by_ranks"]
        assert "3 live 2-D device meshes" in result["ambiguous"] and "process_group=" in result["ambiguous"]
        assert "2 live PipelineStage objects over different pipeline groups" in result["two_stages"]


def test_what_a_pipeline_must_not_train_silently(runs):
    for r in runs[2]:
        errors = r["refusals"]
        # Built before its stage, over stages of unequal sizes: refused at construction (no gloo abort).
        assert "other shapes" in errors["before_stage_unequal"] and "PipelineStage" in errors["before_stage_unequal"]
        # Over stages of equal shapes: their values differ, refused at the first step().
        assert "different param values" in errors["before_stage_equal"]
        # A bf16 wire, two schedule steps before step(): the second is refused, naming what to do.
        assert "one schedule.step() per step()" in errors["bf16_wire_two_schedule_steps"]
