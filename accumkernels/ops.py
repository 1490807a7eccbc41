"""The public functional ops of accumkernels.

Each op has one formula, stated in its docstring and in
csrc/include/accumkernels/formulas.h; every backend (``reference``, ``cpu``,
``cuda``) computes it in fp32 whatever the storage dtype. Each function
validates its arguments (accumkernels._validation) before any backend runs,
so a bad call writes nothing, then runs the backend picked by
``backend=None`` (the fastest available for the tensors' device) or the one
named.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import _validation as v
from .backends import resolve

Tensors = Sequence[torch.Tensor]


def accumulate_(
    buffers: Tensors,
    grads: Tensors,
    scale: float | torch.Tensor = 1.0,
    *,
    overwrite: bool = False,
    found_inf: torch.Tensor | None = None,
    backend: str | None = None,
) -> None:
    """Fold gradients into fp32 accumulation buffers, in one pass over the list.

    For every pair ``(buffer, grad)``::

        buffer = (0 if overwrite else buffer) + scale * float32(grad)

    and, when ``found_inf`` is given, ``found_inf = 1`` if any element of any
    grad is inf or NaN (it is left as it was otherwise, so one flag can collect
    a whole window). With ``overwrite=True`` the buffer is not read: the first
    contribution of a window needs no zeroing pass.

    Args:
        buffers: fp32 tensors, updated in place.
        grads: bf16, fp16 or fp32 tensors (dtypes may differ within the list),
            each with the numel of its buffer and the same memory order (both
            contiguous, or equal sizes and strides).
        scale: a Python float, or a 1-element fp32 tensor on the buffers'
            device, read there with no host sync (e.g. 1 / GradScaler's scale).
        overwrite: replace the buffers instead of adding to them.
        found_inf: optional 1-element fp32 tensor on the buffers' device.
        backend: None (fastest available) or a name from available_backends().
    """
    op = "accumkernels.accumulate_"
    buffers = v.as_tensor_list(op, buffers, "buffers")
    grads = v.as_tensor_list(op, grads, "grads")
    v.check_length(op, grads, "grads", len(buffers), "one grad per buffer")
    if not buffers:
        v.scale_argument(op, scale, "scale", None)
        return
    device = buffers[0].device
    for i, (b, g) in enumerate(zip(buffers, grads)):
        v.check_tensor(op, b, "buffers", i, device, v.F32)
        v.check_like(op, g, "grads", i, b, "buffers", v.GRAD_DTYPES)
    scale_value, scale_tensor = v.scale_argument(op, scale, "scale", device)
    v.check_scalar_tensor(op, found_inf, "found_inf", device)
    v.check_disjoint(op, {"buffers": buffers, "found_inf": found_inf}, {"grads": grads, "scale": scale_tensor})
    resolve(backend, device).accumulate_(buffers, grads, scale_value, scale_tensor, bool(overwrite), found_inf)


def _check_step_tensors(op, params, buffers, master_params):
    """The tensors every step op takes; returns the device."""
    v.check_length(op, buffers, "buffers", len(params), "one buffer per param")
    if master_params:
        v.check_length(op, master_params, "master_params", len(params), "one master weight per param, or None")
    device = params[0].device
    for i, p in enumerate(params):
        v.check_tensor(op, p, "params", i, device, v.PARAM_DTYPES)
        v.check_like(op, buffers[i], "buffers", i, p, "params", v.F32)
        if master_params:
            if p.dtype == torch.float32:
                raise TypeError(
                    f"{op}: params[{i}] is float32 but master_params were given; "
                    "master weights are for bfloat16 or float16 params"
                )
            v.check_like(op, master_params[i], "master_params", i, p, "params", v.F32)
    return device


def _check_stochastic_rounding(op, stochastic_rounding, seed, master_params) -> int:
    if stochastic_rounding and master_params:
        raise ValueError(
            f"{op}: stochastic_rounding and master_params exclude each other "
            "(with master weights the params are rounded copies of them)"
        )
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ValueError(f"{op}: seed must be an int in [0, 2**32); got {seed!r}")
    return seed


def _check_state(op, state, name, params):
    v.check_length(op, state, name, len(params), "one per param")
    for i, (s, p) in enumerate(zip(state, params)):
        v.check_like(op, s, name, i, p, "params", v.F32)


def sgd_step_and_zero_(
    params: Tensors,
    buffers: Tensors,
    momentum_buffers: Tensors | None = None,
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    maximize: bool = False,
    is_first_step: bool = False,
    grad_scale: float | torch.Tensor = 1.0,
    found_inf: torch.Tensor | None = None,
    master_params: Tensors | None = None,
    zero_buffers: bool = True,
    stochastic_rounding: bool = False,
    seed: int = 0,
    backend: str | None = None,
) -> None:
    """One torch.optim.SGD step from fp32 gradient buffers, then clear them, in one pass.

    Per element, with ``w`` the weight (``master_params`` if given, else the
    param in fp32)::

        g = grad_scale * buffer            (-grad_scale * buffer if maximize)
        g = g + weight_decay * w           (if weight_decay != 0)
        if momentum != 0:
            b = g if is_first_step else momentum * b + (1 - dampening) * g
            g = g + momentum * b if nesterov else b
        w = w - lr * g
        buffer = 0                         (if zero_buffers)

    and the param is set to ``w`` rounded to its dtype (round to nearest even).
    If ``found_inf`` is nonzero, params, master weights and momentum buffers
    are left untouched (the buffers are still cleared).

    Args:
        params: fp32, bf16 or fp16 tensors, updated in place.
        buffers: the fp32 gradient sums, one per param, laid out like it.
        momentum_buffers: fp32 state, one per param; required iff momentum != 0.
        grad_scale: float or 1-element fp32 device tensor multiplying the
            buffers (it can carry 1/N, 1/num_items, 1/loss_scale and a clip
            coefficient at once).
        found_inf: optional 1-element fp32 device tensor; nonzero skips the step.
        master_params: optional fp32 weights for bf16/fp16 params.
        is_first_step: the momentum buffers hold no history yet (torch.optim
            starts them as a copy of the first gradient).
        zero_buffers: write zeros into the buffers in the same pass.
        stochastic_rounding: round bf16 params stochastically (see below).
        seed: the stochastic rounding seed; use a new one every step.

    Stochastic rounding (bf16 params, no master weights): the param receives
    ``w`` with 16 random bits added below the bf16 mantissa, then truncated, so
    its expected value is ``w`` and small updates are not lost to rounding. The
    bits are a fixed hash of (seed, position in the list, element index), the
    same in every backend.
    """
    op = "accumkernels.sgd_step_and_zero_"
    params = v.as_tensor_list(op, params, "params")
    buffers = v.as_tensor_list(op, buffers, "buffers")
    momentum_buffers = v.as_tensor_list(op, momentum_buffers, "momentum_buffers", optional=True)
    master_params = v.as_tensor_list(op, master_params, "master_params", optional=True)
    lr = v.check_number(op, lr, "lr", low=0.0)
    momentum = v.check_number(op, momentum, "momentum", low=0.0)
    dampening = v.check_number(op, dampening, "dampening")
    weight_decay = v.check_number(op, weight_decay, "weight_decay", low=0.0)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(f"{op}: nesterov requires momentum > 0 and dampening == 0")
    seed = _check_stochastic_rounding(op, stochastic_rounding, seed, master_params)
    if not params:
        v.check_length(op, buffers, "buffers", 0, "one buffer per param")
        v.scale_argument(op, grad_scale, "grad_scale", None)
        return
    device = _check_step_tensors(op, params, buffers, master_params)
    if momentum != 0:
        _check_state(op, momentum_buffers, "momentum_buffers", params)
    else:
        v.check_length(op, momentum_buffers, "momentum_buffers", 0, "momentum is 0: pass None")
    scale_value, scale_tensor = v.scale_argument(op, grad_scale, "grad_scale", device)
    v.check_scalar_tensor(op, found_inf, "found_inf", device)
    v.check_disjoint(
        op,
        {"params": params, "buffers": buffers, "momentum_buffers": momentum_buffers, "master_params": master_params},
        {"grad_scale": scale_tensor, "found_inf": found_inf},
    )
    resolve(backend, device).sgd_step_and_zero_(
        params, buffers, momentum_buffers, master_params, lr, momentum, dampening, weight_decay,
        bool(nesterov), bool(maximize), bool(is_first_step), scale_value, scale_tensor, found_inf,
        bool(zero_buffers), bool(stochastic_rounding), seed,
    )  # fmt: skip


def _adam_family(op, adamw, params, buffers, exp_avgs, exp_avg_sqs, state_steps, max_exp_avg_sqs, lr, betas,
                 eps, weight_decay, amsgrad, maximize, grad_scale, found_inf, master_params, zero_buffers,
                 stochastic_rounding, seed, backend):
    params = v.as_tensor_list(op, params, "params")
    buffers = v.as_tensor_list(op, buffers, "buffers")
    exp_avgs = v.as_tensor_list(op, exp_avgs, "exp_avgs")
    exp_avg_sqs = v.as_tensor_list(op, exp_avg_sqs, "exp_avg_sqs")
    state_steps = v.as_tensor_list(op, state_steps, "state_steps")
    max_exp_avg_sqs = v.as_tensor_list(op, max_exp_avg_sqs, "max_exp_avg_sqs", optional=True)
    master_params = v.as_tensor_list(op, master_params, "master_params", optional=True)
    lr = v.check_number(op, lr, "lr", low=0.0)
    if not isinstance(betas, Sequence) or len(betas) != 2:
        raise TypeError(f"{op}: betas must be a pair (beta1, beta2); got {betas!r}")
    beta1 = v.check_number(op, betas[0], "betas[0]", low=0.0, high=1.0, high_inclusive=False)
    beta2 = v.check_number(op, betas[1], "betas[1]", low=0.0, high=1.0, high_inclusive=False)
    eps = v.check_number(op, eps, "eps", low=0.0)
    weight_decay = v.check_number(op, weight_decay, "weight_decay", low=0.0)
    seed = _check_stochastic_rounding(op, stochastic_rounding, seed, master_params)
    if not params:
        v.check_length(op, buffers, "buffers", 0, "one buffer per param")
        v.scale_argument(op, grad_scale, "grad_scale", None)
        return
    device = _check_step_tensors(op, params, buffers, master_params)
    _check_state(op, exp_avgs, "exp_avgs", params)
    _check_state(op, exp_avg_sqs, "exp_avg_sqs", params)
    if amsgrad:
        _check_state(op, max_exp_avg_sqs, "max_exp_avg_sqs", params)
    else:
        v.check_length(op, max_exp_avg_sqs, "max_exp_avg_sqs", 0, "amsgrad is False: pass None")
    v.check_length(op, state_steps, "state_steps", len(params), "one step count per param")
    for i, s in enumerate(state_steps):
        v.check_tensor(op, s, "state_steps", i, device, v.F32)
        if s.numel() != 1:
            raise ValueError(f"{op}: state_steps[{i}] must have 1 element; got {s.numel()}")
    scale_value, scale_tensor = v.scale_argument(op, grad_scale, "grad_scale", device)
    v.check_scalar_tensor(op, found_inf, "found_inf", device)
    v.check_disjoint(
        op,
        {"params": params, "buffers": buffers, "exp_avgs": exp_avgs, "exp_avg_sqs": exp_avg_sqs,
         "max_exp_avg_sqs": max_exp_avg_sqs, "state_steps": state_steps, "master_params": master_params},
        {"grad_scale": scale_tensor, "found_inf": found_inf},
    )  # fmt: skip
    impl = resolve(backend, device)
    fn = impl.adamw_step_and_zero_ if adamw else impl.adam_step_and_zero_
    fn(
        params, buffers, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, master_params, lr, beta1, beta2,
        eps, weight_decay, bool(amsgrad), bool(maximize), scale_value, scale_tensor, found_inf, bool(zero_buffers),
        bool(stochastic_rounding), seed,
    )  # fmt: skip


_ADAM_DOC = """One torch.optim.{cls} step from fp32 gradient buffers, then clear them, in one pass.

    Per element, with ``w`` the weight (``master_params`` if given, else the
    param in fp32) and ``t`` the param's step count after this step
    (``state_steps[i]`` is incremented in place)::

        g = grad_scale * buffer            (-grad_scale * buffer if maximize)
        {decay}
        m = m + (1 - beta1) * (g - m)
        v = beta2 * v + (1 - beta2) * g * g
        v_hat = max(v_max, v) if amsgrad (stored in v_max) else v
        w = w - lr / (1 - beta1^t) * m / (sqrt(v_hat) / sqrt(1 - beta2^t) + eps)
        buffer = 0                         (if zero_buffers)

    and the param is set to ``w`` rounded to its dtype (round to nearest even).
    If ``found_inf`` is nonzero, params, master weights, state and step counts
    are left untouched (the buffers are still cleared).

    Args:
        params: fp32, bf16 or fp16 tensors, updated in place.
        buffers: the fp32 gradient sums, one per param, laid out like it.
        exp_avgs, exp_avg_sqs: fp32 state (``m``, ``v``), one per param.
        state_steps: 1-element fp32 step counts on the params' device, one per
            param (torch.optim's ``state['step']``).
        max_exp_avg_sqs: fp32 state ``v_max``; required iff amsgrad.
        grad_scale: float or 1-element fp32 device tensor multiplying the
            buffers (it can carry 1/N, 1/num_items, 1/loss_scale and a clip
            coefficient at once).
        found_inf: optional 1-element fp32 device tensor; nonzero skips the step.
        master_params: optional fp32 weights for bf16/fp16 params.
        zero_buffers: write zeros into the buffers in the same pass.
        stochastic_rounding: round bf16 params stochastically, as
            sgd_step_and_zero_ describes; seed: its seed, new every step.
    """


def adam_step_and_zero_(
    params: Tensors,
    buffers: Tensors,
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
    state_steps: Tensors,
    *,
    max_exp_avg_sqs: Tensors | None = None,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    amsgrad: bool = False,
    maximize: bool = False,
    grad_scale: float | torch.Tensor = 1.0,
    found_inf: torch.Tensor | None = None,
    master_params: Tensors | None = None,
    zero_buffers: bool = True,
    stochastic_rounding: bool = False,
    seed: int = 0,
    backend: str | None = None,
) -> None:
    _adam_family(
        "accumkernels.adam_step_and_zero_", False, params, buffers, exp_avgs, exp_avg_sqs, state_steps,
        max_exp_avg_sqs, lr, betas, eps, weight_decay, amsgrad, maximize, grad_scale, found_inf, master_params,
        zero_buffers, stochastic_rounding, seed, backend,
    )  # fmt: skip


def adamw_step_and_zero_(
    params: Tensors,
    buffers: Tensors,
    exp_avgs: Tensors,
    exp_avg_sqs: Tensors,
    state_steps: Tensors,
    *,
    max_exp_avg_sqs: Tensors | None = None,
    lr: float = 1e-3,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 1e-2,
    amsgrad: bool = False,
    maximize: bool = False,
    grad_scale: float | torch.Tensor = 1.0,
    found_inf: torch.Tensor | None = None,
    master_params: Tensors | None = None,
    zero_buffers: bool = True,
    stochastic_rounding: bool = False,
    seed: int = 0,
    backend: str | None = None,
) -> None:
    _adam_family(
        "accumkernels.adamw_step_and_zero_", True, params, buffers, exp_avgs, exp_avg_sqs, state_steps,
        max_exp_avg_sqs, lr, betas, eps, weight_decay, amsgrad, maximize, grad_scale, found_inf, master_params,
        zero_buffers, stochastic_rounding, seed, backend,
    )  # fmt: skip


adam_step_and_zero_.__doc__ = _ADAM_DOC.format(cls="Adam", decay="g = g + weight_decay * w           (if weight_decay != 0)")
adamw_step_and_zero_.__doc__ = _ADAM_DOC.format(cls="AdamW", decay="w = w * (1 - lr * weight_decay)    (if weight_decay != 0)")


def grad_norm(buffers: Tensors, *, backend: str | None = None) -> torch.Tensor:
    """The global L2 norm ``sqrt(sum of x^2 over every element of every buffer)``.

    Returns a 0-dim fp32 tensor on the buffers' device, with no host sync.
    Deterministic: the same inputs give the same bits (fixed summation order,
    independent of the thread count). inf or NaN in any buffer gives inf/NaN.

    Args:
        buffers: a non-empty list of fp32 tensors on one device.
    """
    op = "accumkernels.grad_norm"
    buffers = v.as_tensor_list(op, buffers, "buffers")
    if not buffers:
        raise ValueError(f"{op}: buffers is empty; expected at least one tensor (the result's device comes from them)")
    device = buffers[0].device
    for i, b in enumerate(buffers):
        v.check_tensor(op, b, "buffers", i, device, v.F32)
    return resolve(backend, device).grad_norm(buffers)
