"""The reference backend: every op in pure PyTorch with fp32 math, on any device.

It is the fallback where no native kernel exists and the oracle the native
backends are tested against. Each function takes the arguments of the op's
schema (csrc/ops.cpp) by keyword, already validated by accumkernels.ops, and
states the formula of csrc/include/accumkernels/formulas.h with tensor ops.
Nothing here synchronizes with the host: found_inf and the scale tensors are
used on the device.
"""

from __future__ import annotations

import torch

from .. import _state8 as state8


def supports(device: torch.device) -> bool:
    return True


def unavailable_reason() -> str | None:
    return None


def _math_dtype(device: torch.device) -> torch.dtype:
    # Bias corrections are computed in double, as torch.optim computes them in
    # Python; MPS has no float64.
    return torch.float32 if device.type == "mps" else torch.float64


def _effective_scale(scale: float, scale_tensor: torch.Tensor | None):
    """scale * scale_tensor (fp32, on the device) or the plain float."""
    if scale_tensor is None:
        return scale
    return scale_tensor.reshape(()) * scale


def _skip_flag(found_inf: torch.Tensor | None) -> torch.Tensor | None:
    return None if found_inf is None else found_inf.reshape(()) != 0


def _commit(dst: torch.Tensor, new: torch.Tensor, skip: torch.Tensor | None) -> None:
    """dst = new, unless the window is skipped (then dst keeps its value)."""
    dst.copy_(new if skip is None else torch.where(skip, dst, new.to(dst.dtype)))


def accumulate_(*, buffers, grads, scale, scale_tensor, overwrite, found_inf):
    """accumkernels.ops.accumulate_."""
    s = _effective_scale(scale, scale_tensor)
    for buffer, grad in zip(buffers, grads):
        g = grad.float()
        if found_inf is not None and g.numel() > 0:
            torch.maximum(found_inf, (~torch.isfinite(g)).any().float().reshape(found_inf.shape), out=found_inf)
        if overwrite:
            buffer.copy_(g.reshape(buffer.shape) * s)
        else:
            buffer.add_(g.reshape(buffer.shape) * s)


_M32 = 0xFFFFFFFF


def _weights(param, master):
    """The fp32 weights: the master copy (master_or_param), the bf16 param
    joined with its int16 remainder, or the param."""
    if master is None:
        return param.float()
    if master.dtype == torch.int16:
        return join_remainder(param, master)
    return master_or_param(master, param)


def master_or_param(master: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """formulas.h's master_or_param: the fp32 master where it rounds (to
    nearest even) to the param's value, else the param's value (a write
    through ``p.data``, which only the step can see). Compared as values."""
    value = param.float()
    return torch.where(master.to(param.dtype).float() == value, master, value)


def _as_int16(bits: torch.Tensor) -> torch.Tensor:
    """16-bit patterns held in int64 -> an int16 tensor of those bits."""
    return torch.where(bits >= 0x8000, bits - 0x10000, bits).to(torch.int16)


def _as_float32(bits: torch.Tensor) -> torch.Tensor:
    """32-bit patterns held in int64 -> an fp32 tensor of those bits."""
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def join_remainder(param: torch.Tensor, remainder: torch.Tensor) -> torch.Tensor:
    """formulas.h's join_remainder: a bf16 param and its int16 remainder -> the fp32 master."""
    p = param.view(torch.int16).to(torch.int64) & 0xFFFF
    r = remainder.to(torch.int64) & 0xFFFF
    return _as_float32((((p - (r >> 15)) & 0xFFFF) << 16) | r)


def split_remainder(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """formulas.h's remainder_param and remainder_bits: fp32 w -> (bf16 param, int16 remainder)."""
    u = w.view(torch.int32).to(torch.int64) & _M32
    rounded = ((u >> 16) + ((u >> 15) & 1)) & 0xFFFF
    special = (u & 0x7F800000) == 0x7F800000
    nearest = w.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    param = _as_int16(torch.where(special, nearest, rounded)).view(torch.bfloat16)
    return param, _as_int16(u & 0xFFFF)


def sr_random(seed, stream, index):
    """formulas.h's sr_random: a murmur3-style hash of the seed, the tensor's
    stream id and the element's index in its memory order, in int64 arithmetic
    kept to 32 bits (the low 32 bits of a product do not depend on the high
    bits). Operators only, so that the same function serves torch tensors here
    and Triton blocks (triton/_formulas.py compiles it)."""
    x = ((index & 0xFFFFFFFF) * 0x9E3779B1) & 0xFFFFFFFF
    x = x ^ ((((index >> 32) & 0xFFFFFFFF) * 0x85EBCA77) & 0xFFFFFFFF)
    x = x ^ (((seed & 0xFFFFFFFF) * 0xC2B2AE3D) & 0xFFFFFFFF)
    x = x ^ (((stream & 0xFFFFFFFF) * 0x27D4EB2F) & 0xFFFFFFFF)
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    return x ^ (x >> 16)


def sr_slot_seed(seed: int, slot: int) -> int:
    """formulas.h's sr_slot_seed: the seed of rounding slot ``slot`` (0 the
    param, 1 the momentum buffer or exp_avg, 2 exp_avg_sq, 3 max_exp_avg_sq)."""
    return (seed + 0x9E3779B9) & 0xFFFFFFFF if slot in (1, 2) else seed


def sr_slot_shift(slot: int) -> int:
    """formulas.h's sr_slot_shift: slot ``slot`` uses the bits of its hash from this one up."""
    return 16 if slot >= 2 else 0


def memory_order_index(t: torch.Tensor) -> torch.Tensor:
    """Each element's index in the memory order of dense ``t`` (int64, t's shape):
    the element index the kernels hash for stochastic rounding."""
    flat = torch.arange(t.numel(), device=t.device, dtype=torch.int64)
    return flat.as_strided(t.shape, t.stride()) if t.numel() else flat.reshape(t.shape)


def float_to_bf16_stochastic(w: torch.Tensor, random: torch.Tensor) -> torch.Tensor:
    """w (fp32) rounded to bf16 with 16 random bits added below the bf16
    mantissa, then truncated; inf and NaN round to nearest."""
    bits = w.view(torch.int32).to(torch.int64) & _M32
    stochastic = (bits + (random & 0xFFFF)) >> 16
    nearest = w.to(torch.bfloat16).view(torch.int16).to(torch.int64) & 0xFFFF
    special = (bits & 0x7F800000) == 0x7F800000
    return _as_int16(torch.where(special, nearest, stochastic)).view(torch.bfloat16)


def _store_weights(param, master, new, skip, sr=None) -> None:
    """sr: (seed, stream id) to round bf16 params stochastically."""
    if master is not None and master.dtype == torch.int16:
        rounded, remainder = split_remainder(new.float())
        _commit(master, remainder, skip)
        _commit(param, rounded, skip)
    elif master is not None:
        _commit(master, new, skip)
        _commit(param, new, skip)
    elif sr is not None and param.dtype == torch.bfloat16:
        random = sr_random(sr[0], sr[1], memory_order_index(param))
        _commit(param, float_to_bf16_stochastic(new.float(), random), skip)
    else:
        _commit(param, new, skip)


def _store_state(state, new, skip, seed: int, stream: int, slot: int) -> None:
    """formulas.h's State::store: fp32 as is, bf16 rounded stochastically with
    the bits of rounding slot ``slot``."""
    if state.dtype == torch.bfloat16:
        random = sr_random(sr_slot_seed(seed, slot), stream, memory_order_index(state)) >> sr_slot_shift(slot)
        new = float_to_bf16_stochastic(new.float(), random)
    _commit(state, new, skip)


def _store_8bit(codes, scales, new, encode, skip, seed: int, stream: int, slot: int) -> None:
    """8-bit state: ``new`` encoded (accumkernels._state8), rounded
    stochastically with the bits of rounding slot ``slot``, in the codes'
    memory order (as a bf16 state tensor of that slot would be)."""
    index = torch.arange(codes.numel(), device=codes.device, dtype=torch.int64)
    random = sr_random(sr_slot_seed(seed, slot), stream, index) >> sr_slot_shift(slot)
    new_codes, new_scales = encode(new.float(), codes, random)
    _commit(codes, new_codes, skip)
    _commit(scales, new_scales, skip)


def _lerp(start, end, weight: float):
    """formulas.h's lerp: torch.lerp's two forms, chosen by the weight, without
    the fused multiply-add of torch's vectorized CPU loop (the kernels round twice)."""
    w = torch.tensor(weight, dtype=torch.float32).item()  # the weight as fp32, as the kernels hold it
    return start + w * (end - start) if w < 0.5 else end - (end - start) * (1.0 - w)


def _zero(buffers, zero_buffers: bool) -> None:
    if zero_buffers:
        for buffer in buffers:
            buffer.zero_()


def _stream(positions: list[int], i: int) -> int:
    return positions[i] if positions else i


def _stochastic(stochastic_rounding: bool, seed: int, positions: list[int], i: int):
    return (seed, _stream(positions, i)) if stochastic_rounding else None


def sgd_step_and_zero_(
    *,
    params,
    buffers,
    momentum_buffers,
    master_params,
    momentum_buffer_scales,
    lr,
    momentum,
    dampening,
    weight_decay,
    nesterov,
    is_first_step,
    grad_scale,
    grad_scale_tensor,
    found_inf,
    zero_buffers,
    stochastic_rounding,
    seed,
    positions,
):
    """torch.optim.SGD's update with g = grad_scale * buffer."""
    s = _effective_scale(grad_scale, grad_scale_tensor)
    skip = _skip_flag(found_inf)
    for i, (param, buffer) in enumerate(zip(params, buffers)):
        master = master_params[i] if master_params else None
        p = _weights(param, master)
        g = buffer.reshape(param.shape).float() * s  # fp32 sums, or gradients in the param's dtype
        if weight_decay != 0:
            g = g + weight_decay * p
        if momentum != 0:
            b = momentum_buffers[i]
            eight_bit = b.dtype == torch.uint8  # accumkernels._state8: codes and block scales
            if is_first_step:
                new_b = g
            else:
                old_b = state8.decode_exp_avg(b, momentum_buffer_scales[i]) if eight_bit else b.float()
                new_b = momentum * old_b + (1.0 - dampening) * g
            g = g + momentum * new_b if nesterov else new_b
            if eight_bit:
                _store_8bit(
                    b, momentum_buffer_scales[i], new_b, state8.encode_exp_avg, skip, seed, _stream(positions, i), 1
                )
            else:
                _store_state(b, new_b, skip, seed, _stream(positions, i), 1)
        _store_weights(param, master, p - lr * g, skip, _stochastic(stochastic_rounding, seed, positions, i))
    _zero(buffers, zero_buffers)


def _adam(
    adamw,
    *,
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
    s = _effective_scale(grad_scale, grad_scale_tensor)
    skip = _skip_flag(found_inf)
    for i, (param, buffer) in enumerate(zip(params, buffers)):
        master = master_params[i] if master_params else None
        m, v, step = exp_avgs[i], exp_avg_sqs[i], state_steps[i]
        p = _weights(param, master)
        g = buffer.reshape(param.shape).float() * s  # fp32 sums, or gradients in the param's dtype
        if weight_decay != 0:
            if adamw:
                p = p * (1.0 - lr * weight_decay)
            else:
                g = g + weight_decay * p
        new_step = step + 1
        t = new_step.to(_math_dtype(step.device))
        step_size = (lr / (1.0 - beta1**t)).float()
        bias_correction2_sqrt = torch.sqrt(1.0 - beta2**t).float()
        stream = _stream(positions, i)
        eight_bit = m.dtype == torch.uint8
        if eight_bit:  # accumkernels._state8: codes and block scales
            m_old = state8.decode_exp_avg(m, exp_avg_scales[i])
            v_old = state8.decode_exp_avg_sq(v, exp_avg_sq_scales[i])
        else:
            m_old, v_old = m.float(), v.float()
        new_m = _lerp(m_old, g, 1.0 - beta1)
        new_v = beta2 * v_old + (1.0 - beta2) * (g * g)
        v_hat = new_v
        if amsgrad:
            v_hat = torch.maximum(max_exp_avg_sqs[i].float(), new_v)
            _store_state(max_exp_avg_sqs[i], v_hat, skip, seed, stream, 3)
        denom = state8.sqrt_f32(v_hat) / bias_correction2_sqrt + eps
        new_p = p - step_size * (new_m / denom)
        if eight_bit:
            _store_8bit(m, exp_avg_scales[i], new_m, state8.encode_exp_avg, skip, seed, stream, 1)
            _store_8bit(v, exp_avg_sq_scales[i], new_v, state8.encode_exp_avg_sq, skip, seed, stream, 2)
        else:
            _store_state(m, new_m, skip, seed, stream, 1)
            _store_state(v, new_v, skip, seed, stream, 2)
        _commit(step, new_step, skip)
        _store_weights(param, master, new_p, skip, _stochastic(stochastic_rounding, seed, positions, i))
    _zero(buffers, zero_buffers)


def adam_step_and_zero_(**args):
    """torch.optim.Adam's update with g = grad_scale * buffer."""
    _adam(False, **args)


def adamw_step_and_zero_(**args):
    """torch.optim.AdamW's update with g = grad_scale * buffer."""
    _adam(True, **args)


def grad_norm(*, buffers):
    """sqrt(sum of x^2 over all elements of fp32, bf16 or fp16 buffers), summed in the math dtype, as fp32."""
    dtype = _math_dtype(buffers[0].device)
    norms = [torch.linalg.vector_norm(b.reshape(-1), dtype=dtype) for b in buffers]
    return torch.linalg.vector_norm(torch.stack(norms)).float()
