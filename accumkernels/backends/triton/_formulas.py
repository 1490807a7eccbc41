"""formulas.h in Triton: the same functions, with the same names and meaning,
for the Triton kernels (csrc/include/accumkernels/formulas.h is the original;
both are tested against accumkernels/backends/reference.py). Values are fp32
blocks; integer work is done in int64 and kept to 32 bits where formulas.h
uses uint32_t."""

from __future__ import annotations

import types

import triton
import triton.language as tl

from .. import reference

# ---- conversions ------------------------------------------------------------
# bf16 by integer ops: the interpreter's own bf16 casts truncate and mishandle
# subnormals.


@triton.jit
def bf16_to_float(h):
    """bf16 bits (uint16) -> fp32, exact."""
    return (h.to(tl.uint32) << 16).to(tl.float32, bitcast=True)


@triton.jit
def float_to_bf16(x):
    """fp32 -> bf16 bits (uint16), round to nearest even; NaN stays a quiet NaN."""
    u = x.to(tl.uint32, bitcast=True)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    is_nan = (u & 0x7FFFFFFF) > 0x7F800000
    return tl.where(is_nan, (u >> 16) | 0x40, rounded).to(tl.uint16)


# The random bits of stochastic rounding: the reference's hash (operators
# only), compiled as is; Triton looks up the names a jit function uses in its
# globals, so it gets this module's.
sr_random = triton.jit(types.FunctionType(reference.sr_random.__code__, globals(), "sr_random"))


@triton.jit
def sr_slot_seed(seed, slot: tl.constexpr):
    """The seed of rounding slot ``slot`` (0 the param, 1 the momentum buffer or
    exp_avg, 2 exp_avg_sq, 3 max_exp_avg_sq), as formulas.h's."""
    if slot == 1 or slot == 2:
        out = (seed + 0x9E3779B9) & 0xFFFFFFFF
    else:
        out = seed
    return out


@triton.jit
def sr_draw(seed, slot: tl.constexpr, stream, index):
    """Rounding slot ``slot``'s random bits (the low 16 are used), as formulas.h's
    sr_draw: sr_random(sr_slot_seed(seed, slot), stream, index) >> sr_slot_shift(slot)."""
    random = sr_random(sr_slot_seed(seed, slot), stream, index)
    if slot >= 2:
        random = random >> 16
    return random


@triton.jit
def float_to_bf16_stochastic(x, random):
    """fp32 -> bf16 bits adding 16 random bits below the mantissa, then
    truncating; inf and NaN round to nearest."""
    bits = x.to(tl.uint32, bitcast=True).to(tl.int64)
    stochastic = (bits + (random & 0xFFFF)) >> 16
    special = (bits & 0x7F800000) == 0x7F800000
    return tl.where(special, float_to_bf16(x).to(tl.int64), stochastic).to(tl.uint16)


# ---- param remainders ---------------------------------------------------------


@triton.jit
def join_remainder(param, remainder):
    """A bf16 param (uint16 bits) and its int16 remainder (uint16 bits) -> the fp32 master."""
    high = param.to(tl.uint32) - (remainder.to(tl.uint32) >> 15)
    return ((high << 16) | remainder.to(tl.uint32)).to(tl.float32, bitcast=True)


@triton.jit
def remainder_param(x):
    """The bf16 param (uint16 bits) of an fp32 master: its high 16 bits rounded
    to nearest, ties away from zero; inf and NaN rounded as float_to_bf16."""
    u = x.to(tl.uint32, bitcast=True)
    rounded = (u >> 16) + ((u >> 15) & 1)
    special = (u & 0x7F800000) == 0x7F800000
    return tl.where(special, float_to_bf16(x).to(tl.uint32), rounded).to(tl.uint16)


@triton.jit
def remainder_bits(x):
    """The int16 remainder (uint16 bits) of an fp32 master: its low 16 bits."""
    return (x.to(tl.uint32, bitcast=True) & 0xFFFF).to(tl.uint16)


@triton.jit
def is_nonfinite(x):
    """inf or NaN: x - x is NaN exactly for those."""
    return (x - x) != 0.0


@triton.jit
def nan_max(a, b):
    """torch.maximum: NaN if either operand is NaN."""
    return tl.where(a != a, a, tl.where(a > b, a, b))


@triton.jit
def lerp(start, end, weight):
    """torch.lerp's two forms, chosen by the (uniform) weight."""
    if weight < 0.5:
        out = start + weight * (end - start)
    else:
        out = end - (end - start) * (1.0 - weight)
    return out


# ---- accumulate_ ----------------------------------------------------------------


@triton.jit
def accumulate(buffer, grad, scale, OVERWRITE: tl.constexpr):
    """buffer = (0 if overwrite else buffer) + scale * grad."""
    if OVERWRITE:
        out = scale * grad
    else:
        out = buffer + scale * grad
    return out


# ---- SGD ----------------------------------------------------------------------

NO_MOMENTUM = tl.constexpr(0)
FIRST_STEP = tl.constexpr(1)
RUNNING = tl.constexpr(2)


@triton.jit
def sgd_update(
    p,
    g,
    momentum_buffer,
    lr,
    momentum,
    one_minus_dampening,
    weight_decay,
    nesterov,
    has_weight_decay,
    MOMENTUM: tl.constexpr,
):
    """(new weight, new momentum buffer), as formulas.h's sgd_update."""
    if has_weight_decay:
        g = g + weight_decay * p
    b = momentum_buffer
    if MOMENTUM != NO_MOMENTUM:
        if MOMENTUM == FIRST_STEP:
            b = g
        else:
            b = momentum * momentum_buffer + one_minus_dampening * g
        if nesterov:
            g = g + momentum * b
        else:
            g = b
    return p - lr * g, b


# ---- Adam / AdamW -------------------------------------------------------------


@triton.jit
def _pow_int(base, exponent):
    """base ** exponent for a non-negative integer exponent < 2^31, by squaring (fp64)."""
    result = base * 0.0 + 1.0
    for _ in range(31):
        result = tl.where((exponent & 1) != 0, result * base, result)
        base = base * base
        exponent = exponent >> 1
    return result


@triton.jit
def adam_bias_corrections(lr, beta1, beta2, step):
    """(step_size, bias_correction2_sqrt) for step count `step` (fp64 math, fp32 results)."""
    t = step.to(tl.int32)
    step_size = (lr / (1.0 - _pow_int(beta1, t))).to(tl.float32)
    bias_correction2_sqrt = tl.sqrt(1.0 - _pow_int(beta2, t)).to(tl.float32)
    return step_size, bias_correction2_sqrt


@triton.jit
def adam_update(
    p,
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
    AMSGRAD: tl.constexpr,
):
    """(new weight, m, v, v_max), as formulas.h's adam_update."""
    if has_weight_decay:
        if adamw:
            p = p * adamw_decay
        else:
            g = g + weight_decay * p
    m = lerp(m, g, one_minus_beta1)
    v = beta2_f * v + one_minus_beta2 * (g * g)
    v_hat = v
    if AMSGRAD:
        v_max = nan_max(v_max, v)
        v_hat = v_max
    denom = tl.div_rn(tl.sqrt_rn(v_hat), bias_correction2_sqrt) + eps
    return p - step_size * tl.div_rn(m, denom), m, v, v_max


# ---- 8-bit state ----------------------------------------------------------------
# formulas.h's 8-bit state functions (accumkernels/_state8.py states the format).
STATE8_BLOCK = tl.constexpr(256)
STATE8_MANTISSA_BITS = tl.constexpr(3)
EMIN_EXP_AVG = tl.constexpr(-14)
EMIN_EXP_AVG_SQ = tl.constexpr(-30)


@triton.jit
def state8_pow2(k):
    """2^k (fp32) for int32 k in [-126, 127], from its bits."""
    return ((k + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def encode_magnitude(u, emin: tl.constexpr, random):
    """The code (int32) of u in [0, 1], r = the low 16 bits of ``random`` / 2^16:
    formulas.h's two exact forms, by u's range (u >= 2^emin: one integer
    addition to u's bits and a shift; below: u * 2^(3 - emin) + r >= 0, whose
    conversion's truncation is the floor)."""
    bits = u.to(tl.int32, bitcast=True)
    rnd = (random & 0xFFFF).to(tl.int32)
    low_limit = (127 + emin) << 23  # 2^emin's bits
    is_normal = bits >= low_limit
    normal = ((bits + (rnd << 4)) >> 20) - 8 * (126 + emin)  # formulas.h's state8_bits_offset
    u_low = tl.minimum(bits, low_limit).to(tl.float32, bitcast=True)  # larger u would scale past int32
    r = rnd.to(tl.float32) * 0.0000152587890625  # 2^-16
    low = (u_low * state8_pow2(bits * 0 + (STATE8_MANTISSA_BITS - emin)) + r).to(tl.int32)  # k as a tensor, to bit-cast
    return tl.where(is_normal, normal, low)


@triton.jit
def decode_magnitude(code, emin: tl.constexpr):
    """The value in [0, 1] (fp32) of an int32 code of encode_magnitude: codes
    from 8 up as fp32 bits (the encode's shift undone), codes under 8 as
    code * 2^(emin - 3)."""
    normal = ((code + 8 * (126 + emin)) << 20).to(tl.float32, bitcast=True)  # state8_bits_offset
    low = code.to(tl.float32) * state8_pow2(code * 0 + (emin - STATE8_MANTISSA_BITS))  # k as a tensor
    return tl.where(code >= 8, normal, low)


@triton.jit
def state8_divisor(scale):
    """A block's scale as its encode's divisor: 1 for an all-zero block."""
    return tl.where(scale > 0.0, scale, 1.0)


@triton.jit
def decode_exp_avg(code, scale):
    """exp_avg's fp32 value of a uint8 code and its block's scale."""
    c = code.to(tl.int32)
    magnitude = decode_magnitude(c & 0x7F, EMIN_EXP_AVG) * scale
    # The code's sign bit moved to the fp32 sign: a negation (a NaN's sign flips too).
    return (magnitude.to(tl.int32, bitcast=True) ^ ((c & 0x80) << 24)).to(tl.float32, bitcast=True)


@triton.jit
def encode_exp_avg(m, divisor, random):
    """exp_avg's uint8 code of m, its block's divisor and 16 random bits."""
    magnitude = (m.to(tl.int32, bitcast=True) & 0x7FFFFFFF).to(tl.float32, bitcast=True)
    sign = tl.where(m < 0.0, 0x80, 0)
    return (encode_magnitude(tl.div_rn(magnitude, divisor), EMIN_EXP_AVG, random) | sign).to(tl.uint8)


@triton.jit
def decode_exp_avg_sq(code, scale):
    """exp_avg_sq's fp32 value (r * r) of a uint8 code and its block's scale."""
    r = decode_magnitude(code.to(tl.int32), EMIN_EXP_AVG_SQ) * scale
    return r * r


@triton.jit
def encode_exp_avg_sq(r, divisor, random):
    """exp_avg_sq's uint8 code of r = sqrt(v), its block's divisor and 16 random bits."""
    return encode_magnitude(tl.div_rn(r, divisor), EMIN_EXP_AVG_SQ, random).to(tl.uint8)
