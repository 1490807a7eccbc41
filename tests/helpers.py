"""Data makers and float64 references shared by the tests."""

from __future__ import annotations

import math

import torch

DTYPE_IDS = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
# Sizes that cross no boundary, one element, odd primes, and primes around the
# CPU chunk size (65536) so that chunks split inside and across tensors.
SIZES = [0, 1, 7, 127, 1021, 65521, 65537, 200003]


def ulp(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).eps


def randn(n: int, dtype: torch.dtype, *, offset: int = 0, scale: float = 1.0) -> torch.Tensor:
    """n random values of ``dtype``; with ``offset`` > 0 a view starting ``offset``
    elements into its storage (so the data is not 16-byte aligned)."""
    base = torch.randn(n + offset, dtype=torch.float32) * scale
    return base.to(dtype)[offset:]


def random_sizes(count: int, max_size: int = 5000) -> list[int]:
    sizes = torch.randint(0, max_size, (count,)).tolist()
    # A few empties and singletons among them.
    for i in range(0, count, 7):
        sizes[i] = i % 2
    return sizes


def assert_fp32_close(actual: torch.Tensor, expected64: torch.Tensor, magnitude64: torch.Tensor, ulps: float = 4):
    """|actual - expected| <= ulps * eps32 * magnitude, elementwise, where
    ``magnitude`` bounds the size of the terms that were rounded."""
    assert actual.dtype == torch.float32
    err = (actual.double() - expected64).abs()
    bound = ulps * ulp(torch.float32) * magnitude64 + 1e-30
    worst = (err / bound).max().item() if err.numel() else 0.0
    assert worst <= 1.0, f"error {worst:.2f}x the bound of {ulps} fp32 ulps of the terms"


def assert_rounded_close(actual: torch.Tensor, expected64: torch.Tensor, magnitude64: torch.Tensor, ulps32: float = 16):
    """A low-precision result equals the float64 value rounded to its dtype, to
    one unit in its last place plus the fp32 math error (``ulps32`` fp32 ulps of
    ``magnitude``, the size of the rounded terms), which may carry the value
    across a rounding boundary."""
    err = (actual.double() - expected64).abs()
    tol = (
        ulp(actual.dtype) * expected64.abs()
        + ulps32 * ulp(torch.float32) * magnitude64
        + torch.finfo(actual.dtype).tiny
    )
    bad = err > tol
    assert not bad.any(), (
        f"{int(bad.sum())} elements off by more than one {actual.dtype} ulp; max err {err.max().item()}"
    )


# ---- float64 references of the formulas (independent of the package) -------


def sgd64(p, g, b, *, lr, momentum, dampening, weight_decay, nesterov, first):
    if weight_decay:
        g = g + weight_decay * p
    if momentum:
        b = g.clone() if first else momentum * b + (1 - dampening) * g
        g = g + momentum * b if nesterov else b
    return p - lr * g, b


def adam64(p, g, m, v, vmax, step, *, lr, beta1, beta2, eps, weight_decay, amsgrad, adamw):
    if weight_decay:
        if adamw:
            p = p * (1 - lr * weight_decay)
        else:
            g = g + weight_decay * p
    m = beta1 * m + (1 - beta1) * g
    v = beta2 * v + (1 - beta2) * g * g
    if amsgrad:
        vmax = torch.maximum(vmax, v)
        v_hat = vmax
    else:
        v_hat = v
    step_size = lr / (1 - beta1**step)
    denom = v_hat.sqrt() / math.sqrt(1 - beta2**step) + eps
    p = p - step_size * m / denom
    return p, m, v, vmax, step_size / denom


# ---- runs against a reference run ----------------------------------------------

# A run through the wrapper sums the same gradients as the reference in another
# fp32 order (per micro-batch, across ranks), so it may differ from it by what
# the optimizer makes of fp32 summation noise: for Adam up to lr per element
# where a gradient element cancels to ~0. That sensitivity is the algorithm's,
# measured on the reference itself: the same run with the terms summed in other
# orders (the largest distance of those from it). The wrapper's order is one
# more: it may be NOISE_FACTOR times as far, and always STEP_ULPS fp32 ulps per
# step (the fused step's own operation order).
NOISE_FACTOR = 8
STEP_ULPS = 8


def rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """max over tensors of max|a - b| / max|b|."""
    return max(
        ((x.double() - y.double()).abs().max() / y.double().abs().max().clamp_min(1e-12)).item() for x, y in zip(a, b)
    )


def assert_within_summation_noise(ours, reference, alternates, steps: int) -> None:
    """``alternates``: the reference's run with its sums in other orders."""
    noise = max(rel_diff(alternate, reference) for alternate in alternates)
    bound = max(NOISE_FACTOR * noise, STEP_ULPS * steps * ulp(torch.float32))
    got = rel_diff(ours, reference)
    assert got <= bound, (
        f"{got:.3g} from the reference, more than {NOISE_FACTOR} x its own summation-order "
        f"noise {noise:.3g} (or {STEP_ULPS} ulps a step)"
    )
