"""What every Triton kernel of accumkernels shares: the launch table, the
device guard and the loads and stores of storage dtypes.

Multi-tensor launches use one int64 "table" tensor on the device:

    [ pointers of list 0 (T) | ... | list L-1 (T) | numels (T) | stream ids (T) |
      chunk -> tensor (C) | chunk -> first element (C) ]

One program handles one chunk of CHUNK elements of one tensor (in BLOCK-wide
steps), so a list of any length costs one launch per storage dtype. Offsets are
int64. The table depends only on the tensors (addresses, sizes, stream ids), so
it is built once per tensor list and kept (``launch_table``): later calls with
the same tensors, as the optimizer wrapper makes every window, copy nothing to
the device. Per-step values (scale, lr, step counts, grad_scale, the seed) are
runtime arguments or device tensors, never tl.constexpr, and the per-call
integers are not specialized on (``do_not_specialize``): changing them never
recompiles. Whether the optional scale and inf-flag tensors are given is a
runtime flag too (an absent one is a placeholder tensor), not a variant.

Where every tensor of a launch is 16-byte aligned the host passes ALIGNED=True
and the kernels tell the compiler (``tl.multiple_of``); full chunks are then
loaded without a mask, and the loads and stores become 16-byte vector accesses.
"""

from __future__ import annotations

import contextlib
import os
from collections import OrderedDict

import torch
import triton
import triton.language as tl

from . import _formulas as f

INTERPRET = os.environ.get("TRITON_INTERPRET", "") == "1"
# The interpreter pays per program, not per element: one big block per chunk.
CHUNK = 65536 if INTERPRET else 16384
BLOCK = 65536 if INTERPRET else 2048
NUM_WARPS = 8
# Launch options. No floating-point contraction: a + b * c is rounded twice, as
# in the CPU kernels and the reference, so every backend gives the same bits.
OPTIONS = {} if INTERPRET else {"num_warps": NUM_WARPS, "enable_fp_fusion": False}
ALIGNMENT = 16  # bytes

# uint8: the codes of 8-bit optimizer state (accumkernels._state8), as a state dtype.
TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.uint8: tl.uint8}

_TABLES: OrderedDict = OrderedDict()
_TABLES_KEPT = 256


def device_guard(device: torch.device):
    """Launch on the tensors' device (and its current stream), whatever device is current."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def launch_table(
    lists: list[list[torch.Tensor | None]], numels: list[int], device: torch.device, streams: list[int] | None = None
) -> tuple[torch.Tensor, int, int, bool]:
    """The table for L lists of T tensors (None entries become null pointers;
    ``streams``: each tensor's stream id, default 0..T-1); returns (table, T, C,
    aligned), ``aligned`` meaning every tensor starts on a 16-byte boundary."""
    pointers = tuple(tuple(0 if t is None else t.data_ptr() for t in lst) for lst in lists)
    key = (device, pointers, tuple(numels), None if streams is None else tuple(streams))
    hit = _TABLES.get(key)
    if hit is not None:
        _TABLES.move_to_end(key)
        return hit
    count = len(numels)
    sizes = torch.tensor(numels, dtype=torch.int64)
    chunks_per_tensor = (sizes + CHUNK - 1) // CHUNK
    chunk_tensor = torch.repeat_interleave(torch.arange(count, dtype=torch.int64), chunks_per_tensor)
    first_chunk = torch.cumsum(chunks_per_tensor, 0) - chunks_per_tensor
    chunk_count = int(chunk_tensor.numel())
    chunk_start = (torch.arange(chunk_count, dtype=torch.int64) - first_chunk[chunk_tensor]) * CHUNK
    ids = torch.tensor(streams if streams is not None else range(count), dtype=torch.int64)
    table = torch.cat([torch.tensor(pointers, dtype=torch.int64).reshape(-1), sizes, ids, chunk_tensor, chunk_start])
    if device.type == "cuda":
        # Kept pinned and alive with the device copy: a CUDA graph that captured
        # this copy replays it from the same, unchanged host memory.
        host = table.pin_memory()
        table = host.to(device, non_blocking=True)
        table._accumkernels_host = host  # noqa: SLF001  (lifetime only)
    aligned = all(p % ALIGNMENT == 0 for lst in pointers for p in lst)
    entry = (table, count, chunk_count, aligned)
    _TABLES[key] = entry
    if len(_TABLES) > _TABLES_KEPT:
        _TABLES.popitem(last=False)
    return entry


def seed_argument(seed: int) -> int:
    """The uint32 seed as a signed 32-bit int, so that its Triton type is i32
    whatever its value (a value >= 2^31 would be i64: a new compile)."""
    return seed - 2**32 if seed >= 2**31 else seed


@triton.jit
def chunk_of(table, list_count: tl.constexpr, T, C, CHUNK: tl.constexpr, ALIGNED: tl.constexpr):
    """(tensor index, first element, numel) of this program's chunk."""
    c = tl.program_id(0).to(tl.int64)
    t = tl.load(table + list_count * T + 2 * T + c)
    start = tl.load(table + list_count * T + 2 * T + C + c)
    if ALIGNED:
        start = tl.multiple_of(start, CHUNK)
    n = tl.load(table + list_count * T + t)
    return t, start, n


@triton.jit
def stream_of(table, list_count: tl.constexpr, T, t):
    """Tensor t's stream id (stochastic rounding)."""
    return tl.load(table + list_count * T + T + t)


@triton.jit
def pointer(table, list_index: tl.constexpr, T, t, dtype: tl.constexpr, ALIGNED: tl.constexpr):
    """Tensor t's address in list ``list_index`` as a pointer to ``dtype``
    (bf16 as uint16: it is converted by integer ops)."""
    if dtype == tl.bfloat16:
        ptr = tl.load(table + list_index * T + t).to(tl.pointer_type(tl.uint16))
    else:
        ptr = tl.load(table + list_index * T + t).to(tl.pointer_type(dtype))
    if ALIGNED:
        ptr = tl.multiple_of(ptr, 16)
    return ptr


@triton.jit
def load_f32(ptr, offs, mask, dtype: tl.constexpr, MASKED: tl.constexpr):
    """Load ``dtype`` values as fp32 (masked loads return 0 past the end)."""
    if MASKED:
        x = tl.load(ptr + offs, mask=mask, other=0)
    else:
        x = tl.load(ptr + offs)
    if dtype == tl.bfloat16:
        return (x.to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def load(ptr, offs, mask, MASKED: tl.constexpr):
    """Load values as stored (masked loads return 0 past the end)."""
    if MASKED:
        return tl.load(ptr + offs, mask=mask, other=0)
    else:
        return tl.load(ptr + offs)


@triton.jit
def store(ptr, offs, value, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptr + offs, value, mask=mask)
    else:
        tl.store(ptr + offs, value)


@triton.jit
def to_storage(x, dtype: tl.constexpr):
    """fp32 -> storage dtype, rounding to nearest even (bf16 as its uint16 bits)."""
    if dtype == tl.bfloat16:
        return f.float_to_bf16(x)
    else:
        return x.to(dtype)


@triton.jit
def master_or_param(master, value, dtype: tl.constexpr):
    """formulas.h's master_or_param: the fp32 master where it rounds (to
    nearest even) to the param's value ``value`` (fp32, as load_f32 gives
    it), else the value (a write through ``p.data``). Compared as values."""
    held = to_storage(master, dtype)
    if dtype == tl.bfloat16:
        rounded = f.bf16_to_float(held)
    else:
        rounded = held.to(tl.float32)
    return tl.where(rounded == value, master, value)


# ---- the step families (SGD, Adam/AdamW) --------------------------------------


def param_dtype_launches(params: list[torch.Tensor], lists: list[list[torch.Tensor]], positions: list[int]):
    """Per storage dtype of ``params``: (dtype, table, T, C, aligned) over that
    dtype's non-empty params, for ``lists`` (per-param lists; an empty list
    gives null pointers) and stream ids ``positions`` (default: list index)."""
    device = params[0].device
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        index = [i for i, p in enumerate(params) if p.dtype == dtype and p.numel() > 0]
        if not index:
            continue
        picked = [[lst[i] for i in index] if lst else [None] * len(index) for lst in lists]
        streams = [positions[i] if positions else i for i in index]
        yield (dtype, *launch_table(picked, [params[i].numel() for i in index], device, streams))


# What a step's master_params list holds (MASTER_KIND): nothing, fp32 master
# weights, or the int16 remainders of bf16 params.
NO_MASTER, FP32_MASTER, REMAINDER = tl.constexpr(0), tl.constexpr(1), tl.constexpr(2)


def master_kind(master_params: list) -> int:
    if not master_params:
        return NO_MASTER.value
    return (REMAINDER if master_params[0].dtype == torch.int16 else FP32_MASTER).value


@triton.jit
def master_pointer(table, T, t, MASTER_KIND: tl.constexpr, ALIGNED: tl.constexpr):
    """Tensor t's master weights (list 1): fp32, or uint16 remainder bits."""
    if MASTER_KIND == REMAINDER:
        return pointer(table, 1, T, t, tl.uint16, ALIGNED)
    else:
        return pointer(table, 1, T, t, tl.float32, ALIGNED)


def step_flags(
    dtype: torch.dtype,
    master_params: list,
    stochastic_rounding: bool,
    state_dtype: torch.dtype,
    aligned: bool,
    buffers: list,
) -> dict:
    """The compile-time flags every step kernel takes, and the launch options,
    for a launch over the params of ``dtype``; ``buffers``: the call's (all
    fp32 sums, or each a gradient of its param's dtype: GRAD_DTYPE)."""
    kind = master_kind(master_params)
    narrow = any(b.dtype != torch.float32 for b in buffers)
    return dict(
        PARAM_DTYPE=TL_DTYPES[dtype],
        MASTER_KIND=kind,
        STOCHASTIC=stochastic_rounding and dtype == torch.bfloat16 and kind == NO_MASTER.value,
        STATE_DTYPE=TL_DTYPES[state_dtype],
        GRAD_DTYPE=TL_DTYPES[dtype if narrow else torch.float32],
        ALIGNED=aligned,
        CHUNK=CHUNK,
        BLOCK=BLOCK,
        **OPTIONS,
    )


_PLACEHOLDERS: dict = {}


def scalar_arguments(grad_scale_tensor, found_inf, device: torch.device) -> tuple:
    """(grad_scale_ptr, has_grad_scale_tensor, found_inf_ptr, has_found_inf):
    the optional scalar tensors as runtime arguments, an absent one replaced by
    a placeholder tensor of the device (None would compile a variant of its own)."""
    placeholder = _PLACEHOLDERS.get(device)
    if placeholder is None:
        placeholder = _PLACEHOLDERS[device] = torch.zeros(1, dtype=torch.float32, device=device)
    return (
        placeholder if grad_scale_tensor is None else grad_scale_tensor,
        grad_scale_tensor is not None,
        placeholder if found_inf is None else found_inf,
        found_inf is not None,
    )


@triton.jit
def load_weight(param, master, offs, mask, PARAM_DTYPE: tl.constexpr, MASTER_KIND: tl.constexpr, MASKED: tl.constexpr):
    """The fp32 weight: the master copy, the param joined with its remainder, or the param."""
    if MASTER_KIND == FP32_MASTER:
        m = load_f32(master, offs, mask, tl.float32, MASKED)
        return master_or_param(m, load_f32(param, offs, mask, PARAM_DTYPE, MASKED), PARAM_DTYPE)
    elif MASTER_KIND == REMAINDER:
        return f.join_remainder(load(param, offs, mask, MASKED), load(master, offs, mask, MASKED))
    else:
        return load_f32(param, offs, mask, PARAM_DTYPE, MASKED)


@triton.jit
def store_weight(
    param,
    master,
    offs,
    w,
    mask,
    seed,
    stream,
    PARAM_DTYPE: tl.constexpr,
    MASTER_KIND: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    MASKED: tl.constexpr,
):
    """The updated weight to the master copy (fp32) and the param (its dtype),
    to a bf16 param and its remainder, or to the param alone (bf16
    stochastically rounded where STOCHASTIC)."""
    if MASTER_KIND == FP32_MASTER:
        store(master, offs, w, mask, MASKED)
        store(param, offs, to_storage(w, PARAM_DTYPE), mask, MASKED)
    elif MASTER_KIND == REMAINDER:
        store(param, offs, f.remainder_param(w), mask, MASKED)
        store(master, offs, f.remainder_bits(w), mask, MASKED)
    elif STOCHASTIC:
        store(param, offs, f.float_to_bf16_stochastic(w, f.sr_draw(seed, 0, stream, offs)), mask, MASKED)
    else:
        store(param, offs, to_storage(w, PARAM_DTYPE), mask, MASKED)


@triton.jit
def store_state(ptr, offs, x, mask, seed, slot: tl.constexpr, stream, STATE_DTYPE: tl.constexpr, MASKED: tl.constexpr):
    """A state tensor's new value: fp32 as is, bf16 rounded stochastically with
    the bits of its rounding slot."""
    if STATE_DTYPE == tl.bfloat16:
        store(ptr, offs, f.float_to_bf16_stochastic(x, f.sr_draw(seed, slot, stream, offs)), mask, MASKED)
    else:
        store(ptr, offs, x, mask, MASKED)


@triton.jit
def step_chunk(
    block: tl.constexpr,
    ptrs,
    hp,
    buffer,
    start,
    n,
    grad_scale,
    grad_scale_ptr,
    has_grad_scale_tensor,
    found_inf_ptr,
    has_found_inf,
    zero_buffers,
    seed,
    stream,
    PARAM_DTYPE: tl.constexpr,
    MASTER_KIND: tl.constexpr,
    STOCHASTIC: tl.constexpr,
    STATE_DTYPE: tl.constexpr,
    GRAD_DTYPE: tl.constexpr,
    VARIANT: tl.constexpr,
    CHUNK: tl.constexpr,
    BLOCK: tl.constexpr,
):
    """One step family's update over this program's chunk, BLOCK elements at a
    time: ``block(ptrs, hp, offs, n, g_scale, seed, stream, PARAM_DTYPE,
    MASTER_KIND, STOCHASTIC, STATE_DTYPE, GRAD_DTYPE, VARIANT, MASKED)``, then
    buffer = 0 where zero_buffers (GRAD_DTYPE: the buffers' dtype, fp32 sums
    or gradients of the param's dtype).
    VARIANT is the family's inner-loop variant (Adam: amsgrad; SGD: the
    momentum mode). The update's scale is grad_scale (times *grad_scale_ptr
    where has_grad_scale_tensor); a window with *found_inf != 0 (where
    has_found_inf) is skipped but still clears its buffers (where zero_buffers)."""
    gs = grad_scale
    if has_grad_scale_tensor:
        gs = grad_scale * tl.load(grad_scale_ptr)
    seed64 = seed.to(tl.int64) & 0xFFFFFFFF
    skip = False
    if has_found_inf:
        skip = tl.load(found_inf_ptr) != 0.0
    zeros = tl.zeros((BLOCK,), tl.float32)
    if skip:
        if zero_buffers:
            for i in range(0, CHUNK, BLOCK):
                offs = start + i + tl.arange(0, BLOCK).to(tl.int64)
                tl.store(buffer + offs, zeros, mask=offs < n)
    elif start + CHUNK <= n:  # a full chunk: no masks, vector accesses where ALIGNED
        for i in range(0, CHUNK, BLOCK):
            offs = start + i + tl.arange(0, BLOCK).to(tl.int64)
            block(
                ptrs,
                hp,
                offs,
                n,
                gs,
                seed64,
                stream,
                PARAM_DTYPE,
                MASTER_KIND,
                STOCHASTIC,
                STATE_DTYPE,
                GRAD_DTYPE,
                VARIANT,
                False,
            )
            if zero_buffers:
                clear_after_block(buffer, offs, zeros, mask=None)
    else:
        for i in range(0, CHUNK, BLOCK):
            offs = start + i + tl.arange(0, BLOCK).to(tl.int64)
            block(
                ptrs,
                hp,
                offs,
                n,
                gs,
                seed64,
                stream,
                PARAM_DTYPE,
                MASTER_KIND,
                STOCHASTIC,
                STATE_DTYPE,
                GRAD_DTYPE,
                VARIANT,
                True,
            )
            if zero_buffers:
                clear_after_block(buffer, offs, zeros, mask=offs < n)


@triton.jit
def clear_after_block(buffer, offs, zeros, mask):
    """buffer[offs] = 0 once every thread of the program has read it. The
    compiler lays out each access on its own (16 bytes a thread: 8 elements
    where the block works with 16-bit params, 4 for these fp32 zeros), so the
    threads that clear an element need not be those that loaded it; without the
    barrier a zero can land before its sum is read, and the step drops that
    gradient (seen on an H200 with Triton 3.6: bf16 and fp16 params, a different
    result every run)."""
    tl.debug_barrier()
    tl.store(buffer + offs, zeros, mask=mask)


# ---- 8-bit state: a tile's blocks of 256 as rows --------------------------------
# A tile starts at a block boundary of its tensor, so its blocks are the rows
# of a (ROWS, 256) view; a state tensor's codes sit at ``offs``, its block
# scales at the rows' block indices.


@triton.jit
def load_state8(codes, scales, offs, n, decode: tl.constexpr, MASKED: tl.constexpr):
    """The fp32 values of a state tensor's codes, ``decode`` being
    _formulas.decode_exp_avg or decode_exp_avg_sq (masked elements: 0)."""
    TILE: tl.constexpr = offs.shape[0]
    ROWS: tl.constexpr = TILE // f.STATE8_BLOCK
    rows, row_mask = state8_rows(offs, n, ROWS)
    scale = per_element(load(scales, rows, row_mask, MASKED), ROWS, TILE)
    return decode(load(codes, offs, offs < n, MASKED), scale)


@triton.jit
def store_state8(
    codes, scales, offs, n, stored, seed, slot: tl.constexpr, stream, encode: tl.constexpr, MASKED: tl.constexpr
):
    """Encode ``stored`` (exp_avg's m, or exp_avg_sq's r = sqrt(v)) with
    ``encode`` (_formulas.encode_exp_avg or encode_exp_avg_sq) and the bits of
    rounding slot ``slot``: the new scales are the rows' maxima of |stored|
    (NaN where a row holds a NaN, as torch.amax)."""
    TILE: tl.constexpr = offs.shape[0]
    ROWS: tl.constexpr = TILE // f.STATE8_BLOCK
    mask = offs < n
    rows, row_mask = state8_rows(offs, n, ROWS)
    new_scale = row_max(tl.where(mask, tl.abs(stored), 0.0), ROWS)
    divisor = per_element(f.state8_divisor(new_scale), ROWS, TILE)
    store(codes, offs, encode(stored, divisor, f.sr_draw(seed, slot, stream, offs)), mask, MASKED)
    store(scales, rows, new_scale, row_mask, MASKED)


@triton.jit
def state8_rows(offs, n, ROWS: tl.constexpr):
    """(the block index of each row of the tile ``offs``, which rows hold elements):
    a tile starts at a block boundary of its tensor."""
    rows = tl.min(offs, axis=0) // f.STATE8_BLOCK + tl.arange(0, ROWS).to(tl.int64)
    return rows, rows < (n + f.STATE8_BLOCK - 1) // f.STATE8_BLOCK


@triton.jit
def per_element(row_values, ROWS: tl.constexpr, TILE: tl.constexpr):
    """A value per row of 256 as a value per element of the tile."""
    return tl.reshape(tl.broadcast_to(tl.reshape(row_values, (ROWS, 1)), (ROWS, TILE // ROWS)), (TILE,))


@triton.jit
def row_max(x, ROWS: tl.constexpr):
    """The maximum of each row of 256 of the tile ``x`` (>= 0), NaN where the row holds a NaN."""
    rows = tl.reshape(x, (ROWS, x.shape[0] // ROWS))
    has_nan = tl.max((rows != rows).to(tl.int32), axis=1) != 0
    nan = tl.full((ROWS,), 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
    return tl.where(has_nan, nan, tl.max(rows, axis=1))
