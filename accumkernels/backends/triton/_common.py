"""What every Triton kernel of accumkernels shares.

Multi-tensor launches use one int64 "meta" tensor on the device, built on the
host and copied in one asynchronous transfer:

    [ pointers of list 0 (T) | ... | list L-1 (T) | numels (T) | list positions (T) |
      chunk -> tensor (C) | chunk -> first element (C) | extra int64/fp64 bits ]

One program handles one chunk of CHUNK elements of one tensor (in BLOCK-wide
steps), so a list of any length costs one launch per storage dtype. Offsets are
int64. Per-step values (scale, lr, betas, step counts, grad_scale) are runtime
arguments or device tensors, never tl.constexpr: changing them never recompiles.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "") == "1"
# The interpreter pays per program, not per element: one big block per chunk.
CHUNK = 65536 if INTERPRET else 16384
BLOCK = 65536 if INTERPRET else 2048
NUM_WARPS = 8

TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


def build_meta(lists: list[list[torch.Tensor | None]], numels: list[int], device: torch.device,
               extra: list[int] | None = None, positions: list[int] | None = None) -> tuple[torch.Tensor, int, int]:
    """The meta tensor for L lists of T tensors (None entries become null
    pointers; ``positions``: each tensor's place in the op's list, default
    0..T-1); returns (meta, T, C)."""
    count = len(numels)
    sizes = torch.tensor(numels, dtype=torch.int64)
    chunks_per_tensor = (sizes + CHUNK - 1) // CHUNK
    chunk_tensor = torch.repeat_interleave(torch.arange(count, dtype=torch.int64), chunks_per_tensor)
    first_chunk = torch.cumsum(chunks_per_tensor, 0) - chunks_per_tensor
    chunk_count = int(chunk_tensor.numel())
    chunk_start = (torch.arange(chunk_count, dtype=torch.int64) - first_chunk[chunk_tensor]) * CHUNK
    pointers = torch.tensor([[0 if t is None else t.data_ptr() for t in lst] for lst in lists], dtype=torch.int64)
    places = torch.tensor(positions if positions is not None else range(count), dtype=torch.int64)
    parts = [pointers.reshape(-1), sizes, places, chunk_tensor, chunk_start]
    if extra:
        parts.append(torch.tensor(extra, dtype=torch.int64))
    meta = torch.cat(parts)
    if device.type == "cuda":
        meta = meta.pin_memory().to(device, non_blocking=True)
    return meta, count, chunk_count


def f64_bits(*values: float) -> list[int]:
    """fp64 values as int64 bit patterns, for the meta tensor's extra part."""
    return torch.tensor(values, dtype=torch.float64).view(torch.int64).tolist()


@triton.jit
def chunk_of(meta, list_count: tl.constexpr, T, C):
    """(tensor index, first element, numel) of this program's chunk."""
    c = tl.program_id(0).to(tl.int64)
    t = tl.load(meta + list_count * T + 2 * T + c)
    start = tl.load(meta + list_count * T + 2 * T + C + c)
    n = tl.load(meta + list_count * T + t)
    return t, start, n


@triton.jit
def position(meta, list_count: tl.constexpr, T, t):
    """Tensor t's place in the op's list."""
    return tl.load(meta + list_count * T + T + t)


@triton.jit
def extra_at(meta, list_count: tl.constexpr, T, C):
    """Address of the meta tensor's extra part."""
    return meta + list_count * T + 2 * T + 2 * C


@triton.jit
def sr_random(seed, tensor, index):
    """The random bits of stochastic rounding, as formulas.h's sr_random: int64
    arithmetic kept to 32 bits (the low 32 bits of a product do not depend on
    the high bits, so wrapping is harmless)."""
    m = 0xFFFFFFFF
    x = ((index & m) * 0x9E3779B1) & m
    x = x ^ ((((index >> 32) & m) * 0x85EBCA77) & m)
    x = x ^ (((seed & m) * 0xC2B2AE3D) & m)
    x = x ^ (((tensor & m) * 0x27D4EB2F) & m)
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & m
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & m
    return x ^ (x >> 16)


@triton.jit
def to_bf16_stochastic(x, random):
    """fp32 -> bf16 adding 16 random bits below the mantissa, then truncating
    (inf and NaN round to nearest), as formulas.h's float_to_bf16_stochastic."""
    bits = x.to(tl.uint32, bitcast=True).to(tl.int64)
    stochastic = (bits + (random & 0xFFFF)) >> 16
    special = (bits & 0x7F800000) == 0x7F800000
    nearest = to_storage(x, tl.bfloat16).to(tl.uint16, bitcast=True).to(tl.int64)
    return tl.where(special, nearest, stochastic).to(tl.uint16).to(tl.bfloat16, bitcast=True)


@triton.jit
def pointer(meta, list_index: tl.constexpr, T, t, dtype: tl.constexpr):
    return tl.load(meta + list_index * T + t).to(tl.pointer_type(dtype))


@triton.jit
def load_f32(ptr, offs, mask, dtype: tl.constexpr):
    """Load ``dtype`` values as fp32; bf16 by a 16-bit shift, exact for every
    pattern (the interpreter's own bf16 conversion mishandles subnormals)."""
    if dtype == tl.bfloat16:
        raw = tl.load(ptr.to(tl.pointer_type(tl.uint16)) + offs, mask=mask, other=0)
        return (raw.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return tl.load(ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def to_storage(x, dtype: tl.constexpr):
    """fp32 -> storage dtype, rounding to nearest even (bf16 by integer ops,
    as formulas.h does: the interpreter's own bf16 cast truncates)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        is_nan = (bits & 0x7FFFFFFF) > 0x7F800000
        out = tl.where(is_nan, (bits >> 16) | 0x40, rounded)
        return out.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(dtype)


@triton.jit
def is_nonfinite(x):
    """inf or NaN: x - x is NaN exactly for those."""
    return (x - x) != 0.0
