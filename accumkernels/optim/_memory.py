"""What a configuration of AccumulatingOptimizer holds in memory, counted
from the optimizer and the wrapper's options before anything is built (the
planner's static part)."""

from __future__ import annotations

import torch

from ._layout import Layout, collect_params
from ._update import optimizer_kind, precision_of, state_keys


def static_bytes(optimizer: torch.optim.Optimizer, **wrapper_options) -> dict[str, int]:
    """The bytes an AccumulatingOptimizer over ``optimizer`` with these
    options (the wrapper's keyword arguments) holds whatever the micro-batch,
    by kind: the params, the fp32 buffers (with their alignment padding), the
    optimizer state (in its dtype, and Adam's step counts) and the master
    weights, per rank (``sharded=True``: 1/W of the state and masters). What
    accumkernels.plan_window budgets before it measures the rest."""
    kind = optimizer_kind(optimizer)
    if kind == "fallback":
        raise ValueError(f"plan_window knows the state of SGD, Adam and AdamW; got {type(optimizer).__name__}")
    params, groups = collect_params(optimizer)
    world = 1
    if wrapper_options.get("sharded"):
        import torch.distributed as dist

        world = dist.get_world_size(wrapper_options.get("process_group"))
    layout = Layout(params, groups, torch.device("meta"), wrapper_options.get("bucket_cap_mb", 25.0), world)
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
    return {
        "params": sum(p.numel() * p.element_size() for p in params),
        "fp32 buffers": layout.flat.numel() * 4,
        "optimizer state": state,
        "master weights": sum(precision[id(p)].master_bytes() * stepped[id(p)] for p in params),
    }
