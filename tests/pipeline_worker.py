"""The process side of tests/test_pipeline.py: pipeline-parallel scenarios
(torch.distributed.pipelining, gloo on the CPU), one AccumulatingOptimizer per
stage, each returning what the test checks.

The model is an MLP cut into two stages of different sizes. A data-parallel
rank draws its batch from a generator seeded by (seed, window, dp rank); the
single-process reference trains the whole model on all data-parallel ranks'
batches with one plain AdamW step per window on the mean loss.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from distributed_worker import run_cases
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


def reference(cfg, dp: int, order: str = "rows") -> list[torch.Tensor]:
    """One process, the whole batch (``order="reverse"``: its rows from the
    last, ``"rolled"``: from the middle; the other orders measure the
    reference's own sensitivity to fp32 summation order)."""
    model = full_model()
    opt = make_inner(model.parameters())
    for w in range(WINDOWS):
        opt.zero_grad()
        xs, ys = zip(*(batch(cfg["seed"], w, r) for r in range(dp)))
        x, y = torch.cat(xs), torch.cat(ys)
        if order == "reverse":
            x, y = x.flip(0), y.flip(0)
        elif order == "rolled":
            x, y = x.roll(len(x) // 2, 0), y.roll(len(y) // 2, 0)
        F.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _schedule(name: str, stage):
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name]
    return cls(stage, MICRO, loss_fn=lambda out, target: F.mse_loss(out, target))


def train_pipeline(cfg, pp_rank: int, dp_rank: int, pp_group, wrapper_options: dict, wrapper_first=False):
    """Stage ``pp_rank`` of the pipeline on ``pp_group``: the stage's params after WINDOWS windows."""
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
    for w in range(WINDOWS):
        x, y = batch(cfg["seed"], w, dp_rank, 12 if equal else 3)
        if pp_rank == 0:
            schedule.step(x)
        else:
            schedule.step(target=y, losses=[])
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in sub.parameters()], opt


def _error(run) -> str | None:
    try:
        run()
    except (RuntimeError, ValueError) as e:
        return str(e)
    return None


def pipeline_only(cfg, rank, world):
    """Two ranks, one stage each, no data parallelism: the wrapper built after
    the stage (defaults), then with process_group= given explicitly."""
    params, opt = train_pipeline(cfg, rank, 0, None, {})
    out = {"params": params, "world_size": opt.world_size}
    if rank == 0:
        out["reference"] = reference(cfg, 1)
        out["alternates"] = [reference(cfg, 1, order) for order in ("reverse", "rolled")]
    return out


def mesh_pp_dp(cfg, rank, world):
    """Four ranks on a (pp=2, dp=2) mesh: each stage's wrapper finds the mesh
    and reduces over its dp dimension (and likewise with process_group=mesh['dp'])."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    found, opt = train_pipeline(cfg, pp_rank, dp_rank, mesh["pp"].get_group(), {})
    given, given_opt = train_pipeline(cfg, pp_rank, dp_rank, mesh["pp"].get_group(), {"process_group": mesh["dp"]})
    out = {
        "pp_rank": pp_rank,
        "params": found,
        "given": given,
        "world_size": opt.world_size,
        "given_world_size": given_opt.world_size,
    }
    if rank == 0:
        out["reference"] = reference(cfg, 2)
        out["alternates"] = [reference(cfg, 2, order) for order in ("reverse", "rolled")]
    return out


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
