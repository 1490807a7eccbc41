"""The 8-bit optimizer state format (``state_dtype="8bit"``), in pure PyTorch.

A state tensor of n elements is cut, in its memory order, into blocks of
``BLOCK`` = 256 elements (the last one shorter). Each block keeps one fp32
scale, each element one uint8 code (1 + 4/256 bytes an element):

===================  =====================================  ===============================
state                stored                                 code
===================  =====================================  ===============================
``exp_avg``          m, signed: scale = max |m| (block)     ``sign << 7 | c(|m| / scale, -14)``
``exp_avg_sq``       r = sqrt(v): scale = max r (block)     ``c(r / scale, -30)``
``momentum_buffer``  b (SGD), signed, as ``exp_avg``        ``sign << 7 | c(|b| / scale, -14)``
===================  =====================================  ===============================

``c(u, emin)`` puts ``u`` in [0, 1] on a grid of 3 mantissa bits per binade
from 2^emin up to 1, evenly spaced below 2^emin down to 0 (as subnormals)::

    e    = max(emin, floor(log2 u))         (the exponent of u's fp32 bits; emin for u = 0)
    j    = floor(u * 2^(3 - e) + r)         r = 16 random bits / 2^16 (stochastic), or 1/2 (nearest)
    code = 8 * (e - emin) + j               (j = 16, a carry into the next binade, is that binade's 8)

and a code decodes to ``j * 2^(e - 3)`` with ``e = emin + max(0, code // 8 - 1)``,
``j = code - 8 * (e - emin)``; values are ``scale`` times that (``r`` then
squared). 1 decodes to code 8 * (1 - emin): 120 for exp_avg (with the sign
bit, codes up to 248), 248 for exp_avg_sq.

Why this format: block-wise scales as bitsandbytes' and torchao's 8-bit
optimizers (Dettmers et al., arXiv 2110.02861), so one outlier costs only its
block's precision; a floating-point grid, as their dynamic quantization map and
torchao's / Transformer Engine's fp8 moments, so small moments keep 3
significant bits instead of flushing to zero; but computed from the exponent
(no lookup table) so that every backend computes it the same way; exp_avg_sq
stored as its square root, with a 5-bit exponent range (2^-30 relative: v
keeps 2^-60), because Adam divides by sqrt(v): a v flushed to zero under a
nonzero m would step by m / eps. The encode rounds stochastically (unbiased, as
the bf16 state): Adam's exp_avg_sq moves by (1 - beta2) of itself a step, far
below the grid's 1/8 spacing, and rounding to nearest would freeze it.

A block holding an inf or NaN gets an inf or NaN scale, and then every one
of its elements decodes to inf or NaN (its codes are unspecified): as an fp32
moment would, a non-finite gradient without a GradScaler ruins the training,
here a block of it at once.

Every computation here is fp32 arithmetic in a fixed order (the sum
``u * 2^(3 - e) + r`` is exact from 2^emin up), so a native kernel can
reproduce it bit for bit; the kernels (formulas.h, the Triton mirror) do so
in exact integer forms of these formulas, which take fewer instructions:
from 2^emin up a code is u's fp32 bits plus ``r``'s shifted to bit 4, shifted
right by 20, less 8 * (126 + emin), and decodes by the reverse shift.
"""

from __future__ import annotations

import torch

BLOCK = 256
MANTISSA_BITS = 3
EMIN_EXP_AVG = -14
EMIN_EXP_AVG_SQ = -30


def scales_numel(n: int) -> int:
    """The number of blocks (scales) of a state tensor of ``n`` elements."""
    return -(-n // BLOCK)


def _blocks(x: torch.Tensor) -> torch.Tensor:
    """The elements of ``x`` (1-D, memory order), padded with zeros to whole blocks, as rows."""
    n = x.numel()
    return torch.nn.functional.pad(x, (0, scales_numel(n) * BLOCK - n)).view(-1, BLOCK)


def _pow2(k: torch.Tensor) -> torch.Tensor:
    """2^k (fp32) of int32 exponents k in [-126, 127], from its bits (exact on every CPU)."""
    return ((k + 127) << 23).view(torch.float32)


def _exponent(u: torch.Tensor, emin: int) -> torch.Tensor:
    """max(emin, floor(log2 u)) from u's fp32 bits (emin for u = 0); int32."""
    biased = (u.view(torch.int32) >> 23) & 0xFF
    return torch.clamp(biased - 127, min=emin)


def encode_magnitude(u: torch.Tensor, emin: int, random: torch.Tensor | None) -> torch.Tensor:
    """The codes of ``u`` in [0, 1] (fp32), with ``random`` (16-bit values, any
    integer dtype) for stochastic rounding or None for nearest; int32."""
    e = _exponent(u, emin)
    scaled = u * _pow2(MANTISSA_BITS - e)
    r = (random & 0xFFFF).float() * 2.0**-16 if random is not None else 0.5
    j = torch.floor(scaled + r).to(torch.int32)
    return 8 * (e - emin) + j


def decode_magnitude(code: torch.Tensor, emin: int) -> torch.Tensor:
    """The value in [0, 1] of each code (int32) of ``encode_magnitude``; fp32."""
    e = emin + torch.clamp(code // 8 - 1, min=0)
    j = code - 8 * (e - emin)
    return j.float() * _pow2(e - MANTISSA_BITS)


def encode(values: torch.Tensor, like: torch.Tensor, signed: bool, emin: int, random: torch.Tensor | None):
    """(codes uint8 laid out like ``like``, scales fp32 of scales_numel) of
    ``values`` (fp32, ``like``'s shape); blocks follow ``like``'s memory order.
    ``random``: 16-bit values (1-D, one per element in that order) for
    stochastic rounding, or None for nearest."""
    ordered = torch.empty_like(like, dtype=torch.float32).copy_(values)
    flat = _flat(ordered)
    rows = _blocks(flat)
    scale = rows.abs().amax(dim=1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    u = rows.abs() / safe[:, None]  # <= 1: |x| <= scale and IEEE division is monotone
    rand = None if random is None else _blocks(random.reshape(-1).to(torch.int64))
    code = encode_magnitude(u, emin, rand)
    if signed:
        code = code | (rows < 0).to(torch.int32) << 7
    out = torch.empty_like(like, dtype=torch.uint8)
    _flat(out).copy_(code.reshape(-1)[: flat.numel()].to(torch.uint8))
    return out, scale


def decode(codes: torch.Tensor, scales: torch.Tensor, signed: bool, emin: int) -> torch.Tensor:
    """The fp32 values of ``codes`` (uint8) and their blocks' ``scales``, laid out like ``codes``."""
    flat = _flat(codes).to(torch.int32)
    rows = _blocks(flat)
    magnitude = decode_magnitude(rows & 0x7F if signed else rows, emin) * scales[:, None]
    if signed:
        magnitude = torch.where((rows & 0x80) != 0, -magnitude, magnitude)
    out = torch.empty_like(codes, dtype=torch.float32)
    _flat(out).copy_(magnitude.reshape(-1)[: flat.numel()])
    return out


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A dense tensor's elements in memory order, as a 1-D view."""
    return t.as_strided((t.numel(),), (1,), t.storage_offset())


def encode_exp_avg(m: torch.Tensor, like: torch.Tensor, random: torch.Tensor | None):
    return encode(m, like, True, EMIN_EXP_AVG, random)


def decode_exp_avg(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    return decode(codes, scales, True, EMIN_EXP_AVG)


def sqrt_f32(v: torch.Tensor) -> torch.Tensor:
    """sqrt of fp32 ``v``, correctly rounded (as sqrtf and IEEE 754): torch's
    fp32 CPU sqrt is not (off by an ulp in ~17% of values on torch 2.14.1
    here), so it is taken in fp64 and rounded once, which is exact for sqrt
    (53 >= 2 * 24 + 2 bits). The reference's Adam denominator takes it too,
    so that the kernels' sqrtf gives the reference's bits."""
    return torch.sqrt(v.double()).float()


def encode_exp_avg_sq(v: torch.Tensor, like: torch.Tensor, random: torch.Tensor | None):
    return encode(sqrt_f32(v), like, False, EMIN_EXP_AVG_SQ, random)


def decode_exp_avg_sq(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    r = decode(codes, scales, False, EMIN_EXP_AVG_SQ)
    return r * r


# The optimizer state keys kept in 8 bits (torch.optim's names). SGD's
# momentum_buffer is signed and moves as exp_avg does (a moving sum of
# gradients): it is stored as exp_avg is.
MOMENTS = ("exp_avg", "exp_avg_sq", "momentum_buffer")


def encode_moment(key: str, values: torch.Tensor, like: torch.Tensor, random: torch.Tensor | None):
    """encode_exp_avg_sq for exp_avg_sq, else encode_exp_avg, by the state key."""
    return (encode_exp_avg_sq if key == "exp_avg_sq" else encode_exp_avg)(values, like, random)


def decode_moment(key: str, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """decode_exp_avg_sq for exp_avg_sq, else decode_exp_avg, by the state key."""
    return (decode_exp_avg_sq if key == "exp_avg_sq" else decode_exp_avg)(codes, scales)
