"""Data makers and float64 references shared by the tests."""

from __future__ import annotations

import functools
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

# A run through the wrapper on many ranks (or pipeline stages) sums the same
# micro-batch gradients as one process would, in another fp32 order. Compared
# with a whole reference run, that order's noise is amplified by the algorithm
# (Adam: lr / eps per unit of gradient where an element cancels to ~0) and fed
# back through the next windows' gradients, so no bound on the distance of two
# trajectories holds at every seed. Each window is checked on its own instead
# ("teacher-forced"): from the params the run held before it, the exact
# (float64) sum of the same micro-batch gradients and an exact optimizer state
# carried from window to window, the step the optimizer defines; the run's
# params after the window must lie within the error that fp32 arithmetic can
# make of it, bounded element by element (assert_windows_within_bound). Runs in
# bf16 add known roundings to that: a reduction across ranks in bf16, and params
# and state stored in bf16 (to nearest: half an ulp, 2^-8 of the value;
# stochastically: under one ulp, 2^-7); their gradients are computed by the same
# ops in bf16, so these are the gradients the check is given.

U32 = 2.0**-24  # fp32 unit roundoff
U_BF16 = 2.0**-8  # bf16 unit roundoff (to nearest); stochastic rounding: 2 * U_BF16


def gamma(k: int, u: float = U32) -> float:
    """Higham's gamma_k = k u / (1 - k u): a sum of k + 1 terms in any order,
    each addition rounded with unit roundoff u, is within gamma_k * sum |terms|
    of the exact sum."""
    return k * u / (1 - k * u)


def rel_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    """max over tensors of max|a - b| / max|b|."""
    return max(
        ((x.double() - y.double()).abs().max() / y.double().abs().max().clamp_min(1e-12)).item() for x, y in zip(a, b)
    )


def gradients_at(model, params, losses) -> list[list[torch.Tensor]]:
    """Each of ``losses``' gradients (callables of ``model``) with the model's
    params set to ``params``; zeros for a param a loss does not use."""
    with torch.no_grad():
        for p, value in zip(model.parameters(), params):
            p.copy_(value)
    grads = []
    for loss in losses:
        got = torch.autograd.grad(loss(model), list(model.parameters()), allow_unused=True)
        grads.append([torch.zeros_like(p) if g is None else g for p, g in zip(model.parameters(), got)])
    return grads


def _window_gradient(micro_grads, divisor, reduce_error=0.0):
    """The exact window gradient (sum of the micro-batch gradients / divisor)
    and the bound on fp32's: n - 1 additions in any order (across ranks too),
    the scaling by 1 / divisor and its own rounding, <= gamma_{n+2} sum |g_i| / divisor;
    plus ``reduce_error`` sum |g_i| / divisor where the ranks' gradients were
    reduced in a lower precision (its gamma) before the fp32 sum."""
    n = len(micro_grads)
    exact = [sum(g[i].double() for g in micro_grads) / divisor for i in range(len(micro_grads[0]))]
    relative = gamma(n + 2) + reduce_error
    error = [relative * sum(g[i].double().abs() for g in micro_grads) / divisor for i in range(len(exact))]
    return exact, error


def exact_window_norm(micro_grads, divisor) -> float:
    """The L2 norm of the exact window gradient (float64; see _window_gradient)."""
    exact, _ = _window_gradient(micro_grads, divisor)
    return torch.cat([g.flatten() for g in exact]).norm().item()


def _clipped(grad, error, max_norm):
    """clip_grad_norm_'s c = min(1, max_norm / (norm + 1e-6)) applied to the
    exact gradient, and the bound on fp32's c * g: its norm is of a gradient
    within ``error`` (|norm' - norm| <= ||error||) computed in fp32 (relative
    gamma_{numel+2}), c is monotone in the norm, and c's and the product's roundings."""
    norm = torch.cat([g.flatten() for g in grad]).norm().item()
    spread = torch.cat([e.flatten() for e in error]).norm().item()
    numel = sum(g.numel() for g in grad)

    def coef(x):
        return min(1.0, max_norm / (max(x, 0.0) + 1e-6))

    c = coef(norm)
    low, high = coef((norm + spread) * (1 + gamma(numel + 2))), coef((norm - spread) * (1 - gamma(numel + 2)))
    dc = max(high - c, c - low) + 3 * U32 * c
    return [c * g for g in grad], [c * e + (dc + U32 * (c + dc)) * (g.abs() + e) for g, e in zip(grad, error)]


def _adamw_window(p, g, dg, state, h):
    """AdamW from exact params ``p`` and gradient ``g``: the exact new params
    and the bound on fp32's. The moments' errors carry from window to window
    (``state``: exact m, v and their bounds); the update m^/(sqrt(v^) + eps)
    moves by at most (|dm^| + |m^| ds / (s + eps)) / (max(s - ds, 0) + eps),
    s = sqrt(v^), ds = |sqrt(v^') - s| <= min(sqrt(dv^), dv^ / s); then the
    roundings of the update (8 u of it) and of the param's two operations."""
    b1, b2 = h["betas"]
    t = state["step"] = state.get("step", 0) + 1
    m, v = state.get("m", torch.zeros_like(p)), state.get("v", torch.zeros_like(p))
    dm, dv = state.get("dm", torch.zeros_like(p)), state.get("dv", torch.zeros_like(p))
    ga = g.abs() + dg
    dm = b1 * dm + (1 - b1) * dg + 3 * U32 * (b1 * (m.abs() + dm) + (1 - b1) * ga)
    dv = b2 * dv + (1 - b2) * (2 * g.abs() * dg + dg * dg) + 4 * U32 * (b2 * (v + dv) + (1 - b2) * ga * ga)
    m, v = b1 * m + (1 - b1) * g, b2 * v + (1 - b2) * g * g
    state.update(m=m, v=v, dm=dm, dv=dv)
    bc1, bc2 = 1 - b1**t, 1 - b2**t
    mh, dmh = m / bc1, dm / bc1 + 3 * U32 * (m.abs() + dm) / bc1
    vh, dvh = v / bc2, dv / bc2 + 3 * U32 * (v + dv) / bc2
    s = vh.sqrt()
    ds = torch.minimum(dvh.sqrt(), torch.where(s > 0, dvh / s.clamp_min(1e-300), math.inf))
    eps = h["eps"]
    update = mh / (s + eps)
    dupdate = (dmh + mh.abs() * ds / (s + eps)) / ((s - ds).clamp_min(0) + eps)
    dupdate = dupdate + 8 * U32 * (update.abs() + dupdate)
    lr = h["lr"]
    new = p * (1 - lr * h["weight_decay"]) - lr * update
    return new, lr * dupdate + 4 * U32 * (p.abs() + new.abs() + lr * update.abs())


def _sgd_window(p, g, dg, state, h, state_roundoff=0.0):
    """SGD with momentum (torch's, dampening 0): b = mu b + g + wd p, p - lr b;
    b's error carries from window to window, with its storage's rounding
    (``state_roundoff`` of it) where b is held in a lower precision."""
    mu, wd, lr = h["momentum"], h["weight_decay"], h["lr"]
    d = g + wd * p
    dd = dg + 2 * U32 * (wd * p).abs()
    if "b" not in state:
        b, db = d, dd + U32 * (d.abs() + dd)
    else:
        b = mu * state["b"] + d
        db = mu * state["db"] + dd + 3 * U32 * (mu * (state["b"].abs() + state["db"]) + d.abs() + dd)
    db = db + state_roundoff * (b.abs() + db)
    state.update(b=b, db=db)
    new = p - lr * b
    return new, lr * db + 3 * U32 * (p.abs() + new.abs() + lr * b.abs())


def _step_rule(optimizer: torch.optim.Optimizer, state_roundoff: float):
    """The window rule for ``optimizer``'s type and its hyperparameters (one group)."""
    (h,) = optimizer.param_groups
    if isinstance(optimizer, torch.optim.AdamW) and not (h["amsgrad"] or h["maximize"] or state_roundoff):
        return _adamw_window, h
    if isinstance(optimizer, torch.optim.SGD) and not (h["nesterov"] or h["dampening"] or h["maximize"]):
        return functools.partial(_sgd_window, state_roundoff=state_roundoff), h
    raise NotImplementedError(
        f"no window bound for {type(optimizer).__name__} with {h} (state_roundoff {state_roundoff})"
    )


def assert_windows_within_bound(
    trajectory, window_gradients, optimizer, clip=None, *, reduce_error=0.0, param_roundoff=0.0, state_roundoff=0.0
) -> None:
    """``trajectory``: the run's params before its first window and after each;
    ``window_gradients(w, params)``: window w's micro-batch gradients at
    ``params`` (each a list over params, as the ranks computed them: the same
    ops on the same params give the same bits) and the divisor of their sum;
    ``optimizer``: a torch optimizer of the run's type and hyperparameters.
    Every window's step is within the fp32 error bound of the exact step from
    the params the run held (module comment above), widened by the run's
    lower-precision roundings: ``reduce_error`` (relative to sum |g_i|) of the
    gradients' reduction across ranks, ``param_roundoff`` and ``state_roundoff``
    (relative) of storing the new params and the momentum."""
    rule, h = _step_rule(optimizer, state_roundoff)
    states = None
    for w, (before, after) in enumerate(zip(trajectory, trajectory[1:])):
        threads = torch.get_num_threads()
        torch.set_num_threads(1)  # as the ranks (tests/distributed_worker.py's run_cases)
        try:
            micro_grads, divisor = window_gradients(w, before)
        finally:
            torch.set_num_threads(threads)
        grad, error = _window_gradient(micro_grads, divisor, reduce_error)
        if clip:
            grad, error = _clipped(grad, error, clip)
        states = states or [{} for _ in before]
        for i, (p, g, dg) in enumerate(zip(before, grad, error)):
            expected, bound = rule(p.double(), g, dg, states[i], h)
            bound = bound + param_roundoff * (expected.abs() + bound)
            err = (after[i].double() - expected).abs()
            worst = (err / (bound + 1e-300)).max().item()
            assert worst <= 1.0, (
                f"window {w}, param {i}: {err.max().item():.3g} from the exact step, "
                f"{worst:.3g} x the fp32 bound (largest bound {bound.max().item():.3g})"
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
