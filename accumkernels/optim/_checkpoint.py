"""Checking a checkpoint before AccumulatingOptimizer.load_state_dict writes
anything, and taking the optimizer state in fp32.

A state dict is the wrapped optimizer's own (``state``, ``param_groups``, params
as indices in group order) plus, from the wrapper, an ``"accumkernels"`` entry
with the in-window state. Every tensor is checked against the param it belongs
to (its elements on this rank: the whole param, or its shard in sharded mode),
so a checkpoint of another model is refused whole, with the first mismatch
named, and the wrapper goes on as it was.
"""

from __future__ import annotations

import math
from itertools import chain

import torch

from .._state8 import MOMENTS, decode_moment, scales_numel
from ._discovery import calling_frame
from ._fsdp import local_tensor, shard_like, state8_blocks
from ._options import check_groups
from ._update import optimizer_kind


def _params_in_saved_order(wrapper, state_dict) -> list:
    """(saved id, record) for every param, pairing the checkpoint's groups with ours."""
    ours = wrapper.param_groups
    saved = state_dict.get("param_groups")
    if not isinstance(saved, list) or "state" not in state_dict:
        raise ValueError("not an optimizer state dict: it needs 'state' and 'param_groups'")
    if len(saved) != len(ours):
        raise ValueError(f"checkpoint has {len(saved)} param groups; this optimizer has {len(ours)}")
    pairs = []
    for g, (group_saved, group_ours) in enumerate(zip(saved, ours)):
        if len(group_saved["params"]) != len(group_ours["params"]):
            raise ValueError(
                f"checkpoint's param group {g} has {len(group_saved['params'])} params; this optimizer's has "
                f"{len(group_ours['params'])}"
            )
        pairs += [(i, wrapper._layout.record(p)) for i, p in zip(group_saved["params"], group_ours["params"])]
    return pairs


def _check_sums_scale(wrapper, extra: dict) -> None:
    """A mid-window checkpoint's sums are loss-scaled as this wrapper's would
    be: intake "hooks" with a GradScaler it knows (given as grad_scaler=, or
    adopted at its first scaler.step()) folds each gradient unscaled; without
    one, and intake "grad", the sums are as autograd made them (scaled, under
    AMP), to be unscaled at the window's end. Loaded into the other kind, a
    window would be unscaled twice, or not at all. (Checkpoints without the
    entry: taken as this wrapper's.)"""
    unscaled = extra.get("sums_unscaled")
    if extra["flat_buffer"] is None or unscaled is None or unscaled == wrapper._intake.folds_unscaled:
        return
    if unscaled:
        raise ValueError(
            "checkpoint was saved mid-window by intake='hooks' with a GradScaler (grad_scaler=, or adopted at "
            "scaler.step()), whose sums are unscaled; this wrapper would take them as loss-scaled "
            f"(intake={wrapper.intake!r}, no GradScaler known yet) and unscale them again: build it with "
            "intake='hooks' and grad_scaler=scaler, or save at a window boundary (after the step() that ends a window)"
        )
    raise ValueError(
        "checkpoint was saved mid-window with loss-scaled sums (intake='grad', or intake='hooks' before its "
        "GradScaler was known); this wrapper (intake='hooks' with grad_scaler=) would take them as unscaled: "
        "build it as the checkpoint's was (without grad_scaler=: the scaler is adopted at its first scaler.step()), "
        "or save at a window boundary (after the step() that ends a window)"
    )


def check_loadable(wrapper, state_dict: dict, extra: dict | None) -> None:
    """Raises ValueError naming the first thing that does not fit; writes nothing."""
    if extra is not None:
        saved = (extra.get("world_size", 1), extra.get("rank", 0), extra.get("sharded", False))
        if saved != (wrapper.world_size, wrapper.rank, wrapper.sharded):
            raise ValueError(
                f"checkpoint is of rank {saved[1]} of {saved[0]} (sharded={saved[2]}); this wrapper is rank "
                f"{wrapper.rank} of {wrapper.world_size} (sharded={wrapper.sharded}): each rank loads its own "
                "checkpoint"
            )
    elif wrapper.sharded:
        raise ValueError("sharded=True loads only its own state dicts (a plain optimizer's holds whole params)")
    pairs = _params_in_saved_order(wrapper, state_dict)  # (checks that the groups pair with ours)
    check_groups(wrapper.optimizer, wrapper._arguments["state_dtype"], state_dict["param_groups"], "the checkpoint's ")
    counts_steps = optimizer_kind(wrapper.optimizer) in ("adam", "adamw")
    for saved_id, r in pairs:
        entries = state_dict["state"].get(saved_id, {})
        # torch's Adam would take a state without a step half-loaded (KeyError in __setstate__).
        if counts_steps and entries and "step" not in entries:
            raise ValueError(
                f"checkpoint's state of param {r.index} has no 'step' (it has {', '.join(map(str, entries))}); "
                "Adam's and AdamW's state needs one"
            )
        for moment in MOMENTS:  # 8-bit state: codes without their scales (or the reverse) cannot be decoded
            if (moment + "_codes" in entries) != (moment + "_scales" in entries):
                raise ValueError(
                    f"checkpoint's 8-bit {moment!r} of param {r.index} has only one of {moment}_codes and "
                    f"{moment}_scales; both are needed"
                )
        for key, value in entries.items():
            if key == "step":
                _check_step(value, r, count=counts_steps)
                continue
            if not torch.is_tensor(value):
                continue
            # A DTensor (FSDP2 state) is checked against the whole param, a plain
            # tensor against what this rank steps.
            like = r.param if hasattr(value, "device_mesh") else r.param_view()
            if key.endswith(("_codes", "_scales")):  # 8-bit state (accumkernels._state8)
                _check_8bit_entry(key, value, like, r)
                continue
            if value.numel() == 1 and like.numel() != 1:  # a scalar state
                continue
            if not value.is_floating_point():
                raise ValueError(f"checkpoint's {key!r} of param {r.index} has dtype {value.dtype}; expected a float")
            if tuple(value.shape) != tuple(like.shape):
                raise ValueError(
                    f"checkpoint's {key!r} of param {r.index} has shape {tuple(value.shape)}; the param's "
                    f"{'shard ' if r.shard is not None else ''}has shape {tuple(like.shape)} (a checkpoint of another "
                    "model?)"
                )
    if extra is None:
        return
    flat = extra["flat_buffer"]
    if flat is not None and flat.shape != (wrapper._layout.numel,):
        raise ValueError(
            f"checkpoint buffer has {flat.numel()} elements; this wrapper's has {wrapper._layout.numel} "
            "(another model, bucket size or world size?)"
        )
    wrapper._window.check_state_dict(extra, len(wrapper._layout))
    _check_sums_scale(wrapper, extra)
    saved_steps = extra.get("accum_steps", wrapper.accum_steps)  # older checkpoints did not say
    if extra["micro_steps"] and saved_steps != wrapper.accum_steps:
        raise ValueError(
            f"checkpoint was saved mid-window ({extra['micro_steps']} micro-steps into a window of "
            f"accum_steps={saved_steps}); this wrapper has accum_steps={wrapper.accum_steps}, which would end that "
            f"window elsewhere: resume with accum_steps={saved_steps}, or save at a window boundary "
            "(opt.window_stepped) to change the window length"
        )
    saved_normalize = extra.get("normalize", wrapper._window.normalize)  # (older checkpoints did not say)
    if extra["micro_steps"] and saved_normalize != wrapper._window.normalize:
        raise ValueError(
            f"checkpoint was saved mid-window ({extra['micro_steps']} micro-steps into a window of "
            f"normalize={saved_normalize!r}); this wrapper has normalize={wrapper._window.normalize!r}, which would "
            "divide that window's sum by another count (and normalize='items' by the items of the micro-steps after "
            f"the resume only): resume with normalize={saved_normalize!r}, or save at a window boundary "
            "(opt.window_stepped) to change it"
        )
    check_masters(wrapper, extra.get("master_weights", {}), every=True)


def check_masters(wrapper, masters: dict, every: bool) -> None:
    """``masters`` (a checkpoint's master weights by param index, this rank's
    elements) fit the wrapper's: for ``every`` param that keeps them (the
    in-window entry), or for some of them (carried through DCP)."""
    ours = {r.index: r.master for r in wrapper._layout if r.master is not None}
    if set(masters) != set(ours) if every else not set(masters) <= set(ours):
        raise ValueError(
            f"checkpoint has master weights for {len(masters)} params; this wrapper keeps them for {len(ours)} "
            "(was it saved with another master_weights setting?)"
        )
    for i, master in masters.items():
        if master.shape != ours[i].shape:
            raise ValueError(
                f"checkpoint's master weights of param {i} have shape {tuple(master.shape)}; "
                f"expected {tuple(ours[i].shape)}"
            )
        if master.dtype != ours[i].dtype:
            kinds = {torch.float32: "master_weights=True (fp32)", torch.int16: "master_weights='remainders'"}
            raise ValueError(
                f"checkpoint's master weights of param {i} are {master.dtype}, saved with "
                f"{kinds.get(master.dtype, master.dtype)}; this wrapper keeps {kinds[ours[i].dtype]}"
            )


def _check_step(step, r, count: bool) -> None:
    """A param's 'step': one element (a tensor or a number); where it counts
    Adam's steps (``count``), a whole number >= 0 (step 0 state is what a
    first step creates; a negative one would divide by a zero bias
    correction)."""
    if torch.is_tensor(step) and step.numel() != 1:
        raise ValueError(f"checkpoint's 'step' of param {r.index} has {step.numel()} elements; expected 1")
    if not count:
        return
    try:
        value = float(step)
    except (TypeError, ValueError):
        value = float("nan")
    if not (math.isfinite(value) and value >= 0 and value == int(value)):
        raise ValueError(f"checkpoint's 'step' of param {r.index} is {step!r}; expected a whole number >= 0")


def _check_8bit_entry(key: str, value: torch.Tensor, like: torch.Tensor, r) -> None:
    """Codes of the shape of what they stand for (``like``); scales: one per
    block of this rank's elements, or for FSDP2 state a (W, blocks) DTensor
    (_fsdp.state8_blocks), which a checkpoint of another world size is not."""
    if key.endswith("_codes"):
        if value.dtype != torch.uint8 or tuple(value.shape) != tuple(like.shape):
            raise ValueError(
                f"checkpoint's {key!r} of param {r.index} is {value.dtype} of shape {tuple(value.shape)}; expected "
                f"uint8 codes of shape {tuple(like.shape)}"
            )
        return
    if hasattr(value, "device_mesh"):
        shape = (r.param.device_mesh.size(), state8_blocks(r.param))
        if value.dtype != torch.float32 or tuple(value.shape) != shape:
            raise ValueError(
                f"checkpoint's {key!r} of param {r.index} is {value.dtype} of shape {tuple(value.shape)}; expected "
                f"fp32 block scales of shape {shape} (one row per rank: 8-bit FSDP2 state loads at the world size "
                "it was saved with; dequantized_state_dict converts it for another)"
            )
    elif value.dtype != torch.float32 or value.numel() != scales_numel(like.numel()):
        raise ValueError(
            f"checkpoint's {key!r} of param {r.index} is {value.dtype} with {value.numel()} elements; expected "
            f"{scales_numel(like.numel())} fp32 block scales"
        )


def load_state_in_its_dtype(wrapper, state_dict: dict) -> None:
    """The plain optimizer casts loaded state to the param dtype (bf16 for bf16
    params): take the checkpoint's own values instead, in each param's state
    dtype (exact where the checkpoint was saved in it). 8-bit codes and scales
    are taken as they are; a state of another kind than the wrapper's is
    converted at its first step (accumkernels.optim._update). A fallback
    optimizer steps its state itself: it keeps what it loaded, as torch's."""
    if optimizer_kind(wrapper.optimizer) == "fallback":
        return
    for saved_id, r in _params_in_saved_order(wrapper, state_dict):
        for key, value in state_dict["state"].get(saved_id, {}).items():
            if not torch.is_tensor(value) or key == "step":
                continue
            if key.endswith(("_codes", "_scales")):
                wrapper.state[r.param][key] = value.to(device=r.local.device, copy=True)
            elif value.is_floating_point():
                dtype = r.precision.state_dtype
                dtype = torch.float32 if dtype == "8bit" else dtype
                wrapper.state[r.param][key] = value.to(device=r.local.device, dtype=dtype, copy=True)


# ---- torch.distributed.checkpoint -----------------------------------------------
#
# get_optimizer_state_dict / set_optimizer_state_dict (torch.distributed.checkpoint.
# state_dict) handle the wrapper as any optimizer: its param_groups and state are
# the wrapped optimizer's, its state_dict() their state dict. Two of their habits
# need care: they keep only 'state' and 'param_groups' (the in-window entry would
# be dropped), and to create missing state they call step() with zero gradients
# and lr 0 (which would count a micro-step).

_DCP = "torch.distributed.checkpoint.state_dict"


def _called_from(module: str, function: str) -> bool:
    """``module.function`` is among the 12 callers of the wrapper method calling this."""
    return (
        calling_frame(
            lambda f: f.f_code.co_name == function and f.f_globals.get("__name__") == module, skip=2, limit=12
        )
        is not None
    )


def dcp_initializing_state() -> bool:
    """step() is being called by torch.distributed.checkpoint to create the
    optimizer's state (with zero gradients and lr 0), not by training."""
    return _called_from(_DCP, "_init_optim_state")


MASTER_KEY = "accumkernels_master"  # in a param's state: its master weights (fp32) or remainders (int16)


def dcp_saving() -> bool:
    """state_dict() is being called by get_optimizer_state_dict (or by
    set_optimizer_state_dict, which maps the state through it)."""
    return _called_from(_DCP, "_get_optim_state_dict")


def carried_through_dcp(wrapper, sd: dict) -> dict:
    """``sd`` (state_dict() at a window boundary, the only place DCP may save)
    with each param's master weights (fp32, or remainders) in its state, where
    DCP, which keeps only 'state' and 'param_groups', keeps them too (a
    DTensor sharded like the param on FSDP2). Params without state (never
    stepped) have masters equal to the params. Of the in-window entry nothing
    else holds anything at a boundary but the stochastic-rounding seed and
    window count, which are not carried: DCP loads only the keys its template
    (the new optimizer's state dict) has, so a key there that a checkpoint of
    torch.optim lacks makes that checkpoint fail to load; masters are worth
    that (without them a resumed run loses their precision), a rounding
    stream that starts anew is not (it is as unbiased)."""
    state = dict(sd["state"])
    saved_ids = chain.from_iterable(g["params"] for g in sd["param_groups"])
    for saved_id, p in zip(saved_ids, chain.from_iterable(g["params"] for g in wrapper.param_groups)):
        r = wrapper._layout.record(p)
        if r.master is not None and saved_id in state:
            master = r.master.clone()
            master = shard_like(master, r.param) if hasattr(r.param, "device_mesh") else master
            state[saved_id] = {**state[saved_id], MASTER_KEY: master}
    return {**sd, "state": state}


def _take_carried(wrapper, state_dict: dict) -> tuple[dict, dict]:
    """``state_dict`` without the masters carried_through_dcp put in it (the
    wrapped optimizer never holds them), and those masters (by param index,
    this rank's elements)."""
    pairs = dict(_params_in_saved_order(wrapper, state_dict))
    state, masters = {}, {}
    for saved_id, entries in state_dict["state"].items():
        if MASTER_KEY in entries and saved_id in pairs:
            entries = dict(entries)
            masters[pairs[saved_id].index] = local_tensor(entries.pop(MASTER_KEY))
        state[saved_id] = entries
    return {**state_dict, "state": state}, masters


def refuse_dcp(wrapper) -> None:
    """Called when get_optimizer_state_dict saves (dcp_saving). It keeps the
    optimizer state but not the wrapper's in-window entry: refused while a
    window holds gradients. With sharded=True (ZeRO-1) each rank's state is a
    plain tensor of its own shard, which DCP would save once for all ranks:
    refused."""
    window = wrapper._window
    if window.micro_steps or window.touched:
        raise RuntimeError(
            "torch.distributed.checkpoint's get_optimizer_state_dict would drop the gradients of the window in "
            f"progress ({window.micro_steps} micro-steps): call it after the window's last step(), or save "
            "opt.state_dict() per rank (torch.save), which keeps them"
        )
    if wrapper.sharded:
        raise RuntimeError(
            "torch.distributed.checkpoint's get_optimizer_state_dict cannot save sharded=True (ZeRO-1) state: each "
            "rank holds its own shard as a plain tensor, which DCP would save once for all ranks; save "
            "opt.state_dict() per rank (torch.save) and load it on the same rank"
        )


def load(wrapper, state_dict: dict) -> None:
    """AccumulatingOptimizer.load_state_dict: everything checked, then written."""
    state_dict = dict(state_dict)
    extra = state_dict.pop("accumkernels", None)
    state_dict, carried = _take_carried(wrapper, state_dict)  # saved through DCP (checks it pairs with ours)
    check_loadable(wrapper, state_dict, extra)
    check_masters(wrapper, carried, every=False)
    wrapper.optimizer.load_state_dict(state_dict)
    load_state_in_its_dtype(wrapper, state_dict)
    if extra is not None and extra["flat_buffer"] is not None:
        # Saved mid-window (state_dict() keeps sums only there): the window in
        # progress becomes the checkpoint's, its sums included. A clear of the
        # gradient the last step() used, which the intake tells by the buffers
        # the load writes over, is noted first (window.unzeroed).
        wrapper._window.unzeroed = wrapper._intake.uncleared(wrapper._window.unzeroed)
        wrapper._intake.before_restore()
        wrapper._window.clear()
        wrapper._window.load_state_dict(extra)
        wrapper._intake.restore_sums(extra["flat_buffer"], extra.get("arrivals"))
    elif extra is not None:
        # Saved at a window boundary (or a plain optimizer's checkpoint: no entry): it holds no
        # gradients, and the window in progress keeps its own (.grad, the buffers), as a
        # torch.optim load leaves .grad as it is; the run's window count and seed are the checkpoint's.
        wrapper._window.load_run(extra)
    if extra is not None:
        wrapper._intake.adopt_left_grads(set(extra.get("zero_grads", ())), set(extra.get("unzeroed", ())))
    masters = carried if extra is None else extra["master_weights"]
    for r in wrapper._layout:  # master weights: the checkpoint's, or the (already loaded) params'
        if r.master is None:
            continue
        if r.index in masters:
            r.master.copy_(masters[r.index])
        elif r.master.dtype == torch.int16:
            r.master.zero_()  # a bf16 param is an fp32 value with zero low bits
        else:
            r.master.copy_(r.param_view())


# ---- 8-bit state ------------------------------------------------------------------


def dequantized_state_dict(state_dict: dict) -> dict:
    """A copy of ``state_dict`` (of an AccumulatingOptimizer or optimizer with
    ``state_dtype="8bit"``) with each 8-bit state (``<key>_codes`` and
    ``<key>_scales``, accumkernels._state8) replaced by its fp32 values under
    ``<key>``: what ``torch.optim.AdamW.load_state_dict`` takes. (The other way
    needs no call: an 8-bit optimizer loads a plain checkpoint and encodes its
    state, to nearest, at its first step.)"""
    out = {k: v for k, v in state_dict.items() if k != "state"}
    out["state"] = {}
    for index, entries in state_dict["state"].items():
        entries = dict(entries)
        for key in MOMENTS:
            if key + "_codes" in entries:
                entries[key] = _decoded(key, entries.pop(key + "_codes"), entries.pop(key + "_scales"))
        out["state"][index] = entries
    return out


def _decoded(key: str, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """decode_moment; FSDP2 state (DTensors) shard by shard, as a DTensor sharded like the codes."""
    if not hasattr(codes, "device_mesh"):
        return decode_moment(key, codes, scales)
    local = local_tensor(codes)
    values = decode_moment(key, local, local_tensor(scales).reshape(-1)[: scales_numel(local.numel())])
    return shard_like(values, codes)
