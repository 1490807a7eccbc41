"""The process side of tests/test_pipeline.py: pipeline-parallel scenarios
(torch.distributed.pipelining, gloo on the CPU), one AccumulatingOptimizer per
stage, each returning what the test checks.

The model is an MLP cut into two stages of different sizes. A data-parallel
rank draws its batch from a generator seeded by (seed, window, dp rank); the
tests check each window of the stages' params against the exact AdamW step of
the whole model on all data-parallel ranks' batches (window_gradients).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from distributed_worker import run_cases
from helpers import gradients_at
from torch import nn
from torch.nn import functional as F

import accumkernels as ak

WINDOWS, MICRO, BATCH = 3, 4, 16


def full_model(equal_stages: bool = False) -> nn.Sequential:
    torch.manual_seed(1234)
    if equal_stages:  # two stages of the same shapes: only their values differ
        return nn.Sequential(nn.Linear(12, 12), nn.Tanh(), nn.Linear(12, 12))
    return nn.Sequential(nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 32), nn.LayerNorm(32), nn.GELU(), nn.Linear(32, 3))


def stage_module(model: nn.Sequential, stage: int, equal_stages: bool = False) -> nn.Module:
    cut = 2 if equal_stages else 3
    return model[:cut] if stage == 0 else model[cut:]


def batch(seed: int, window: int, dp_rank: int, out: int = 3):
    g = torch.Generator().manual_seed(seed * 1_000_003 + window * 10_007 + dp_rank)
    return torch.randn(BATCH, 12, generator=g), torch.randn(BATCH, out, generator=g)


def make_inner(params):
    return torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, eps=1e-4)


def window_gradients(cfg, dp: int):
    """For tests/helpers.py's assert_windows_within_bound: window w's
    micro-batch gradients of the whole model at the given params (the
    schedule's MICRO chunks of every data-parallel rank's batch, each loss the
    chunk's mean), and the divisor of their sum (scale_grads' MICRO times the
    mean over dp ranks)."""

    def gradients(w: int, params: list[torch.Tensor]):
        chunks = [(xm, ym) for r in range(dp) for xm, ym in zip(*(t.chunk(MICRO) for t in batch(cfg["seed"], w, r)))]
        losses = [lambda model, x=x, y=y: F.mse_loss(model(x), y) for x, y in chunks]
        return gradients_at(full_model(), params, losses), MICRO * dp

    return gradients


def _schedule(name: str, stage):
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name]
    return cls(stage, MICRO, loss_fn=lambda out, target: F.mse_loss(out, target))


def train_pipeline(cfg, pp_rank: int, dp_rank: int, pp_group, wrapper_options: dict, wrapper_first=False):
    """Stage ``pp_rank`` of the pipeline on ``pp_group``: the stage's params
    before the first window and after each."""
    from torch.distributed.pipelining import PipelineStage

    equal = cfg.get("equal_stages", False)
    model = full_model(equal)
    sub = stage_module(model, pp_rank, equal)
    opt = None
    if wrapper_first:
        opt = ak.AccumulatingOptimizer(make_inner(sub.parameters()), backend=cfg["backend"], **wrapper_options)
    stage = PipelineStage(sub, pp_rank, 2, torch.device("cpu"), group=pp_group)
    if opt is None:
        opt = ak.AccumulatingOptimizer(make_inner(sub.parameters()), backend=cfg["backend"], **wrapper_options)
    schedule = _schedule(cfg["schedule"], stage)
    trajectory = [[p.detach().clone() for p in sub.parameters()]]
    for w in range(WINDOWS):
        x, y = batch(cfg["seed"], w, dp_rank, 12 if equal else 3)
        if pp_rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])
        opt.step()
        opt.zero_grad()
        trajectory.append([p.detach().clone() for p in sub.parameters()])
    return trajectory, opt


def _error(run) -> str | None:
    try:
        run()
    except (RuntimeError, ValueError) as e:
        return str(e)
    return None


def _options(cfg) -> dict:
    """The wrapper's options: the defaults, or max_grad_norm=cfg["clip"]."""
    return {"max_grad_norm": cfg["clip"]} if cfg.get("clip") else {}


def pipeline_only(cfg, rank, world):
    """Two ranks, one stage each, no data parallelism: the wrapper built after
    the stage (defaults, or clipping by the whole model's norm)."""
    trajectory, opt = train_pipeline(cfg, rank, 0, None, _options(cfg))
    return {"trajectory": trajectory, "world_size": opt.world_size}


def mesh_pp_dp(cfg, rank, world):
    """Four ranks on a (pp=2, dp=2) mesh: each stage's wrapper finds the mesh
    and reduces over its dp dimension (and likewise with process_group=mesh['dp'])."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    found, opt = train_pipeline(cfg, pp_rank, dp_rank, mesh["pp"].get_group(), _options(cfg))
    given, given_opt = train_pipeline(
        cfg, pp_rank, dp_rank, mesh["pp"].get_group(), {"process_group": mesh["dp"], **_options(cfg)}
    )
    return {
        "pp_rank": pp_rank,
        "dp_rank": dp_rank,
        "trajectory": found,
        "given": given,
        "world_size": opt.world_size,
        "given_world_size": given_opt.world_size,
    }


def refusals(cfg, rank, world):
    """What a pipeline must not train silently wrong: the wrapper built before
    the stage (it cannot know it is one) over stages of unequal and of equal
    shapes; the hooks intake, whose .grad a schedule's scale_grads cannot
    divide (intake='hooks', or accum_steps=N)."""
    out = {}
    out["before_stage_unequal"] = _error(lambda: train_pipeline(cfg, rank, 0, None, {}, wrapper_first=True))
    dist.barrier()
    out["before_stage_equal"] = _error(
        lambda: train_pipeline(dict(cfg, equal_stages=True), rank, 0, None, {}, wrapper_first=True)
    )
    dist.barrier()
    out["hooks"] = _error(lambda: train_pipeline(cfg, rank, 0, None, {"intake": "hooks"}))
    return out


SCENARIOS = {"pipeline_only": pipeline_only, "mesh_pp_dp": mesh_pp_dp, "refusals": refusals}


def _run_case(cfg: dict, rank: int, world: int):
    return SCENARIOS[cfg["scenario"]](cfg, rank, world)


def main(rank: int, world: int, init_file: str, out_dir: str, cases: dict) -> None:
    run_cases(rank, world, init_file, out_dir, cases, _run_case)
