"""sgd_step_and_zero_ in Triton: torch.optim.SGD's update with
g = grad_scale * buffer, then buffer = 0, one launch per param dtype."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import _common as c

# Lists: 0 param, 1 master, 2 buffer, 3 momentum buffer.
LISTS = tl.constexpr(4)
NO_MOMENTUM, FIRST_STEP, RUNNING = 0, 1, 2


@triton.jit
def _sgd_kernel(meta, T, C, lr, momentum, one_minus_dampening, weight_decay, grad_scale, grad_scale_ptr,
                found_inf_ptr, seed, PARAM_DTYPE: tl.constexpr, HAS_MASTER: tl.constexpr, STOCHASTIC: tl.constexpr,
                MOMENTUM: tl.constexpr,
                NESTEROV: tl.constexpr, WEIGHT_DECAY: tl.constexpr, HAS_GRAD_SCALE_TENSOR: tl.constexpr,
                HAS_FOUND_INF: tl.constexpr, ZERO_BUFFERS: tl.constexpr, CHUNK: tl.constexpr,
                BLOCK: tl.constexpr):  # fmt: skip
    t, start, n = c.chunk_of(meta, LISTS, T, C)
    param = c.pointer(meta, 0, T, t, PARAM_DTYPE)
    master = c.pointer(meta, 1, T, t, tl.float32)
    buffer = c.pointer(meta, 2, T, t, tl.float32)
    mom = c.pointer(meta, 3, T, t, tl.float32)
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
            g = g + weight_decay * w
        if MOMENTUM != 0:
            if MOMENTUM == 1:
                b = g
            else:
                b = momentum * tl.load(mom + offs, mask=mask, other=0.0) + one_minus_dampening * g
            tl.store(mom + offs, b, mask=update)
            if NESTEROV:
                g = g + momentum * b
            else:
                g = b
        w = w - lr * g
        if HAS_MASTER:
            tl.store(master + offs, w, mask=update)
        if STOCHASTIC:
            random = c.sr_random(seed, c.position(meta, LISTS, T, t), offs)
            tl.store(param + offs, c.to_bf16_stochastic(w, random), mask=update)
        else:
            tl.store(param + offs, c.to_storage(w, PARAM_DTYPE), mask=update)
        if ZERO_BUFFERS:
            tl.store(buffer + offs, tl.zeros((BLOCK,), dtype=tl.float32), mask=mask)


@torch.library.custom_op("accumkernels_triton::sgd_step_and_zero_",
                         mutates_args=("params", "buffers", "momentum_buffers", "master_params"))  # fmt: skip
def sgd_step_and_zero_(params: list[torch.Tensor], buffers: list[torch.Tensor], momentum_buffers: list[torch.Tensor],
                       master_params: list[torch.Tensor], lr: float, momentum: float, dampening: float,
                       weight_decay: float, nesterov: bool, maximize: bool, is_first_step: bool, grad_scale: float,
                       grad_scale_tensor: torch.Tensor | None, found_inf: torch.Tensor | None,
                       zero_buffers: bool, stochastic_rounding: bool = False, seed: int = 0) -> None:  # fmt: skip
    """torch.optim.SGD's update with g = grad_scale * buffer, then buffer = 0."""
    mode = NO_MOMENTUM if momentum == 0 else (FIRST_STEP if is_first_step else RUNNING)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        index = [i for i, p in enumerate(params) if p.dtype == dtype and p.numel() > 0]
        if not index:
            continue
        pick = lambda lst: [lst[i] for i in index] if lst else [None] * len(index)  # noqa: E731
        meta, count, chunks = c.build_meta([pick(params), pick(master_params), pick(buffers), pick(momentum_buffers)],
                                           [params[i].numel() for i in index], params[0].device,
                                           positions=index)  # fmt: skip
        _sgd_kernel[(chunks,)](
            meta, count, chunks, lr, momentum, 1.0 - dampening, weight_decay, -grad_scale if maximize else grad_scale,
            grad_scale_tensor, found_inf, seed, PARAM_DTYPE=c.TL_DTYPES[dtype], HAS_MASTER=bool(master_params),
            STOCHASTIC=stochastic_rounding and dtype == torch.bfloat16,
            MOMENTUM=mode, NESTEROV=nesterov, WEIGHT_DECAY=weight_decay != 0,
            HAS_GRAD_SCALE_TENSOR=grad_scale_tensor is not None, HAS_FOUND_INF=found_inf is not None,
            ZERO_BUFFERS=zero_buffers, CHUNK=c.CHUNK, BLOCK=c.BLOCK, num_warps=c.NUM_WARPS,
        )  # fmt: skip


@sgd_step_and_zero_.register_fake
def _(*args) -> None:
    return None
