"""sgd_step_and_zero_ in Triton: torch.optim.SGD's update with
g = grad_scale * buffer, then buffer = 0, one launch per param dtype."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _common as c
from . import _formulas as f

# Lists: 0 param, 1 master, 2 buffer, 3 momentum buffer.
LISTS = tl.constexpr(4)


@triton.jit
def _sgd_block(param, master, buffer, mom, offs, n, gs, lr, momentum, one_minus_dampening, weight_decay, nesterov,
               has_weight_decay, seed, stream, PARAM_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr,
               STOCHASTIC: tl.constexpr, MOMENTUM: tl.constexpr, ZERO_BUFFERS: tl.constexpr,
               MASKED: tl.constexpr):  # fmt: skip
    mask = offs < n
    g = gs * c.load_f32(buffer, offs, mask, tl.float32, MASKED)
    if HAS_MASTER:
        w = c.load_f32(master, offs, mask, tl.float32, MASKED)
    else:
        w = c.load_f32(param, offs, mask, PARAM_DTYPE, MASKED)
    b = tl.zeros_like(g)
    if MOMENTUM == f.RUNNING:
        b = c.load_f32(mom, offs, mask, tl.float32, MASKED)
    w, b = f.sgd_update(w, g, b, lr, momentum, one_minus_dampening, weight_decay, nesterov, has_weight_decay,
                        MOMENTUM)  # fmt: skip
    if MOMENTUM != f.NO_MOMENTUM:
        c.store(mom, offs, b, mask, MASKED)
    if HAS_MASTER:
        c.store(master, offs, w, mask, MASKED)
    if STOCHASTIC:
        c.store(param, offs, f.float_to_bf16_stochastic(w, f.sr_random(seed, stream, offs)), mask, MASKED)
    else:
        c.store(param, offs, c.to_storage(w, PARAM_DTYPE), mask, MASKED)
    if ZERO_BUFFERS:
        c.store(buffer, offs, tl.zeros_like(g), mask, MASKED)


@triton.jit(do_not_specialize=["T", "C", "seed"])
def _sgd_kernel(table, T, C, lr, momentum, one_minus_dampening, weight_decay, nesterov, has_weight_decay, grad_scale,
                grad_scale_ptr, found_inf_ptr, seed, PARAM_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr,
                STOCHASTIC: tl.constexpr, MOMENTUM: tl.constexpr, HAS_GRAD_SCALE_TENSOR: tl.constexpr,
                HAS_FOUND_INF: tl.constexpr, ZERO_BUFFERS: tl.constexpr, ALIGNED: tl.constexpr, CHUNK: tl.constexpr,
                BLOCK: tl.constexpr):  # fmt: skip
    t, start, n = c.chunk_of(table, LISTS, T, C, CHUNK, ALIGNED)
    param = c.pointer(table, 0, T, t, PARAM_DTYPE, ALIGNED)
    master = c.pointer(table, 1, T, t, tl.float32, ALIGNED)
    buffer = c.pointer(table, 2, T, t, tl.float32, ALIGNED)
    mom = c.pointer(table, 3, T, t, tl.float32, ALIGNED)
    stream = c.stream_of(table, LISTS, T, t)
    seed64 = seed.to(tl.int64) & 0xFFFFFFFF
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
            _sgd_block(param, master, buffer, mom, offs, n, gs, lr, momentum, one_minus_dampening, weight_decay,
                       nesterov, has_weight_decay, seed64, stream, PARAM_DTYPE, HAS_MASTER, STOCHASTIC, MOMENTUM,
                       ZERO_BUFFERS, False)  # fmt: skip
    else:
        for i in range(0, CHUNK, BLOCK):
            offs = start + i + tl.arange(0, BLOCK).to(tl.int64)
            _sgd_block(param, master, buffer, mom, offs, n, gs, lr, momentum, one_minus_dampening, weight_decay,
                       nesterov, has_weight_decay, seed64, stream, PARAM_DTYPE, HAS_MASTER, STOCHASTIC, MOMENTUM,
                       ZERO_BUFFERS, True)  # fmt: skip


def momentum_mode(momentum: float, is_first_step: bool) -> int:
    if momentum == 0:
        return f.NO_MOMENTUM.value
    return f.FIRST_STEP.value if is_first_step else f.RUNNING.value


@torch.library.custom_op("accumkernels_triton::sgd_step_and_zero_",
                         mutates_args=("params", "buffers", "momentum_buffers", "master_params"))  # fmt: skip
def sgd_step_and_zero_(params: list[torch.Tensor], buffers: list[torch.Tensor], momentum_buffers: list[torch.Tensor],
                       master_params: list[torch.Tensor], lr: float, momentum: float, dampening: float,
                       weight_decay: float, nesterov: bool, is_first_step: bool, grad_scale: float,
                       grad_scale_tensor: torch.Tensor | None, found_inf: torch.Tensor | None, zero_buffers: bool,
                       stochastic_rounding: bool, seed: int, positions: list[int]) -> None:  # fmt: skip
    """torch.optim.SGD's update with g = grad_scale * buffer, then buffer = 0."""
    device = params[0].device
    with c.device_guard(device):
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            index = [i for i, p in enumerate(params) if p.dtype == dtype and p.numel() > 0]
            if not index:
                continue
            pick = lambda lst: [lst[i] for i in index] if lst else [None] * len(index)  # noqa: E731
            table, count, chunks, aligned = c.launch_table(
                [pick(params), pick(master_params), pick(buffers), pick(momentum_buffers)],
                [params[i].numel() for i in index], device, [positions[i] if positions else i for i in index],
            )  # fmt: skip
            _sgd_kernel[(chunks,)](
                table, count, chunks, lr, momentum, 1.0 - dampening, weight_decay, nesterov, weight_decay != 0,
                grad_scale, grad_scale_tensor, found_inf, c.seed_argument(seed), PARAM_DTYPE=c.TL_DTYPES[dtype],
                HAS_MASTER=bool(master_params), STOCHASTIC=stochastic_rounding and dtype == torch.bfloat16,
                MOMENTUM=momentum_mode(momentum, is_first_step), HAS_GRAD_SCALE_TENSOR=grad_scale_tensor is not None,
                HAS_FOUND_INF=found_inf is not None, ZERO_BUFFERS=zero_buffers, ALIGNED=aligned, CHUNK=c.CHUNK,
                BLOCK=c.BLOCK, **c.OPTIONS,
            )  # fmt: skip


@sgd_step_and_zero_.register_fake
def _(*args, **kwargs) -> None:
    return None
