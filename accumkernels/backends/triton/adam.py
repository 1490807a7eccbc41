"""adam_step_and_zero_ / adamw_step_and_zero_ in Triton: torch.optim.Adam's and
AdamW's update with g = grad_scale * buffer, then buffer = 0, one launch per
param dtype. A first launch increments the step counts on the device (unless
found_inf); the update reads them and computes the bias corrections in fp64."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _common as c

# Lists: 0 param, 1 master, 2 buffer, 3 exp_avg, 4 exp_avg_sq, 5 max_exp_avg_sq, 6 step.
LISTS = tl.constexpr(7)


@triton.jit
def _increment_steps_kernel(meta, found_inf_ptr, HAS_FOUND_INF: tl.constexpr):
    step = tl.load(meta + tl.program_id(0)).to(tl.pointer_type(tl.float32))
    keep = True
    if HAS_FOUND_INF:
        keep = tl.load(found_inf_ptr) == 0.0
    tl.store(step, tl.load(step) + 1.0, mask=keep)


@triton.jit
def _pow_int(base, exponent):
    """base ** exponent for a non-negative integer exponent < 2^31, by squaring (fp64)."""
    result = base * 0.0 + 1.0
    for _ in range(31):
        result = tl.where((exponent & 1) != 0, result * base, result)
        base = base * base
        exponent = exponent >> 1
    return result


@triton.jit
def _adam_kernel(meta, T, C, eps, weight_decay, one_minus_beta1, one_minus_beta2, beta2_f, adamw_decay,
                 grad_scale, grad_scale_ptr, found_inf_ptr, seed, PARAM_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr,
                 STOCHASTIC: tl.constexpr,
                 ADAMW: tl.constexpr, AMSGRAD: tl.constexpr, WEIGHT_DECAY: tl.constexpr,
                 HAS_GRAD_SCALE_TENSOR: tl.constexpr, HAS_FOUND_INF: tl.constexpr, ZERO_BUFFERS: tl.constexpr,
                 CHUNK: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    t, start, n = c.chunk_of(meta, LISTS, T, C)
    param = c.pointer(meta, 0, T, t, PARAM_DTYPE)
    master = c.pointer(meta, 1, T, t, tl.float32)
    buffer = c.pointer(meta, 2, T, t, tl.float32)
    exp_avg = c.pointer(meta, 3, T, t, tl.float32)
    exp_avg_sq = c.pointer(meta, 4, T, t, tl.float32)
    max_sq = c.pointer(meta, 5, T, t, tl.float32)
    step = tl.load(c.pointer(meta, 6, T, t, tl.float32))
    extra = c.extra_at(meta, LISTS, T, C)  # fp64 bits: lr, beta1, beta2
    lr = tl.load(extra).to(tl.float64, bitcast=True)
    beta1 = tl.load(extra + 1).to(tl.float64, bitcast=True)
    beta2 = tl.load(extra + 2).to(tl.float64, bitcast=True)
    step_int = step.to(tl.int32)
    step_size = (lr / (1.0 - _pow_int(beta1, step_int))).to(tl.float32)
    bias_correction2_sqrt = tl.sqrt(1.0 - _pow_int(beta2, step_int)).to(tl.float32)
    gs = grad_scale
    if HAS_GRAD_SCALE_TENSOR:
        gs = grad_scale * tl.load(grad_scale_ptr)
    # A block-shaped flag: the interpreter cannot AND a scalar into a mask.
    keep = tl.full((BLOCK,), 1, tl.int1)
    if HAS_FOUND_INF:
        keep = (tl.zeros((BLOCK,), tl.float32) + tl.load(found_inf_ptr)) == 0.0
    for i in range(0, CHUNK, BLOCK):
        offs = start + i + tl.arange(0, BLOCK).to(tl.int64)
        mask = offs < n
        update = mask & keep
        g = gs * tl.load(buffer + offs, mask=mask, other=0.0)
        if HAS_MASTER:
            w = tl.load(master + offs, mask=mask, other=0.0)
        else:
            w = c.load_f32(param, offs, mask, PARAM_DTYPE)
        if WEIGHT_DECAY:
            if ADAMW:
                w = w * adamw_decay
            else:
                g = g + weight_decay * w
        m = tl.load(exp_avg + offs, mask=mask, other=0.0)
        v = tl.load(exp_avg_sq + offs, mask=mask, other=0.0)
        m = m + one_minus_beta1 * (g - m)
        v = beta2_f * v + one_minus_beta2 * (g * g)
        v_hat = v
        if AMSGRAD:
            v_max = tl.maximum(tl.load(max_sq + offs, mask=mask, other=0.0), v)
            tl.store(max_sq + offs, v_max, mask=update)
            v_hat = v_max
        denom = tl.div_rn(tl.sqrt_rn(v_hat), bias_correction2_sqrt) + eps
        w = w - step_size * tl.div_rn(m, denom)
        tl.store(exp_avg + offs, m, mask=update)
        tl.store(exp_avg_sq + offs, v, mask=update)
        if HAS_MASTER:
            tl.store(master + offs, w, mask=update)
        if STOCHASTIC:
            random = c.sr_random(seed, c.position(meta, LISTS, T, t), offs)
            tl.store(param + offs, c.to_bf16_stochastic(w, random), mask=update)
        else:
            tl.store(param + offs, c.to_storage(w, PARAM_DTYPE), mask=update)
        if ZERO_BUFFERS:
            tl.store(buffer + offs, tl.zeros((BLOCK,), dtype=tl.float32), mask=mask)


def _adam(adamw, params, buffers, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, master_params, lr, beta1,
          beta2, eps, weight_decay, amsgrad, maximize, grad_scale, grad_scale_tensor, found_inf, zero_buffers,
          stochastic_rounding, seed):  # fmt: skip
    if not params:
        return
    device = params[0].device
    step_meta = torch.tensor([s.data_ptr() for s in state_steps], dtype=torch.int64)
    if device.type == "cuda":
        step_meta = step_meta.pin_memory().to(device, non_blocking=True)
    _increment_steps_kernel[(len(state_steps),)](step_meta, found_inf, HAS_FOUND_INF=found_inf is not None)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        index = [i for i, p in enumerate(params) if p.dtype == dtype and p.numel() > 0]
        if not index:
            continue
        pick = lambda lst: [lst[i] for i in index] if lst else [None] * len(index)  # noqa: E731
        lists = [pick(params), pick(master_params), pick(buffers), pick(exp_avgs), pick(exp_avg_sqs),
                 pick(max_exp_avg_sqs), pick(state_steps)]  # fmt: skip
        meta, count, chunks = c.build_meta(lists, [params[i].numel() for i in index], device,
                                           extra=c.f64_bits(lr, beta1, beta2), positions=index)  # fmt: skip
        _adam_kernel[(chunks,)](
            meta, count, chunks, eps, weight_decay, 1.0 - beta1, 1.0 - beta2, beta2, 1.0 - lr * weight_decay,
            -grad_scale if maximize else grad_scale, grad_scale_tensor, found_inf, seed,
            PARAM_DTYPE=c.TL_DTYPES[dtype], HAS_MASTER=bool(master_params),
            STOCHASTIC=stochastic_rounding and dtype == torch.bfloat16, ADAMW=adamw, AMSGRAD=amsgrad, WEIGHT_DECAY=weight_decay != 0,
            HAS_GRAD_SCALE_TENSOR=grad_scale_tensor is not None, HAS_FOUND_INF=found_inf is not None,
            ZERO_BUFFERS=zero_buffers, CHUNK=c.CHUNK, BLOCK=c.BLOCK, num_warps=c.NUM_WARPS,
        )  # fmt: skip


_MUTATES = ("params", "buffers", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "state_steps", "master_params")


def _define(name, adamw):
    def op(params: list[torch.Tensor], buffers: list[torch.Tensor], exp_avgs: list[torch.Tensor],
           exp_avg_sqs: list[torch.Tensor], max_exp_avg_sqs: list[torch.Tensor], state_steps: list[torch.Tensor],
           master_params: list[torch.Tensor], lr: float, beta1: float, beta2: float, eps: float,
           weight_decay: float, amsgrad: bool, maximize: bool, grad_scale: float,
           grad_scale_tensor: torch.Tensor | None, found_inf: torch.Tensor | None, zero_buffers: bool,
           stochastic_rounding: bool = False, seed: int = 0) -> None:  # fmt: skip
        _adam(adamw, params, buffers, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, master_params, lr,
              beta1, beta2, eps, weight_decay, amsgrad, maximize, grad_scale, grad_scale_tensor, found_inf,
              zero_buffers, stochastic_rounding, seed)  # fmt: skip

    op.__name__ = name
    custom = torch.library.custom_op(f"accumkernels_triton::{name}", op, mutates_args=_MUTATES)
    custom.register_fake(lambda *args: None)
    return custom


adam_step_and_zero_ = _define("adam_step_and_zero_", adamw=False)
adamw_step_and_zero_ = _define("adamw_step_and_zero_", adamw=True)
