"""sgd_step_and_zero_ in Triton: torch.optim.SGD's update with
g = grad_scale * buffer, then buffer = 0, one launch per param dtype."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._op_table import OPS
from . import _common as c
from . import _formulas as f

# Lists: 0 param, 1 master, 2 buffer, 3 momentum buffer, 4 its block scales
# (8-bit state; STATE_DTYPE uint8 means it).
LISTS = tl.constexpr(5)


@triton.jit
def _sgd_block(
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
    MOMENTUM: tl.constexpr,
    MASKED: tl.constexpr,
):
    param, master, buffer, mom, mom_scales = ptrs
    lr, momentum, one_minus_dampening, weight_decay, nesterov, has_weight_decay = hp
    mask = offs < n
    g = gs * c.load_f32(buffer, offs, mask, GRAD_DTYPE, MASKED)
    w = c.load_weight(param, master, offs, mask, PARAM_DTYPE, MASTER_KIND, MASKED)
    b = tl.zeros_like(g)
    if MOMENTUM == f.RUNNING:
        if STATE_DTYPE == tl.uint8:  # 8-bit momentum buffer, stored as exp_avg
            b = c.load_state8(mom, mom_scales, offs, n, f.decode_exp_avg, MASKED)
        else:
            b = c.load_f32(mom, offs, mask, STATE_DTYPE, MASKED)
    w, b = f.sgd_update(w, g, b, lr, momentum, one_minus_dampening, weight_decay, nesterov, has_weight_decay, MOMENTUM)
    if MOMENTUM != f.NO_MOMENTUM:
        if STATE_DTYPE == tl.uint8:
            c.store_state8(mom, mom_scales, offs, n, b, seed, 1, stream, f.encode_exp_avg, MASKED)
        else:
            c.store_state(mom, offs, b, mask, seed, 1, stream, STATE_DTYPE, MASKED)
    c.store_weight(param, master, offs, w, mask, seed, stream, PARAM_DTYPE, MASTER_KIND, STOCHASTIC, MASKED)


@triton.jit(do_not_specialize=["T", "C", "seed"])
def _sgd_kernel(
    table,
    T,
    C,
    lr,
    momentum,
    one_minus_dampening,
    weight_decay,
    nesterov,
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
    MOMENTUM: tl.constexpr,
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
        c.pointer(table, 4, T, t, tl.float32, ALIGNED),
    )
    hp = (lr, momentum, one_minus_dampening, weight_decay, nesterov, has_weight_decay)
    c.step_chunk(
        _sgd_block,
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
        MOMENTUM,
        CHUNK,
        BLOCK,
    )


def momentum_mode(momentum: float, is_first_step: bool) -> int:
    if momentum == 0:
        return f.NO_MOMENTUM.value
    return f.FIRST_STEP.value if is_first_step else f.RUNNING.value


@torch.library.custom_op("accumkernels_triton::sgd_step_and_zero_", mutates_args=OPS["sgd_step_and_zero_"].mutates)
def sgd_step_and_zero_(
    params: list[torch.Tensor],
    buffers: list[torch.Tensor],
    momentum_buffers: list[torch.Tensor],
    master_params: list[torch.Tensor],
    momentum_buffer_scales: list[torch.Tensor],
    lr: float,
    momentum: float,
    dampening: float,
    weight_decay: float,
    nesterov: bool,
    is_first_step: bool,
    grad_scale: float,
    grad_scale_tensor: torch.Tensor | None,
    found_inf: torch.Tensor | None,
    zero_buffers: bool,
    stochastic_rounding: bool,
    seed: int,
    positions: list[int],
) -> None:
    """torch.optim.SGD's update with g = grad_scale * buffer, then buffer = 0."""
    device = params[0].device
    with c.device_guard(device):
        scale_ptr, has_scale, inf_ptr, has_inf = c.scalar_arguments(grad_scale_tensor, found_inf, device)
        lists = [params, master_params, buffers, momentum_buffers, momentum_buffer_scales]
        state_dtype = momentum_buffers[0].dtype if momentum_buffers else torch.float32
        for dtype, table, count, chunks, aligned in c.param_dtype_launches(params, lists, positions):
            _sgd_kernel[(chunks,)](
                table,
                count,
                chunks,
                lr,
                momentum,
                1.0 - dampening,
                weight_decay,
                nesterov,
                weight_decay != 0,
                grad_scale,
                scale_ptr,
                has_scale,
                inf_ptr,
                has_inf,
                zero_buffers,
                c.seed_argument(seed),
                MOMENTUM=momentum_mode(momentum, is_first_step),
                **c.step_flags(dtype, master_params, stochastic_rounding, state_dtype, aligned, buffers),
            )


@sgd_step_and_zero_.register_fake
def _(*args, **kwargs) -> None:
    return None
