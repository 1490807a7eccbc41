"""The process side of tests/test_pipeline.py: pipeline-parallel scenarios
(torch.distributed.pipelining, gloo on the CPU), one AccumulatingOptimizer per
stage, each returning what the test checks.

The model is an MLP cut into two stages of different sizes. A data-parallel
rank draws its batch from a generator seeded by (seed, window, dp rank); the
tests check each window of the stages' params against the exact AdamW step of
the whole model on all data-parallel ranks' batches (window_gradients).
"""

from __future__ import annotations

import functools
import gc

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


def _schedule(name: str, stage, scale_grads: bool = True):
    """``scale_grads=False``: the schedule's perform_reduce_grad divides nothing (sum-reduced losses)."""
    from torch.distributed.pipelining import Schedule1F1B, ScheduleGPipe

    cls = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B}[name]
    return cls(stage, MICRO, loss_fn=lambda out, target: F.mse_loss(out, target), scale_grads=scale_grads)


def schedule_step(schedule, pp_rank: int, x, y) -> None:
    """One schedule step of a two-rank pipeline: the first rank feeds the inputs, the last the targets."""
    if pp_rank == 0:
        schedule.step(x)
    else:
        schedule.step(target=y, losses=[])


def torch_clip(params, max_norm: float, pp_group) -> float:
    """How torch users clip a pipeline (torchtitan's clip_grad_norm_ with a
    pp mesh): each stage's squared norm of ``.grad`` summed over the pipeline
    group, every stage clipped by the whole model's norm; between
    ``schedule.step()`` and ``step()``, where torch's data-parallel
    reduction (DDP, FSDP) has made ``.grad`` the stage's global gradient
    (FSDP2's: a DTensor, whose norm is one over the dp mesh)."""
    params = [p for p in params if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in params])
    squared = (norm.full_tensor() if hasattr(norm, "full_tensor") else norm) ** 2
    dist.all_reduce(squared, group=pp_group)
    total = squared.sqrt()
    torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
    return float(total)


def train_pipeline(
    cfg, pp_rank: int, dp_rank: int, pp_group, wrapper_options: dict | None, wrapper_first=False, dp_group=None
):
    """Stage ``pp_rank`` of the pipeline on ``pp_group``: the stage's params
    before the first window and after each, and the norms torch's clip
    logged (cfg["torch_clip"]: clipping to it between the schedule's step and
    the optimizer's). ``wrapper_options`` None: torch's AdamW alone;
    ``dp_group``: the stage module wrapped in DDP over it, as torch's
    pipelining supports; cfg["schedule_steps"]: schedule steps per window;
    cfg["scale_grads"]: the schedule's."""
    from torch.distributed.pipelining import PipelineStage

    equal = cfg.get("equal_stages", False)
    model = full_model(equal)
    sub = stage_module(model, pp_rank, equal)

    def optimizer():
        if wrapper_options is None:
            return make_inner(sub.parameters())
        return ak.AccumulatingOptimizer(make_inner(sub.parameters()), backend=cfg["backend"], **wrapper_options)

    opt = optimizer() if wrapper_first else None
    module = sub if dp_group is None else nn.parallel.DistributedDataParallel(sub, process_group=dp_group)
    stage = PipelineStage(module, pp_rank, 2, torch.device("cpu"), group=pp_group)
    opt = opt or optimizer()
    schedule = _schedule(cfg["schedule"], stage, cfg.get("scale_grads", True))
    trajectory, norms = [[p.detach().clone() for p in sub.parameters()]], []
    for w in range(WINDOWS):
        for k in range(cfg.get("schedule_steps", 1)):
            x, y = batch(cfg["seed"], w + 1000 * k, dp_rank, 12 if equal else 3)
            schedule_step(schedule, pp_rank, x, y)
        if cfg.get("torch_clip"):
            norms.append(torch_clip(sub.parameters(), cfg["torch_clip"], pp_group or dist.group.WORLD))
        opt.step()
        opt.zero_grad()
        trajectory.append([p.detach().clone() for p in sub.parameters()])
    return trajectory, norms, opt


def _error(run) -> str | None:
    """The error ``run()`` raised, with its causes (a schedule re-raises a backward's error)."""
    try:
        run()
    except (RuntimeError, ValueError) as e:
        messages = []
        while e is not None:
            messages.append(str(e))
            e = e.__cause__
        return " <- ".join(messages)
    return None


def _options(cfg) -> dict:
    """The wrapper's options: the defaults, max_grad_norm=cfg["clip"], intake=cfg["intake"], sharded=cfg["sharded"]."""
    names = (("clip", "max_grad_norm"), ("intake", "intake"), ("sharded", "sharded"))
    return {name: cfg[key] for key, name in names if cfg.get(key)}


def pipeline_only(cfg, rank, world):
    """Two ranks, one stage each, no data parallelism: the wrapper built after
    the stage (defaults, or clipping by the whole model's norm)."""
    trajectory, norms, opt = train_pipeline(cfg, rank, 0, None, _options(cfg))
    return {"trajectory": trajectory, "norms": norms, "world_size": opt.world_size}


def mesh_pp_dp(cfg, rank, world):
    """Four ranks on a (pp=2, dp=2) mesh: each stage's wrapper finds the mesh
    and reduces over its dp dimension (and likewise with process_group=mesh['dp'])."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank()
    found, norms, opt = train_pipeline(cfg, pp_rank, dp_rank, mesh["pp"].get_group(), _options(cfg))
    given, given_norms, given_opt = train_pipeline(
        cfg, pp_rank, dp_rank, mesh["pp"].get_group(), {"process_group": mesh["dp"], **_options(cfg)}
    )
    return {
        "pp_rank": pp_rank,
        "dp_rank": dp_rank,
        "trajectory": found,
        "given": given,
        "norms": norms,
        "given_norms": given_norms,
        "world_size": opt.world_size,
        "given_world_size": given_opt.world_size,
    }


def mesh_against_ddp(cfg, rank, world):
    """(pp=2, dp=2), cfg["schedule_steps"] schedule steps per window (and
    cfg["scale_grads"]: False leaves the schedule's perform_reduce_grad the
    one call after the backwards), torch's
    clip between the last and step(): the run torch users have (each stage
    module wrapped in DDP over dp, which reduces in each schedule step's last
    backward; torch's AdamW) and the wrapper on plain stages (which reduces
    when each schedule step's backwards end); and the wrapper over a DDP
    stage, which is refused."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    pp_rank, dp_rank, pp_group = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank(), mesh["pp"].get_group()
    dp_group = mesh["dp"].get_group()
    runs = {
        "torch": train_pipeline(cfg, pp_rank, dp_rank, pp_group, None, dp_group=dp_group),
        "ours": train_pipeline(cfg, pp_rank, dp_rank, pp_group, {}),
    }
    out = {name: {"trajectory": run[0], "norms": run[1]} for name, run in runs.items()}
    out["ddp_stage"] = _error(lambda: train_pipeline(cfg, pp_rank, dp_rank, pp_group, {}, dp_group=dp_group))
    return out


def stale_meshes(cfg, rank, world):
    """Which data-parallel group a stage's wrapper finds on a (pp=2, dp=2)
    mesh while two other (2, 2) meshes are alive (a run's meshes that its
    caller dropped but gc has not collected yet), younger than it, so that a
    scan of the live objects meets them first: the mesh whose pp group the
    stage was built with ("meant"; before, the first mesh met with a pp
    group of the same ranks, so each rank could take another's and hang in
    its reductions). A stage over a pipeline group of the user's own
    (dist.new_group of the same ranks) is found by ranks: refused while the
    three meshes live ("ambiguous"), found once the other two are dropped
    ("by_ranks"; the first case of its ranks' run: a mesh of an FSDP2 case
    before it lives on in torch's DTensor caches, and would make it
    ambiguous too). A stage built again over the same module on another
    mesh, while the first is still referenced: refused ("two_stages")."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    gc.collect()  # the mesh meant is now in gc's oldest generation, which a scan of the live objects reads last
    others = [init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp")) for _ in range(2)]
    pp_rank, pp_ranks = mesh["pp"].get_local_rank(), dist.get_process_group_ranks(mesh["pp"].get_group())
    own = {tuple(ranks): dist.new_group(ranks) for ranks in ([0, 2], [1, 3])}[tuple(pp_ranks)]
    sub = stage_module(full_model(), pp_rank)

    def dp_group(pp_group):
        stage = PipelineStage(sub, pp_rank, 2, torch.device("cpu"), group=pp_group)
        opt = ak.AccumulatingOptimizer(make_inner(sub.parameters()), backend=cfg["backend"])
        del stage
        opt.close()
        return opt.process_group

    out = {"meant": dp_group(mesh["pp"].get_group()) is mesh["dp"].get_group()}
    out["ambiguous"] = _error(lambda: dp_group(own))
    del others
    out["by_ranks"] = dp_group(own) is mesh["dp"].get_group()
    # A stage built again over the same module, on another mesh, the first still referenced: refused.
    other = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    first = PipelineStage(sub, pp_rank, 2, torch.device("cpu"), group=other["pp"].get_group())
    out["two_stages"] = _error(lambda: dp_group(mesh["pp"].get_group()))
    del first
    return out


def _four_stages() -> nn.Sequential:
    torch.manual_seed(1234)
    return nn.Sequential(
        nn.Linear(12, 32), nn.GELU(), nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 32), nn.LayerNorm(32),
        nn.Linear(32, 16), nn.GELU(), nn.Linear(16, 3),
    )  # fmt: skip


FOUR_CUTS = [(0, 2), (2, 4), (4, 7), (7, 9)]


def _stage_modules(cfg, pp_rank: int) -> list[tuple[int, nn.Module]]:
    """This rank's (stage index, module) pairs: with cfg["interleaved"], stages
    pp_rank and pp_rank + 2 of four (Interleaved1F1B); else stage pp_rank of two."""
    if not cfg.get("interleaved"):
        return [(pp_rank, stage_module(full_model(), pp_rank))]
    model = _four_stages()
    return [(i, model[slice(*FOUR_CUTS[i])]) for i in (pp_rank, pp_rank + 2)]


def _train_stages(cfg, mesh, ours: bool):
    """This rank's stages (_stage_modules) on the (pp=2, dp=2) mesh, clipped
    after each schedule step. ``ours``: one wrapper per stage and torch's
    clip; else torch's AdamW over all of them, after ``.grad`` is averaged
    over dp (what DDP or FSDP stages give; DDP stages fail inside torch's
    interleaved schedules, an internal assert of DDP's reducer), and torch's
    clip. cfg["fsdp"]: each stage module FSDP2-sharded over dp (torchtitan's
    PP x FSDP: FSDP2 averages .grad, reduce-scattered in the schedule's
    perform_reduce_grad before scale_grads divides it), torch's clip on the
    sharded .grad, and ours one wrapper over all the rank's stages (intake
    "hooks", FSDP2's) with max_grad_norm= (one per stage, of two, is refused:
    "one_per_stage"). Returns the params (full) after each window and the
    norms clipped by."""
    from torch.distributed.pipelining import PipelineStage, ScheduleInterleaved1F1B

    pp_rank, dp_rank, pp_group = mesh["pp"].get_local_rank(), mesh["dp"].get_local_rank(), mesh["pp"].get_group()
    indexed = _stage_modules(cfg, pp_rank)
    subs = [sub for _, sub in indexed]
    fsdp = cfg.get("fsdp", False)
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for sub in subs:
            fully_shard(sub, mesh=mesh["dp"])
    num_stages = 2 * len(indexed)
    stages = [PipelineStage(sub, i, num_stages, torch.device("cpu"), group=pp_group) for i, sub in indexed]
    params = [p for sub in subs for p in sub.parameters()]
    out = {}
    if ours and fsdp:
        clip = {"intake": "hooks", "max_grad_norm": cfg["torch_clip"], "backend": cfg["backend"]}
        if len(subs) > 1:
            out["one_per_stage"] = _error(lambda: ak.AccumulatingOptimizer(make_inner(subs[0].parameters()), **clip))
        opts = [ak.AccumulatingOptimizer(make_inner(params), **clip)]
    elif ours:
        opts = [ak.AccumulatingOptimizer(make_inner(sub.parameters()), backend=cfg["backend"]) for sub in subs]
    else:
        opts = [make_inner(params)]
    if cfg.get("interleaved"):
        schedule = ScheduleInterleaved1F1B(stages, MICRO, loss_fn=lambda out, target: F.mse_loss(out, target))
    else:
        schedule = _schedule(cfg["schedule"], stages[0])
    if cfg.get("multi_loop"):
        # PipelineScheduleMulti's own step loop over the same order (custom
        # schedules subclassing it run it): it calls each stage's scale_grads
        # after its last backward, not perform_reduce_grad.
        from torch.distributed.pipelining.schedules import PipelineScheduleMulti

        schedule._step_microbatches = functools.partial(PipelineScheduleMulti._step_microbatches, schedule)
    full = (lambda p: p.full_tensor()) if fsdp else (lambda p: p.detach())
    trajectory, norms = [[full(p).clone() for p in params]], []
    for w in range(WINDOWS):
        x, y = batch(cfg["seed"], w, dp_rank)
        schedule_step(schedule, pp_rank, x, y)
        if not ours and not fsdp:
            for p in params:
                dist.all_reduce(p.grad, group=mesh["dp"].get_group())
                p.grad.div_(mesh["dp"].size())
        if not (ours and fsdp):
            norms.append(torch_clip(params, cfg["torch_clip"], pp_group))
        for opt in opts:
            opt.step()
            opt.zero_grad()
        if ours and fsdp:
            norms.append(float(opts[0].last_grad_norm))
        trajectory.append([full(p).clone() for p in params])
    for opt in opts:
        getattr(opt, "close", lambda: None)()
    return {"trajectory": trajectory, "norms": norms, **out}


def mesh_stages(cfg, rank, world):
    """(pp=2, dp=2), one stage per rank or, cfg["interleaved"], two
    (Interleaved1F1B, which torch 2.14 runs through its schedule runtime:
    perform_reduce_grad per stage once its backwards have run): torch's run
    and ours."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("pp", "dp"))
    return {"torch": _train_stages(cfg, mesh, False), "ours": _train_stages(cfg, mesh, True)}


def _single_stage_two_schedule_steps(cfg, wire_dtype):
    """A one-stage pipeline on a (pp=1, dp=2) mesh, two schedule steps before step()."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

    mesh = init_device_mesh("cpu", (1, 2), mesh_dim_names=("pp", "dp"))
    model = full_model()
    stage = PipelineStage(model, 0, 1, torch.device("cpu"), group=mesh["pp"].get_group())
    opt = ak.AccumulatingOptimizer(make_inner(model.parameters()), backend=cfg["backend"], wire_dtype=wire_dtype)
    schedule = ScheduleGPipe(stage, MICRO, loss_fn=lambda out, target: F.mse_loss(out, target))
    try:
        for k in range(2):
            x, y = batch(cfg["seed"], k, mesh["dp"].get_local_rank())
            schedule.step(x, target=y)
        opt.step()
    finally:
        opt.close()


def refusals(cfg, rank, world):
    """What a pipeline must not train silently wrong: the wrapper built before
    the stage (it cannot know it is one) over stages of unequal and of equal
    shapes; a bf16 wire with two schedule steps per window."""
    out = {}
    out["before_stage_unequal"] = _error(lambda: train_pipeline(cfg, rank, 0, None, {}, wrapper_first=True))
    dist.barrier()
    out["before_stage_equal"] = _error(
        lambda: train_pipeline(dict(cfg, equal_stages=True), rank, 0, None, {}, wrapper_first=True)
    )
    dist.barrier()
    # A bf16 wire rounds each rank's contribution once per window: a second
    # schedule step after the window's reduction is refused (a float32 one is
    # summed: mesh_against_ddp).
    out["bf16_wire_two_schedule_steps"] = _error(lambda: _single_stage_two_schedule_steps(cfg, torch.bfloat16))
    return out


SCENARIOS = {
    "pipeline_only": pipeline_only,
    "mesh_pp_dp": mesh_pp_dp,
    "mesh_against_ddp": mesh_against_ddp,
    "mesh_stages": mesh_stages,
    "stale_meshes": stale_meshes,
    "refusals": refusals,
}


def _run_case(cfg: dict, rank: int, world: int):
    return SCENARIOS[cfg["scenario"]](cfg, rank, world)


def main(rank: int, world: int, init_file: str, out_dir: str, cases: dict) -> None:
    run_cases(rank, world, init_file, out_dir, cases, _run_case)
