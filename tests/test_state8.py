"""The 8-bit optimizer state (state_dtype="8bit", accumkernels/_state8.py): the
format exactly as documented, its rounding (nearest within half a grid step,
stochastic unbiased over all 2^16 draws), the reference Adam step that uses it
against float64 Adam, and the wrapper around it: codes and scales in the
state dict, a bitwise resume mid-window, the conversions to and from a plain
torch.optim.AdamW checkpoint, and the refusals of what it does not do yet."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import accumkernels as ak
from accumkernels import _state8 as s8

EMINS = {"exp_avg": s8.EMIN_EXP_AVG, "exp_avg_sq": s8.EMIN_EXP_AVG_SQ}


def _generator() -> torch.Generator:
    """A generator seeded from the test's seed (tests/conftest.py)."""
    return torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))


@pytest.mark.parametrize("emin", EMINS.values(), ids=EMINS.keys())
def test_every_code_decodes_to_a_grid_value_that_encodes_back(emin):
    codes = torch.arange(0, 8 * (1 - emin) + 1, dtype=torch.int32)
    values = s8.decode_magnitude(codes, emin)
    assert values[0] == 0 and values[-1] == 1.0
    assert bool((values[1:] > values[:-1]).all())
    assert torch.equal(s8.encode_magnitude(values, emin, None), codes)
    # 3 mantissa bits: consecutive values above 2^emin are 1/8 of their binade apart
    normal = values[16:]
    step = normal[1:] - normal[:-1]
    binade = torch.exp2(torch.floor(torch.log2(normal[:-1])))
    assert torch.equal(step, binade / 8)


def _awkward(n: int, generator) -> torch.Tensor:
    """Values over many binades, with zeros, exact block boundaries and a block of one element."""
    x = torch.randn(n, generator=generator) * torch.exp(torch.randn(n, generator=generator) * 4)
    x[::97] = 0
    return x


@pytest.mark.parametrize("signed", [True, False])
@pytest.mark.parametrize("n", [1, 255, 256, 1000, 4097])
def test_nearest_is_within_half_a_grid_step(signed, n):
    g = _generator()
    x = _awkward(n, g)
    x = x if signed else x.abs()
    emin = s8.EMIN_EXP_AVG if signed else s8.EMIN_EXP_AVG_SQ
    codes, scales = s8.encode(x, x, signed, emin, None)
    assert codes.dtype == torch.uint8 and scales.numel() == s8.scales_numel(n)
    back = s8.decode(codes, scales, signed, emin)
    scale = scales.repeat_interleave(s8.BLOCK)[:n]
    # Half a grid step: at u = |x| / scale >= 2^emin the step is 1/8 of u's binade
    # (<= u / 8), below it 2^(emin - 3): so |error| <= max(|x| / 16, 2^(emin - 4) scale),
    # plus the few fp32 ulps of the division and the product.
    bound = torch.maximum(x.abs() / 16, scale * 2.0 ** (emin - 4)) + 4 * torch.finfo(torch.float32).eps * x.abs()
    assert bool(((back - x).abs() <= bound).all())
    u = x.abs() / torch.where(scale > 0, scale, torch.ones_like(scale))
    assert torch.equal(back == 0, u < 2.0 ** (emin - 4))
    # each block's largest magnitude is exact: it is the block's scale
    blocks = torch.nn.functional.pad(x.abs(), (0, s8.scales_numel(n) * s8.BLOCK - n)).view(-1, s8.BLOCK)
    assert torch.equal(scales, blocks.amax(dim=1))


@pytest.mark.parametrize("emin", EMINS.values(), ids=EMINS.keys())
def test_stochastic_encoding_is_unbiased_over_all_draws(emin):
    """Over all 2^16 random draws, the mean decoded value is the value itself,
    up to 2^-16 of a grid step (the draw's resolution): exactly unbiased."""
    g = _generator()
    u = torch.rand(64, generator=g) * torch.exp2(-torch.randint(0, -emin + 3, (64,), generator=g).float())
    draws = torch.arange(1 << 16, dtype=torch.int64)
    codes = s8.encode_magnitude(u[:, None].expand(-1, draws.numel()).contiguous(), emin, draws[None, :].expand(64, -1))
    mean = s8.decode_magnitude(codes, emin).double().mean(dim=1)
    e = torch.clamp(torch.floor(torch.log2(u.double())), min=emin)
    step = torch.exp2(e - 3)
    assert bool(((mean - u.double()).abs() <= step * 2.0**-16 + 1e-12 * u.double()).all())


def _adam_run(state: str, grads, lr=1e-3, betas=(0.9, 0.95)):
    """One param stepped by the reference Adam on fixed gradients; returns the
    decoded (m, v) after each step (float64 for the float64 run)."""
    n = grads[0].numel()
    if state == "float64":
        m = torch.zeros(n, dtype=torch.float64)
        v = torch.zeros(n, dtype=torch.float64)
        out = []
        for g in grads:
            m = betas[0] * m + (1 - betas[0]) * g.double()
            v = betas[1] * v + (1 - betas[1]) * g.double() ** 2
            out.append((m.clone(), v.clone()))
        return out
    p = torch.zeros(n)
    codes_m, codes_v = torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)
    scales_m, scales_v = torch.zeros(s8.scales_numel(n)), torch.zeros(s8.scales_numel(n))
    step = torch.zeros(())
    out = []
    for t, g in enumerate(grads):
        ak.adamw_step_and_zero_(
            [p],
            [g.clone()],
            [codes_m],
            [codes_v],
            [step],
            exp_avg_scales=[scales_m],
            exp_avg_sq_scales=[scales_v],
            lr=lr,
            betas=betas,
            weight_decay=0.0,
            seed=t,
            backend="reference",
        )
        out.append((s8.decode_exp_avg(codes_m, scales_m).double(), s8.decode_exp_avg_sq(codes_v, scales_v).double()))
    return out


def test_moments_against_float64_adam():
    """The 8-bit moments against float64 Adam on the same gradients. Each
    encode adds an error of mean zero and at most one grid step, 1/8 of the
    value's binade (variance <= (step / 2)^2), which the moving averages carry
    on with weight beta per step: the relative L2 error of m is at most
    (1/16) / sqrt(1 - beta1^2) (0.143 at beta1 = 0.9), and that of
    r = sqrt(v) (the stored quantity) (1/16) / sqrt(1 - beta2^2) (0.200 at
    beta2 = 0.95), v's about twice r's. Over 20000 elements the measured L2
    error concentrates (within a few percent) at or below these; asserted
    with a 1.25 margin, plus the fp32 rounding of the update."""
    g = _generator()
    n, steps, betas = 20000, 60, (0.9, 0.95)
    scale = torch.exp(torch.randn(n, generator=g) * 2)  # elements over many binades, each its own size
    grads = [torch.randn(n, generator=g) * scale for _ in range(steps)]
    ours, exact = _adam_run("8bit", grads, betas=betas), _adam_run("float64", grads, betas=betas)
    for (m8, v8), (m, v) in list(zip(ours, exact))[10:]:
        assert float((m8 - m).norm() / m.norm()) <= 1.25 * (1 / 16) / (1 - betas[0] ** 2) ** 0.5
        r_error = float((v8.sqrt() - v.sqrt()).norm() / v.sqrt().norm())
        assert r_error <= 1.25 * (1 / 16) / (1 - betas[1] ** 2) ** 0.5
        assert float((v8 - v).norm() / v.norm()) <= 2.5 * 1.25 * (1 / 16) / (1 - betas[1] ** 2) ** 0.5


# Awkward sizes: one element, a block less one, a block, a block and one, sizes
# whose chunks (64K elements) cross blocks of the flat index of the call, and
# fp32 and bf16 params in one call (two dtype groups).
STEP_SIZES = [1, 255, 256, 257, 65537, 4099, 70001, 300]
STEP_DTYPES = [torch.float32, torch.bfloat16] * 4


def _random_8bit_state(sizes, generator):
    """Codes and scales of random moments, each element of its own magnitude
    (over many binades), with an all-zero block in the largest tensor."""
    out = []
    for n in sizes:
        spread = torch.exp(torch.randn(n, generator=generator) * 3)
        m = torch.randn(n, generator=generator) * spread * 0.01
        v = (torch.randn(n, generator=generator) * spread * 0.01) ** 2
        if n > 1024:
            m[512:768], v[512:768] = 0.0, 0.0
        like = torch.empty(n, dtype=torch.uint8)
        out.append((s8.encode_exp_avg(m, like, None), s8.encode_exp_avg_sq(v, like, None)))
    return out


# Where the steps' inputs start in their storage, in elements: (params and
# buffers, codes). A kernel that moves a lane's elements as packs (CUDA's)
# checks every list's alignment and takes them one by one where any is off.
LAYOUTS = {"aligned": (0, 0), "codes-offset": (0, 1), "all-offset": (1, 1)}


def _placed(x, offset):
    """A copy of ``x`` that starts ``offset`` elements into its storage."""
    return torch.empty(x.numel() + offset, dtype=x.dtype)[offset:].copy_(x)


def _step_8bit(backend, adamw, params, grads, state, steps=3, grad_scale=1.0, layout=(0, 0)):
    """``steps`` Adam(W) steps over copies of the inputs (placed at ``layout``'s
    offsets); returns (params, m codes, v codes, m scales, v scales)."""
    at, codes_at = layout
    p = [_placed(x, at) for x in params]
    m, v = [_placed(c, codes_at) for (c, _), _ in state], [_placed(c, codes_at) for _, (c, _) in state]
    ms, vs = [s.clone() for (_, s), _ in state], [s.clone() for _, (_, s) in state]
    counts = [torch.tensor(3.0) for _ in params]
    fn = ak.adamw_step_and_zero_ if adamw else ak.adam_step_and_zero_
    for k in range(steps):
        fn(
            p,
            [_placed(g, at) for g in grads],
            m,
            v,
            counts,
            exp_avg_scales=ms,
            exp_avg_sq_scales=vs,
            lr=1e-2,
            betas=(0.9, 0.95),
            weight_decay=0.1 if adamw else 0.0,
            grad_scale=grad_scale,
            stochastic_rounding=True,
            seed=11 + k,
            backend=backend,
        )
    return p, m, v, ms, vs


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
@pytest.mark.parametrize("adamw", [True, False], ids=["adamw-decay", "adam"])
def test_every_backend_steps_8bit_state_to_the_reference_bits(backend, adamw, layout):
    """The kernels compute the reference's formula in the same fp32
    operations (the reference's sqrt correctly rounded, as sqrtf), and their
    blocks follow each tensor's memory order whatever the chunking and
    wherever the tensors start in their storage: codes,
    scales equal the reference's to the bit after three steps (encoded
    stochastically from the same draws). They do not depend on the bias
    corrections, whose pow may differ by an ulp between backends (Adam runs
    without weight decay here and AdamW's decay does not feed the moments);
    the params, which do, match within an ulp (_assert_params_match)."""
    g = _generator()
    params = [(torch.randn(n, generator=g)).to(d) for n, d in zip(STEP_SIZES, STEP_DTYPES)]
    grads = [torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 2) for n in STEP_SIZES]
    state = _random_8bit_state(STEP_SIZES, g)
    ours = _step_8bit(backend, adamw, params, grads, state, layout=layout)
    ref = _step_8bit("reference", adamw, params, grads, state)
    for k, name in enumerate(("params", "exp_avg codes", "exp_avg_sq codes", "exp_avg scales", "exp_avg_sq scales")):
        for i, n in enumerate(STEP_SIZES):
            a, b = ours[k][i], ref[k][i]
            if k:
                assert torch.equal(a, b), (name, n)
            else:
                _assert_params_match(a, b, (name, n))


def test_every_code_and_binade_through_the_kernels_codec_to_the_reference_bits(backend):
    """The kernels decode and encode in exact integer forms of the
    reference's fp32 formulas (formulas.h's encode_magnitude and
    decode_magnitude: one form from 2^emin up, another below it): every code
    of both moments is decoded, and new moments over every binade from 1 down
    to under 2^emin (exp_avg_sq's 2^-30 included, and zeros) are encoded, to
    the reference's codes and scales bit for bit. Block 0 holds every exp_avg
    code and the exp_avg_sq codes 0..248 (all there are) at scale 1, with a
    zero gradient (the step decodes them, scales and re-encodes); block 1
    starts at zero and takes gradients 2^-k, k uniform in [0, 48) with random
    signs, with 1 and the edges of exp_avg_sq's lowest binade among them."""
    g = _generator()
    m_codes = torch.arange(256, dtype=torch.uint8)
    v_codes = torch.arange(256).clamp(max=248).to(torch.uint8)
    n = 512
    m = torch.cat([m_codes, torch.zeros(256, dtype=torch.uint8)])
    v = torch.cat([v_codes, torch.zeros(256, dtype=torch.uint8)])
    scales = torch.tensor([1.0, 0.0])
    state = [((m, scales.clone()), (v, scales.clone()))]
    grad = torch.zeros(n)
    sign = torch.where(torch.rand(256, generator=g) < 0.5, -1.0, 1.0)
    grad[256:] = sign * torch.exp2(-48 * torch.rand(256, generator=g))
    # u = r / max r is g / max g for exp_avg_sq: these put r at, and an ulp either side of, 2^-30 of the max
    grad[256:260] = torch.tensor([1.0, 2.0**-30, 2.0**-30 * (1 + 2.0**-23), 2.0**-30 * (1 - 2.0**-24)])
    params = [torch.randn(n, generator=g)]
    ours = _step_8bit(backend, True, params, [grad], state, steps=1)
    ref = _step_8bit("reference", True, params, [grad], state, steps=1)
    for k, name in enumerate(("exp_avg codes", "exp_avg_sq codes", "exp_avg scales", "exp_avg_sq scales"), start=1):
        assert torch.equal(ours[k][0], ref[k][0]), name
    _assert_params_match(ours[0][0], ref[0][0], "params")


def test_a_nonfinite_gradient_ruins_its_block_alike_in_every_backend(backend):
    """A NaN gradient element makes its block's scales NaN (as torch.amax):
    every element of the block decodes to inf or NaN, in every backend (its
    codes are unspecified); the other blocks and the params are stepped as
    usual, as the reference steps them."""
    g = _generator()
    n = 1000
    params, grads = [torch.randn(n, generator=g)], [torch.randn(n, generator=g)]
    grads[0][300] = float("nan")
    state = _random_8bit_state([n], g)
    runs = {name: _step_8bit(name, True, params, grads, state, steps=1) for name in (backend, "reference")}
    for p, m, v, ms, vs in ([x[0] for x in run] for run in runs.values()):
        assert torch.isnan(ms[1]) and torch.isnan(vs[1]) and not torch.isnan(ms[[0, 2, 3]]).any()
        assert not torch.isfinite(s8.decode_exp_avg(m, ms)[256:512]).any()
        assert not torch.isfinite(s8.decode_exp_avg_sq(v, vs)[256:512]).any()
        assert torch.isnan(p[300]) and torch.isfinite(p[:300]).all() and torch.isfinite(p[301:]).all()
    outside = torch.ones(n, dtype=torch.bool)
    outside[256:512] = False
    for k in (1, 2):
        assert torch.equal(runs[backend][k][0][outside], runs["reference"][k][0][outside])
    _assert_params_match(runs[backend][0][0], runs["reference"][0][0], "params")


def _assert_params_match(a, b, what):
    """Within an ulp of the param and its step (lr * |m / denom| <~ 10 lr), and
    the same bits in 99% of elements (the bias corrections' pow may differ by
    an ulp between backends, which moves a few roundings)."""
    ulp = torch.finfo(a.dtype).eps
    diff = torch.where(torch.isnan(a) & torch.isnan(b), 0.0, (a.float() - b.float()).abs())
    assert (diff <= ulp * (b.float().abs().nan_to_num(0.0) + 0.1)).all(), what
    assert ((a == b) | (torch.isnan(a) & torch.isnan(b))).float().mean() >= 0.99, what


def _model(dtype=torch.bfloat16):
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(300, 40), nn.LayerNorm(40), nn.Linear(40, 3)).to(dtype)


def _wrapped(model, **options):
    options = {"state_dtype": "8bit", "seed": 7, **options}
    return ak.AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), accum_steps=2, **options)


def _micro_steps(model, opt, count, generator):
    for _ in range(count):
        x = torch.randn(8, 300, generator=generator).to(next(model.parameters()).dtype)
        model(x).float().square().mean().backward()
        opt.step()


@pytest.mark.parametrize("backend_name", ["cpu", "triton"])
def test_the_wrapper_on_a_kernel_backend_steps_as_on_the_reference(backend_name):
    """One window of the wrapper with 8-bit state on a kernel backend and on
    the reference: the same gradients (the same params before the step), so
    the same codes and scales to the bit, and params within an ulp."""
    if backend_name not in ak.available_backends():
        pytest.skip(f"backend {backend_name!r} does not run here")
    runs = []
    for name in (backend_name, "reference"):
        model = _model()
        opt = _wrapped(model, backend=name)
        _micro_steps(model, opt, 2, torch.Generator().manual_seed(5))
        runs.append((list(model.parameters()), opt.state_dict()["state"]))
    (params, state), (ref_params, ref_state) = runs
    for i, (a, b) in enumerate(zip(params, ref_params)):
        _assert_params_match(a.detach(), b.detach(), f"param {i}")
        assert all(torch.equal(state[i][k], ref_state[i][k]) for k in ref_state[i]), f"param {i}'s state"


def _resume_and_go_on(model, opt, state_dict, make, generator):
    """A copy of ``model`` with a wrapper ``make(copy)`` that loaded
    ``state_dict`` (saved from ``opt`` now); then 5 more micro-steps of the
    same batches on both pairs. Returns (the copy, its wrapper)."""
    twin = copy.deepcopy(model)
    resumed = make(twin)
    resumed.load_state_dict(state_dict)
    twin_generator = copy.deepcopy(generator)
    _micro_steps(model, opt, 5, generator)
    _micro_steps(twin, resumed, 5, twin_generator)
    return twin, resumed


def test_state_dict_holds_codes_and_scales_and_resumes_bitwise_mid_window():
    model = _model()
    opt = _wrapped(model)
    g = _generator()
    _micro_steps(model, opt, 5, g)  # two windows and one micro-step
    sd = copy.deepcopy(opt.state_dict())
    entry = sd["state"][0]
    assert sorted(entry) == ["exp_avg_codes", "exp_avg_scales", "exp_avg_sq_codes", "exp_avg_sq_scales", "step"]
    assert entry["exp_avg_codes"].dtype == torch.uint8 and entry["exp_avg_scales"].dtype == torch.float32
    twin, resumed = _resume_and_go_on(model, opt, sd, _wrapped, g)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    for a, b in zip(opt.state_dict()["state"].values(), resumed.state_dict()["state"].values()):
        assert all(torch.equal(a[k], b[k]) for k in a)


def test_dequantized_state_dict_loads_into_torch_adamw_and_back():
    model = _model()
    opt = _wrapped(model)
    _micro_steps(model, opt, 4, torch.Generator().manual_seed(1))
    sd = ak.optim.dequantized_state_dict(opt.state_dict())
    plain = torch.optim.AdamW(copy.deepcopy(model).parameters(), lr=1e-2)
    plain.load_state_dict({k: v for k, v in sd.items() if k != "accumkernels"})
    state = plain.state_dict()["state"][0]
    assert sorted(state) == ["exp_avg", "exp_avg_sq", "step"]
    decoded = s8.decode_exp_avg(
        opt.state_dict()["state"][0]["exp_avg_codes"], opt.state_dict()["state"][0]["exp_avg_scales"]
    )
    assert torch.equal(sd["state"][0]["exp_avg"], decoded)
    # a plain checkpoint loads into the 8-bit optimizer: encoded (to nearest) at its first step
    again = _wrapped(copy.deepcopy(model))
    again.load_state_dict(plain.state_dict())
    again._updater.init_state(again._intake)
    entry = again.optimizer.state[again.optimizer.param_groups[0]["params"][0]]
    assert "exp_avg" not in entry and entry["exp_avg_codes"].dtype == torch.uint8
    back = s8.decode_exp_avg(entry["exp_avg_codes"], entry["exp_avg_scales"])
    nearest = s8.decode_exp_avg(*s8.encode_exp_avg(state["exp_avg"].float(), state["exp_avg"], None))
    assert torch.equal(back, nearest)


def test_an_8bit_checkpoint_loads_into_an_fp32_state_wrapper():
    model = _model()
    opt = _wrapped(model)
    _micro_steps(model, opt, 4, torch.Generator().manual_seed(2))
    sd = opt.state_dict()
    other = _wrapped(copy.deepcopy(model), state_dtype=torch.float32)
    other.load_state_dict(sd)
    other._updater.init_state(other._intake)
    p0 = other.optimizer.param_groups[0]["params"][0]
    entry = other.optimizer.state[p0]
    expected = s8.decode_exp_avg(sd["state"][0]["exp_avg_codes"], sd["state"][0]["exp_avg_scales"])
    assert entry["exp_avg"].dtype == torch.float32 and torch.equal(entry["exp_avg"], expected)


def test_static_bytes_count_codes_and_scales():
    model = _model()
    numel = sum(p.numel() for p in model.parameters())
    scales = sum(s8.scales_numel(p.numel()) for p in model.parameters())
    got = ak.optim.static_bytes(torch.optim.AdamW(model.parameters()), state_dtype="8bit")
    steps = 4 * len(list(model.parameters()))
    assert got["optimizer state"] == 2 * (numel + 4 * scales) + steps


@pytest.mark.parametrize(
    "make, match",
    [
        (
            lambda m: ak.AccumulatingOptimizer(torch.optim.RMSprop(m.parameters()), state_dtype="8bit"),
            "SGD, Adam or AdamW",
        ),
        (
            lambda m: ak.AccumulatingOptimizer(
                torch.optim.AdamW(m.parameters(), amsgrad=True), state_dtype="8bit", backend="reference"
            ),
            "amsgrad",
        ),
    ],
    ids=["rmsprop", "amsgrad"],
)
def test_what_8bit_state_does_not_do_yet_is_refused_at_construction(make, match):
    with pytest.raises(ValueError, match=match):
        make(_model())


@pytest.mark.parametrize("accum_steps", [None, 2], ids=["loop-counts", "accum_steps=2"])
def test_amsgrad_switched_on_later_is_refused_before_the_step(accum_steps):
    """A group's amsgrad set to True after building (8-bit state has no
    max_exp_avg_sq) is refused by name at the window's step, before anything
    is stepped: with it set back, the same step() goes on as if never touched."""
    model = _model()
    twin = copy.deepcopy(model)
    xs = [torch.randn(3, 300).bfloat16() for _ in range(4)]
    opts = [
        ak.AdamW(m.parameters(), lr=1e-2, state_dtype="8bit", accum_steps=accum_steps, seed=7) for m in (model, twin)
    ]
    per_window = accum_steps or 1
    for i, x in enumerate(xs):
        for m, opt in zip((model, twin), opts):
            m(x).float().square().mean().backward()
            last = (i + 1) % per_window == 0
            if m is model and i == 1 and last:
                opt.param_groups[0]["amsgrad"] = True
                before = [p.detach().clone() for p in m.parameters()]
                with pytest.raises(ValueError, match="amsgrad=True.*param group 0"):
                    opt.step()
                assert all(torch.equal(a, b) for a, b in zip(before, m.parameters()))
                opt.param_groups[0]["amsgrad"] = False
            opt.step()
            if accum_steps is None or last:
                opt.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))


def test_an_amsgrad_checkpoint_is_refused_whole_by_8bit_state():
    """torch's AdamW(amsgrad=True) state dict would switch amsgrad on in the
    8-bit optimizer's groups: refused by name before anything is loaded."""
    model = _model()
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2, amsgrad=True)
    model(torch.randn(3, 300).bfloat16()).float().square().mean().backward()
    plain.step()
    plain.zero_grad()
    opt = ak.AdamW(model.parameters(), lr=1e-2, state_dtype="8bit", seed=7)
    before = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match="amsgrad=True.*the checkpoint's param group 0"):
        opt.load_state_dict(plain.state_dict())
    after = opt.state_dict()
    assert after["param_groups"] == before["param_groups"] and not after["state"]


def test_native_entry_checks_8bit_arguments_by_name(native_only):
    """Called directly (torch.ops, past accumkernels.ops' checks), the native
    kernels still refuse wrong scales and amsgrad with 8-bit state, by name,
    before they touch memory."""
    n = 300
    p, b = torch.zeros(n), torch.ones(n)
    codes = [torch.zeros(n, dtype=torch.uint8), torch.zeros(n, dtype=torch.uint8)]

    def call(scales, amsgrad=False):
        torch.ops.accumkernels.adamw_step_and_zero_(
            [p],
            [b],
            [codes[0]],
            [codes[1]],
            [codes[0]] if amsgrad else [],
            [torch.zeros(())],
            [],
            [scales[0]],
            [scales[1]],
            1e-3,
            0.9,
            0.999,
            1e-8,
            0.0,
            amsgrad,
            1.0,
            None,
            None,
            True,
            False,
            0,
            [],
        )

    with pytest.raises(ValueError, match=r"exp_avg_scales\[0\] has 3 elements; expected 2"):
        call([torch.zeros(3), torch.zeros(2)])
    with pytest.raises(ValueError, match="amsgrad"):
        call([torch.zeros(2), torch.zeros(2)], amsgrad=True)
    assert torch.equal(b, torch.ones(n)) and not p.any()


def test_uint8_momentum_without_scales_is_refused():
    with pytest.raises(ValueError, match="momentum_buffer_scales"):
        ak.sgd_step_and_zero_(
            [torch.zeros(4)], [torch.zeros(4)], [torch.zeros(4, dtype=torch.uint8)], lr=0.1, momentum=0.9
        )


def _sgd_8bit(backend, params, grads, state, is_first: list[bool], nesterov=False, layout=(0, 0)):
    """SGD steps (momentum 0.9) over copies of the inputs (placed at
    ``layout``'s offsets); returns (params, codes, scales)."""
    at, codes_at = layout
    p = [_placed(x, at) for x in params]
    codes, scales = [_placed(c, codes_at) for c, _ in state], [s.clone() for _, s in state]
    for k, first in enumerate(is_first):
        ak.sgd_step_and_zero_(
            p,
            [_placed(g, at) for g in grads],
            codes,
            momentum_buffer_scales=scales,
            lr=0.05,
            momentum=0.9,
            dampening=0.0 if nesterov else 0.1,
            weight_decay=0.01,
            nesterov=nesterov,
            is_first_step=first,
            stochastic_rounding=True,
            seed=21 + k,
            backend=backend,
        )
    return p, codes, scales


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
@pytest.mark.parametrize("nesterov", [False, True], ids=["dampening", "nesterov"])
def test_every_backend_steps_8bit_momentum_to_the_reference_bits(backend, nesterov, layout):
    """SGD's momentum buffer in 8 bits (stored as exp_avg): a first step and two
    running ones, the inputs placed as ``layout`` says; SGD's update has no pow,
    so codes, scales and params (bf16 ones rounded stochastically) all equal
    the reference's to the bit."""
    g = _generator()
    params = [(torch.randn(n, generator=g)).to(d) for n, d in zip(STEP_SIZES, STEP_DTYPES)]
    grads = [torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g) * 2) for n in STEP_SIZES]
    state = [m for m, _ in _random_8bit_state(STEP_SIZES, g)]
    steps = [True, False, False]
    ours = _sgd_8bit(backend, params, grads, state, steps, nesterov, layout)
    ref = _sgd_8bit("reference", params, grads, state, steps, nesterov)
    for k, name in enumerate(("params", "codes", "scales")):
        for i, n in enumerate(STEP_SIZES):
            assert torch.equal(ours[k][i], ref[k][i]), (name, n)


def test_8bit_momentum_against_float64_sgd():
    """The 8-bit momentum buffer b = 0.9 b + g against float64's on the same
    gradients: as Adam's exp_avg (test_moments_against_float64_adam), each
    encode adds a zero-mean error of at most one grid step (1/8 of the
    value's binade), carried on with weight 0.9 a step: relative L2 error at
    most (1/16) / sqrt(1 - 0.9^2) = 0.143; asserted with a 1.25 margin."""
    g = _generator()
    n, mu = 20000, 0.9
    scale = torch.exp(torch.randn(n, generator=g) * 2)
    codes, scales = torch.zeros(n, dtype=torch.uint8), torch.zeros(s8.scales_numel(n))
    exact = torch.zeros(n, dtype=torch.float64)
    for t in range(60):
        grad = torch.randn(n, generator=g) * scale
        ak.sgd_step_and_zero_(
            [torch.zeros(n)],
            [grad.clone()],
            [codes],
            momentum_buffer_scales=[scales],
            lr=0.0,
            momentum=mu,
            is_first_step=t == 0,
            seed=t,
            backend="reference",
        )
        exact = grad.double() if t == 0 else mu * exact + grad.double()
        if t >= 10:
            ours = s8.decode_exp_avg(codes, scales).double()
            assert float((ours - exact).norm() / exact.norm()) <= 1.25 * (1 / 16) / (1 - mu**2) ** 0.5


def test_sgd_wrapper_keeps_8bit_momentum_and_resumes_bitwise():
    """The wrapper's SGD with state_dtype='8bit': the state dict holds the
    momentum buffer's codes and scales, a mid-window checkpoint resumes to the
    bit, and the dequantized state dict loads into torch.optim.SGD."""
    model = _model()

    def wrapped(m):
        opt = torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9, dampening=0.1)
        return ak.AccumulatingOptimizer(opt, accum_steps=2, state_dtype="8bit", seed=3)

    opt = wrapped(model)
    g = _generator()
    _micro_steps(model, opt, 5, g)
    sd = copy.deepcopy(opt.state_dict())
    assert sorted(sd["state"][0]) == ["momentum_buffer_codes", "momentum_buffer_scales"]
    twin, _ = _resume_and_go_on(model, opt, sd, wrapped, g)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin.parameters()))
    plain = torch.optim.SGD(copy.deepcopy(model).parameters(), lr=0.05, momentum=0.9, dampening=0.1)
    dequantized = ak.optim.dequantized_state_dict(opt.state_dict())
    plain.load_state_dict({k: v for k, v in dequantized.items() if k != "accumkernels"})
    entry = opt.state_dict()["state"][0]
    expected = s8.decode_exp_avg(entry["momentum_buffer_codes"], entry["momentum_buffer_scales"])
    assert torch.equal(dequantized["state"][0]["momentum_buffer"], expected)
    # torch.optim casts a loaded momentum buffer to its param's dtype (bf16 here)
    assert torch.equal(plain.state_dict()["state"][0]["momentum_buffer"], expected.bfloat16())


def test_a_checkpoint_with_codes_but_no_scales_is_refused_whole():
    model = _model()
    opt = _wrapped(model)
    _micro_steps(model, opt, 4, torch.Generator().manual_seed(3))
    sd = copy.deepcopy(opt.state_dict())
    del sd["state"][0]["exp_avg_scales"]
    other = _wrapped(copy.deepcopy(model))
    before = copy.deepcopy(other.state_dict())
    with pytest.raises(ValueError, match="exp_avg_scales"):
        other.load_state_dict(sd)
    assert other.state_dict()["state"] == before["state"]


def _reset_between_windows(optimizer_class, hyper, reset) -> nn.Module:
    """Two windows, ``reset(opt, params)`` on the state, two more windows
    (8-bit state); the same gradients for every ``reset``."""
    model = _model()
    opt = ak.AccumulatingOptimizer(
        optimizer_class(model.parameters(), **hyper), accum_steps=2, state_dtype="8bit", seed=7
    )
    g = torch.Generator().manual_seed(11)
    _micro_steps(model, opt, 4, g)
    reset(opt, list(model.parameters()))
    _micro_steps(model, opt, 4, g)
    return model


@pytest.mark.parametrize(
    "optimizer_class, hyper, key, set_to",
    [
        (torch.optim.AdamW, dict(lr=1e-2), "exp_avg", "zeros"),
        (torch.optim.AdamW, dict(lr=1e-2), "exp_avg_sq", "zeros"),
        (torch.optim.SGD, dict(lr=0.05, momentum=0.9), "momentum_buffer", "zeros"),
        (torch.optim.SGD, dict(lr=0.05, momentum=0.9), "momentum_buffer", None),
    ],
    ids=["adamw-exp_avg", "adamw-exp_avg_sq", "sgd-momentum", "sgd-momentum-None"],
)
def test_a_moment_set_in_the_state_is_what_the_next_step_uses(optimizer_class, hyper, key, set_to):
    """torch code resets a moment by setting it in the state
    (``opt.state[p]["exp_avg"] = torch.zeros_like(p)``; torch's SGD starts its
    momentum anew from the gradient where ``momentum_buffer`` is None). With
    8-bit state the moment is kept as codes and scales, which the step used
    instead, silently: a plain value set since is encoded at the next step and
    replaces them, and None starts the momentum anew. References: the codes
    and scales zeroed (code 0 is 0), or the param's state emptied."""

    def set_plain(opt, params):
        for p in params:
            opt.state[p][key] = None if set_to is None else torch.zeros_like(p)

    def reference(opt, params):
        for p in params:
            if set_to is None:
                opt.state[p] = {}
            else:
                opt.state[p][key + "_codes"].zero_()
                opt.state[p][key + "_scales"].zero_()

    done = _reset_between_windows(optimizer_class, hyper, set_plain)
    expected = _reset_between_windows(optimizer_class, hyper, reference)
    untouched = _reset_between_windows(optimizer_class, hyper, lambda opt, params: None)
    assert all(torch.equal(a, b) for a, b in zip(done.parameters(), expected.parameters()))
    assert not torch.equal(done[0].weight, untouched[0].weight)
