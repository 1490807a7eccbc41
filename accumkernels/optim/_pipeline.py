"""Pipeline parallelism (``torch.distributed.pipelining``): one wrapper per
stage, reducing over the stage's data-parallel group only.

A pipeline splits the model across the ranks of a pipeline group: each rank
holds one stage, whose params no other rank of that group holds. The wrapper's
default group (the world) would take the stages for data-parallel replicas and
sum one stage's buffer with another's (or, with stages of different sizes,
abort the process inside the collective). So a wrapper whose params a
``PipelineStage`` holds reduces over the ranks that hold the same stage:

- no other pipeline (the stage's group is the world): no reduction at all;
- pipelines side by side on a device mesh (PP x DP): the mesh dimension that
  is not the stage's group, found among the process's DeviceMesh objects (the
  mesh whose dimension is the stage's group object; only where none is, the
  one whose dimension has its ranks);
- anything else (a group of the user's own, a mesh with more dimensions):
  refused, naming ``process_group=``.

A schedule runs one backward per micro-batch and then divides ``.grad`` by
their number (``scale_grads``), so a stage's wrapper runs with
``accum_steps=None``: every ``step()`` after a schedule step ends a window.
With intake "grad" (its default), a stage with replicas has its window
reduced when the schedule's backwards end (``reduce_when_backwards_end``),
where torch's data-parallel wrappers reduce theirs: code that reads ``.grad``
between ``schedule.step()`` and ``step()`` (a clip, a logged norm) sees the
stage's gradient averaged over its replicas, as with DDP or FSDP. With intake
"hooks" (an FSDP2 stage's), ``scale_grads`` divides the ``.grad`` markers
(accumkernels.optim._folded), and a stage with plain replicas reduces at
``step()``; FSDP2 reduces its own stage's gradients in the schedule's
``perform_reduce_grad``. Either way a clip by ``max_grad_norm=`` sums the
stages' squared norms over the pipeline group (``Sync.over_stages``).
"""

from __future__ import annotations

import gc

import torch.distributed as dist

from ._discovery import live_instances


def stages_holding(params) -> list:
    """The pipeline stages (``_PipelineStageBase``) in this process whose
    submodule holds any of ``params``. A stage an earlier run built over the
    same module, dropped but not yet collected, is found too: where the
    stages found run over different pipeline groups, gc runs first, and
    stages over several groups left are refused (which one's group the
    wrapper would reduce and clip over is not known: data_parallel_group)."""
    try:
        from torch.distributed.pipelining.stage import _PipelineStageBase
    except ImportError:  # torch without pipelining
        return []
    ids = {id(p) for p in params}

    def holding():
        return live_instances(_PipelineStageBase, lambda stage: any(id(p) in ids for p in stage.submod.parameters()))

    stages = holding()
    if len({id(stage.group) for stage in stages}) > 1:
        gc.collect()
        stages = holding()
    if len({id(stage.group) for stage in stages}) > 1:
        raise ValueError(
            f"these params belong to {len(stages)} live PipelineStage objects over different pipeline groups (a "
            "stage built again over the same module, the earlier one still referenced): the optimizer would not "
            "know which pipeline it is a stage of. Drop the earlier stage (and its schedule) before building this "
            "optimizer"
        )
    return stages


def refuse_ddp_stages(stages) -> None:
    """A stage over a DistributedDataParallel module: its schedule prepares
    DDP's reducer itself for the last backward (bypassing the forward the
    wrapper takes over, accumkernels.optim._ddp), which then all-reduces
    ``.grad`` a second time, in the params' dtype (bf16 params fail inside
    the backward)."""
    from torch.nn.parallel import DistributedDataParallel

    for stage in stages:
        if issubclass(type(stage.submod), DistributedDataParallel):
            raise ValueError(
                f"pipeline stage {stage.stage_index} runs a DistributedDataParallel module: its schedule makes DDP's "
                "reducer all-reduce the last backward's .grad, which AccumulatingOptimizer reduces itself. Build the "
                "PipelineStage over the plain module (ddp.module): the optimizer reduces the stage's window over "
                "its data-parallel group (found on a 2-D device mesh, or process_group=)"
            )


def part_of_process(stages) -> str | None:
    """Where this process runs more stages of the pipeline than ``stages``
    (those holding the optimizer's params: one optimizer per stage under an
    interleaved or looped schedule), the refusal of a norm over the pipeline:
    each optimizer's squared norm is summed over the pipeline group, which
    then leaves out this process's other stages. Else None."""
    stage = stages[0]
    per_process = stage.num_stages // stage.group_size
    if len(stages) >= per_process:
        return None
    held = sorted(s.stage_index for s in stages)
    return (
        f"this process runs {per_process} stages of its pipeline ({stage.num_stages} stages on "
        f"{stage.group_size} ranks) and this optimizer holds stage {held}'s params only: a norm for "
        "max_grad_norm= or clip_grad_norm_() sums one optimizer per process over the pipeline group, so it would "
        "leave out the other stages' gradients. Build one optimizer over the params of all of this process's "
        "stages, or clip .grad with torch's clip over all of them (intake 'grad') and leave max_grad_norm= unset"
    )


def reduce_when_backwards_end(stage, reduce) -> None:
    """Have ``stage``'s schedule call ``reduce()`` once a step's backwards have
    run: after ``perform_reduce_grad`` (where torch's schedules reduce an
    FSDP stage's gradients and scale them, after the last backward; every
    schedule class of torch 2.14 calls it) and after ``scale_grads`` (which
    earlier torch versions' schedules, and PipelineScheduleMulti's own step
    loop, call instead), so after the schedule's division. Not inside a
    backward: a collective there would wait for a stage that waits for this
    one's gradients, while here every replica of the stage has run all of
    its own. ``reduce`` must be idempotent within a window (a schedule may
    call both); the latest wrapper over ``stage`` replaces an earlier one's."""
    stage._accumkernels_reduce = reduce
    if getattr(stage, "_accumkernels_hooked", False):
        return
    stage._accumkernels_hooked = True
    for name in ("perform_reduce_grad", "scale_grads"):
        method = getattr(stage, name, None)
        if method is not None:
            setattr(stage, name, _then_reduce(stage, method))


def _then_reduce(stage, method):
    def call(*args, **kwargs):
        method(*args, **kwargs)
        stage._accumkernels_reduce()

    return call


def _same_ranks(a, b) -> bool:
    return dist.get_process_group_ranks(a) == dist.get_process_group_ranks(b)


def _other_dimensions(group, match) -> list:
    """The other dimension's group of each live 2-D world-sized DeviceMesh one
    of whose dimensions' groups ``match(that group, group)``, each group once."""
    from torch.distributed.device_mesh import DeviceMesh

    found = []
    for mesh in live_instances(DeviceMesh):
        if mesh.ndim != 2 or mesh.size() != dist.get_world_size():
            continue
        for dim in range(2):
            other = mesh.get_group(1 - dim)
            if match(mesh.get_group(dim), group) and all(other is not g for g in found):
                found.append(other)
    return found


def data_parallel_group(stage):
    """The group over which the wrapper of ``stage``'s params reduces: None
    where the stage has no replica (its pipeline spans the world), else the
    other dimension of the 2-D device mesh whose one dimension is the stage's
    group. Raises where neither holds, or where several meshes would.

    The mesh whose dimension *is* the stage's group object comes first. By
    ranks alone, a mesh an earlier run built and dropped, not yet garbage-
    collected, matches too (its groups have the same ranks): each rank could
    take another mesh's group, and their reductions would then wait on each
    other forever (tests/test_pipeline.py hung so, beside other tests, until
    2026-12-07). So a match by ranks is looked for only after a collection,
    and must be the only one."""
    group = stage.group or dist.group.WORLD
    if dist.get_world_size(group) == dist.get_world_size():
        return None
    found, how = _other_dimensions(group, lambda a, b: a is b), "have a dimension that is"
    if not found:
        gc.collect()
        found, how = _other_dimensions(group, _same_ranks), "have a dimension with the ranks of"
    if len(found) == 1:
        return found[0]
    if found:
        raise ValueError(
            f"these params belong to pipeline stage {stage.stage_index}, and {len(found)} live 2-D device meshes "
            f"{how} its pipeline group, each with another data-parallel dimension: which one the stage's replicas "
            "reduce over is not known. Pass process_group= the stage's data-parallel group (e.g. mesh['dp'] of "
            "the mesh meant), or build the PipelineStage with group=mesh['pp'].get_group() of one mesh"
        )
    raise ValueError(
        f"these params belong to pipeline stage {stage.stage_index} of a pipeline group of "
        f"{dist.get_world_size(group)} ranks out of {dist.get_world_size()}, and no 2-D device mesh (pipeline x data "
        "parallel) holds that group: pass process_group= the stage's data-parallel group (e.g. mesh['dp'], or "
        "mesh['dp'].get_group())"
    )
