"""FSDP2 (``fully_shard``) models: params are DTensors sharded on a 1-D device
mesh, and FSDP2 reduce-scatters each micro-step's gradient itself.

The wrapper then holds fp32 buffers for this rank's shards only (1/W of the
model per rank). FSDP2 assigns the reduce-scattered shard to a ``.grad`` it
finds None, or adds it into the one it finds, then calls the sharded param's
post-accumulate-grad hooks: the hooks intake folds the local shard into the
buffer and leaves a DTensor over a FoldedGrad marker in ``.grad``, whose
``add_`` hands the next shard over, so FSDP2 never accumulates (in the
params' dtype) across micro-steps, and code reading ``.grad`` (torch's
``clip_grad_norm_``) is refused rather than finding None. With
``set_requires_gradient_sync(False)`` on the first N-1 micro-steps, FSDP2 keeps
its own unsharded accumulated gradient (in ``reduce_dtype``, full size on
every rank) and hands over the window's shard on the last one.

FSDP2 divides the reduced gradient by its gradient divide factor (the world
size unless set otherwise): the buffers carry that divisor (``Window.divisor``).
The window's counts and flags, which params got a gradient on any rank, and
the gradient norm are summed over the mesh at the window's end, as in the
wrapper's own distributed mode.
"""

from __future__ import annotations

import functools

import torch

from ._discovery import live_instances
from ._distributed import all_reduce_window, sum_over_ranks
from ._sync import Sync


@functools.cache  # an import statement per gradient costs more than the check
def _dtensor_class():
    from torch.distributed.tensor import DTensor

    return DTensor


def is_sharded(params) -> bool:
    """Whether any param is a DTensor (FSDP2 made it one)."""
    DTensor = _dtensor_class()
    return any(isinstance(p, DTensor) for p in params)


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """The elements of ``t`` this rank holds (a DTensor's local shard; a plain tensor itself)."""
    return t._local_tensor if isinstance(t, _dtensor_class()) else t


def sharded_grad(local: torch.Tensor, param) -> torch.Tensor:
    """``local`` (shaped as this rank's shard of ``param``) as ``param``'s
    DTensor ``.grad``, made as FSDP2 makes the ``.grad`` it assigns: without
    an operation on ``local`` (intake "hooks": a FoldedGrad marker)."""
    return _dtensor_class()(local, param._spec, requires_grad=False)


def shard_like(local: torch.Tensor, param) -> torch.Tensor:
    """``local`` (this rank's shard of a tensor laid out like ``param``) as a
    DTensor sharded like the DTensor ``param``: optimizer state as torch.optim
    keeps it for FSDP2, and as torch.distributed.checkpoint saves it."""
    return _dtensor_class().from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )


def state8_blocks(param) -> int:
    """The block scales each rank keeps of an FSDP2 param's 8-bit state: those
    of the largest local shard (Shard(0): ceil(rows / W) rows), the last ones
    unused on a smaller shard, so that every rank's scales are one row of a
    (W, blocks) DTensor sharded on dim 0 (state8_scales), whose shape names the
    world size: a checkpoint of another world size is refused by its shape
    rather than resharded (each rank's blocks follow its own shard)."""
    from .._state8 import scales_numel

    rows = param.shape[0] if param.dim() else 1
    per_row = param.numel() // rows if rows else 0
    world = param.device_mesh.size()
    return scales_numel(-(-rows // world) * per_row)


def state8_scales(local_row: torch.Tensor, param) -> torch.Tensor:
    """This rank's block scales (state8_blocks of them) as its row of the (W,
    blocks) DTensor that holds every rank's."""
    from torch.distributed.tensor import Shard

    blocks = local_row.numel()
    world = param.device_mesh.size()
    mesh = param.device_mesh
    shape, stride = (world, blocks), (blocks, 1)
    return _dtensor_class().from_local(
        local_row.view(1, blocks), mesh, (Shard(0),), run_check=False, shape=shape, stride=stride
    )


def mesh_of(params):
    """The one 1-D mesh every param is Shard(0)-sharded on; refuses anything else."""
    from torch.distributed.tensor import Shard

    DTensor = _dtensor_class()
    plain = [i for i, p in enumerate(params) if not isinstance(p, DTensor)]
    if plain:
        raise ValueError(
            f"params {plain[:5]} are plain tensors beside FSDP2's DTensor params: apply fully_shard to the whole "
            "model (its root too), so that every param the optimizer holds is sharded"
        )
    # Equal meshes are one (DeviceMesh compares ranks and dimension names):
    # each mesh["dp"] is a new object, as in fully_shard(part, mesh=mesh["dp"]) per part.
    meshes = {p.device_mesh for p in params}
    if len(meshes) > 1:
        raise ValueError(f"the params are on {len(meshes)} device meshes; AccumulatingOptimizer supports one")
    mesh = next(iter(meshes))
    if mesh.ndim != 1:
        raise ValueError(
            f"the params are on a {mesh.ndim}-D device mesh (HSDP or tensor parallelism); AccumulatingOptimizer "
            "supports FSDP2 on a 1-D mesh"
        )
    for i, p in enumerate(params):
        if tuple(p.placements) != (Shard(0),):
            raise ValueError(f"param {i} has placements {p.placements}; expected (Shard(0),), FSDP2's default")
    return mesh


def fsdp_param_groups(params) -> list:
    """FSDP2's param groups that hold any of ``params`` (each fully_shard'ed module has one)."""
    from torch.distributed.fsdp import FSDPModule

    ids = {id(p) for p in params}
    return [
        group
        for module in live_instances(FSDPModule)
        for group in module._get_fsdp_state()._fsdp_param_groups
        if any(id(fp.sharded_param) in ids for fp in group.fsdp_params)
    ]


def unit_of(params):
    """param -> the index of the FSDP2 param group (fully_shard module) that
    reduce-scatters its gradient (Layout's bucket boundaries)."""
    unit = {id(fp.sharded_param): i for i, g in enumerate(fsdp_param_groups(params)) for fp in g.fsdp_params}
    return lambda p: unit.get(id(p))


class FSDPSync(Sync):
    """The window's cross-rank bookkeeping over the FSDP2 mesh: FSDP2 reduces
    the gradients, so no buffer is reduced here (nor ever started), and the
    buffers never hold more than this rank's shards (a global norm needs
    max_grad_norm=, summed over the mesh at the window's end)."""

    spans_ranks = True

    def __init__(self, mesh, params, layout, window) -> None:
        super().__init__(layout, window)
        self.group = mesh.get_group()
        self.world = mesh.size()
        self.rank = mesh.get_local_rank()
        self._params = params
        self._groups: list | None = None

    def divisor(self) -> float:
        """What FSDP2 divided the reduced gradient by: its gradient divide factor
        where one is set, else the world size (its default average)."""
        if self._groups is None:
            self._groups = fsdp_param_groups(self._params)
        factors = {g.gradient_divide_factor for g in self._groups}
        if len(factors) > 1:
            raise RuntimeError(f"the FSDP2 modules divide gradients by different factors {factors}: set one for all")
        factor = factors.pop() if factors else None
        return float(self.world if factor is None else factor)

    @property
    def reduced(self) -> bool:
        return False

    def end_window(self, check_inf: bool):
        self.window.divisor = self.divisor()
        found_inf, items, micro_steps, _ = all_reduce_window(self.group, self.window, self.layout, check_inf)
        return found_inf, self.window.global_normalization(items, micro_steps)

    def squared_norm(self, local: torch.Tensor) -> torch.Tensor:
        """Every rank holds its shards: the squared norms add up over the mesh
        (and, on a pipeline stage, over the pipeline's stages)."""
        return self.over_stages(sum_over_ranks(local, self.group))

    def stream_id(self, index: int) -> int:
        """Param ``index``'s stochastic-rounding stream on this rank: ranks hold
        different elements of one param (shards), so each gets its own."""
        return index * self.world + self.rank
