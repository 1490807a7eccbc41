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


def opcheck_cases(device="cpu"):
    """(op name, arguments) for torch.library.opcheck: every op, its options
    (scale tensor, inf flag, master weights, remainders, bf16 and 8-bit state),
    on tensors of ``device``."""

    def lists(dtype=torch.float32):
        return [torch.randn(37, device=device, dtype=dtype), torch.randn(5, 3, device=device, dtype=dtype)]

    scale = torch.tensor([0.5], device=device)
    found = torch.zeros(1, device=device)
    steps = [torch.tensor(2.0, device=device), torch.tensor(0.0, device=device)]
    yield "accumulate_", (lists(), lists(torch.bfloat16), 2.0, None, False, found)
    yield "accumulate_", (lists(), lists(torch.float16), 1.0, scale, True, None)
    yield (
        "sgd_step_and_zero_",
        (
            lists(torch.bfloat16),
            lists(),
            lists(),
            lists(),
            [],
            0.1,
            0.9,
            0.0,
            0.01,
            True,
            False,
            -1.0,
            scale,
            found,
            True,
            False,
            0,
            [],
        ),
    )
    yield (
        "sgd_step_and_zero_",
        (
            lists(torch.bfloat16),
            lists(),
            [],
            [],
            [],
            0.1,
            0.0,
            0.0,
            0.0,
            False,
            False,
            1.0,
            None,
            None,
            False,
            True,
            2**32 - 1,
            [3, 9],
        ),
    )
    for op in ("adam_step_and_zero_", "adamw_step_and_zero_"):
        yield (
            op,
            (
                lists(),
                lists(),
                lists(),
                [t.abs() for t in lists()],
                [t.abs() for t in lists()],
                steps,
                [],
                [],
                [],
                1e-3,
                0.9,
                0.999,
                1e-8,
                0.01,
                True,
                -1.0,
                scale,
                found,
                True,
                False,
                0,
                [],
            ),
        )
        yield (
            op,
            (
                lists(torch.bfloat16),
                lists(),
                lists(),
                [t.abs() for t in lists()],
                [],
                steps,
                [],
                [],
                [],
                1e-3,
                0.9,
                0.999,
                1e-8,
                0.0,
                False,
                1.0,
                None,
                None,
                False,
                True,
                7,
                [1, 0],
            ),
        )
    # bf16 state, and int16 remainders of bf16 params
    rems = [torch.zeros(37, device=device, dtype=torch.int16), torch.zeros(5, 3, device=device, dtype=torch.int16)]
    yield (
        "sgd_step_and_zero_",
        (
            lists(torch.bfloat16),
            lists(),
            lists(torch.bfloat16),
            rems,
            [],
            0.1,
            0.9,
            0.0,
            0.01,
            False,
            False,
            1.0,
            None,
            found,
            True,
            False,
            3,
            [],
        ),
    )
    yield (
        "adamw_step_and_zero_",
        (
            lists(),
            lists(),
            lists(torch.bfloat16),
            [t.abs() for t in lists(torch.bfloat16)],
            [],
            steps,
            [],
            [],
            [],
            1e-3,
            0.9,
            0.999,
            1e-8,
            0.01,
            False,
            1.0,
            scale,
            None,
            True,
            False,
            5,
            [],
        ),
    )

    # 8-bit state: uint8 codes and a scale per block of 256 (37 and 15 elements: one block each)
    def codes():
        return [
            torch.randint(0, 249, (37,), device=device, dtype=torch.uint8),
            torch.randint(0, 249, (5, 3), device=device, dtype=torch.uint8),
        ]

    def block_scales():
        return [torch.rand(1, device=device), torch.rand(1, device=device)]

    yield (
        "adamw_step_and_zero_",
        (lists(torch.bfloat16), lists(), codes(), codes(), [], steps, [], block_scales(), block_scales())
        + (1e-3, 0.9, 0.999, 1e-8, 0.01, False, 1.0, scale, found, True, True, 5, []),
    )
    yield (
        "sgd_step_and_zero_",
        (lists(torch.bfloat16), lists(), codes(), [], block_scales())
        + (0.1, 0.9, 0.0, 0.01, False, False, 1.0, None, found, True, True, 3, []),
    )
    yield "grad_norm", (lists(),)
    yield "grad_norm", (lists() + lists(torch.bfloat16) + lists(torch.float16),)
