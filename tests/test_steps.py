"""sgd/adam/adamw step-and-zero: against float64 formulas, against torch.optim
over several steps (params and every state tensor), the found_inf skip, and
master weights for low-precision params."""

from __future__ import annotations

import itertools

import pytest
import torch
from helpers import DTYPE_IDS, adam64, assert_fp32_close, assert_rounded_close, randn, sgd64

import accumkernels as ak

PARAM_CASES = [
    (torch.float32, False),
    (torch.bfloat16, False),
    (torch.bfloat16, True),
    (torch.float16, False),
    (torch.float16, True),
]
PARAM_IDS = [f"{DTYPE_IDS[d]}{'-master' if m else ''}" for d, m in PARAM_CASES]
SIZES = [0, 1, 31, 65537, 70001]


def _f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


def _make_params(dtype, with_master, sizes):
    """Random params of ``dtype``; with masters, the params are the masters
    rounded to nearest, except every 7th element, written since (as through
    ``p.data``): the step starts there from the param (master_or_param)."""
    weights = [randn(n, torch.float32, offset=i % 2) for i, n in enumerate(sizes)]
    if not with_master:
        return [w.to(dtype) for w in weights], None
    masters = [w + randn(w.numel(), torch.float32) * 1e-3 for w in weights]
    params = [m.to(dtype) for m in masters]
    for p in params:
        p[::7] *= -0.5  # exact in the param's dtype, and no longer the rounded master
    return params, masters


def _weights64(params, masters, i):
    """The weights a step starts from (float64): the master where its param
    holds it rounded, else the param."""
    if not masters:
        return params[i].double()
    held = masters[i].to(params[i].dtype) == params[i]
    return torch.where(held, masters[i], params[i].float()).double()


def _check_weights(params, masters, i, expected64, magnitude64):
    if masters:
        assert_fp32_close(masters[i], expected64, magnitude64, ulps=16)
        assert torch.equal(params[i], masters[i].to(params[i].dtype)), "param must be the rounded master"
    elif params[i].dtype == torch.float32:
        assert_fp32_close(params[i], expected64, magnitude64, ulps=16)
    else:
        assert_rounded_close(params[i], expected64, magnitude64)


SGD_CASES = [
    dict(momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, first=False, maximize=False),
    dict(momentum=0.9, dampening=0.0, weight_decay=0.0, nesterov=False, first=True, maximize=False),
    dict(momentum=0.9, dampening=0.1, weight_decay=0.01, nesterov=False, first=False, maximize=True),
    dict(momentum=0.8, dampening=0.0, weight_decay=0.05, nesterov=True, first=False, maximize=False),
    dict(momentum=0.8, dampening=0.0, weight_decay=0.0, nesterov=True, first=True, maximize=False),
]


def _sgd_id(c):
    return "-".join(k + (str(v) if not isinstance(v, bool) else "") for k, v in c.items() if v)


@pytest.mark.parametrize("case", SGD_CASES, ids=[_sgd_id(c) or "plain" for c in SGD_CASES])
@pytest.mark.parametrize("dtype,with_master", PARAM_CASES, ids=PARAM_IDS)
def test_sgd_matches_float64(backend, dtype, with_master, case):
    params, masters = _make_params(dtype, with_master, SIZES)
    buffers = [randn(p.numel(), torch.float32, offset=1) for p in params]
    moms = [randn(p.numel(), torch.float32) for p in params] if case["momentum"] else None
    moms_before = [m.double() for m in moms] if moms else None
    grad_scale, lr = 0.37, 0.05
    expected = []
    for i in range(len(params)):
        g = buffers[i].double() * _f32(grad_scale) * (-1 if case["maximize"] else 1)
        p64 = _weights64(params, masters, i)
        b64 = moms[i].double() if moms else None
        hyper = {k: case[k] for k in ("momentum", "dampening", "weight_decay", "nesterov")}
        new_p, new_b = sgd64(p64, g, b64, lr=lr, first=case["first"], **hyper)
        g_decayed = g.abs() + case["weight_decay"] * p64.abs()
        expected.append((new_p, new_b, p64.abs() + (lr * 4 * g).abs() + (new_p - p64).abs() * 4, g_decayed))
    ak.sgd_step_and_zero_(
        params,
        buffers,
        moms,
        lr=lr,
        momentum=case["momentum"],
        dampening=case["dampening"],
        weight_decay=case["weight_decay"],
        nesterov=case["nesterov"],
        maximize=case["maximize"],
        is_first_step=case["first"],
        grad_scale=grad_scale,
        master_params=masters,
        backend=backend,
    )
    for i, (new_p, new_b, mag, gmag) in enumerate(expected):
        _check_weights(params, masters, i, new_p, mag)
        if moms:
            old_b = moms_before[i].abs() * case["momentum"]
            assert_fp32_close(moms[i], new_b, new_b.abs() + gmag + old_b, ulps=8)
        assert not buffers[i].any(), "buffers must be zeroed"


ADAM_CASES = list(itertools.product([False, True], [False, True], [0.0, 0.1], [False, True]))


@pytest.mark.parametrize(
    "adamw,amsgrad,weight_decay,maximize",
    ADAM_CASES,
    ids=[
        f"{'adamw' if a else 'adam'}{'-amsgrad' if s else ''}{'-wd' if w else ''}{'-max' if m else ''}"
        for a, s, w, m in ADAM_CASES
    ],
)
@pytest.mark.parametrize("dtype,with_master", PARAM_CASES, ids=PARAM_IDS)
def test_adam_matches_float64(backend, dtype, with_master, adamw, amsgrad, weight_decay, maximize):
    params, masters = _make_params(dtype, with_master, SIZES)
    buffers = [randn(p.numel(), torch.float32, offset=1) for p in params]
    exp_avgs = [randn(p.numel(), torch.float32) * 0.1 for p in params]
    exp_avg_sqs = [randn(p.numel(), torch.float32).abs() * 0.01 for p in params]
    max_sqs = [randn(p.numel(), torch.float32).abs() * 0.01 for p in params] if amsgrad else None
    steps = [torch.tensor(float(s)) for s in torch.randint(0, 50, (len(params),)).tolist()]
    lr, betas, eps, grad_scale = 1e-2, (0.9, 0.999), 1e-8, torch.tensor([0.5])
    expected = []
    for i in range(len(params)):
        g = buffers[i].double() * 0.5 * (-1 if maximize else 1)
        p64 = _weights64(params, masters, i)
        out = adam64(
            p64,
            g,
            exp_avgs[i].double(),
            exp_avg_sqs[i].double(),
            max_sqs[i].double() if max_sqs else None,
            steps[i].item() + 1,
            lr=lr,
            beta1=betas[0],
            beta2=betas[1],
            eps=eps,
            weight_decay=weight_decay,
            amsgrad=amsgrad,
            adamw=adamw,
        )
        # Sizes of the rounded terms: g (with the decay term for Adam), m's
        # terms, and m's rounding error carried through the update.
        gmag = g.abs() if adamw else g.abs() + weight_decay * p64.abs()
        mmag = exp_avgs[i].double().abs() + gmag
        expected.append((out, gmag, mmag, p64))
    old_steps = [s.item() for s in steps]
    fn = ak.adamw_step_and_zero_ if adamw else ak.adam_step_and_zero_
    fn(
        params,
        buffers,
        exp_avgs,
        exp_avg_sqs,
        steps,
        max_exp_avg_sqs=max_sqs,
        lr=lr,
        betas=betas,
        eps=eps,
        weight_decay=weight_decay,
        amsgrad=amsgrad,
        maximize=maximize,
        grad_scale=grad_scale,
        master_params=masters,
        backend=backend,
    )
    for i, ((p, m, v, vmax, rate), gmag, mmag, p64) in enumerate(expected):
        _check_weights(params, masters, i, p, p64.abs() + 4 * (p - p64).abs() + rate * mmag)
        assert_fp32_close(exp_avgs[i], m, mmag)
        assert_fp32_close(exp_avg_sqs[i], v, v.abs() + gmag * gmag)
        if amsgrad:
            assert_fp32_close(max_sqs[i], vmax, vmax.abs() + gmag * gmag)
        assert steps[i].item() == old_steps[i] + 1
        assert not buffers[i].any(), "buffers must be zeroed"


def _torch_optimizer(kind, params, **hyper):
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[kind]
    return cls(params, foreach=False, **hyper)


TORCH_CASES = [
    ("sgd", dict(lr=0.1)),
    ("sgd", dict(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=1e-2)),
    ("sgd", dict(lr=0.1, momentum=0.9, nesterov=True, maximize=True)),
    ("adam", dict(lr=1e-2)),
    ("adam", dict(lr=1e-2, weight_decay=0.1, amsgrad=True, maximize=True)),
    ("adamw", dict(lr=1e-2)),
    ("adamw", dict(lr=1e-2, betas=(0.8, 0.99), weight_decay=0.3, amsgrad=True)),
]


def _ours(kind, params, buffers, state, step_index, hyper, backend):
    h = dict(hyper)
    if kind == "sgd":
        momentum = h.get("momentum", 0.0)
        ak.sgd_step_and_zero_(
            params,
            buffers,
            state["momentum_buffer"] if momentum else None,
            lr=h["lr"],
            momentum=momentum,
            dampening=h.get("dampening", 0.0),
            weight_decay=h.get("weight_decay", 0.0),
            nesterov=h.get("nesterov", False),
            maximize=h.get("maximize", False),
            is_first_step=step_index == 0,
            backend=backend,
        )
    else:
        fn = ak.adam_step_and_zero_ if kind == "adam" else ak.adamw_step_and_zero_
        fn(
            params,
            buffers,
            state["exp_avg"],
            state["exp_avg_sq"],
            state["step"],
            max_exp_avg_sqs=state["max_exp_avg_sq"] if h.get("amsgrad") else None,
            lr=h["lr"],
            betas=h.get("betas", (0.9, 0.999)),
            weight_decay=h.get("weight_decay", 0.0 if kind == "adam" else 1e-2),
            amsgrad=h.get("amsgrad", False),
            maximize=h.get("maximize", False),
            backend=backend,
        )


@pytest.mark.parametrize("kind,hyper", TORCH_CASES, ids=[f"{k}-{'-'.join(map(str, h))}" for k, h in TORCH_CASES])
def test_parity_with_torch_optim(backend, kind, hyper):
    sizes = [1, 33, 65537, 4099]
    theirs = [torch.randn(n) for n in sizes]
    ours = [p.clone() for p in theirs]
    opt = _torch_optimizer(kind, [torch.nn.Parameter(p) for p in theirs], **hyper)
    params = opt.param_groups[0]["params"]
    state = {
        "momentum_buffer": [torch.zeros(n) for n in sizes],
        "exp_avg": [torch.zeros(n) for n in sizes],
        "exp_avg_sq": [torch.zeros(n) for n in sizes],
        "max_exp_avg_sq": [torch.zeros(n) for n in sizes],
        "step": [torch.tensor(0.0) for _ in sizes],
    }
    # Adam's L2 weight decay computes g = (-)grad + wd * p, rounded. Where that cancels to near
    # zero, the step lr * g / (|g| + eps) (at the first step; m / (sqrt(v) + eps) later) has a
    # slope of lr * eps / (|g| + eps)^2 in g, up to lr / eps: the last-bit rounding of g
    # (2^-24 * wd * |p|, ~1e-9) then moves the step by up to a sizable fraction of lr, and two
    # correct orders of rounding differ by that much. Such elements (|g| < 1e-5 at some step: a
    # few per run) are held to lr, the size of a step; the rest to 2e-6.
    # A param difference d allowed there feeds the next step's decayed gradient as wd * d, so the
    # state inherits it: exp_avg by (1 - beta1) * wd * d a step, decaying by beta1 after (at most
    # wd * lr in all); exp_avg_sq by (1 - beta2) * wd * d * (2 |g| + wd * d); max_exp_avg_sq by the
    # largest exp_avg_sq difference so far. ``inherited`` carries that bound per element, from the
    # measured d, zero wherever the params are held to 2e-6; the state is held to 2e-6 plus it.
    ill_conditioned = [torch.zeros(n, dtype=torch.bool) for n in sizes]
    wd = hyper.get("weight_decay", 0.0) if kind == "adam" else 0.0
    beta1, beta2 = hyper.get("betas", (0.9, 0.999))
    inherited = [{key: torch.zeros(n, dtype=torch.float64) for key in state} for n in sizes]
    for step_index in range(5):
        grads = [torch.randn(n) for n in sizes]
        for p, g, ill, ours_p, carry in zip(params, grads, ill_conditioned, ours, inherited):
            p.grad = g.clone()
            if wd:
                decayed = (-g if hyper.get("maximize") else g) + wd * p.detach()
                d = torch.where(ill, (ours_p - p.detach()).abs(), 0).double()
                carry["exp_avg"] = beta1 * carry["exp_avg"] + (1 - beta1) * wd * d
                carry["exp_avg_sq"] = beta2 * carry["exp_avg_sq"] + (1 - beta2) * wd * d * (2 * decayed.abs() + wd * d)
                carry["max_exp_avg_sq"] = torch.maximum(carry["max_exp_avg_sq"], carry["exp_avg_sq"])
                ill |= decayed.abs() < 1e-5
        opt.step()
        buffers = [g.clone() for g in grads]
        _ours(kind, ours, buffers, state, step_index, hyper, backend)
        for i, p in enumerate(params):
            ill = ill_conditioned[i]
            torch.testing.assert_close(ours[i][~ill], p.detach()[~ill], rtol=2e-6, atol=2e-6)
            torch.testing.assert_close(ours[i][ill], p.detach()[ill], rtol=0, atol=hyper["lr"])
            for key, value in opt.state[p].items():
                if value is None:
                    continue
                error = (state[key][i].double() - value.double()).abs()
                bound = 2e-6 + 2e-6 * value.double().abs() + inherited[i][key]
                assert (error <= bound).all(), (
                    f"state {key}: worst error {(error - bound).max().item():.3g} above its bound "
                    f"at {(error > bound).nonzero().flatten()[:5].tolist()}"
                )


@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_found_inf_skips_and_still_zeroes(backend, kind):
    params = [torch.randn(n).bfloat16() for n in (5, 70001)]
    masters = [p.float() for p in params]
    buffers = [torch.randn(p.numel()) for p in params]
    state = [torch.randn(p.numel()).abs() for p in params]
    state2 = [torch.randn(p.numel()).abs() for p in params]
    steps = [torch.tensor(3.0) for _ in params]
    before = [t.clone() for t in params + masters + state + state2 + steps]
    found_inf = torch.ones(1)
    if kind == "sgd":
        ak.sgd_step_and_zero_(
            params,
            buffers,
            state,
            lr=0.1,
            momentum=0.9,
            weight_decay=0.1,
            found_inf=found_inf,
            master_params=masters,
            backend=backend,
        )
    else:
        fn = ak.adam_step_and_zero_ if kind == "adam" else ak.adamw_step_and_zero_
        fn(
            params,
            buffers,
            state,
            state2,
            steps,
            lr=0.1,
            weight_decay=0.1,
            found_inf=found_inf,
            master_params=masters,
            backend=backend,
        )
    for b, a in zip(before, params + masters + state + state2 + steps):
        assert torch.equal(a, b), "a skipped step must leave params, masters, state and steps untouched"
    assert all(not b.any() for b in buffers), "a skipped step still clears the buffers"


GRAD_STATES = [torch.float32, torch.bfloat16, "8bit"]


def _step_from(kind, backend, params, buffers, state_dtype, zero_buffers, found_inf=None):
    """Two steps of ``kind`` over copies of ``params`` from ``buffers`` (kept as
    given: the second step reads what the first left), with fresh state of
    ``state_dtype``; returns the params and every state tensor."""
    params = [p.clone() for p in params]
    eight = state_dtype == "8bit"
    dtype = torch.uint8 if eight else state_dtype
    first = [torch.zeros(p.numel(), dtype=dtype) for p in params]
    second = [torch.zeros(p.numel(), dtype=dtype) for p in params]
    scales = [[torch.zeros(-(-p.numel() // 256)) for p in params] for _ in range(2)] if eight else [None, None]
    steps = [torch.zeros(()) for _ in params]
    for k in range(2):
        common = dict(
            grad_scale=torch.tensor([0.75]),
            found_inf=found_inf,
            zero_buffers=zero_buffers,
            stochastic_rounding=True,
            seed=5 + k,
            backend=backend,
        )
        if kind == "sgd":
            ak.sgd_step_and_zero_(
                params,
                buffers,
                first,
                momentum_buffer_scales=scales[0],
                lr=0.1,
                momentum=0.9,
                weight_decay=0.01,
                is_first_step=k == 0,
                **common,
            )
        else:
            ak.adamw_step_and_zero_(
                params,
                buffers,
                first,
                second,
                steps,
                exp_avg_scales=scales[0],
                exp_avg_sq_scales=scales[1],
                lr=0.01,
                weight_decay=0.1,
                **common,
            )
    return params + first + second + [s for ss in scales if ss for s in ss]


@pytest.mark.parametrize("state_dtype", GRAD_STATES, ids=["fp32-state", "bf16-state", "8bit-state"])
@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_gradients_of_the_param_dtype_step_as_their_fp32_values(backend, kind, state_dtype):
    """A window of one micro-batch holds no fp32 buffer: the step reads each
    param's gradient in its own dtype. bf16 and fp16 values are exact in fp32,
    so the result (params, state, 8-bit codes and scales) equals, bit for bit,
    the same backend's step from the fp32 copies of those gradients; the
    gradients are left as they are (zero_buffers=False), or cleared."""
    dtypes = [torch.float32, torch.bfloat16, torch.float16, torch.bfloat16]
    sizes = [33, 70001, 1000, 257]
    params = [randn(n, torch.float32).to(d) for n, d in zip(sizes, dtypes)]
    grads = [randn(n, torch.float32, offset=i % 2).to(d) for i, (n, d) in enumerate(zip(sizes, dtypes))]
    wide = [g.float() for g in grads]
    kept = [g.clone() for g in grads]
    ours = _step_from(kind, backend, params, grads, state_dtype, zero_buffers=False)
    theirs = _step_from(kind, backend, params, wide, state_dtype, zero_buffers=False)
    for a, b in zip(ours, theirs):
        assert torch.equal(a, b)
    assert all(torch.equal(g, k) for g, k in zip(grads, kept)), "zero_buffers=False leaves the gradients"
    _step_from(kind, backend, params, grads, state_dtype, zero_buffers=True)
    assert all(g.dtype == k.dtype and not g.any() for g, k in zip(grads, kept)), "zero_buffers clears them"
    skipped = [g.clone() for g in kept]
    before = [p.clone() for p in params]
    out = _step_from(kind, backend, params, skipped, state_dtype, zero_buffers=True, found_inf=torch.ones(1))
    assert all(torch.equal(a, b) for a, b in zip(out, before)) and not any(g.any() for g in skipped)


def test_a_call_mixing_fp32_sums_and_narrow_gradients_is_refused(backend):
    params = [torch.randn(8).bfloat16(), torch.randn(8).bfloat16()]
    buffers = [torch.randn(8), torch.randn(8).bfloat16()]
    kept = [p.clone() for p in params]
    with pytest.raises(TypeError, match=r"buffers\[0\] is torch.float32 and params\[0\] torch.bfloat16"):
        ak.sgd_step_and_zero_(params, buffers, lr=0.1, backend=backend)
    assert all(torch.equal(p, k) for p, k in zip(params, kept))


def test_zero_buffers_false_keeps_buffers(backend):
    params = [torch.randn(100)]
    buffers = [torch.randn(100)]
    kept = buffers[0].clone()
    ak.sgd_step_and_zero_(params, buffers, lr=0.1, zero_buffers=False, backend=backend)
    assert torch.equal(buffers[0], kept)


def test_bf16_param_rounds_to_nearest_even(backend):
    # The update lands exactly between two bf16 values: ties go to the even one.
    p = torch.tensor([1.0, 1.0], dtype=torch.bfloat16)
    half_ulp = 2.0**-8
    buffers = [torch.tensor([half_ulp, 3 * half_ulp])]
    ak.sgd_step_and_zero_([p], buffers, lr=1.0, maximize=True, backend=backend)
    assert p.tolist() == [1.0, 1.0 + 4 * half_ulp]


# ---- stochastic rounding of bf16 params ------------------------------------


def test_stochastic_rounding_is_unbiased_and_deterministic(backend):
    n = 200003
    start = torch.randn(n).bfloat16()
    update = torch.randn(n) * 1e-3  # mostly below half a bf16 ulp of the params
    exact = start.double() - update.double()

    def step(seed):
        p = [start.clone()]
        ak.sgd_step_and_zero_(p, [update.clone()], lr=1.0, stochastic_rounding=True, seed=seed, backend=backend)
        return p[0]

    a, b, other = step(11), step(11), step(12)
    assert torch.equal(a, b), "the same seed gives the same bits"
    assert not torch.equal(a, other), "another seed gives other bits"
    # bf16 spacing near x is at most |x| * 2^-7.
    ulp = (torch.maximum(start.double().abs(), exact.abs()) * 2.0**-7).clamp_min(1e-30)
    assert ((a.double() - exact).abs() <= ulp * 2).all(), "each value is one of the two neighbours"
    # Unbiased: the mean error is tiny against one ulp; round to nearest loses the updates.
    bias = ((a.double() - exact) / ulp).mean().item()
    assert abs(bias) < 0.01, bias
    # Each param moves by its update on average (by one ulp with the probability
    # |update| / ulp): the mean |move| is the mean |update|, to the noise of the
    # ~30 000 params that move (a relative 0.6 %). Round to nearest loses more
    # than half of it: updates below half an ulp do not move their param at all.
    nearest = [start.clone()]
    ak.sgd_step_and_zero_(nearest, [update.clone()], lr=1.0, backend=backend)
    mean_update = update.double().abs().mean().item()
    assert abs((a.double() - start.double()).abs().mean().item() / mean_update - 1) < 0.03
    assert (nearest[0].double() - start.double()).abs().mean().item() < 0.6 * mean_update


def test_stochastic_rounding_same_bits_in_every_backend(backend):
    # lr = 1, no momentum: w = p - g rounds once in fp32 in every backend, so
    # the stochastic result must agree bit for bit with the reference.
    sizes = [1, 7, 65537, 1000]
    params = [torch.randn(n).bfloat16() for n in sizes]
    buffers = [torch.randn(n) * 1e-2 for n in sizes]
    ours = [p.clone() for p in params]
    ref = [p.clone() for p in params]
    ak.sgd_step_and_zero_(ours, [b.clone() for b in buffers], lr=1.0, stochastic_rounding=True, seed=5, backend=backend)
    ak.sgd_step_and_zero_(
        ref, [b.clone() for b in buffers], lr=1.0, stochastic_rounding=True, seed=5, backend="reference"
    )
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)


def test_stochastic_rounding_excludes_master_weights(backend):
    p = [torch.randn(4).bfloat16()]
    with pytest.raises(ValueError, match="stochastic_rounding"):
        ak.adamw_step_and_zero_(
            p,
            [torch.randn(4)],
            [torch.zeros(4)],
            [torch.zeros(4)],
            [torch.tensor(0.0)],
            stochastic_rounding=True,
            master_params=[p[0].float()],
            backend=backend,
        )


# ---- inf and NaN: torch's meaning in every backend --------------------------

NONFINITE_CASES = [
    ("sgd", dict(lr=0.1, momentum=0.9, weight_decay=1e-2)),
    ("sgd", dict(lr=0.1, momentum=0.9, nesterov=True)),
    ("adam", dict(lr=1e-2, weight_decay=0.1, amsgrad=True)),
    ("adam", dict(lr=1e-2, betas=(0.3, 0.999))),  # beta1 <= 0.5: torch.lerp's other form
    ("adamw", dict(lr=1e-2, amsgrad=True)),
    ("adamw", dict(lr=1e-2, weight_decay=0.3, betas=(0.5, 0.99), amsgrad=True)),
]


def _same_nonfinite(ours: torch.Tensor, theirs: torch.Tensor, what: str) -> None:
    """NaN where torch has NaN, the same infinities, finite values close."""
    assert torch.equal(ours.isnan(), theirs.isnan()), f"{what}: NaN in other places than torch"
    inf = theirs.isinf()
    assert torch.equal(ours.isinf(), inf) and torch.equal(ours[inf], theirs[inf]), f"{what}: other infinities"
    finite = theirs.isfinite()
    torch.testing.assert_close(ours[finite], theirs[finite], rtol=2e-6, atol=2e-6, msg=what)


@pytest.mark.parametrize(
    "kind,hyper",
    NONFINITE_CASES,
    ids=[f"{k}-{'-'.join(f'{a}{b}' for a, b in h.items() if a != 'lr')}" for k, h in NONFINITE_CASES],
)
def test_nonfinite_gradients_as_torch(backend, kind, hyper):
    """inf, -inf and NaN gradient elements over two steps (the second step sees
    state the first made non-finite): params and every state tensor hold what
    torch's own for-loop optimizer holds."""
    n = 64
    theirs = torch.randn(n)
    ours = [theirs.clone()]
    opt = _torch_optimizer(kind, [torch.nn.Parameter(theirs)], **hyper)
    param = opt.param_groups[0]["params"][0]
    state = {
        "momentum_buffer": [torch.zeros(n)],
        "exp_avg": [torch.zeros(n)],
        "exp_avg_sq": [torch.zeros(n)],
        "max_exp_avg_sq": [torch.zeros(n)],
        "step": [torch.tensor(0.0)],
    }
    bad = [(3, float("inf")), (4, float("-inf")), (5, float("nan"))]
    for step_index in range(2):
        grad = torch.randn(n)
        for i, value in bad:
            grad[i + 10 * step_index] = value  # step 2 poisons other elements, and meets step 1's state
        param.grad = grad.clone()
        opt.step()
        _ours(kind, ours, [grad.clone()], state, step_index, hyper, backend)
        _same_nonfinite(ours[0], param.detach(), f"params after step {step_index + 1}")
        for key, value in opt.state[param].items():
            if torch.is_tensor(value) and value.numel() > 1:
                _same_nonfinite(state[key][0], value, f"{key} after step {step_index + 1}")


def test_stochastic_rounding_keeps_every_nan_a_nan(backend):
    """NaNs whose low bits plus the random bits would carry (into inf, or past
    the sign into a zero) stay NaN when rounded stochastically to bf16, and inf
    stays inf: an SGD step's first momentum buffer is its gradient, so the
    buffer's bits reach the rounding as they are (slot 1), and the param
    (slot 0) becomes p - lr * NaN. Every element is rounded with 300 seeds."""
    payloads = [0x7FFFFFFF, 0xFFFFFFFF, 0x7FFF8001, 0x7F800001, 0xFF800001, 0x7FBFFFFF, 0x7FC00000]
    specials = torch.tensor(payloads, dtype=torch.int64).to(torch.int32).view(torch.float32)
    grad = torch.cat([specials, torch.tensor([float("inf"), float("-inf"), 1.0, -2.5])])
    nan, inf = grad.isnan(), grad.isinf()
    for seed in range(300):
        param = torch.randn(grad.numel()).bfloat16()
        momentum_buffer = torch.zeros(grad.numel(), dtype=torch.bfloat16)
        ak.sgd_step_and_zero_(
            [param],
            [grad.clone()],
            [momentum_buffer],
            lr=1.0,
            momentum=0.9,
            is_first_step=True,
            stochastic_rounding=True,
            seed=seed,
            backend=backend,
        )
        for name, out, expected_inf in (("momentum buffer", momentum_buffer, grad), ("param", param, -grad)):
            assert torch.equal(out.isnan(), nan), f"{name}, seed {seed}: {out}"
            assert torch.equal(out.float()[inf], expected_inf[inf]), f"{name}, seed {seed}: {out}"


@pytest.mark.parametrize("value", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
def test_nonfinite_accumulate_and_norm_as_torch(backend, value):
    grad = torch.randn(100).bfloat16()
    grad[7] = value
    buffer = torch.randn(100)
    expected = buffer + 0.5 * grad.float()
    ak.accumulate_([buffer], [grad], 0.5, backend=backend)
    _same_nonfinite(buffer, expected, "accumulate_")
    norm = ak.grad_norm([buffer, torch.randn(10)], backend=backend)
    assert (norm.isnan() if value != value else norm.isinf()).item(), norm


def test_stochastic_rounding_follows_memory_order(backend):
    """A channels_last bf16 param: every backend hashes each element's index in
    memory order, so the reference (which indexes logically) must agree."""
    start = torch.randn(3, 5, 4, 6).bfloat16().contiguous(memory_format=torch.channels_last)
    update = (torch.randn(3, 5, 4, 6) * 1e-2).contiguous(memory_format=torch.channels_last)
    ours, ref = start.clone(memory_format=torch.preserve_format), start.clone(memory_format=torch.preserve_format)
    for out, b in ((ours, backend), (ref, "reference")):
        ak.sgd_step_and_zero_(
            [out],
            [update.clone(memory_format=torch.preserve_format)],
            lr=1.0,
            stochastic_rounding=True,
            seed=77,
            positions=[5],
            backend=b,
        )
    assert ours.is_contiguous(memory_format=torch.channels_last)
    assert torch.equal(ours, ref)
    # The same values laid out contiguously get the same bits per memory position, not per logical index.
    flat = start.permute(0, 2, 3, 1).contiguous()
    flat_update = update.permute(0, 2, 3, 1).contiguous()
    ak.sgd_step_and_zero_(
        [flat], [flat_update], lr=1.0, stochastic_rounding=True, seed=77, positions=[5], backend=backend
    )
    assert torch.equal(flat, ours.permute(0, 2, 3, 1))


def test_stochastic_rounding_streams_follow_positions(backend):
    """Identical params with identical updates draw the same bits only with
    the same stream id: positions, not the place in the call, decide."""
    start = torch.full((4096,), 1.0).bfloat16()
    update = torch.full((4096,), 1e-3)

    def rounded(position, first=False):
        params = [start.clone(), start.clone()] if first else [start.clone()]
        positions = [position, position + 1] if first else [position]
        ak.sgd_step_and_zero_(
            params,
            [update.clone() for _ in params],
            lr=1.0,
            stochastic_rounding=True,
            seed=3,
            positions=positions,
            backend=backend,
        )
        return params[0]

    assert torch.equal(rounded(11), rounded(11, first=True)), "the same stream id, the same bits, whatever the call"
    assert not torch.equal(rounded(11), rounded(12)), "another stream id, other bits"


# ---- optimizer state in bf16 -------------------------------------------------


def _bf16_ulp(x64: torch.Tensor) -> torch.Tensor:
    """The spacing of bf16 values near x (an upper bound: |x| * 2^-7, or the smallest subnormal step)."""
    return (x64.abs() * 2.0**-7).clamp_min(2.0**-133)


def _state_lists(n_list, dtype, count=1, scale=1.0, positive=False):
    out = []
    for _ in range(count):
        ts = [randn(n, torch.float32) * scale for n in n_list]
        out.append([(t.abs() if positive else t).to(dtype) for t in ts])
    return out


@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("first", [False, True], ids=["running", "first-step"])
def test_sgd_bf16_momentum_same_bits_as_reference(backend, param_dtype, first):
    """SGD's update rounds the same way in every backend (test_sgd_matches_float64),
    so the bf16 momentum buffer, rounded stochastically with its own slot's
    bits, must be bitwise the reference's; it lies within one bf16 ulp of the
    float64 value, its neighbours."""
    sizes = [1, 31, 65537, 70001]
    params = [randn(n, torch.float32).to(param_dtype) for n in sizes]
    buffers = [randn(n, torch.float32) for n in sizes]
    (moms,) = _state_lists(sizes, torch.bfloat16)
    runs = {}
    for name in (backend, "reference"):
        p, b, m = [x.clone() for x in params], [x.clone() for x in buffers], [x.clone() for x in moms]
        ak.sgd_step_and_zero_(
            p,
            b,
            m,
            lr=0.1,
            momentum=0.9,
            dampening=0.1,
            weight_decay=0.01,
            is_first_step=first,
            stochastic_rounding=param_dtype == torch.bfloat16,
            seed=99,
            backend=name,
        )
        runs[name] = (p, m)
        assert all(not x.any() for x in b)
    for i in range(len(sizes)):
        assert torch.equal(runs[backend][0][i], runs["reference"][0][i]), "params"
        assert torch.equal(runs[backend][1][i], runs["reference"][1][i]), "bf16 momentum"
        g = buffers[i].double() + 0.01 * params[i].double()
        exact = g if first else 0.9 * moms[i].double() + 0.9 * g
        # Rounding picks a bf16 neighbour of the kernel's fp32 value, which is a
        # few fp32 roundings (4 * 2^-24) of the terms' magnitude from float64:
        # |got - exact| <= ulp_bf16(exact) + (1 + 2^-7) * 4 * 2^-24 * terms, where
        # the terms may cancel (g = b + 0.01 w near 0), so never relative to g.
        terms = buffers[i].double().abs() + 0.01 * params[i].double().abs()
        terms = terms if first else 0.9 * moms[i].double().abs() + 0.9 * terms
        err = (runs[backend][1][i].double() - exact).abs()
        assert (err <= _bf16_ulp(exact) + 5 * 2.0**-24 * terms).all()


@pytest.mark.parametrize(
    "adamw,amsgrad", [(False, False), (True, False), (True, True)], ids=["adam", "adamw", "adamw-amsgrad"]
)
@pytest.mark.parametrize("param_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_adam_bf16_state_against_float64_and_reference(backend, param_dtype, adamw, amsgrad):
    """Adam's moments in bf16: each within one bf16 ulp of its float64 value
    (stochastic rounding picks a neighbour), the params as with fp32 state up to
    the moments' rounding, and the same bits as the reference except where the
    two backends' fp32 values differ by an ulp (the bias corrections' pow)."""
    sizes = [1, 7, 65537, 4099]
    params = [randn(n, torch.float32).to(param_dtype) for n in sizes]
    buffers = [randn(n, torch.float32) for n in sizes]
    m0, v0, vmax0 = (
        _state_lists(sizes, torch.bfloat16, scale=s, positive=pos)[0]
        for s, pos in ((0.1, False), (0.01, True), (0.01, True))
    )
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, amsgrad=amsgrad)
    fn = ak.adamw_step_and_zero_ if adamw else ak.adam_step_and_zero_
    runs = {}
    for name in (backend, "reference"):
        p, m, v, vm = ([x.clone() for x in xs] for xs in (params, m0, v0, vmax0))
        steps = [torch.tensor(4.0) for _ in sizes]
        fn(
            p,
            [b.clone() for b in buffers],
            m,
            v,
            steps,
            max_exp_avg_sqs=vm if amsgrad else None,
            seed=1234,
            stochastic_rounding=param_dtype == torch.bfloat16,
            backend=name,
            **hyper,
        )
        runs[name] = (p, m, v, vm)
        assert all(s.item() == 5.0 for s in steps)
    for i in range(len(sizes)):
        g = buffers[i].double()
        w = params[i].double()
        g_terms = g.abs()
        if not adamw:
            g = g + 0.1 * w
            g_terms = g_terms + 0.1 * w.abs()
        m64 = 0.9 * m0[i].double() + 0.1 * g
        v64 = 0.95 * v0[i].double() + 0.05 * g * g
        # As in the SGD test: a bf16 neighbour of the fp32 value, a few fp32
        # roundings of the terms' magnitude (which may cancel) from float64.
        m_terms = 0.9 * m0[i].double().abs() + 0.1 * g_terms
        v_terms = 0.95 * v0[i].double() + 0.05 * g_terms * g_terms
        for got, want, terms, name in (
            (runs[backend][1][i], m64, m_terms, "exp_avg"),
            (runs[backend][2][i], v64, v_terms, "exp_avg_sq"),
        ):
            assert got.dtype == torch.bfloat16
            err = (got.double() - want).abs()
            assert (err <= _bf16_ulp(want) + 8 * 2.0**-24 * terms).all(), name
    slots = ((0, "params"), (1, "exp_avg"), (2, "exp_avg_sq")) + (((3, "max_exp_avg_sq"),) if amsgrad else ())
    start = torch.cat([t.double() for t in params])
    for k, name in slots:
        ours, ref = (torch.cat([t.double() for t in runs[r][k]]) for r in (backend, "reference"))
        # The two fp32 values differ by a few roundings of the terms' magnitude
        # (for params: where they started and how far they moved, which may
        # cancel to ~0, so never relative to the result), plus a bf16 neighbour.
        scale = start.abs() + (ref - start).abs() if k == 0 else ref.abs()
        assert ((ours - ref).abs() <= _bf16_ulp(ref) + 17 * 2.0**-24 * scale).all(), name
        if k:  # the state, rounded stochastically: other bits only where the fp32 values differed
            assert (ours == ref).double().mean() > 0.99, f"{name}: other bits than the reference"


def test_bf16_state_rounding_keeps_small_updates(backend):
    """exp_avg_sq with beta2 = 0.999 moves by 1e-3 of its value per step, a
    quarter of a bf16 ulp: round to nearest would never move it; stochastic
    rounding moves it by the right amount on average, unbiased."""
    n = 200003
    v = torch.full((n,), 1.0).bfloat16()
    m = torch.zeros(n).bfloat16()
    g = torch.full((n,), 2.0)  # g^2 = 4: v64 = 0.999 * 1 + 0.001 * 4 = 1.003
    p = [torch.zeros(n)]
    ak.adam_step_and_zero_(p, [g], [m], [v], [torch.tensor(0.0)], lr=1e-3, betas=(0.9, 0.999), seed=7, backend=backend)
    assert set(v.unique().tolist()) == {1.0, 1.0078125}, "each element is one of the two bf16 neighbours"
    assert abs(v.double().mean().item() - 1.003) < 2e-4


def test_state_dtype_is_one_per_call(backend):
    p = [torch.randn(4), torch.randn(4)]
    with pytest.raises(TypeError, match="one dtype"):
        ak.adam_step_and_zero_(
            p,
            [torch.randn(4), torch.randn(4)],
            [torch.zeros(4), torch.zeros(4).bfloat16()],
            [torch.zeros(4), torch.zeros(4)],
            [torch.tensor(0.0)] * 2,
            backend=backend,
        )
    with pytest.raises(TypeError, match="float32, bfloat16"):
        ak.sgd_step_and_zero_(p[:1], [torch.randn(4)], [torch.zeros(4).half()], lr=0.1, momentum=0.9, backend=backend)


# ---- param remainders: fp32 master weights in 16 more bits ------------------


def _random_fp32(n: int) -> torch.Tensor:
    """fp32 values over the whole range, with zeros, subnormals, the largest
    finite values and the rounding edges of the low 16 bits among them."""
    x = torch.randn(n) * torch.exp2(torch.randint(-60, 60, (n,)).float())
    bits = x.view(torch.int32)
    edges = torch.tensor(
        [
            0x00000000,
            0x80000000,
            0x00000001,
            0x00008000,
            0x3F7F7FFF,
            0x3F7F8000,
            0x3F7FFFFF,
            0xBF7FFFFF - 2**32,
            0x7F7FFFFF,
            0x7F7F8000,
            0x7F7E8000,
            0x0000FFFF,
        ],
        dtype=torch.int64,
    )
    bits[: len(edges)] = edges.to(torch.int32)
    return x


def test_remainders_hold_every_fp32_value():
    """split, then join, gives back every finite fp32 value and infinity bit
    for bit (NaN stays NaN); the bf16 half is the value rounded to nearest
    (ties away from zero)."""
    from accumkernels.backends import reference

    x = torch.cat([_random_fp32(100003), torch.tensor([float("inf"), float("-inf"), float("nan")])])
    param, remainder = reference.split_remainder(x)
    back = reference.join_remainder(param, remainder)
    finite = ~x.isnan()
    assert torch.equal(back[finite].view(torch.int32), x[finite].view(torch.int32))
    assert back[~finite].isnan().all() and param[~finite].isnan().all()
    ok = x.isfinite() & param.isfinite()
    err = (param[ok].double() - x[ok].double()).abs()
    assert (err <= x[ok].double().abs() * 2.0**-8 + 2.0**-134).all(), "the param half is rounded to nearest"


@pytest.mark.parametrize("kind", ["sgd", "adamw"])
def test_remainders_step_like_fp32_masters_bit_for_bit(backend, kind):
    """The same step from fp32 master weights and from (bf16 param, int16
    remainder) pairs holding the same masters: the remainder's master is the
    fp32 master, bit for bit; its param is that master rounded to nearest."""
    from accumkernels.backends import reference

    sizes = [1, 33, 65537, 4099]
    masters = [randn(n, torch.float32) for n in sizes]
    buffers = [randn(n, torch.float32) for n in sizes]
    pairs = [reference.split_remainder(m) for m in masters]
    results = []
    for use_remainders in (False, True):
        params = [p.clone() if use_remainders else m.bfloat16() for (p, _), m in zip(pairs, masters)]
        extra = [r.clone() for _, r in pairs] if use_remainders else [m.clone() for m in masters]
        state = [[torch.zeros(n) for n in sizes] for _ in range(2)]
        if kind == "sgd":
            ak.sgd_step_and_zero_(
                params,
                [b.clone() for b in buffers],
                state[0],
                lr=0.1,
                momentum=0.9,
                weight_decay=0.01,
                master_params=extra,
                backend=backend,
            )
        else:
            ak.adamw_step_and_zero_(
                params,
                [b.clone() for b in buffers],
                state[0],
                state[1],
                [torch.tensor(0.0) for _ in sizes],
                lr=1e-2,
                master_params=extra,
                backend=backend,
            )
        results.append((params, extra, state))
    (_, fp32_masters, fp32_state), (params, remainders, state) = results
    for i in range(len(sizes)):
        joined = reference.join_remainder(params[i], remainders[i])
        assert torch.equal(joined.view(torch.int32), fp32_masters[i].view(torch.int32)), "the master, bit for bit"
        assert torch.equal(params[i], reference.split_remainder(fp32_masters[i])[0])
        assert torch.equal(state[0][i], fp32_state[0][i])


def test_remainders_round_trip_in_every_backend(backend):
    """lr = 0: w - 0 * g = w, so every weight passes through join and split
    unchanged (a step with +1 gradients keeps -0 too), whatever its bits."""
    from accumkernels.backends import reference

    x = _random_fp32(70001)
    param, remainder = reference.split_remainder(x)
    p, r = [param.clone()], [remainder.clone()]
    ak.sgd_step_and_zero_(p, [torch.ones(x.numel())], lr=0.0, master_params=r, backend=backend)
    assert torch.equal(p[0].view(torch.int16), param.view(torch.int16))
    assert torch.equal(r[0], remainder)


def test_remainders_are_for_bf16_params(backend):
    with pytest.raises(TypeError, match="remainders are for bfloat16"):
        ak.sgd_step_and_zero_(
            [torch.randn(4).half()],
            [torch.randn(4)],
            lr=0.1,
            master_params=[torch.zeros(4, dtype=torch.int16)],
            backend=backend,
        )
    with pytest.raises(TypeError, match="one kind of master weights"):
        ak.sgd_step_and_zero_(
            [torch.randn(4).bfloat16()] * 1 + [torch.randn(4).bfloat16()],
            [torch.randn(4)] * 2,
            lr=0.1,
            master_params=[torch.zeros(4), torch.zeros(4, dtype=torch.int16)],
            backend=backend,
        )
    with pytest.raises(ValueError, match="exclude"):
        ak.sgd_step_and_zero_(
            [torch.randn(4).bfloat16()],
            [torch.randn(4)],
            lr=0.1,
            stochastic_rounding=True,
            master_params=[torch.zeros(4, dtype=torch.int16)],
            backend=backend,
        )
