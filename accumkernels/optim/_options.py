"""The wrapper's constructor arguments, checked before anything is built: a
refused combination raises naming the argument and what to pass instead, and
leaves the optimizer and its params untouched."""

from __future__ import annotations

import inspect
from typing import NamedTuple

import torch
import torch.distributed as dist

from .. import ops
from .._validation import is_dense
from . import _ddp, _fsdp, _pipeline
from ._discovery import calling_frame
from ._intake import INTAKES, default_intake
from ._layout import collect_params
from ._update import MASTER_WEIGHTS, STATE_DTYPES, _number, optimizer_kind
from ._window import NORMALIZE

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _needs_closure(optimizer) -> bool:
    """Whether the optimizer's step() takes a closure it cannot do without (LBFGS)."""
    try:
        closure = inspect.signature(type(optimizer).step).parameters.get("closure")
    except (TypeError, ValueError):
        return False
    return closure is not None and closure.default is inspect.Parameter.empty


class Options(NamedTuple):
    accum_steps: int | None
    intake: str
    params: list
    groups: list
    device: torch.device
    mesh: object  # the FSDP2 mesh of DTensor params, else None
    initialized: bool  # torch.distributed
    # None: the default group, looked up at each call (the wrapper does not
    # keep the world group alive past destroy_process_group()).
    process_group: object
    world_size: int
    rank: int
    # A pipeline stage's params: (the stage's pipeline group, None for the
    # world; over which a norm of the window sums: the whole model's, and the
    # refusal of that norm where the optimizer holds only some of this
    # process's stages, else None); else ().
    pipeline: tuple = ()


def check_options(
    optimizer,
    accum_steps,
    *,
    normalize,
    max_grad_norm,
    master_weights,
    stochastic_rounding,
    state_dtype,
    seed,
    intake,
    bucket_cap_mb,
    process_group,
    sharded,
    wire_dtype,
) -> Options:
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise TypeError(f"optimizer must be a torch.optim.Optimizer; got {type(optimizer).__name__}")
    accum_steps = getattr(accum_steps, "accum_steps", accum_steps)  # a WindowPlan gives its own
    if accum_steps is not None and (
        isinstance(accum_steps, bool) or not isinstance(accum_steps, int) or accum_steps < 1
    ):
        raise ValueError(f"accum_steps must be None or an int >= 1; got {accum_steps!r}")
    if normalize not in NORMALIZE:
        raise ValueError(f"normalize must be one of {NORMALIZE}; got {normalize!r}")
    if max_grad_norm is not None and not max_grad_norm > 0:
        raise ValueError(f"max_grad_norm must be > 0; got {max_grad_norm!r}")
    if bucket_cap_mb <= 0:
        raise ValueError(f"bucket_cap_mb must be > 0; got {bucket_cap_mb!r}")
    if wire_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"wire_dtype must be torch.float32 or torch.bfloat16; got {wire_dtype!r}")
    intake = default_intake(intake, accum_steps)
    if intake not in INTAKES:
        raise ValueError(f"intake must be None or one of {INTAKES}; got {intake!r}")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32):
        raise ValueError(f"seed must be None or an int in [0, 2**32); got {seed!r}")
    if isinstance(master_weights, str) and master_weights != "remainders" or master_weights not in MASTER_WEIGHTS:
        raise ValueError(f"master_weights must be False, True (fp32 copies) or 'remainders'; got {master_weights!r}")
    if stochastic_rounding not in (None, True, False):
        raise ValueError(
            f"stochastic_rounding must be None (bf16 params without master weights), True or False; "
            f"got {stochastic_rounding!r}"
        )
    if state_dtype not in STATE_DTYPES:
        raise ValueError(f"state_dtype must be None, torch.float32, torch.bfloat16 or '8bit'; got {state_dtype!r}")
    for flag, name in (
        (master_weights, "master_weights"),
        (stochastic_rounding, "stochastic_rounding=True"),
        (state_dtype is not None, "state_dtype"),
        (sharded, "sharded=True"),
    ):
        if flag and optimizer_kind(optimizer) == "fallback":
            raise ValueError(f"{name} needs SGD, Adam or AdamW (the fused step); got {type(optimizer).__name__}")
    check_groups(optimizer, state_dtype)
    if master_weights and stochastic_rounding:
        raise ValueError("master_weights and stochastic_rounding=True exclude each other: choose one")
    initialized = dist.is_available() and dist.is_initialized()
    if process_group is not None and not initialized:
        raise ValueError("process_group was given but torch.distributed is not initialized")
    if not initialized and (sharded or wire_dtype != torch.float32):
        raise ValueError("sharded=True and wire_dtype need torch.distributed: initialize it or pass process_group")
    if sharded and intake == "grad":
        raise ValueError(
            "sharded=True needs intake='hooks': after a reduce-scatter each rank holds only its shard of the "
            "window's gradient, so .grad could not show it whole"
        )
    if _needs_closure(optimizer):
        raise TypeError(
            f"{type(optimizer).__name__}.step() needs a closure that re-evaluates the loss (several forward and "
            "backward passes per step), which a window of accumulated gradients cannot give it: use "
            f"{type(optimizer).__name__} directly, without AccumulatingOptimizer"
        )
    if isinstance(optimizer, torch.optim.SparseAdam):
        raise TypeError(
            "SparseAdam steps sparse gradients only, and the window is summed in dense fp32 buffers: use "
            "SparseAdam directly, without AccumulatingOptimizer (or Adam, whose dense step this wrapper fuses)"
        )
    params, groups = collect_params(optimizer)
    unsupported = [(i, p.dtype) for i, p in enumerate(params) if p.dtype not in SUPPORTED_DTYPES]
    if unsupported:
        i, dtype = unsupported[0]
        raise TypeError(
            f"param {i} is {dtype} ({len(unsupported)} params are neither float32, bfloat16 nor float16): "
            "AccumulatingOptimizer sums gradients in float32 buffers, which would round float64 ones and cannot "
            "hold complex ones. Train such params with torch.optim directly"
        )
    if stochastic_rounding and not any(p.dtype == torch.bfloat16 for p in params):
        dtypes = sorted({str(p.dtype) for p in params})
        raise ValueError(
            f"stochastic_rounding=True rounds bf16 params, and this optimizer has none (its params are "
            f"{', '.join(dtypes) or 'none'}): leave it None"
        )
    if sharded:
        strided = [i for i, p in enumerate(params) if not is_dense(p)]
        if strided:
            raise ValueError(
                f"sharded=True splits params in memory order; params {strided[:5]} are non-dense views "
                "(e.g. a column slice): make them contiguous, or leave sharded=False"
            )
    if master_weights == "remainders":
        fp16 = [i for i, p in enumerate(params) if p.dtype == torch.float16]
        if fp16:
            raise ValueError(
                f"master_weights='remainders' holds the low 16 bits of bf16 params' fp32 masters; params "
                f"{fp16[:5]} are float16: use master_weights=True (fp32 copies)"
            )
    mesh = _fsdp_mesh(params, intake, sharded, process_group, wire_dtype, state_dtype)
    devices = {p.device for p in params}
    if len(devices) > 1:
        raise ValueError(f"params on several devices ({sorted(map(str, devices))}) are not supported yet")
    device = next(iter(devices)) if devices else torch.device("cpu")
    stages = _pipeline.stages_holding(params) if initialized else []
    _pipeline.refuse_ddp_stages(stages)
    group = mesh.get_group() if mesh is not None else _data_parallel_group(stages, process_group, initialized)
    replicated = initialized and group is not _NO_REPLICAS
    world_size = dist.get_world_size(group) if replicated else 1
    rank = dist.get_rank(group) if replicated else 0
    group = None if group is _NO_REPLICAS else group
    if world_size > 1 and mesh is None:
        _refuse_zero_redundancy_optimizer()
    pipeline = (stages[0].group, _pipeline.part_of_process(stages)) if stages else ()
    if max_grad_norm is not None and pipeline and pipeline[1]:
        raise ValueError(pipeline[1])
    return Options(accum_steps, intake, params, groups, device, mesh, initialized, group, world_size, rank, pipeline)


_NO_REPLICAS = object()  # a pipeline stage no other rank holds: nothing to reduce


NOT_DIFFERENTIABLE = "differentiable=True: the fused step is not differentiable (use torch.optim's optimizer)"


def check_groups(optimizer, state_dtype, param_groups: list[dict] | None = None, whose: str = "") -> None:
    """What the fused step (SGD, Adam, AdamW) refuses in a param group of
    ``optimizer`` (``param_groups``: a checkpoint's, to be loaded into it):
    differentiable=True (the step records no autograd graph: a loss through
    the updated params would carry no gradient back through it, silently) and,
    with state_dtype='8bit' (accumkernels._state8), amsgrad=True. A fallback
    optimizer runs its own step. Checked on the groups when built, on a
    checkpoint's before it is loaded, and again at every window's step (a flag
    set in between), before anything is written or stepped."""
    kind = optimizer_kind(optimizer)
    if kind == "fallback":
        return
    for i, group in enumerate(optimizer.param_groups if param_groups is None else param_groups):
        if group.get("differentiable"):
            raise ValueError(f"{whose}param group {i} has {NOT_DIFFERENTIABLE}")
        _check_hyperparameters(kind, group, f"{whose}param group {i}")
        if state_dtype == "8bit" and group.get("amsgrad"):
            raise ValueError(
                f"state_dtype='8bit' does not support amsgrad=True (its max_exp_avg_sq would need a code too): "
                f"{whose}param group {i} has it; set it to False, or build the optimizer with "
                "state_dtype=torch.bfloat16"
            )


def _check_hyperparameters(kind: str, group: dict, where: str) -> None:
    """The group's hyperparameters within the fused step's bounds (those
    torch.optim's constructor sets, which torch does not check again when a
    group is edited later): checked for every group before a window's step,
    so that no group is stepped where a later one would be refused."""
    try:
        if kind == "sgd":
            ops.check_sgd_hyperparameters(
                where,
                _number(group["lr"]),
                group["momentum"],
                group["dampening"],
                group["weight_decay"],
                group["nesterov"],
            )
        else:
            betas = tuple(_number(b) for b in group["betas"])
            ops.check_adam_hyperparameters(where, _number(group["lr"]), betas, group["eps"], group["weight_decay"])
    except (TypeError, ValueError) as error:
        raise type(error)(
            f"{error}: the fused step takes only the values torch.optim's constructor accepts (nothing was "
            "stepped or loaded: set it to one, then call again)"
        ) from None


def _data_parallel_group(stages, process_group, initialized):
    """The group to reduce over: the one given (a ProcessGroup or a 1-D
    DeviceMesh); for params of a pipeline stage (``stages``: those holding
    them), the stage's data-parallel group (accumkernels.optim._pipeline), or
    _NO_REPLICAS; else None (the world, looked up at each call)."""
    from torch.distributed.device_mesh import DeviceMesh

    if isinstance(process_group, DeviceMesh):
        if process_group.ndim != 1:
            raise ValueError(
                f"process_group= a {process_group.ndim}-D DeviceMesh; pass its data-parallel dimension "
                "(e.g. mesh['dp'])"
            )
        return process_group.get_group()
    if process_group is not None or not initialized:
        return process_group
    if not stages:
        return None
    group = _pipeline.data_parallel_group(stages[0])
    return _NO_REPLICAS if group is None else group


def _refuse_zero_redundancy_optimizer() -> None:
    """torch's ZeroRedundancyOptimizer builds the optimizer class it is given
    over each rank's share of the params, so each rank's wrapper would hold
    other params than its peers' and could not reduce its window sums with
    theirs (refused on their shapes only where the shares' layouts differ).
    Found on the call stack, by the code of its methods: it is the caller of
    this construction. (No frame's f_locals is read: reading them pins a
    frame's variables to it, a device mesh among them.)"""
    from torch.distributed.optim import ZeroRedundancyOptimizer

    source = inspect.getfile(ZeroRedundancyOptimizer)  # (a decorator's wrapper code is shared with others)
    codes = {
        f.__code__
        for f in vars(ZeroRedundancyOptimizer).values()
        if inspect.isfunction(f) and f.__code__.co_filename == source
    }
    if calling_frame(lambda f: f.f_code in codes, skip=1, limit=16):
        raise ValueError(
            "torch.distributed.optim.ZeroRedundancyOptimizer builds this optimizer over one rank's share of "
            "the params, whose window sums the ranks cannot reduce together (each holds other params). Use "
            "accumkernels' own ZeRO-1 in its place: build the optimizer over every param with sharded=True "
            "(e.g. accumkernels.AdamW(model.parameters(), sharded=True)): each rank steps its slice of the "
            "reduced fp32 sums, with the optimizer state of that slice only"
        )


def _fsdp_mesh(params, intake, sharded, process_group, wire_dtype, state_dtype):
    """The FSDP2 mesh of DTensor params, or None for plain params."""
    if not params or not _fsdp.is_sharded(params):
        return None
    if sharded or process_group is not None or wire_dtype != torch.float32:
        raise ValueError(
            "sharded=, process_group= and wire_dtype= are for plain params: FSDP2 shards and reduces "
            "the gradients of its DTensor params itself"
        )
    if intake == "grad":
        raise ValueError(
            "an FSDP2 model needs intake='hooks': pass accum_steps=N (whose default it is), or intake='hooks' "
            "with accum_steps=None (a pipeline stage's: each step() after schedule.step() ends a window); clip "
            "with max_grad_norm=. FSDP2 hands each micro-step's reduced shard over in .grad"
        )
    if _ddp.ddp_modules_holding(params):
        raise ValueError("these params are both FSDP2-sharded and held by DistributedDataParallel: use one")
    return _fsdp.mesh_of(params)
