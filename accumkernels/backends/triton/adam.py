"""adam_step_and_zero_ / adamw_step_and_zero_ in Triton: torch.optim.Adam's and
AdamW's update with g = grad_scale * buffer, then buffer = 0, one launch per
param dtype. A first launch increments the step counts on the device (unless
found_inf); the update reads them and computes the bias corrections in fp64
from lr, beta1 and beta2, which travel as fp64 in a small per-call tensor."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._op_table import OPS
from . import _common as c
from . import _formulas as f

# Lists: 0 param, 1 master, 2 buffer, 3 exp_avg, 4 exp_avg_sq, 5 max_exp_avg_sq, 6 step,
# 7 exp_avg scales, 8 exp_avg_sq scales (8-bit state; STATE_DTYPE uint8 means it).
LISTS = tl.constexpr(9)


@triton.jit(do_not_specialize=["T"])
def _increment_steps_kernel(table, T, found_inf_ptr, has_found_inf):
    step = tl.load(table + tl.program_id(0)).to(tl.pointer_type(tl.float32))
    keep = True
    if has_found_inf:
        keep = tl.load(found_inf_ptr) == 0.0
    tl.store(step, tl.load(step) + 1.0, mask=keep)


@triton.jit
def _adam_block(
    ptrs,
    hp,
    offs,
    n,
    gs,
    seed,
    stream,
    PARAM_DTYPE: tl.constexpr,
    MASTER_KIND: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    STATE_DTYPE: tl.constexpr,
    GRAD_DTYPE: tl.constexpr,
    AMSGRAD: tl.constexpr,
    MASKED: tl.constexpr,
):
    param, master, buffer, exp_avg, exp_avg_sq, max_sq, m_scales, v_scales = ptrs
    (
        step_size,
        bias_correction2_sqrt,
        eps,
        weight_decay,
        one_minus_beta1,
        one_minus_beta2,
        beta2_f,
        adamw_decay,
        adamw,
        has_weight_decay,
    ) = hp
    mask = offs < n
    g = gs * c.load_f32(buffer, offs, mask, GRAD_DTYPE, MASKED)
    w = c.load_weight(param, master, offs, mask, PARAM_DTYPE, MASTER_KIND, MASKED)
    v_max = tl.zeros_like(g)
    if STATE_DTYPE == tl.uint8:  # 8-bit state (no amsgrad): codes and block scales
        m = c.load_state8(exp_avg, m_scales, offs, n, f.decode_exp_avg, MASKED)
        v = c.load_state8(exp_avg_sq, v_scales, offs, n, f.decode_exp_avg_sq, MASKED)
    else:
        m = c.load_f32(exp_avg, offs, mask, STATE_DTYPE, MASKED)
        v = c.load_f32(exp_avg_sq, offs, mask, STATE_DTYPE, MASKED)
        if AMSGRAD:
            v_max = c.load_f32(max_sq, offs, mask, STATE_DTYPE, MASKED)
    w, m, v, v_max = f.adam_update(
        w,
        g,
        m,
        v,
        v_max,
        step_size,
        bias_correction2_sqrt,
        eps,
        weight_decay,
        one_minus_beta1,
        one_minus_beta2,
        beta2_f,
        adamw_decay,
        adamw,
        has_weight_decay,
        AMSGRAD,
    )
    if STATE_DTYPE == tl.uint8:
        c.store_state8(exp_avg, m_scales, offs, n, m, seed, 1, stream, f.encode_exp_avg, MASKED)
        c.store_state8(exp_avg_sq, v_scales, offs, n, tl.sqrt_rn(v), seed, 2, stream, f.encode_exp_avg_sq, MASKED)
    else:
        c.store_state(exp_avg, offs, m, mask, seed, 1, stream, STATE_DTYPE, MASKED)
        c.store_state(exp_avg_sq, offs, v, mask, seed, 2, stream, STATE_DTYPE, MASKED)
        if AMSGRAD:
            c.store_state(max_sq, offs, v_max, mask, seed, 3, stream, STATE_DTYPE, MASKED)
    c.store_weight(param, master, offs, w, mask, seed, stream, PARAM_DTYPE, MASTER_KIND, STOCHASTIC, MASKED)


@triton.jit(do_not_specialize=["T", "C", "seed"])
def _adam_kernel(
    table,
    T,
    C,
    scalars,
    eps,
    weight_decay,
    one_minus_beta1,
    one_minus_beta2,
    beta2_f,
    adamw_decay,
    adamw,
    has_weight_decay,
    grad_scale,
    grad_scale_ptr,
    has_grad_scale_tensor,
    found_inf_ptr,
    has_found_inf,
    zero_buffers,
    seed,
    PARAM_DTYPE: tl.constexpr,
    MASTER_KIND: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    STATE_DTYPE: tl.constexpr,
    GRAD_DTYPE: tl.constexpr,
    AMSGRAD: tl.constexpr,
    ALIGNED: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t, start, n = c.chunk_of(table, LISTS, T, C, CHUNK, ALIGNED)
    ptrs = (
        c.pointer(table, 0, T, t, PARAM_DTYPE, ALIGNED),
        c.master_pointer(table, T, t, MASTER_KIND, ALIGNED),
        c.pointer(table, 2, T, t, GRAD_DTYPE, ALIGNED),
        c.pointer(table, 3, T, t, STATE_DTYPE, ALIGNED),
        c.pointer(table, 4, T, t, STATE_DTYPE, ALIGNED),
        c.pointer(table, 5, T, t, STATE_DTYPE, ALIGNED),
        c.pointer(table, 7, T, t, tl.float32, ALIGNED),
        c.pointer(table, 8, T, t, tl.float32, ALIGNED),
    )
    step = tl.load(c.pointer(table, 6, T, t, tl.float32, False))
    step_size, bias_correction2_sqrt = f.adam_bias_corrections(
        tl.load(scalars), tl.load(scalars + 1), tl.load(scalars + 2), step
    )
    hp = (
        step_size,
        bias_correction2_sqrt,
        eps,
        weight_decay,
        one_minus_beta1,
        one_minus_beta2,
        beta2_f,
        adamw_decay,
        adamw,
        has_weight_decay,
    )
    c.step_chunk(
        _adam_block,
        ptrs,
        hp,
        ptrs[2],
        start,
        n,
        grad_scale,
        grad_scale_ptr,
        has_grad_scale_tensor,
        found_inf_ptr,
        has_found_inf,
        zero_buffers,
        seed,
        c.stream_of(table, LISTS, T, t),
        PARAM_DTYPE,
        MASTER_KIND,
        STOCHASTIC,
        STATE_DTYPE,
        GRAD_DTYPE,
        AMSGRAD,
        CHUNK,
        BLOCK,
    )


def _adam(
    adamw,
    params,
    buffers,
    exp_avgs,
    exp_avg_sqs,
    max_exp_avg_sqs,
    state_steps,
    master_params,
    exp_avg_scales,
    exp_avg_sq_scales,
    lr,
    beta1,
    beta2,
    eps,
    weight_decay,
    amsgrad,
    grad_scale,
    grad_scale_tensor,
    found_inf,
    zero_buffers,
    stochastic_rounding,
    seed,
    positions,
):
    device = params[0].device
    with c.device_guard(device):
        scale_ptr, has_scale, inf_ptr, has_inf = c.scalar_arguments(grad_scale_tensor, found_inf, device)
        steps_table, count, _, _ = c.launch_table([state_steps], [1] * len(state_steps), device)
        _increment_steps_kernel[(count,)](steps_table, count, inf_ptr, has_inf)
        scalars = torch.tensor([lr, beta1, beta2], dtype=torch.float64)
        if device.type == "cuda":
            scalars = scalars.pin_memory().to(device, non_blocking=True)
        lists = [
            params,
            master_params,
            buffers,
            exp_avgs,
            exp_avg_sqs,
            max_exp_avg_sqs,
            state_steps,
            exp_avg_scales,
            exp_avg_sq_scales,
        ]
        state_dtype = exp_avgs[0].dtype
        for dtype, table, count, chunks, aligned in c.param_dtype_launches(params, lists, positions):
            _adam_kernel[(chunks,)](
                table,
                count,
                chunks,
                scalars,
                eps,
                weight_decay,
                1.0 - beta1,
                1.0 - beta2,
                beta2,
                1.0 - lr * weight_decay,
                adamw,
                weight_decay != 0,
                grad_scale,
                scale_ptr,
                has_scale,
                inf_ptr,
                has_inf,
                zero_buffers,
                c.seed_argument(seed),
                AMSGRAD=amsgrad,
                **c.step_flags(dtype, master_params, stochastic_rounding, state_dtype, aligned, buffers),
            )


def _define(name, adamw):
    def op(
        params: list[torch.Tensor],
        buffers: list[torch.Tensor],
        exp_avgs: list[torch.Tensor],
        exp_avg_sqs: list[torch.Tensor],
        max_exp_avg_sqs: list[torch.Tensor],
        state_steps: list[torch.Tensor],
        master_params: list[torch.Tensor],
        exp_avg_scales: list[torch.Tensor],
        exp_avg_sq_scales: list[torch.Tensor],
        lr: float,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        amsgrad: bool,
        grad_scale: float,
        grad_scale_tensor: torch.Tensor | None,
        found_inf: torch.Tensor | None,
        zero_buffers: bool,
        stochastic_rounding: bool,
        seed: int,
        positions: list[int],
    ) -> None:
        _adam(
            adamw,
            params,
            buffers,
            exp_avgs,
            exp_avg_sqs,
            max_exp_avg_sqs,
            state_steps,
            master_params,
            exp_avg_scales,
            exp_avg_sq_scales,
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            amsgrad,
            grad_scale,
            grad_scale_tensor,
            found_inf,
            zero_buffers,
            stochastic_rounding,
            seed,
            positions,
        )

    op.__name__ = name
    custom = torch.library.custom_op(f"accumkernels_triton::{name}", op, mutates_args=OPS[name].mutates)
    custom.register_fake(lambda *args, **kwargs: None)
    return custom


adam_step_and_zero_ = _define("adam_step_and_zero_", adamw=False)
adamw_step_and_zero_ = _define("adamw_step_and_zero_", adamw=True)
