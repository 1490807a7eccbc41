"""What ``.grad`` holds under intake="hooks": a marker that says where the
gradient went, instead of ``None``.

The hooks intake takes each gradient as it is computed and folds it into the
wrapper's fp32 buffer, so there is no ``.grad`` to read after backward. With
``.grad = None``, code written for plain PyTorch reads that silently: torch's
``clip_grad_norm_`` finds no gradient, clips nothing and returns 0, and a
logged norm is 0. The marker is a tensor with the param's shape, dtype and
device and no storage; any operation on it raises an error that says what to
use instead. Autograd never adds into it (the intake's hook hands it no
gradient); the one operation it takes is GradScaler's own inf check before it
steps the wrapper, which checked every gradient as it folded it.

An FSDP2 param's ``.grad`` is a DTensor over this rank's marker (a marker of
its local shard's shape). FSDP2 adds each micro-step's reduced shard into a
``.grad`` it finds set (``grad._local_tensor += shard``), and code may add
into ``.grad`` itself: that ``add_`` hands the shard to the intake (the
marker's ``sink``), which is what torch.optim's ``.grad`` would sum.

Zeroing ``.grad`` in place (``model.zero_grad(set_to_none=False)``,
``p.grad.zero_()``, torch.optim's ``zero_grad(set_to_none=False)``) is a
clear: the marker's ``cleared`` tells the intake, which keeps the param's zero
gradient stepped as torch.optim would, or refuses where the param's gradient
is in the window already.

A gradient added into a plain param's ``.grad`` (autograd's own add, where
the param was unfrozen since the last step() and so is hooked only at the
next; ``p.grad.add_(g)`` by other code) is handed to the intake (the
marker's ``added``), which takes it as the param's hook would: what
torch.optim's ``.grad`` would sum.

Scaling ``.grad`` in place by a number (``p.grad.div_(n)``, ``mul_(c)``: a
pipeline schedule's ``scale_grads``, which divides each stage param's
gradient by the number of micro-batches) scales the param's window sum so
far: the marker's ``scaled`` hands the factor to the intake, which scales the
param's fp32 buffer, as torch.optim's ``.grad`` would have been scaled.
"""

from __future__ import annotations

import torch

from . import _amp, _guards

_UNSCALE = torch.ops.aten._amp_foreach_non_finite_check_and_unscale_.default
_ADD = torch.ops.aten.add_.Tensor
_ZERO = torch.ops.aten.zero_.default
_FOREACH_ZERO = torch.ops.aten._foreach_zero_.default
# In-place scaling by a number: whether the op divides.
_SCALE = {
    torch.ops.aten.mul_.Tensor: False,
    torch.ops.aten.mul_.Scalar: False,
    torch.ops.aten.div_.Tensor: True,
    torch.ops.aten.div_.Scalar: True,
}


def _plain_add(args, kwargs) -> bool:
    """``marker.add_(gradient)``: a plain tensor added once (alpha 1)."""
    return (
        len(args) == 2
        and isinstance(args[1], torch.Tensor)
        and not isinstance(args[1], FoldedGrad)
        and (kwargs or {}).get("alpha", 1) == 1
    )


def _by_a_number(args, kwargs) -> bool:
    """``marker.mul_(c)`` or ``div_(c)``: ``c`` a number, or a one-element
    tensor that broadcasts to the marker's shape (a Python number reaches
    dispatch as a 0-dim tensor)."""
    if len(args) != 2 or kwargs:
        return False
    factor = args[1]
    if not isinstance(factor, torch.Tensor):
        return isinstance(factor, (int, float))
    return not isinstance(factor, FoldedGrad) and factor.numel() == 1 and factor.dim() <= args[0].dim()


def _same_place(t: torch.Tensor, kwargs: dict) -> bool:
    """_to_copy's dtype, device and memory format are t's own (a device index
    of the current device counts as none)."""
    dtype, device, memory_format = kwargs.get("dtype"), kwargs.get("device"), kwargs.get("memory_format")
    if dtype is not None and dtype != t.dtype:
        return False
    if memory_format not in (None, torch.preserve_format) and not t.is_contiguous(memory_format=memory_format):
        return False
    if device is None:
        return True
    device = torch.device(device)
    index = t.device.index if t.device.index is not None else 0
    return device.type == t.device.type and (device.index is None or device.index == index)


class FoldedGrad(torch.Tensor):
    """``param.grad`` once intake="hooks" folded its gradient (see the module docstring)."""

    @staticmethod
    def __new__(cls, param: torch.Tensor, index: int, sink=None, cleared=None, scaled=None, added=None):
        return torch.Tensor._make_wrapper_subclass(
            cls, param.shape, strides=param.stride(), dtype=param.dtype, device=param.device, requires_grad=False
        )

    def __init__(self, param: torch.Tensor, index: int, sink=None, cleared=None, scaled=None, added=None) -> None:
        # param: the param (an FSDP2 param: its local shard); sink(gradient):
        # an FSDP2 param's, takes what is added into .grad; cleared(): told of
        # an in-place zeroing; scaled(factor, divide): of an in-place scaling;
        # added(gradient): a plain param's, told of a gradient added into .grad.
        self.index = index
        self.lost = None  # why the gradient it stands for is not known (HookIntake.close)
        self.sink = sink
        self.cleared = cleared
        self.scaled = scaled
        self.added = added

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __deepcopy__(self, memo):
        # copy.deepcopy(model) copies .grad: the copy's gradient is in this
        # wrapper's buffer, which a copied wrapper restores from its own state.
        return None

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        target = args[0] if args else None
        if isinstance(target, FoldedGrad) and func is torch.ops.aten.detach.default:
            return target
        markers = [a for a in args if isinstance(a, FoldedGrad)] + [
            t for a in args if isinstance(a, (list, tuple)) for t in a if isinstance(t, FoldedGrad)
        ]
        if func is _ADD and isinstance(target, FoldedGrad) and target.sink is not None and _plain_add(args, kwargs):
            target.sink(args[1])
            return target
        if (
            func is _ADD
            and isinstance(target, FoldedGrad)
            and target.added is not None
            and _plain_add(args, kwargs)
            and args[1].shape == target.shape
        ):
            target.added(args[1])
            return target
        if func is _ZERO and isinstance(target, FoldedGrad) and target.cleared is not None:
            target.cleared()
            return target
        scaling = func in _SCALE and isinstance(target, FoldedGrad) and target.scaled is not None
        if scaling and _by_a_number(args, kwargs):
            target.scaled(args[1], _SCALE[func])
            return target
        if func is _FOREACH_ZERO and all(isinstance(t, FoldedGrad) and t.cleared is not None for t in target):
            for marker in target:
                marker.cleared()
            return None
        if func is _UNSCALE and _amp.checking_inf_for_step():
            return None  # GradScaler's own check before it steps the wrapper, which checks as it folds
        index = markers[0].index if markers else None
        if func is torch.ops.aten._to_copy.default:  # module.to(dtype or device) converts .grad too
            if isinstance(target, FoldedGrad) and _same_place(target, kwargs or {}):
                return target  # another spelling of the same device ('cpu:0' for 'cpu'), as Accelerate's prepare
            raise RuntimeError(
                f"param {index} cannot be converted or moved (model.to(), .half(), .cuda(), memory_format=...) while "
                "AccumulatingOptimizer holds it: its buffer, master weights and state were made for its dtype, "
                "device and layout. Convert or move the model first, then build the optimizer and the wrapper (or call "
                "opt.close() first)"
            )
        if markers and markers[0].lost is not None:
            raise RuntimeError(markers[0].lost)
        framework = _guards.framework_reading_grad(index)
        if framework is not None:
            raise RuntimeError(framework)
        fsdp = markers and markers[0].sink is not None
        raise RuntimeError(
            f"AccumulatingOptimizer (intake='hooks') folded param {index}'s gradients into its fp32 buffer during "
            f"backward: its .grad holds no values, so {func.__name__} cannot use it. Clip with max_grad_norm= (or "
            "opt.clip_grad_norm_(max_norm)); read the window's gradient with opt.accumulated_grad(param)"
            + (
                " (an FSDP2 model's gradients are only folded: intake 'grad' is not offered for FSDP2)"
                if fsdp
                else "; for code that must read or edit .grad (torch.nn.utils.clip_grad_norm_, a framework's "
                "clipping or norm logging, GradScaler.unscale_), count the window in your loop: accum_steps=None, "
                "whose default intake='grad' holds the window's sum in .grad (with accum_steps=N its .grad holds "
                "the undivided running sum the step divides, which torch's clip may edit only with normalize='sum' "
                "and the loss divided by N)"
            )
        )

    def __repr__(self) -> str:
        return (
            f"FoldedGrad(param {self.index}, shape {tuple(self.shape)}: folded into AccumulatingOptimizer's fp32 "
            "buffer; opt.accumulated_grad(param) reads it)"
        )
