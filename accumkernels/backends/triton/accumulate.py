"""accumulate_ in Triton: buffer = (0 if overwrite else buffer) + scale * float32(grad),
one launch per grad dtype present in the list."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._op_table import OPS
from . import _common as c
from . import _formulas as f


@triton.jit
def _accumulate_block(
    buffer, grad, offs, n, s, GRAD_DTYPE: tl.constexpr, OVERWRITE: tl.constexpr, MASKED: tl.constexpr
):
    """One BLOCK of a chunk; returns its inf/NaN flags."""
    mask = offs < n
    g = c.load_f32(grad, offs, mask, GRAD_DTYPE, MASKED)
    b = 0.0
    if not OVERWRITE:
        b = c.load_f32(buffer, offs, mask, tl.float32, MASKED)
    c.store(buffer, offs, f.accumulate(b, g, s, OVERWRITE), mask, MASKED)
    return f.is_nonfinite(g).to(tl.int32)


@triton.jit(do_not_specialize=["T", "C"])
def _accumulate_kernel(
    table,
    T,
    C,
    scale,
    scale_ptr,
    has_scale_tensor,
    found_inf_ptr,
    has_found_inf,
    GRAD_DTYPE: tl.constexpr,
    OVERWRITE: tl.constexpr,
    ALIGNED: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t, start, n = c.chunk_of(table, 2, T, C, CHUNK, ALIGNED)
    buffer = c.pointer(table, 0, T, t, tl.float32, ALIGNED)
    grad = c.pointer(table, 1, T, t, GRAD_DTYPE, ALIGNED)
    s = scale
    if has_scale_tensor:
        s = scale * tl.load(scale_ptr)
    nonfinite = tl.zeros((BLOCK,), dtype=tl.int32)
    if start + CHUNK <= n:  # a full chunk: no masks, vector accesses where ALIGNED
        for i in range(0, CHUNK, BLOCK):
            offs = start + i + tl.arange(0, BLOCK).to(tl.int64)
            nonfinite = nonfinite | _accumulate_block(buffer, grad, offs, n, s, GRAD_DTYPE, OVERWRITE, False)
    else:
        for i in range(0, CHUNK, BLOCK):
            offs = start + i + tl.arange(0, BLOCK).to(tl.int64)
            nonfinite = nonfinite | _accumulate_block(buffer, grad, offs, n, s, GRAD_DTYPE, OVERWRITE, True)
    if has_found_inf:
        # Every writer stores the same 1.0: no atomics needed.
        tl.store(found_inf_ptr, 1.0, mask=tl.max(nonfinite, axis=0) > 0)


@torch.library.custom_op("accumkernels_triton::accumulate_", mutates_args=OPS["accumulate_"].mutates)
def accumulate_(
    buffers: list[torch.Tensor],
    grads: list[torch.Tensor],
    scale: float,
    scale_tensor: torch.Tensor | None,
    overwrite: bool,
    found_inf: torch.Tensor | None,
) -> None:
    """buffer = (0 if overwrite else buffer) + scale * float32(grad), for every pair."""
    device = buffers[0].device
    with c.device_guard(device):
        scale_ptr, has_scale, inf_ptr, has_inf = c.scalar_arguments(scale_tensor, found_inf, device)
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            pairs = [(b, g) for b, g in zip(buffers, grads) if g.dtype == dtype and b.numel() > 0]
            if not pairs:
                continue
            table, count, chunks, aligned = c.launch_table(
                [[b for b, _ in pairs], [g for _, g in pairs]], [b.numel() for b, _ in pairs], device
            )
            _accumulate_kernel[(chunks,)](
                table,
                count,
                chunks,
                scale,
                scale_ptr,
                has_scale,
                inf_ptr,
                has_inf,
                GRAD_DTYPE=c.TL_DTYPES[dtype],
                OVERWRITE=overwrite,
                ALIGNED=aligned,
                CHUNK=c.CHUNK,
                BLOCK=c.BLOCK,
                **c.OPTIONS,
            )


@accumulate_.register_fake
def _(buffers, grads, scale, scale_tensor, overwrite, found_inf) -> None:
    return None
