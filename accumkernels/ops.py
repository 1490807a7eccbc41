"""The public functional ops of accumkernels.

Each op has one formula, stated in its docstring and in
csrc/include/accumkernels/formulas.h; every backend (``reference``, ``cpu``,
``cuda``, ``triton``; see accumkernels.backends) computes it in fp32 whatever
the storage dtype. Each function validates its arguments
(accumkernels._validation) before any backend runs, so a bad call writes
nothing, then calls the backend picked by ``backend=None`` (the fastest
available for the tensors' device) or the one named, by keyword with the
names of the op's schema (csrc/ops.cpp). ``maximize`` is folded into the sign
of ``grad_scale`` here, once: no backend sees it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from . import _validation as checks
from ._state8 import scales_numel
from .backends import resolve
from .backends.native import NativeBackend

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
    if isinstance(backend, Prepared):  # the caller's own tensors, checked when it made them
        if buffers:
            value, tensor = _split_scale(scale)
            backend.on(buffers[0].device).accumulate_(
                buffers=buffers,
                grads=grads,
                scale=value,
                scale_tensor=tensor,
                overwrite=bool(overwrite),
                found_inf=found_inf,
            )
        return
    buffers = checks.as_tensor_list(op, buffers, "buffers")
    grads = checks.as_tensor_list(op, grads, "grads")
    checks.check_length(op, grads, "grads", len(buffers), "one grad per buffer")
    if not buffers:
        checks.scale_argument(op, scale, "scale", None)
        return
    device = buffers[0].device
    for i, (b, g) in enumerate(zip(buffers, grads)):
        checks.check_tensor(op, b, "buffers", i, device, checks.F32)
        checks.check_like(op, g, "grads", i, b, "buffers", checks.GRAD_DTYPES)
    scale_value, scale_tensor = checks.scale_argument(op, scale, "scale", device)
    checks.check_scalar_tensor(op, found_inf, "found_inf", device)
    checks.check_disjoint(op, {"buffers": buffers, "found_inf": found_inf}, {"grads": grads, "scale": scale_tensor})
    resolve(backend, device).accumulate_(
        buffers=buffers,
        grads=grads,
        scale=scale_value,
        scale_tensor=scale_tensor,
        overwrite=bool(overwrite),
        found_inf=found_inf,
    )


def _backend(backend, device: torch.device):
    """The backend module for a ``backend=`` argument: a name (or None), or a Prepared one."""
    return backend.on(device) if isinstance(backend, Prepared) else resolve(backend, device)


def _step_arguments(
    op,
    params,
    buffers,
    master_params,
    grad_scale,
    found_inf,
    maximize,
    zero_buffers,
    stochastic_rounding,
    seed,
    positions,
    check_tensors=True,
) -> dict:
    """Checks what every step op takes and returns it under the schema's names
    (maximize folded into the sign of grad_scale); {} for an empty call.
    ``check_tensors=False`` (a Prepared backend): the numbers are checked, the
    tensors are the caller's own, checked when it made them."""
    if not check_tensors:
        params, buffers, master_params = list(params), list(buffers), list(master_params or ())
        if not params:
            return {}
        scale_value, scale_tensor = _split_scale(grad_scale)
        positions = list(positions or ())
    else:
        params, buffers, master_params, positions, scale_value, scale_tensor = _check_step_tensors(
            op, params, buffers, master_params, grad_scale, found_inf, stochastic_rounding, seed, positions
        )
        if not params:
            return {}
    return dict(
        params=params,
        buffers=buffers,
        master_params=master_params,
        grad_scale=-scale_value if maximize else scale_value,
        grad_scale_tensor=scale_tensor,
        found_inf=found_inf,
        zero_buffers=bool(zero_buffers),
        stochastic_rounding=bool(stochastic_rounding),
        seed=seed,
        positions=positions,
    )


def _split_scale(value) -> tuple[float, torch.Tensor | None]:
    """A scale the caller vouches for, as the schema's (float, tensor) pair."""
    return (1.0, value) if isinstance(value, torch.Tensor) else (float(value), None)


def _check_step_tensors(
    op, params, buffers, master_params, grad_scale, found_inf, stochastic_rounding, seed, positions
):
    """The checks of what every step op takes; returns (params, buffers,
    master_params, positions, scale value, scale tensor), params empty for an
    empty call."""
    params = checks.as_tensor_list(op, params, "params")
    buffers = checks.as_tensor_list(op, buffers, "buffers")
    master_params = checks.as_tensor_list(op, master_params, "master_params", optional=True)
    if stochastic_rounding and master_params:
        raise ValueError(
            f"{op}: stochastic_rounding and master_params exclude each other "
            "(with master weights the params are rounded copies of them)"
        )
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**32:
        raise ValueError(f"{op}: seed must be an int in [0, 2**32); got {seed!r}")
    checks.check_length(op, buffers, "buffers", len(params), "one buffer per param")
    positions = checks.positions_argument(op, positions, len(params))
    if not params:
        checks.scale_argument(op, grad_scale, "grad_scale", None)
        return params, buffers, master_params, positions, 1.0, None
    if master_params:
        checks.check_length(op, master_params, "master_params", len(params), "one master weight per param, or None")
    device = params[0].device
    # One kind of buffer per call: every buffer fp32 (the window's sums), or,
    # where any is narrower, every buffer a gradient of its param's dtype.
    narrow = any(isinstance(b, torch.Tensor) and b.dtype != torch.float32 for b in buffers)
    for i, p in enumerate(params):
        checks.check_tensor(op, p, "params", i, device, checks.PARAM_DTYPES)
        if narrow and isinstance(buffers[i], torch.Tensor) and buffers[i].dtype != p.dtype:
            raise TypeError(
                f"{op}: buffers[{i}] is {buffers[i].dtype} and params[{i}] {p.dtype}; expected every buffer float32 "
                "(the window's sums), or every buffer of its param's dtype (a gradient, read as it is)"
            )
        checks.check_like(op, buffers[i], "buffers", i, p, "params", (p.dtype,) if narrow else checks.F32)
        if master_params:
            if p.dtype == torch.float32:
                raise TypeError(
                    f"{op}: params[{i}] is float32 but master_params were given; "
                    "master weights are for bfloat16 or float16 params"
                )
            checks.check_like(op, master_params[i], "master_params", i, p, "params", checks.MASTER_DTYPES)
            checks.check_same_dtype(op, master_params, "master_params", i, "one kind of master weights per call")
            if master_params[i].dtype == torch.int16 and p.dtype != torch.bfloat16:
                raise TypeError(
                    f"{op}: master_params[{i}] are int16 remainders but params[{i}] is {p.dtype}; "
                    "remainders are for bfloat16 params"
                )
    scale_value, scale_tensor = checks.scale_argument(op, grad_scale, "grad_scale", device)
    checks.check_scalar_tensor(op, found_inf, "found_inf", device)
    return params, buffers, master_params, positions, scale_value, scale_tensor


def _check_state(op, state, name, params, dtype):
    """One state tensor per param, laid out like it, of the call's state dtype ``dtype``."""
    checks.check_length(op, state, name, len(params), "one per param")
    for i, (s, p) in enumerate(zip(state, params)):
        checks.check_like(op, s, name, i, p, "params", checks.STATE_DTYPES)
        if s.dtype != dtype:
            raise TypeError(
                f"{op}: {name}[{i}] has dtype {s.dtype} but the call's state is {dtype}; every state tensor of a "
                "call has one dtype"
            )


def _scalar_tensors(args: dict) -> dict:
    return {"grad_scale": args["grad_scale_tensor"], "found_inf": args["found_inf"]}


def _check_8bit_scales(op, scales, name, params) -> None:
    """8-bit state: one fp32 scale per block of 256 of each param."""
    checks.check_length(op, scales, name, len(params), "8-bit state: one scale tensor per param")
    for i, (sc, p) in enumerate(zip(scales, params)):
        checks.check_tensor(op, sc, name, i, p.device, checks.F32)
        if sc.numel() != scales_numel(p.numel()):
            raise ValueError(
                f"{op}: {name}[{i}] has {sc.numel()} elements; expected {scales_numel(p.numel())} (one "
                f"per block of 256 of params[{i}]'s {p.numel()})"
            )


def _check_momentum_buffers(op, momentum_buffers, momentum_buffer_scales, params, momentum) -> None:
    if momentum == 0:
        checks.check_length(op, momentum_buffers, "momentum_buffers", 0, "momentum is 0: pass None")
    else:
        _check_state(op, momentum_buffers, "momentum_buffers", params, checks.first_dtype(momentum_buffers))
    if momentum != 0 and checks.first_dtype(momentum_buffers) == torch.uint8:
        _check_8bit_scales(op, momentum_buffer_scales, "momentum_buffer_scales", params)
    else:
        checks.check_length(
            op, momentum_buffer_scales, "momentum_buffer_scales", 0, "the momentum buffers are not 8-bit: pass None"
        )


def check_sgd_hyperparameters(op: str, lr, momentum, dampening, weight_decay, nesterov) -> tuple[float, ...]:
    """sgd_step_and_zero_'s hyperparameters, checked (the bounds torch.optim.SGD's
    constructor sets): (lr, momentum, dampening, weight_decay) as floats."""
    lr = checks.check_number(op, lr, "lr", low=0.0)
    momentum = checks.check_number(op, momentum, "momentum", low=0.0)
    dampening = checks.check_number(op, dampening, "dampening")
    weight_decay = checks.check_number(op, weight_decay, "weight_decay", low=0.0)
    if nesterov and (momentum <= 0 or dampening != 0):
        raise ValueError(f"{op}: nesterov requires momentum > 0 and dampening == 0")
    return lr, momentum, dampening, weight_decay


def check_adam_hyperparameters(op: str, lr, betas, eps, weight_decay) -> tuple[float, ...]:
    """adam(w)_step_and_zero_'s hyperparameters, checked (the bounds torch.optim.Adam's
    constructor sets): (lr, beta1, beta2, eps, weight_decay) as floats."""
    lr = checks.check_number(op, lr, "lr", low=0.0)
    if not isinstance(betas, Sequence) or len(betas) != 2:
        raise TypeError(f"{op}: betas must be a pair (beta1, beta2); got {betas!r}")
    beta1 = checks.check_number(op, betas[0], "betas[0]", low=0.0, high=1.0, high_inclusive=False)
    beta2 = checks.check_number(op, betas[1], "betas[1]", low=0.0, high=1.0, high_inclusive=False)
    eps = checks.check_number(op, eps, "eps", low=0.0)
    weight_decay = checks.check_number(op, weight_decay, "weight_decay", low=0.0)
    return lr, beta1, beta2, eps, weight_decay


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
    momentum_buffer_scales: Tensors | None = None,
    zero_buffers: bool = True,
    stochastic_rounding: bool = False,
    seed: int = 0,
    positions: Sequence[int] | None = None,
    backend: str | None = None,
) -> None:
    """One torch.optim.SGD step from fp32 gradient buffers, then clear them, in one pass.

    Per element, with ``w`` the weight (else the param in fp32; with fp32
    ``master_params``, the master where the param holds it rounded to the
    param's dtype, else the param: a param written since the last step,
    through ``p.data`` too, is stepped from as it is)::

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
        buffers: the fp32 gradient sums, one per param, laid out like it; or,
            where nothing was summed (a window of one micro-batch), each
            param's gradient in the param's own dtype, read as it is (every
            buffer of a call is fp32, or every buffer of its param's dtype).
        momentum_buffers: the state ``b``, one per param, all fp32 or all bf16
            (bf16: rounded stochastically, see below) or all uint8: 8-bit codes
            with block scales as Adam's exp_avg (accumkernels._state8; encoded
            stochastically with the bits of rounding slot 1), then with
            ``momentum_buffer_scales``, one fp32 tensor of ceil(numel / 256)
            elements per param; required iff momentum != 0.
        grad_scale: float or 1-element fp32 device tensor multiplying the
            buffers (it can carry 1/N, 1/num_items, 1/loss_scale and a clip
            coefficient at once).
        found_inf: optional 1-element fp32 device tensor; nonzero skips the step.
        master_params: optional master weights of bf16/fp16 params: fp32
            copies (4 bytes per element), or, for bf16 params, int16
            remainders (2 bytes): the low 16 bits of the fp32 master, whose
            high 16 bits the param holds (rounded to nearest, ties away from
            zero), so that param and remainder are the fp32 master bit for bit.
        is_first_step: the momentum buffers hold no history yet (torch.optim
            starts them as a copy of the first gradient).
        zero_buffers: write zeros into the buffers in the same pass.
        stochastic_rounding: round bf16 params stochastically (see below).
        seed: the stochastic rounding seed (of bf16 params with
            stochastic_rounding, and of bf16 state always); use a new one every step.
        positions: each param's stream id for stochastic rounding (default:
            its place in the list); give distinct ids to params that share a seed.

    Stochastic rounding (bf16 params without master weights, and every bf16
    state tensor): the value receives 16 random bits added below the bf16
    mantissa, then is truncated, so its expected value is the fp32 result and
    small updates are not lost to rounding. The bits are a fixed hash of (seed,
    stream id, the element's index in memory order), the same in every
    backend; the param and each state tensor of an element draw different bits
    (formulas.h's rounding slots).
    """
    op = "accumkernels.sgd_step_and_zero_"
    trusted = isinstance(backend, Prepared)
    if trusted:
        momentum_buffers, momentum_buffer_scales = list(momentum_buffers or ()), list(momentum_buffer_scales or ())
    else:
        momentum_buffers = checks.as_tensor_list(op, momentum_buffers, "momentum_buffers", optional=True)
        momentum_buffer_scales = checks.as_tensor_list(
            op, momentum_buffer_scales, "momentum_buffer_scales", optional=True
        )
    lr, momentum, dampening, weight_decay = check_sgd_hyperparameters(
        op, lr, momentum, dampening, weight_decay, nesterov
    )
    args = _step_arguments(
        op,
        params,
        buffers,
        master_params,
        grad_scale,
        found_inf,
        maximize,
        zero_buffers,
        stochastic_rounding,
        seed,
        positions,
        check_tensors=not trusted,
    )
    params = args.get("params", [])
    if not trusted:
        _check_momentum_buffers(op, momentum_buffers, momentum_buffer_scales, params, momentum)
    if not params:
        return
    if not trusted:
        checks.check_disjoint(
            op,
            {
                "params": params,
                "buffers": args["buffers"],
                "momentum_buffers": momentum_buffers,
                "master_params": args["master_params"],
                "momentum_buffer_scales": momentum_buffer_scales,
            },
            _scalar_tensors(args),
        )
    _backend(backend, params[0].device).sgd_step_and_zero_(
        **args,
        momentum_buffers=momentum_buffers,
        momentum_buffer_scales=momentum_buffer_scales,
        lr=lr,
        momentum=momentum,
        dampening=dampening,
        weight_decay=weight_decay,
        nesterov=bool(nesterov),
        is_first_step=bool(is_first_step),
    )


_ADAM_DOC = """One torch.optim.{cls} step from fp32 gradient buffers, then clear them, in one pass.

    Per element, with ``w`` the weight (else the param in fp32; with fp32
    ``master_params``, the master where the param holds it rounded to the
    param's dtype, else the param: a param written since the last step,
    through ``p.data`` too, is stepped from as it is) and ``t`` the param's
    step count after this step
    (``state_steps[i]`` is incremented in place)::

        g = grad_scale * buffer            (-grad_scale * buffer if maximize)
        {decay}
        m = lerp(m, g, 1 - beta1)          (torch.lerp: m + (1 - beta1) * (g - m) for beta1 > 0.5)
        v = beta2 * v + (1 - beta2) * g * g
        v_hat = maximum(v_max, v) if amsgrad (stored in v_max; NaN if either is NaN) else v
        w = w - lr / (1 - beta1^t) * m / (sqrt(v_hat) / sqrt(1 - beta2^t) + eps)
        buffer = 0                         (if zero_buffers)

    and the param is set to ``w`` rounded to its dtype (round to nearest even).
    If ``found_inf`` is nonzero, params, master weights, state and step counts
    are left untouched (the buffers are still cleared).

    Args:
        params: fp32, bf16 or fp16 tensors, updated in place.
        buffers: the fp32 gradient sums, one per param, laid out like it; or,
            where nothing was summed (a window of one micro-batch), each
            param's gradient in the param's own dtype, read as it is (every
            buffer of a call is fp32, or every buffer of its param's dtype).
        exp_avgs, exp_avg_sqs: the state (``m``, ``v``), one per param; all
            state tensors of a call fp32, or all bf16 (rounded stochastically,
            as sgd_step_and_zero_ describes), or all uint8: 8-bit codes with
            block scales (accumkernels._state8 states the format; encoded
            stochastically with the bits of the bf16 state's rounding slots),
            then with ``exp_avg_scales`` and ``exp_avg_sq_scales``, one fp32
            tensor of ceil(numel / 256) elements per param. 8-bit state: not
            with amsgrad; a block holding an inf or NaN decodes to inf or NaN.
        state_steps: 1-element fp32 step counts on the params' device, one per
            param (torch.optim's ``state['step']``).
        max_exp_avg_sqs: the state ``v_max``; required iff amsgrad.
        grad_scale: float or 1-element fp32 device tensor multiplying the
            buffers (it can carry 1/N, 1/num_items, 1/loss_scale and a clip
            coefficient at once).
        found_inf: optional 1-element fp32 device tensor; nonzero skips the step.
        master_params: optional master weights of bf16/fp16 params: fp32
            copies, or int16 remainders of bf16 params (see sgd_step_and_zero_).
        zero_buffers: write zeros into the buffers in the same pass.
        stochastic_rounding, seed, positions: stochastic rounding of bf16
            params and bf16 state, as sgd_step_and_zero_ describes.
    """


def _check_adam_tensors(
    op, args, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, amsgrad, exp_avg_scales, exp_avg_sq_scales
) -> None:
    """The state, scales and step-count tensors of an Adam-family call."""
    params = args["params"]
    state_dtype = checks.first_dtype(exp_avgs)
    _check_state(op, exp_avgs, "exp_avgs", params, state_dtype)
    _check_state(op, exp_avg_sqs, "exp_avg_sqs", params, state_dtype)
    if state_dtype == torch.uint8:
        if amsgrad:
            raise ValueError(f"{op}: amsgrad with 8-bit state (uint8 exp_avgs) is not supported")
        for name, scales in (("exp_avg_scales", exp_avg_scales), ("exp_avg_sq_scales", exp_avg_sq_scales)):
            _check_8bit_scales(op, scales, name, params)
    else:
        checks.check_length(op, exp_avg_scales, "exp_avg_scales", 0, "the state is not 8-bit: pass None")
        checks.check_length(op, exp_avg_sq_scales, "exp_avg_sq_scales", 0, "the state is not 8-bit: pass None")
    if amsgrad:
        _check_state(op, max_exp_avg_sqs, "max_exp_avg_sqs", params, state_dtype)
    else:
        checks.check_length(op, max_exp_avg_sqs, "max_exp_avg_sqs", 0, "amsgrad is False: pass None")
    checks.check_length(op, state_steps, "state_steps", len(params), "one step count per param")
    for i, s in enumerate(state_steps):
        checks.check_tensor(op, s, "state_steps", i, params[0].device, checks.F32)
        if s.numel() != 1:
            raise ValueError(f"{op}: state_steps[{i}] must have 1 element; got {s.numel()}")
    checks.check_disjoint(
        op,
        {
            "params": params,
            "buffers": args["buffers"],
            "exp_avgs": exp_avgs,
            "exp_avg_sqs": exp_avg_sqs,
            "max_exp_avg_sqs": max_exp_avg_sqs,
            "state_steps": state_steps,
            "master_params": args["master_params"],
            "exp_avg_scales": exp_avg_scales,
            "exp_avg_sq_scales": exp_avg_sq_scales,
        },
        _scalar_tensors(args),
    )


def _adam_family(name: str, adamw: bool, default_weight_decay: float, decay: str):
    """The Adam and AdamW entry points: one definition, two defaults."""
    op = f"accumkernels.{name}"

    def step_and_zero_(
        params: Tensors,
        buffers: Tensors,
        exp_avgs: Tensors,
        exp_avg_sqs: Tensors,
        state_steps: Tensors,
        *,
        max_exp_avg_sqs: Tensors | None = None,
        exp_avg_scales: Tensors | None = None,
        exp_avg_sq_scales: Tensors | None = None,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = default_weight_decay,
        amsgrad: bool = False,
        maximize: bool = False,
        grad_scale: float | torch.Tensor = 1.0,
        found_inf: torch.Tensor | None = None,
        master_params: Tensors | None = None,
        zero_buffers: bool = True,
        stochastic_rounding: bool = False,
        seed: int = 0,
        positions: Sequence[int] | None = None,
        backend: str | None = None,
    ) -> None:
        trusted = isinstance(backend, Prepared)
        if trusted:
            exp_avgs, exp_avg_sqs, state_steps = list(exp_avgs), list(exp_avg_sqs), list(state_steps)
            max_exp_avg_sqs = list(max_exp_avg_sqs or ())
            exp_avg_scales, exp_avg_sq_scales = list(exp_avg_scales or ()), list(exp_avg_sq_scales or ())
        else:
            exp_avgs = checks.as_tensor_list(op, exp_avgs, "exp_avgs")
            exp_avg_sqs = checks.as_tensor_list(op, exp_avg_sqs, "exp_avg_sqs")
            state_steps = checks.as_tensor_list(op, state_steps, "state_steps")
            max_exp_avg_sqs = checks.as_tensor_list(op, max_exp_avg_sqs, "max_exp_avg_sqs", optional=True)
            exp_avg_scales = checks.as_tensor_list(op, exp_avg_scales, "exp_avg_scales", optional=True)
            exp_avg_sq_scales = checks.as_tensor_list(op, exp_avg_sq_scales, "exp_avg_sq_scales", optional=True)
        lr, beta1, beta2, eps, weight_decay = check_adam_hyperparameters(op, lr, betas, eps, weight_decay)
        args = _step_arguments(
            op,
            params,
            buffers,
            master_params,
            grad_scale,
            found_inf,
            maximize,
            zero_buffers,
            stochastic_rounding,
            seed,
            positions,
            check_tensors=not trusted,
        )
        params = args.get("params", [])
        if not params:
            return
        if not trusted:
            _check_adam_tensors(
                op,
                args,
                exp_avgs,
                exp_avg_sqs,
                max_exp_avg_sqs,
                state_steps,
                amsgrad,
                exp_avg_scales,
                exp_avg_sq_scales,
            )
        getattr(_backend(backend, params[0].device), name)(
            **args,
            exp_avgs=exp_avgs,
            exp_avg_sqs=exp_avg_sqs,
            max_exp_avg_sqs=max_exp_avg_sqs,
            exp_avg_scales=exp_avg_scales,
            exp_avg_sq_scales=exp_avg_sq_scales,
            state_steps=state_steps,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=bool(amsgrad),
        )

    step_and_zero_.__name__ = step_and_zero_.__qualname__ = name
    step_and_zero_.__doc__ = _ADAM_DOC.format(cls="AdamW" if adamw else "Adam", decay=decay)
    return step_and_zero_


adam_step_and_zero_ = _adam_family(
    "adam_step_and_zero_", False, 0.0, "g = g + weight_decay * w           (if weight_decay != 0)"
)
adamw_step_and_zero_ = _adam_family(
    "adamw_step_and_zero_", True, 1e-2, "w = w * (1 - lr * weight_decay)    (if weight_decay != 0)"
)


def grad_norm(buffers: Tensors, *, backend: str | None = None) -> torch.Tensor:
    """The global L2 norm ``sqrt(sum of x^2 over every element of every buffer)``,
    the squares (exact) summed in float64.

    Returns a 0-dim fp32 tensor on the buffers' device, with no host sync.
    Deterministic: the same inputs give the same bits (fixed summation order,
    independent of the thread count). inf or NaN in any buffer gives inf/NaN.

    Args:
        buffers: a non-empty list of tensors on one device: fp32 (the
            accumulation buffers), bf16 or fp16 (gradients held in their
            params' dtype), mixed as they come.
    """
    op = "accumkernels.grad_norm"
    if isinstance(backend, Prepared):
        return backend.on(buffers[0].device).grad_norm(buffers=list(buffers))
    buffers = checks.as_tensor_list(op, buffers, "buffers")
    if not buffers:
        raise ValueError(f"{op}: buffers is empty; expected at least one tensor (the result's device comes from them)")
    device = buffers[0].device
    for i, b in enumerate(buffers):
        checks.check_tensor(op, b, "buffers", i, device, checks.GRAD_DTYPES)
    return resolve(backend, device).grad_norm(buffers=buffers)


class Prepared:
    """A backend for a caller whose tensors are its own, checked once when it
    made them (AccumulatingOptimizer: its buffers, state, master weights and
    the gradients it checked on arrival): passed as ``backend=``, the ops
    check only the numbers of each call (hyperparameters, scales) and call
    the backend, resolved once per device. The native kernels' own checks
    (sizes, devices) still run; a bad tensor is the caller's bug."""

    def __init__(self, name: str | None) -> None:
        self.name = name
        self._resolved: dict[torch.device, object] = {}

    def on(self, device: torch.device):
        backend = self._resolved.get(device)
        if backend is None:
            backend = self._resolved[device] = resolve(self.name, device)
        return backend

    def runs_native(self, device: torch.device) -> bool:
        """Whether ``device``'s ops are the extension's kernels
        (torch.ops.accumkernels), which its own C++ may call as they are."""
        return isinstance(self.on(device), NativeBackend)

    def __repr__(self) -> str:
        return f"Prepared({self.name!r})"
