"""Drop-in optimizer classes: ``accumkernels.AdamW``, ``Adam`` and ``SGD``.

Each takes ``torch.optim``'s signature (params or param groups, every
hyperparameter with torch's default) plus AccumulatingOptimizer's keywords,
builds the matching ``torch.optim`` optimizer and wraps it: the class is an
AccumulatingOptimizer, and so a ``torch.optim.Optimizer``, that can be built
wherever frameworks build optimizers from a class (HF Trainer's
``optimizer_cls_and_kwargs``, Lightning's ``configure_optimizers``, configs
that instantiate a class by name). Its ``state_dict()`` is the torch
optimizer's (plus the in-window entry), so it loads into the matching
``torch.optim`` class and back.

With the defaults (``accum_steps=None``) every ``step()`` call ends a window:
the loop, or the framework, counts the micro-batches and scales the loss as it
would for ``torch.optim``; the gradients are summed in fp32 and the step is the
fused one. ``accum_steps=N`` makes the class count the window instead.
"""

from __future__ import annotations

import torch

from ._options import NOT_DIFFERENTIABLE
from .wrapper import AccumulatingOptimizer


class AdamW(AccumulatingOptimizer):
    """``torch.optim.AdamW`` accumulating its gradients in fp32 buffers (see
    AccumulatingOptimizer): once per window, the update of
    ``accumkernels.ops.adamw_step_and_zero_`` (its docstring has the formula)
    with the window's gradient.

    Args: those of ``torch.optim.AdamW`` (``foreach``, ``fused`` and
    ``capturable`` are kept in the param groups for interchange; the step is
    always accumkernels' fused one), then ``accum_steps`` and the keyword
    arguments of AccumulatingOptimizer (``max_grad_norm``, ``master_weights``,
    ``stochastic_rounding``, ``state_dtype``, ``intake``, ...).
    """

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=1e-2,
        amsgrad=False,
        *,
        maximize=False,
        foreach=None,
        capturable=False,
        differentiable=False,
        fused=None,
        accum_steps: int | None = None,
        **options,
    ) -> None:
        if differentiable:
            raise ValueError(f"accumkernels.AdamW: {NOT_DIFFERENTIABLE}")
        inner = torch.optim.AdamW(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            maximize=maximize,
            foreach=foreach,
            capturable=capturable,
            fused=fused,
        )
        super().__init__(inner, accum_steps, **options)


class Adam(AccumulatingOptimizer):
    """``torch.optim.Adam`` accumulating its gradients in fp32 buffers (see
    AccumulatingOptimizer): once per window, the update of
    ``accumkernels.ops.adam_step_and_zero_`` (``adamw_step_and_zero_``'s with
    ``decoupled_weight_decay=True``) with the window's gradient.

    Args: those of ``torch.optim.Adam``, then ``accum_steps`` and the keyword
    arguments of AccumulatingOptimizer (see accumkernels.AdamW).
    """

    def __init__(
        self,
        params,
        lr=1e-3,
        betas=(0.9, 0.999),
        eps=1e-8,
        weight_decay=0,
        amsgrad=False,
        *,
        foreach=None,
        maximize=False,
        capturable=False,
        differentiable=False,
        fused=None,
        decoupled_weight_decay=False,
        accum_steps: int | None = None,
        **options,
    ) -> None:
        if differentiable:
            raise ValueError(f"accumkernels.Adam: {NOT_DIFFERENTIABLE}")
        inner = torch.optim.Adam(
            params,
            lr=lr,
            betas=betas,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            foreach=foreach,
            maximize=maximize,
            capturable=capturable,
            fused=fused,
            decoupled_weight_decay=decoupled_weight_decay,
        )
        super().__init__(inner, accum_steps, **options)


class SGD(AccumulatingOptimizer):
    """``torch.optim.SGD`` accumulating its gradients in fp32 buffers (see
    AccumulatingOptimizer): once per window, the update of
    ``accumkernels.ops.sgd_step_and_zero_`` (its docstring has the formula)
    with the window's gradient.

    Args: those of ``torch.optim.SGD``, then ``accum_steps`` and the keyword
    arguments of AccumulatingOptimizer (see accumkernels.AdamW).
    """

    def __init__(
        self,
        params,
        lr=1e-3,
        momentum=0,
        dampening=0,
        weight_decay=0,
        nesterov=False,
        *,
        maximize=False,
        foreach=None,
        differentiable=False,
        fused=None,
        accum_steps: int | None = None,
        **options,
    ) -> None:
        if differentiable:
            raise ValueError(f"accumkernels.SGD: {NOT_DIFFERENTIABLE}")
        inner = torch.optim.SGD(
            params,
            lr=lr,
            momentum=momentum,
            dampening=dampening,
            weight_decay=weight_decay,
            nesterov=nesterov,
            maximize=maximize,
            foreach=foreach,
            fused=fused,
        )
        super().__init__(inner, accum_steps, **options)
