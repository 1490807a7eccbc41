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
  is not the stage's group, found among the process's DeviceMesh objects;
- anything else (a group of the user's own, a mesh with more dimensions):
  refused, naming ``process_group=``.

A schedule runs one backward per micro-batch and then divides ``.grad`` by
their number (``scale_grads``), so a stage's wrapper runs with
``accum_steps=None`` and intake "grad" (its defaults): every ``step()`` after
a schedule step ends a window.
"""

from __future__ import annotations

import torch.distributed as dist

from ._discovery import live_instances


def stages_holding(params) -> list:
    """The pipeline stages (``_PipelineStageBase``) in this process whose submodule holds any of ``params``."""
    try:
        from torch.distributed.pipelining.stage import _PipelineStageBase
    except ImportError:  # torch without pipelining
        return []
    ids = {id(p) for p in params}
    return live_instances(_PipelineStageBase, lambda stage: any(id(p) in ids for p in stage.submod.parameters()))


def _same_group(a, b) -> bool:
    return a is b or dist.get_process_group_ranks(a) == dist.get_process_group_ranks(b)


def data_parallel_group(stage):
    """The group over which the wrapper of ``stage``'s params reduces: None
    where the stage has no replica (its pipeline spans the world), else the
    other dimension of the 2-D device mesh whose one dimension is the stage's
    group. Raises where neither holds."""
    group = stage.group or dist.group.WORLD
    if dist.get_world_size(group) == dist.get_world_size():
        return None
    from torch.distributed.device_mesh import DeviceMesh

    for mesh in live_instances(DeviceMesh):
        if mesh.ndim != 2 or mesh.size() != dist.get_world_size():
            continue
        for dim in range(2):
            if _same_group(mesh.get_group(dim), group):
                return mesh.get_group(1 - dim)
    raise ValueError(
        f"these params belong to pipeline stage {stage.stage_index} of a pipeline group of "
        f"{dist.get_world_size(group)} ranks out of {dist.get_world_size()}, and no 2-D device mesh (pipeline x data "
        "parallel) holds that group: pass process_group= the stage's data-parallel group (e.g. mesh['dp'], or "
        "mesh['dp'].get_group())"
    )
