"""What a configuration of AccumulatingOptimizer holds in memory, counted
from the optimizer and the wrapper's options before anything is built (the
planner's static part)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._intake import default_intake, holds_buffers
from ._layout import Layout, collect_params
from ._update import optimizer_kind, precision_of, state_keys


def static_bytes(optimizer: torch.optim.Optimizer, **wrapper_options) -> dict[str, int]:
    """The bytes an AccumulatingOptimizer over ``optimizer`` with these
    options (the wrapper's keyword arguments) holds whatever the micro-batch,
    by kind: the params, the fp32 buffers (with their alignment padding), the
    optimizer state (in its dtype, and Adam's step counts) and the master
    weights, per rank (``sharded=True``: 1/W of the state and masters). With
    ``accum_steps=1`` on one process (intake "hooks") there are no fp32
    buffers; the gradients, in the params' dtypes, are held from backward to
    the step instead. What accumkernels.plan_window budgets before it
    measures the rest."""
    kind = optimizer_kind(optimizer)
    if kind == "fallback":
        raise ValueError(f"plan_window knows the state of SGD, Adam and AdamW; got {type(optimizer).__name__}")
    params, groups = collect_params(optimizer)
    world = 1
    ranks = dist.get_world_size(wrapper_options.get("process_group")) if dist.is_initialized() else 1
    if wrapper_options.get("sharded"):
        world = ranks
    accum_steps = wrapper_options.get("accum_steps")
    intake = default_intake(wrapper_options.get("intake"), accum_steps)
    lean = not holds_buffers(intake, accum_steps, ranks, fsdp=False)
    layout = Layout(params, groups, torch.device("meta"), wrapper_options.get("bucket_cap_mb", 25.0), world, hold=False)
    stepped = {id(p): p.numel() // world for p in params}  # sharded: each rank steps 1/W of every bucket
    precision = {
        id(p): precision_of(
            p.dtype,
            master_weights=wrapper_options.get("master_weights", False),
            stochastic_rounding=wrapper_options.get("stochastic_rounding"),
            state_dtype=wrapper_options.get("state_dtype"),
        )
        for p in params
    }
    state = 0
    for group in optimizer.param_groups:
        tensors = len(state_keys(kind, group))
        if kind != "sgd":
            state += 4 * len(group["params"])  # the step counts
        state += sum(tensors * precision[id(p)].state_bytes(stepped[id(p)]) for p in group["params"])
    param_bytes = sum(p.numel() * p.element_size() for p in params)
    return {
        "params": param_bytes,
        "fp32 buffers": 0 if lean else layout.numel * 4,
        **({"gradients": param_bytes} if lean else {}),
        "optimizer state": state,
        "master weights": sum(precision[id(p)].master_bytes() * stepped[id(p)] for p in params),
    }
