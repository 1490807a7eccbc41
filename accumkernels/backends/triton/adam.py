"""adam_step_and_zero_ / adamw_step_and_zero_ in Triton: torch.optim.Adam's and
AdamW's update with g = grad_scale * buffer, then buffer = 0, one launch per
param dtype. A first launch increments the step counts on the device (unless
found_inf); the update reads them and computes the bias corrections in fp64
from lr, beta1 and beta2, which travel as fp64 in a small per-call tensor."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _common as c
from . import _formulas as f

# Lists: 0 param, 1 master, 2 buffer, 3 exp_avg, 4 exp_avg_sq, 5 max_exp_avg_sq, 6 step.
LISTS = tl.constexpr(7)


@triton.jit(do_not_specialize=["T"])
def _increment_steps_kernel(table, T, found_inf_ptr, HAS_FOUND_INF: tl.constexpr):
    step = tl.load(table + tl.program_id(0)).to(tl.pointer_type(tl.float32))
    keep = True
    if HAS_FOUND_INF:
        keep = tl.load(found_inf_ptr) == 0.0
    tl.store(step, tl.load(step) + 1.0, mask=keep)


@triton.jit
def _adam_block(param, master, buffer, exp_avg, exp_avg_sq, max_sq, offs, n, gs, step_size, bias_correction2_sqrt,
                eps, weight_decay, one_minus_beta1, one_minus_beta2, beta2_f, adamw_decay, adamw, has_weight_decay,
                seed, stream, PARAM_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr, STOCHASTIC: tl.constexpr,
                AMSGRAD: tl.constexpr, ZERO_BUFFERS: tl.constexpr, MASKED: tl.constexpr):  # fmt: skip
    mask = offs < n
    g = gs * c.load_f32(buffer, offs, mask, tl.float32, MASKED)
    if HAS_MASTER:
        w = c.load_f32(master, offs, mask, tl.float32, MASKED)
    else:
        w = c.load_f32(param, offs, mask, PARAM_DTYPE, MASKED)
    m = c.load_f32(exp_avg, offs, mask, tl.float32, MASKED)
    v = c.load_f32(exp_avg_sq, offs, mask, tl.float32, MASKED)
    v_max = tl.zeros_like(g)
    if AMSGRAD:
        v_max = c.load_f32(max_sq, offs, mask, tl.float32, MASKED)
    w, m, v, v_max = f.adam_update(w, g, m, v, v_max, step_size, bias_correction2_sqrt, eps, weight_decay,
                                   one_minus_beta1, one_minus_beta2, beta2_f, adamw_decay, adamw, has_weight_decay,
                                   AMSGRAD)  # fmt: skip
    c.store(exp_avg, offs, m, mask, MASKED)
    c.store(exp_avg_sq, offs, v, mask, MASKED)
    if AMSGRAD:
        c.store(max_sq, offs, v_max, mask, MASKED)
    if HAS_MASTER:
        c.store(master, offs, w, mask, MASKED)
    if STOCHASTIC:
        c.store(param, offs, f.float_to_bf16_stochastic(w, f.sr_random(seed, stream, offs)), mask, MASKED)
    else:
        c.store(param, offs, c.to_storage(w, PARAM_DTYPE), mask, MASKED)
    if ZERO_BUFFERS:
        c.store(buffer, offs, tl.zeros_like(g), mask, MASKED)


@triton.jit(do_not_specialize=["T", "C", "seed"])
def _adam_kernel(table, T, C, scalars, eps, weight_decay, one_minus_beta1, one_minus_beta2, beta2_f, adamw_decay,
                 adamw, has_weight_decay, grad_scale, grad_scale_ptr, found_inf_ptr, seed, PARAM_DTYPE: tl.constexpr,
                 HAS_MASTER: tl.constexpr, STOCHASTIC: tl.constexpr, AMSGRAD: tl.constexpr,
                 HAS_GRAD_SCALE_TENSOR: tl.constexpr, HAS_FOUND_INF: tl.constexpr, ZERO_BUFFERS: tl.constexpr,
                 ALIGNED: tl.constexpr, CHUNK: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    t, start, n = c.chunk_of(table, LISTS, T, C, CHUNK, ALIGNED)
    param = c.pointer(table, 0, T, t, PARAM_DTYPE, ALIGNED)
    master = c.pointer(table, 1, T, t, tl.float32, ALIGNED)
    buffer = c.pointer(table, 2, T, t, tl.float32, ALIGNED)
    exp_avg = c.pointer(table, 3, T, t, tl.float32, ALIGNED)
    exp_avg_sq = c.pointer(table, 4, T, t, tl.float32, ALIGNED)
    max_sq = c.pointer(table, 5, T, t, tl.float32, ALIGNED)
    step = tl.load(c.pointer(table, 6, T, t, tl.float32, False))
    stream = c.stream_of(table, LISTS, T, t)
    seed64 = seed.to(tl.int64) & 0xFFFFFFFF
    lr = tl.load(scalars)
    beta1 = tl.load(scalars + 1)
    beta2 = tl.load(scalars + 2)
    step_size, bias_correction2_sqrt = f.adam_bias_corrections(lr, beta1, beta2, step)
    gs = grad_scale
    if HAS_GRAD_SCALE_TENSOR:
        gs = grad_scale * tl.load(grad_scale_ptr)
    skip = False
    if HAS_FOUND_INF:
        skip = tl.load(found_inf_ptr) != 0.0
    if skip:  # a skipped window still clears its buffers
        if ZERO_BUFFERS:
            for i in range(0, CHUNK, BLOCK):
                offs = start + i + tl.arange(0, BLOCK).to(tl.int64)
                tl.store(buffer + offs, tl.zeros((BLOCK,), tl.float32), mask=offs < n)
    elif start + CHUNK <= n:  # a full chunk: no masks, vector accesses where ALIGNED
        for i in range(0, CHUNK, BLOCK):
            offs = start + i + tl.arange(0, BLOCK).to(tl.int64)
            _adam_block(param, master, buffer, exp_avg, exp_avg_sq, max_sq, offs, n, gs, step_size,
                        bias_correction2_sqrt, eps, weight_decay, one_minus_beta1, one_minus_beta2, beta2_f,
                        adamw_decay, adamw, has_weight_decay, seed64, stream, PARAM_DTYPE, HAS_MASTER, STOCHASTIC,
                        AMSGRAD, ZERO_BUFFERS, False)  # fmt: skip
    else:
        for i in range(0, CHUNK, BLOCK):
            offs = start + i + tl.arange(0, BLOCK).to(tl.int64)
            _adam_block(param, master, buffer, exp_avg, exp_avg_sq, max_sq, offs, n, gs, step_size,
                        bias_correction2_sqrt, eps, weight_decay, one_minus_beta1, one_minus_beta2, beta2_f,
                        adamw_decay, adamw, has_weight_decay, seed64, stream, PARAM_DTYPE, HAS_MASTER, STOCHASTIC,
                        AMSGRAD, ZERO_BUFFERS, True)  # fmt: skip


def _adam(adamw, params, buffers, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, master_params, lr, beta1,
          beta2, eps, weight_decay, amsgrad, grad_scale, grad_scale_tensor, found_inf, zero_buffers,
          stochastic_rounding, seed, positions):  # fmt: skip
    device = params[0].device
    with c.device_guard(device):
        steps_table, count, _, _ = c.launch_table([state_steps], [1] * len(state_steps), device)
        _increment_steps_kernel[(count,)](steps_table, count, found_inf, HAS_FOUND_INF=found_inf is not None)
        scalars = torch.tensor([lr, beta1, beta2], dtype=torch.float64)
        if device.type == "cuda":
            scalars = scalars.pin_memory().to(device, non_blocking=True)
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            index = [i for i, p in enumerate(params) if p.dtype == dtype and p.numel() > 0]
            if not index:
                continue
            pick = lambda lst: [lst[i] for i in index] if lst else [None] * len(index)  # noqa: E731
            lists = [pick(params), pick(master_params), pick(buffers), pick(exp_avgs), pick(exp_avg_sqs),
                     pick(max_exp_avg_sqs), pick(state_steps)]  # fmt: skip
            table, count, chunks, aligned = c.launch_table(
                lists, [params[i].numel() for i in index], device, [positions[i] if positions else i for i in index]
            )  # fmt: skip
            _adam_kernel[(chunks,)](
                table, count, chunks, scalars, eps, weight_decay, 1.0 - beta1, 1.0 - beta2, beta2,
                1.0 - lr * weight_decay, adamw, weight_decay != 0, grad_scale, grad_scale_tensor, found_inf,
                c.seed_argument(seed), PARAM_DTYPE=c.TL_DTYPES[dtype], HAS_MASTER=bool(master_params),
                STOCHASTIC=stochastic_rounding and dtype == torch.bfloat16, AMSGRAD=amsgrad,
                HAS_GRAD_SCALE_TENSOR=grad_scale_tensor is not None, HAS_FOUND_INF=found_inf is not None,
                ZERO_BUFFERS=zero_buffers, ALIGNED=aligned, CHUNK=c.CHUNK, BLOCK=c.BLOCK, **c.OPTIONS,
            )  # fmt: skip


_MUTATES = ("params", "buffers", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "state_steps", "master_params")


def _define(name, adamw):
    def op(params: list[torch.Tensor], buffers: list[torch.Tensor], exp_avgs: list[torch.Tensor],
           exp_avg_sqs: list[torch.Tensor], max_exp_avg_sqs: list[torch.Tensor], state_steps: list[torch.Tensor],
           master_params: list[torch.Tensor], lr: float, beta1: float, beta2: float, eps: float,
           weight_decay: float, amsgrad: bool, grad_scale: float, grad_scale_tensor: torch.Tensor | None,
           found_inf: torch.Tensor | None, zero_buffers: bool, stochastic_rounding: bool, seed: int,
           positions: list[int]) -> None:  # fmt: skip
        _adam(adamw, params, buffers, exp_avgs, exp_avg_sqs, max_exp_avg_sqs, state_steps, master_params, lr,
              beta1, beta2, eps, weight_decay, amsgrad, grad_scale, grad_scale_tensor, found_inf, zero_buffers,
              stochastic_rounding, seed, positions)  # fmt: skip

    op.__name__ = name
    custom = torch.library.custom_op(f"accumkernels_triton::{name}", op, mutates_args=_MUTATES)
    custom.register_fake(lambda *args, **kwargs: None)
    return custom


adam_step_and_zero_ = _define("adam_step_and_zero_", adamw=False)
adamw_step_and_zero_ = _define("adamw_step_and_zero_", adamw=True)
