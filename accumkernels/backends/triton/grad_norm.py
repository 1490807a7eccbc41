"""grad_norm in Triton: sqrt(sum of x^2) over fp32, bf16 and fp16 buffers,
deterministic: one fp64 partial per chunk (one launch per dtype, in the order
fp32, bf16, fp16, each writing its chunks' partials after the previous
one's), then one program adds the partials in a fixed order."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..._op_table import OPS
from . import _common as c


@triton.jit(do_not_specialize=["T", "C"])
def _partials_kernel(
    table,
    T,
    C,
    partials_ptr,
    DTYPE: tl.constexpr,
    ALIGNED: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    t, start, n = c.chunk_of(table, 1, T, C, CHUNK, ALIGNED)
    x_ptr = c.pointer(table, 0, T, t, DTYPE, ALIGNED)
    acc = tl.zeros((BLOCK,), dtype=tl.float64)
    if start + CHUNK <= n:
        for i in range(0, CHUNK, BLOCK):
            offs = start + i + tl.arange(0, BLOCK).to(tl.int64)
            x = c.load_f32(x_ptr, offs, offs < n, DTYPE, False).to(tl.float64)
            acc += x * x
    else:
        for i in range(0, CHUNK, BLOCK):
            offs = start + i + tl.arange(0, BLOCK).to(tl.int64)
            x = c.load_f32(x_ptr, offs, offs < n, DTYPE, True).to(tl.float64)
            acc += x * x
    tl.store(partials_ptr + tl.program_id(0), tl.sum(acc, axis=0))


@triton.jit(do_not_specialize=["count"])
def _finish_kernel(partials_ptr, count, out_ptr, BLOCK: tl.constexpr):
    acc = tl.zeros((BLOCK,), dtype=tl.float64)
    for i in range(0, count, BLOCK):
        offs = i + tl.arange(0, BLOCK)
        acc += tl.load(partials_ptr + offs, mask=offs < count, other=0.0)
    tl.store(out_ptr, tl.sqrt(tl.sum(acc, axis=0)).to(tl.float32))


@torch.library.custom_op("accumkernels_triton::grad_norm", mutates_args=OPS["grad_norm"].mutates)
def grad_norm(buffers: list[torch.Tensor]) -> torch.Tensor:
    """sqrt(sum of x^2 over every element of every buffer), 0-dim fp32."""
    device = buffers[0].device
    out = torch.zeros((), dtype=torch.float32, device=device)
    groups = [
        [b for b in buffers if b.dtype == dtype and b.numel() > 0]
        for dtype in (torch.float32, torch.bfloat16, torch.float16)
    ]
    with c.device_guard(device):
        launches = [(group, *c.launch_table([group], [b.numel() for b in group], device)) for group in groups if group]
        total = sum(chunks for _, _, _, chunks, _ in launches)
        if not total:
            return out
        partials = torch.empty(total, dtype=torch.float64, device=device)
        first = 0
        for group, table, tensors, chunks, aligned in launches:
            _partials_kernel[(chunks,)](
                table,
                tensors,
                chunks,
                partials[first:],
                DTYPE=c.TL_DTYPES[group[0].dtype],
                ALIGNED=aligned,
                CHUNK=c.CHUNK,
                BLOCK=c.BLOCK,
                **c.OPTIONS,
            )
            first += chunks
        _finish_kernel[(1,)](partials, total, out, BLOCK=1024, **c.OPTIONS)
    return out


@grad_norm.register_fake
def _(buffers):
    return buffers[0].new_empty(())
