"""AccumulatingOptimizer: N micro-batches equal one big batch, bf16 exactness,
"items" normalization, GradScaler (both loops), clipping, schedulers, unused
params, param groups, checkpoints (bitwise resume mid-window), bad use."""

from __future__ import annotations

import copy
import io
import math

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import accumkernels as ak
from accumkernels.optim._folded import FoldedGrad
from accumkernels.testing import GPT

# Adam's update lr * m / (sqrt(v) + eps) turns a gradient element near zero
# into a step of up to lr whatever its size, so the summation-order noise of
# micro-batches (about 1e-9 here) would move such elements by ~1e-3 with the
# default eps=1e-8. eps=1e-4 keeps that noise below the 1e-5 tolerance; the
# kernels' parity with torch.optim at the default eps is tested on identical
# gradients in test_steps.py.
ADAM_EPS = 1e-4
OPTIMIZERS = {
    "sgd": (torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=1e-3)),
    "adam": (torch.optim.Adam, dict(lr=1e-2, weight_decay=1e-3, eps=ADAM_EPS)),
    "adamw": (torch.optim.AdamW, dict(lr=1e-2, weight_decay=0.1, amsgrad=True, eps=ADAM_EPS)),
}


def mlp(norm: str = "layer", dtype=torch.float32) -> nn.Module:
    torch.manual_seed(1234)
    norms = {"layer": nn.LayerNorm(32), "group": nn.GroupNorm(4, 32), "batch": nn.BatchNorm1d(32)}
    return nn.Sequential(nn.Linear(12, 32), norms[norm], nn.GELU(), nn.Linear(32, 3)).to(dtype)


def data(n: int = 64):
    return torch.randn(n, 12), torch.randn(n, 3)


def rel_diff(model_a: nn.Module, model_b: nn.Module) -> float:
    return max(
        ((a.double() - b.double()).abs().max() / b.double().abs().max().clamp_min(1e-12)).item()
        for a, b in zip(model_a.parameters(), model_b.parameters())
    )


# Runs through the wrapper against a plain run: the plain run is torch's own
# accumulation of the same micro-batches (big_batch_run), which hands the
# optimizer the wrapper's window gradient bit for bit.
# What is left is the fused step's own rounding, at most 8 fp32 ulps of the
# largest param a window, so for up to 10 windows:
PARITY = 1e-5  # >= 8 * 10 * 2^-23


def big_batch_run(model, opt, windows, *, clip=None, scheduler=None, n_micro=4):
    """One plain step per window on the window's gradient, summed over its
    ``n_micro`` micro-batches as torch accumulates them (loss / n_micro into
    .grad; n_micro a power of two, so the scaling is exact and the sum is the
    wrapper's fp32 sum times 1 / n_micro, bit for bit); ``n_micro=1``:
    one backward of the whole batch (its gradient then differs from the
    micro-batches' sum by fp32 summation order)."""
    for x, y in windows:
        opt.zero_grad()
        for xb, yb in zip(x.chunk(n_micro), y.chunk(n_micro)):
            (F.mse_loss(model(xb), yb) / n_micro).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        if scheduler:
            scheduler.step()


def micro_batch_run(model, opt, windows, n_micro, *, scheduler=None):
    for x, y in windows:
        for xb, yb in zip(x.chunk(n_micro), y.chunk(n_micro)):
            F.mse_loss(model(xb), yb).backward()
            opt.step()
            opt.zero_grad()
            if scheduler and opt.window_stepped:
                scheduler.step()


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_micro_batches_equal_big_batch(backend, name):
    cls, hyper = OPTIMIZERS[name]
    windows = [data() for _ in range(4)]
    plain, ours = mlp(), mlp()
    big_batch_run(plain, cls(plain.parameters(), **hyper), windows)
    opt = ak.AccumulatingOptimizer(cls(ours.parameters(), **hyper), accum_steps=4, backend=backend)
    micro_batch_run(ours, opt, windows, 4)
    assert rel_diff(ours, plain) <= PARITY
    # (.grad None after zero_grad(), as torch's; a marker after a backward)
    assert all(p.grad is None or isinstance(p.grad, FoldedGrad) for p in ours.parameters()), "no .grad storage"


def test_accumulated_grad_is_torchs_accumulated_grad(backend):
    """Before the window's last step(): the fp32 sum of the micro-batches so far
    times 1/4, bit for bit the .grad torch accumulates from loss / 4 (the same
    additions in the same order, scaled exactly by a power of two)."""
    x, y = data()
    plain, ours = mlp(), mlp()
    for xb, yb in zip(x.chunk(4), y.chunk(4)):
        (F.mse_loss(plain(xb), yb) / 4).backward()
    opt = ak.AccumulatingOptimizer(torch.optim.SGD(ours.parameters(), lr=0.1), accum_steps=4, backend=backend)
    for i, (xb, yb) in enumerate(zip(x.chunk(4), y.chunk(4))):
        F.mse_loss(ours(xb), yb).backward()
        if i < 3:
            opt.step()
    for p_plain, p_ours in zip(plain.parameters(), ours.parameters()):
        assert torch.equal(opt.accumulated_grad(p_ours), p_plain.grad)


def test_bf16_accumulation_is_exact_where_grad_is_not(backend, capsys):
    """N = 32 micro-batches of a bf16 model: the wrapper's fp32 sum against a
    float64 sum of the very same bf16 micro-batch gradients, next to the plain
    path that adds them in bf16 into .grad."""
    n_micro = 32
    plain = mlp(dtype=torch.bfloat16)
    ours = copy.deepcopy(plain)
    probe = copy.deepcopy(plain)
    opt = ak.AccumulatingOptimizer(torch.optim.SGD(ours.parameters(), lr=0.1), normalize="sum", backend=backend)
    exact = [torch.zeros_like(p, dtype=torch.float64) for p in probe.parameters()]
    for _ in range(n_micro):
        x, y = (t.bfloat16() for t in data(16))
        grads = torch.autograd.grad(F.mse_loss(probe(x), y), list(probe.parameters()))
        for e, g in zip(exact, grads):
            e += g.double()
        F.mse_loss(plain(x), y).backward()
        F.mse_loss(ours(x), y).backward()

    def error(tensors):
        num = sum(((t.double() - e) ** 2).sum() for t, e in zip(tensors, exact)) ** 0.5
        return (num / sum((e**2).sum() for e in exact) ** 0.5).item()

    plain_error = error([p.grad for p in plain.parameters()])
    ours_error = error([opt.accumulated_grad(p) for p in ours.parameters()])
    with capsys.disabled():
        print(
            f"\n  bf16, N={n_micro}: relative error of the summed gradient vs float64: "
            f"plain .grad {plain_error:.2e}, accumkernels {ours_error:.2e}"
        )
    assert ours_error * 100 <= plain_error


def test_items_normalization_weights_tokens(backend):
    """Micro-batches of different lengths with a sum-reduced loss and
    step(num_items=...) equal the token-weighted big batch ("mean" does not)."""
    lengths = [3, 17, 9, 35]
    chunks = [data(n) for n in lengths]
    x = torch.cat([c[0] for c in chunks])
    y = torch.cat([c[1] for c in chunks])
    plain, ours, naive = mlp(), mlp(), mlp()
    # SGD: linear in the gradient, so the comparison is not at the mercy of
    # Adam's m / sqrt(v) for elements whose sum nearly cancels.
    hyper = dict(lr=0.1, momentum=0.9)
    big_batch_run(plain, torch.optim.SGD(plain.parameters(), **hyper), [(x, y)], n_micro=1)
    opt = ak.AccumulatingOptimizer(
        torch.optim.SGD(ours.parameters(), **hyper), accum_steps=4, normalize="items", backend=backend
    )
    naive_opt = ak.AccumulatingOptimizer(torch.optim.SGD(naive.parameters(), **hyper), accum_steps=4, backend=backend)
    for i, (xb, yb) in enumerate(chunks):
        F.mse_loss(ours(xb), yb, reduction="sum").div(3).backward()  # 3 outputs per item
        opt.step(num_items=torch.tensor(float(lengths[i])) if i % 2 else lengths[i])
        F.mse_loss(naive(xb), yb).backward()
        naive_opt.step()
    # One SGD window on the whole batch: lr times the fp32 summation-order
    # difference of the gradient (~1e-7 of it), far below 1e-5 of the params.
    assert rel_diff(ours, plain) <= 1e-5
    assert rel_diff(naive, plain) > 1e-3, "the mean of micro-batch means should differ from the token mean"


@pytest.mark.parametrize("loop", ["docs-loop", "wrapper-counts"])
def test_grad_scaler_skips_a_window_with_inf(backend, loop):
    n_micro = 4
    windows = [data() for _ in range(3)]
    ours = mlp()
    reference = mlp()
    scaler = torch.amp.GradScaler(torch.get_default_device().type, init_scale=2.0**10, growth_interval=1000)
    accum = None if loop == "docs-loop" else n_micro
    opt = ak.AccumulatingOptimizer(
        torch.optim.AdamW(ours.parameters(), lr=1e-2, eps=ADAM_EPS),
        accum_steps=accum,
        grad_scaler=scaler,
        backend=backend,
    )
    before = [p.detach().clone() for p in ours.parameters()]
    for w, (x, y) in enumerate(windows):
        for m, (xb, yb) in enumerate(zip(x.chunk(n_micro), y.chunk(n_micro))):
            loss = F.mse_loss(ours(xb), yb)
            if w == 0 and m == 1:
                loss = loss * float("inf")  # one poisoned micro-batch
            if loop == "docs-loop":
                scaler.scale(loss / n_micro).backward()
                if m == n_micro - 1:
                    scaler.step(opt)
                    scaler.update()
                    opt.zero_grad()
            else:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
                opt.zero_grad()
        if w == 0:
            assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), before)), "the inf window must be skipped"
            assert scaler.get_scale() == 2.0**9, "the scaler backs off once"
            assert not opt.state or all(s["step"].item() == 0 for s in opt.state.values())
    # The run equals a plain run of the two clean windows.
    big_batch_run(reference, torch.optim.AdamW(reference.parameters(), lr=1e-2, eps=ADAM_EPS), windows[1:])
    assert rel_diff(ours, reference) <= PARITY


def test_clipping_matches_torch(backend):
    windows = [(x * 30, y) for x, y in (data() for _ in range(3))]
    plain, ours, manual = mlp(), mlp(), mlp()
    big_batch_run(plain, torch.optim.SGD(plain.parameters(), lr=0.05), windows, clip=0.5, n_micro=2)
    opt = ak.AccumulatingOptimizer(
        torch.optim.SGD(ours.parameters(), lr=0.05), accum_steps=2, max_grad_norm=0.5, backend=backend
    )
    micro_batch_run(ours, opt, windows, 2)
    assert rel_diff(ours, plain) <= PARITY
    assert opt.last_grad_norm is not None and opt.last_grad_norm.item() > 0.5

    # clip_grad_norm_ returns the norm torch computes on the big-batch gradient.
    x, y = windows[0]
    manual_opt = ak.AccumulatingOptimizer(torch.optim.SGD(manual.parameters(), lr=0.05), backend=backend)
    F.mse_loss(manual(x), y).backward()
    norm = manual_opt.clip_grad_norm_(0.5)
    probe = mlp()
    F.mse_loss(probe(x), y).backward()
    expected = torch.nn.utils.clip_grad_norm_(probe.parameters(), 1e9)
    # The same .grad values, their squares summed in other orders: each sum
    # within gamma_n = n u / (1 - n u) of the exact one (Higham), so the norms too.
    n, u = sum(p.numel() for p in probe.parameters()), 2.0**-24
    torch.testing.assert_close(norm, expected, rtol=n * u / (1 - n * u), atol=0)


def test_lr_scheduler_and_param_groups(backend):
    windows = [data() for _ in range(4)]
    plain, ours = mlp(), mlp()

    def groups(model):
        return [
            {"params": model[0].parameters(), "lr": 0.05},
            {"params": list(model[1].parameters()) + list(model[3].parameters()), "lr": 0.2, "momentum": 0.5},
        ]

    plain_opt = torch.optim.SGD(groups(plain), lr=0.1)
    big_batch_run(plain, plain_opt, windows, scheduler=torch.optim.lr_scheduler.StepLR(plain_opt, 1, gamma=0.5))
    opt = ak.AccumulatingOptimizer(torch.optim.SGD(groups(ours), lr=0.1), accum_steps=4, backend=backend)
    micro_batch_run(ours, opt, windows, 4, scheduler=torch.optim.lr_scheduler.StepLR(opt, 1, gamma=0.5))
    assert rel_diff(ours, plain) <= PARITY
    assert opt.param_groups[0]["lr"] == pytest.approx(0.05 / 16)


class TwoHeads(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(7)
        self.body = nn.Linear(12, 16)
        self.head_a = nn.Linear(16, 3)
        self.head_b = nn.Linear(16, 3)

    def forward(self, x, head):
        return (self.head_a if head == "a" else self.head_b)(torch.tanh(self.body(x)))


def test_params_without_gradient_are_skipped(backend):
    """head_b gets no gradient in the first window: like torch.optim with
    grad None, no weight decay and no state for it."""
    plain, ours = TwoHeads(), TwoHeads()
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, weight_decay=0.5, eps=ADAM_EPS)
    opt = ak.AccumulatingOptimizer(
        torch.optim.AdamW(ours.parameters(), lr=1e-2, weight_decay=0.5, eps=ADAM_EPS), accum_steps=2, backend=backend
    )
    for heads in (["a", "a"], ["a", "b"]):
        x, y = data(32)
        plain_opt.zero_grad(set_to_none=True)
        sum(F.mse_loss(plain(xb, h), yb) for xb, yb, h in zip(x.chunk(2), y.chunk(2), heads)).div(2).backward()
        plain_opt.step()
        for xb, yb, h in zip(x.chunk(2), y.chunk(2), heads):
            F.mse_loss(ours(xb, h), yb).backward()
            opt.step()
        if heads == ["a", "a"]:
            assert all(ours.head_b.weight not in opt.state for _ in [0])
            assert torch.equal(ours.head_b.weight, TwoHeads().head_b.weight)
    assert rel_diff(ours, plain) <= PARITY


FALLBACKS = {
    "RMSprop": lambda params: torch.optim.RMSprop(params, lr=1e-3, eps=ADAM_EPS),
    "NAdam": lambda params: torch.optim.NAdam(params, lr=1e-3, eps=ADAM_EPS),
    "Adafactor": lambda params: torch.optim.Adafactor(params, lr=1e-2),
    "Muon": lambda params: torch.optim.Muon(params, lr=1e-2),  # 2-D params only
}


@pytest.mark.parametrize("name", list(FALLBACKS))
def test_fallback_optimizer(backend, name):
    """Optimizers without a fused step get the window's gradient as .grad and step
    themselves: against torch's accumulation loop (big_batch_run), which hands
    the optimizer the same window gradient bit for bit, the params are bitwise
    equal (the same optimizer code on the same inputs). Not against one
    backward of the whole batch: its gradient differs from the micro-batches'
    sum by fp32 summation order, which Muon's bf16 Newton-Schulz iteration can
    turn into a bf16 ulp (2^-8) of its update."""
    windows = [data() for _ in range(3)]
    plain, ours = mlp(), mlp()

    def params(model):
        return [p for p in model.parameters() if p.ndim == 2] if name == "Muon" else model.parameters()

    big_batch_run(plain, FALLBACKS[name](params(plain)), windows)
    opt = ak.AccumulatingOptimizer(FALLBACKS[name](params(ours)), accum_steps=4, backend=backend)
    micro_batch_run(ours, opt, windows, 4)
    assert all(torch.equal(a, b) for a, b in zip(ours.parameters(), plain.parameters()))


def test_fallback_optimizer_on_bf16_params_with_either_intake(backend):
    """A fallback optimizer over bf16 params is handed the window's gradient
    as a bf16 .grad: with intake "grad" (.grad otherwise the fp32 buffer,
    grad_dtype fp32) taking .grad back failed at the first step (torch refuses
    a grad_dtype change while a bf16 .grad is held). Both intakes step alike."""
    runs = []
    for accum_steps in (None, 1):
        model = mlp(dtype=torch.bfloat16)
        inner = torch.optim.RMSprop(model.parameters(), lr=1e-3)
        opt = ak.AccumulatingOptimizer(inner, accum_steps=accum_steps, backend=backend)
        _train(model, opt, [(x.bfloat16(), y.bfloat16()) for x, y in (data(8) for _ in range(3))])
        assert opt.intake == ("grad" if accum_steps is None else "hooks")
        runs.append(list(model.parameters()))
    assert all(torch.equal(a, b) for a, b in zip(*runs))


def _train(model, opt, batches):
    for x, y in batches:
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()


PRECISIONS = {
    "defaults": {},  # bf16 params: stochastic rounding, bf16 state
    "master_weights": dict(master_weights=True),
    "remainders": dict(master_weights="remainders"),
    "nearest-fp32-state": dict(stochastic_rounding=False, state_dtype=torch.float32),
}


@pytest.mark.parametrize("precision", list(PRECISIONS))
def test_resume_mid_window_is_bitwise(backend, precision):
    """Stop after 2 windows and 2 micro-steps, save, load into fresh objects:
    the rest of the run is bitwise the same as without stopping."""
    batches = [data(16) for _ in range(16)]

    def make():
        model = mlp(dtype=torch.bfloat16)
        opt = ak.AccumulatingOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-2, eps=ADAM_EPS),
            accum_steps=4,
            backend=backend,
            **PRECISIONS[precision],
        )
        return model, opt

    bf16 = [(x.bfloat16(), y.bfloat16()) for x, y in batches]
    straight, straight_opt = make()
    _train(straight, straight_opt, bf16)

    first, first_opt = make()
    _train(first, first_opt, bf16[:10])
    blob = io.BytesIO()
    torch.save({"model": first.state_dict(), "opt": first_opt.state_dict()}, blob)
    blob.seek(0)
    saved = torch.load(blob)
    resumed, resumed_opt = make()
    resumed.load_state_dict(saved["model"])
    resumed_opt.load_state_dict(saved["opt"])
    assert resumed_opt.micro_steps == 2
    _train(resumed, resumed_opt, bf16[10:])
    for a, b in zip(straight.parameters(), resumed.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("accum_steps", [4, None], ids=["accum_steps=4", "loop-counts"])
@pytest.mark.parametrize("precision", [*PRECISIONS, "8bit", "fallback-rmsprop"])
def test_resume_through_torch_distributed_checkpoint(backend, tmp_path, precision, accum_steps):
    """torch.distributed.checkpoint on one process (get_state_dict, dcp.save,
    dcp.load into a fresh model's and optimizer's, set_state_dict) at a window
    boundary loads the state whole: the moments (8-bit codes and scales
    included) and the master weights or remainders, which ride in each
    param's state as DCP keeps only 'state' and 'param_groups' (before, the
    masters came back rounded to bf16 and the remainders as zeros). Where
    nothing rounds stochastically the rest of the run is bitwise the same as
    without stopping; a stochastic-rounding stream starts anew (not carried:
    a key torch's checkpoints lack would make them fail to load). Both
    intakes: DCP creates a missing state only where every .grad is None
    (with zeros_like(param) .grad, which a bf16 param's fp32 grad_dtype
    refused) or else leaves the template empty (nothing of the state loaded):
    the wrapper creates it; a fallback optimizer (RMSprop) too (DCP's step
    that creates it did nothing there)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    batches = [(x.bfloat16(), y.bfloat16()) for x, y in (data(16) for _ in range(16))]
    options = {**PRECISIONS, "8bit": dict(state_dtype="8bit"), "fallback-rmsprop": {}}[precision]

    def make(seed):
        torch.manual_seed(seed)  # the fresh run's own init: replaced by the checkpoint's
        model = nn.Sequential(nn.Linear(12, 300), nn.GELU(), nn.Linear(300, 3)).bfloat16()
        if precision == "fallback-rmsprop":
            inner = torch.optim.RMSprop(model.parameters(), lr=1e-3, eps=ADAM_EPS)
        else:
            inner = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=ADAM_EPS)
        return model, ak.AccumulatingOptimizer(inner, accum_steps=accum_steps, backend=backend, seed=7, **options)

    def held(opt):  # the state and master weights, by param position
        return [
            ({k: v.clone() if torch.is_tensor(v) else v for k, v in opt.state[r.param].items()}, r.master)
            for r in opt._layout
        ]

    straight, straight_opt = make(0)
    _train(straight, straight_opt, batches)
    first, first_opt = make(0)
    _train(first, first_opt, batches[:8])
    saved = copy.deepcopy(held(first_opt))
    model_state, optim_state = get_state_dict(first, first_opt)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=tmp_path)
    resumed, resumed_opt = make(1)
    model_state, optim_state = get_state_dict(resumed, resumed_opt)
    loaded = {"model": model_state, "optim": optim_state}
    dcp.load(loaded, checkpoint_id=tmp_path)
    set_state_dict(resumed, resumed_opt, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    assert all(state for state, _ in saved)
    for (state, master), (want, want_master) in zip(held(resumed_opt), saved):
        assert set(state) == set(want)  # the carried masters are taken out of the state
        for key, value in want.items():  # the same values in the same dtypes
            assert torch.as_tensor(state[key]).dtype == torch.as_tensor(value).dtype, key
            assert torch.equal(torch.as_tensor(state[key]), torch.as_tensor(value)), key
        assert (master is None) == (want_master is None) and (master is None or torch.equal(master, want_master))
    _train(resumed, resumed_opt, batches[8:])
    if precision in ("master_weights", "remainders", "nearest-fp32-state", "fallback-rmsprop"):
        for a, b in zip(straight.parameters(), resumed.parameters()):
            assert torch.equal(a, b)


def test_a_torch_checkpoint_loads_through_dcp():
    """A torch.optim.AdamW checkpoint saved with torch.distributed.checkpoint
    loads into ours with DCP's default (strict) planner: the template of our
    defaults has no key it lacks. (With master weights, whose entries it
    lacks, dcp.load needs DefaultLoadPlanner(allow_partial_load=True);
    docs/distributed.md.)"""
    import tempfile

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    model = mlp(dtype=torch.bfloat16)
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2, eps=ADAM_EPS)
    _train(model, plain, [(x.bfloat16(), y.bfloat16()) for x, y in (data(8) for _ in range(2))])
    with tempfile.TemporaryDirectory() as folder:
        model_state, optim_state = get_state_dict(model, plain)
        dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=folder)
        fresh = mlp(dtype=torch.bfloat16)
        ours = ak.AdamW(fresh.parameters(), lr=1e-2, eps=ADAM_EPS)
        model_state, optim_state = get_state_dict(fresh, ours)
        loaded = {"model": model_state, "optim": optim_state}
        dcp.load(loaded, checkpoint_id=folder)
        set_state_dict(fresh, ours, model_state_dict=loaded["model"], optim_state_dict=loaded["optim"])
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p, q)
        assert float(ours.state[q]["step"]) == 2
        torch.testing.assert_close(ours.state[q]["exp_avg"], plain.state[p]["exp_avg"].bfloat16())


def test_default_precision_follows_the_param_dtype(backend):
    """bf16 params: stochastically rounded, state in bf16 (10 bytes per param
    with the fp32 buffer: 2 + 4 + 2 + 2); fp32 and fp16 params: fp32 state and
    round to nearest; master weights bring fp32 state."""
    params = [nn.Parameter(torch.randn(40).to(d)) for d in (torch.bfloat16, torch.float32, torch.float16)]
    opt = ak.AccumulatingOptimizer(torch.optim.AdamW(params, lr=1e-2), accum_steps=1, backend=backend)
    sum((p.float() * torch.randn(40)).sum() for p in params).backward()
    opt.step()
    for p in params:
        want = torch.bfloat16 if p.dtype == torch.bfloat16 else torch.float32
        assert opt.state[p]["exp_avg"].dtype == want and opt.state[p]["exp_avg_sq"].dtype == want, p.dtype
        assert opt._layout.record(p).precision.stochastic == (p.dtype == torch.bfloat16)
    x, y = data(8)
    masters = mlp().to(torch.bfloat16)
    opt = ak.AccumulatingOptimizer(
        torch.optim.AdamW(masters.parameters(), lr=1e-2), accum_steps=1, master_weights=True, backend=backend
    )
    F.mse_loss(masters(x.bfloat16()).float(), y).backward()
    opt.step()
    assert all(s["exp_avg"].dtype == torch.float32 for s in opt.state.values())


def test_remainders_are_fp32_master_weights_bit_for_bit(backend):
    """master_weights='remainders' (2 bytes per param) trains like fp32 master
    weights (4 bytes): the fp32 master each (bf16 param, remainder) pair holds
    is the fp32 master of the other run, bit for bit, window after window; the
    param is that master rounded to nearest (ties away from zero)."""
    from accumkernels.backends import reference

    runs = {}
    for kind in (True, "remainders"):
        model = mlp(dtype=torch.bfloat16)
        opt = ak.AccumulatingOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1),
            accum_steps=2,
            master_weights=kind,
            backend=backend,
        )
        torch.manual_seed(5)
        for _ in range(8):
            x, y = data(8)
            F.mse_loss(model(x.bfloat16()).float(), y).backward()
            opt.step()
        runs[kind] = (model, opt)
    (_, fp32_opt), (_, opt) = runs[True], runs["remainders"]
    for r, r32 in zip(opt._layout, fp32_opt._layout):
        assert r.master.dtype == torch.int16 and r32.master.dtype == torch.float32
        joined = reference.join_remainder(r.param.detach(), r.master)
        assert torch.equal(joined.view(torch.int32), r32.master.view(torch.int32))
        assert torch.equal(r.param.detach(), reference.split_remainder(r32.master)[0])


def test_checkpoints_of_other_precisions_load(backend):
    """A checkpoint of the plain torch AdamW over bf16 params (bf16 state), and
    one of a wrapper with fp32 state, load into a wrapper with the defaults
    (bf16 state) and back; masters of another kind are refused whole."""
    model = mlp(dtype=torch.bfloat16)
    plain = torch.optim.AdamW(model.parameters(), lr=1e-2)
    x, y = data(8)
    F.mse_loss(model(x.bfloat16()).float(), y).backward()
    plain.step()
    opt = ak.AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), accum_steps=2, backend=backend)
    opt.load_state_dict(copy.deepcopy(plain.state_dict()))
    p0 = next(model.parameters())
    assert opt.state[p0]["exp_avg"].dtype == torch.bfloat16
    assert torch.equal(opt.state[p0]["exp_avg"], plain.state[p0]["exp_avg"])
    opt.close()
    wide = ak.AccumulatingOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), accum_steps=2, state_dtype=torch.float32, backend=backend
    )
    wide.load_state_dict(copy.deepcopy(opt.state_dict()))
    assert wide.state[p0]["exp_avg"].dtype == torch.float32
    assert torch.equal(wide.state[p0]["exp_avg"], plain.state[p0]["exp_avg"].float())
    back = torch.optim.AdamW(model.parameters(), lr=1e-2)
    back.load_state_dict(copy.deepcopy(wide.state_dict()))
    assert back.state[p0]["exp_avg"].dtype == torch.bfloat16  # torch keeps state in the param dtype
    wide.close()
    fp32_masters = ak.AccumulatingOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), accum_steps=2, master_weights=True, backend=backend
    )
    saved = copy.deepcopy(fp32_masters.state_dict())
    fp32_masters.close()
    rems = ak.AccumulatingOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), accum_steps=2, master_weights="remainders", backend=backend
    )
    with pytest.raises(ValueError, match="remainders"):
        rems.load_state_dict(saved)


def test_rejects_bad_precision_options():
    model = mlp()
    with pytest.raises(ValueError, match="master_weights"):
        ak.AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), master_weights="fp8")
    with pytest.raises(ValueError, match="state_dtype"):
        ak.AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), state_dtype=torch.float16)
    with pytest.raises(ValueError, match="float16"):
        ak.AccumulatingOptimizer(torch.optim.SGD(mlp().half().parameters(), lr=0.1), master_weights="remainders")
    with pytest.raises(ValueError, match="state_dtype needs SGD, Adam or AdamW"):
        ak.AccumulatingOptimizer(torch.optim.RMSprop(model.parameters()), state_dtype=torch.bfloat16)


def test_checkpoints_interoperate_with_the_plain_optimizer(backend):
    windows = [data() for _ in range(2)]
    ours = mlp()
    opt = ak.AccumulatingOptimizer(
        torch.optim.Adam(ours.parameters(), lr=1e-2, eps=ADAM_EPS), accum_steps=2, backend=backend
    )
    micro_batch_run(ours, opt, windows, 2)
    plain = copy.deepcopy(ours)
    plain_opt = torch.optim.Adam(plain.parameters(), lr=1e-2, eps=ADAM_EPS)
    # Through a copy, as through a file: torch's load_state_dict keeps the very
    # tensors it is given, which would tie the two optimizers' state together.
    plain_opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # the extra entry is ignored
    # ... and a plain checkpoint loads into a fresh wrapper.
    again = copy.deepcopy(ours)
    again_opt = ak.AccumulatingOptimizer(
        torch.optim.Adam(again.parameters(), lr=1e-2, eps=ADAM_EPS), accum_steps=2, backend=backend
    )
    again_opt.load_state_dict(copy.deepcopy(plain_opt.state_dict()))
    more = [data() for _ in range(2)]
    big_batch_run(plain, plain_opt, more)
    micro_batch_run(again, again_opt, more, 2)
    assert rel_diff(again, plain) <= PARITY


def test_no_grad_is_kept_beside_the_buffers(backend):
    model = mlp()
    opt = ak.AccumulatingOptimizer(
        torch.optim.SGD(model.parameters(), lr=0.1), accum_steps=4, bucket_cap_mb=0.001, backend=backend
    )
    x, y = data(8)
    F.mse_loss(model(x), y).backward()
    assert all(isinstance(p.grad, FoldedGrad) for p in model.parameters()), "every bucket is folded during backward"
    assert len(opt._layout.buckets) > 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="peak memory is measured with the CUDA allocator")
def test_peak_memory_not_above_fp32_grad_path():
    def peak(use_wrapper):
        torch.cuda.reset_peak_memory_stats()
        model = GPT(d=256, layers=4).cuda()
        inner = torch.optim.AdamW(model.parameters(), lr=1e-3, eps=ADAM_EPS)
        opt = ak.AccumulatingOptimizer(inner, accum_steps=4) if use_wrapper else inner
        idx = torch.randint(0, 256, (8, 64), device="cuda")
        for _ in range(8):
            model.loss(idx, idx).backward()
            opt.step() if use_wrapper else None
        if not use_wrapper:
            inner.step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated()

    assert peak(True) <= peak(False)


def test_gpt_loss_curve_matches_big_batch(backend):
    """A GPT trained through the wrapper (4 micro-batches, clip 1.0) against
    torch's accumulation of the same micro-batches (loss / 4 into .grad, torch's
    clip): the same window gradients, so the params within PARITY (the fused
    step's rounding) and the window losses, their micro-batches' mean, too."""
    torch.manual_seed(0)
    plain = GPT(vocab=64, d=32, layers=2, heads=4, ctx=16)
    ours = copy.deepcopy(plain)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=3e-3, eps=ADAM_EPS)
    opt = ak.AccumulatingOptimizer(
        torch.optim.AdamW(ours.parameters(), lr=3e-3, eps=ADAM_EPS), accum_steps=4, max_grad_norm=1.0, backend=backend
    )
    plain_losses, our_losses, norms = [], [], []
    for _ in range(6):
        idx = torch.randint(0, 64, (16, 16))
        targets = (idx * 7 + 3) % 64  # learnable: a fixed map from each token
        plain_opt.zero_grad()
        loss = 0.0
        for xb, tb in zip(idx.chunk(4), targets.chunk(4)):
            micro = plain.loss(xb, tb) / 4
            micro.backward()
            loss += micro.item()
        norms.append(torch.nn.utils.clip_grad_norm_(plain.parameters(), 1.0).item())
        plain_opt.step()
        plain_losses.append(loss)
        window = 0.0
        for xb, tb in zip(idx.chunk(4), targets.chunk(4)):
            micro = ours.loss(xb, tb)
            micro.backward()
            opt.step()
            window += micro.item() / 4
        our_losses.append(window)
    assert plain_losses[-1] < plain_losses[0], "the model must learn"
    # The losses are of params within PARITY of each other (the loss's relative
    # change is at most its condition number times that; cross-entropy of a
    # small GPT: far below 1e3), summed as fp32 items in the same order.
    assert rel_diff(ours, plain) <= PARITY
    # A window's loss is of params within PARITY * max|p| of each other per
    # element: it moves by at most |grad L| * |dp| <= norm * sqrt(n) * PARITY * max|p|
    # (norm: the largest pre-clip gradient norm seen), against the smallest loss.
    n = sum(p.numel() for p in plain.parameters())
    largest = max(p.detach().abs().max().item() for p in plain.parameters())
    rtol = max(norms) * math.sqrt(n) * PARITY * largest / min(plain_losses)
    torch.testing.assert_close(torch.tensor(our_losses), torch.tensor(plain_losses), rtol=rtol, atol=0)


@pytest.mark.parametrize("norm,equal", [("layer", True), ("group", True), ("batch", False)])
def test_batchnorm_caveat(backend, norm, equal):
    """BatchNorm normalizes with each micro-batch's statistics, so N micro-batches
    are not the big batch; LayerNorm and GroupNorm work per sample, so they are
    (SGD, 2 windows: the big batch's gradient differs from the micro-batches'
    sum by fp32 summation order only, lr times that is far below 1e-5 of the
    params; BatchNorm's differ by far more than 1e-3)."""
    windows = [data() for _ in range(2)]
    plain, ours = mlp(norm), mlp(norm)
    big_batch_run(plain, torch.optim.SGD(plain.parameters(), lr=0.1), windows, n_micro=1)
    opt = ak.AccumulatingOptimizer(torch.optim.SGD(ours.parameters(), lr=0.1), accum_steps=4, backend=backend)
    micro_batch_run(ours, opt, windows, 4)
    assert rel_diff(ours, plain) <= 1e-5 if equal else rel_diff(ours, plain) > 1e-3


# ---- bad use -------------------------------------------------------------


def test_rejects_bad_arguments():
    model = mlp()
    with pytest.raises(ValueError, match="accum_steps"):
        ak.AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accum_steps=0)
    with pytest.raises(ValueError, match="normalize"):
        ak.AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), normalize="median")
    with pytest.raises(TypeError, match="torch.optim.Optimizer"):
        ak.AccumulatingOptimizer(model.parameters())
    with pytest.raises(ValueError, match="master_weights"):
        ak.AccumulatingOptimizer(torch.optim.RMSprop(model.parameters()), master_weights=True)


def test_rejects_a_param_in_two_groups():
    model = mlp()
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    inner.param_groups.append({**inner.param_groups[0], "params": [model[0].weight]})
    with pytest.raises(ValueError, match="list each param once"):
        ak.AccumulatingOptimizer(inner)


def _written_in_place_run(cls, when: str):
    """mlp whose last layer gets no gradient from backward (it is not in the
    forward) but one written by hand into ``.grad``, torch.optim's way (made
    if None, then added into or copied in place), ``when``: before the
    backward, after it, in windows without any backward, or before the
    backward and, every other window, dropped by a zero_grad() after it."""
    model, (x, y) = mlp(), data(16)
    opt = cls(model.parameters(), lr=1e-2, weight_decay=0.1, eps=ADAM_EPS)
    g = torch.Generator().manual_seed(5)

    def write():
        for i, p in enumerate(model[3].parameters()):
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            given = torch.randn(p.shape, generator=g)
            p.grad.add_(given) if i == 0 else p.grad.copy_(given)

    for w in range(6):
        if when != "after" and when != "alone":
            write()
        if when == "dropped-by-optimizer" and w % 2:
            opt.zero_grad()
        if when == "dropped-by-model" and w % 2:
            model.zero_grad()
        if when != "alone" or w % 2:
            F.mse_loss(model[:3](x[w::6])[:, :3], y[w::6]).backward()
        if when in ("after", "alone"):
            write()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("when", ["before", "after", "alone", "dropped-by-optimizer", "dropped-by-model"])
def test_gradients_written_into_grad_in_place_are_stepped_as_torchs(when):
    """A .grad written in place (``p.grad.add_``, ``p.grad.copy_``) on a param
    no backward gave a gradient is stepped, as torch.optim steps it (intake
    "grad", where .grad is never None: such writes were dropped before), and
    discarded by a zero_grad() of the optimizer or the model before the step,
    as torch's (every other window). Bound: PARITY (the fused step's rounding)."""
    ours = _written_in_place_run(ak.AdamW, when)
    plain = _written_in_place_run(torch.optim.AdamW, when)
    for a, b in zip(ours, plain):
        assert (a - b).abs().max() <= PARITY * b.abs().max()
    assert not torch.equal(ours[-1], mlp()[3].bias.detach()), "the written layer must train"


def test_autograd_bumps_the_version_of_grad_once_per_gradient():
    """What intake "grad" counts on to see writes into .grad that are not
    autograd's (_take_written): each gradient autograd adds into a .grad that
    is a view of a flat buffer bumps the flat buffer's version exactly once,
    for an fp32 param and a bf16 param whose grad_dtype is fp32."""
    for dtype in (torch.float32, torch.bfloat16):
        p = nn.Parameter(torch.ones(3, dtype=dtype))
        flat = torch.zeros(8)
        if dtype != torch.float32:
            p.grad_dtype = torch.float32
        p.grad = flat[2:5]
        before = flat._version
        for n in range(1, 4):
            (p * 2).sum().backward()
            assert flat._version == before + n
        assert torch.equal(flat[2:5], torch.full((3,), 6.0))


def _master_weights_run(load=None, windows: int = 6):
    """bf16 mlp, AdamW with fp32 master weights; ``load(model, opt)`` after
    window 3 may load weights into the model, or swap in a resumed model and
    optimizer (returning them)."""
    model = mlp(dtype=torch.bfloat16)
    opt = ak.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1, master_weights=True)
    g = torch.Generator().manual_seed(6)
    for w in range(windows):
        if w == 3 and load is not None:
            model, opt = load(model, opt) or (model, opt)
        x, y = torch.randn(4, 12, generator=g), torch.randn(4, 3, generator=g)
        F.mse_loss(model(x.bfloat16()).float(), y).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("how", ["load_state_dict", "no_grad_copy", "detach_copy", "data_assigned"])
def test_master_weights_follow_weights_loaded_into_the_model(how):
    """Weights loaded into the model mid-run (here: its initial ones) are
    where training goes on from, as with torch.optim: the fp32 masters follow
    the params (they would otherwise overwrite them at the next step). The
    reference is the public way to the same: a plain torch checkpoint of the
    optimizer loaded beside the new weights (its masters made from them)."""
    start = mlp(dtype=torch.bfloat16).state_dict()

    def write(model, opt):
        if how == "load_state_dict":
            model.load_state_dict(start)
        for p, w in zip(model.parameters(), start.values()):
            if how == "no_grad_copy":
                with torch.no_grad():
                    p.copy_(w)
            elif how == "detach_copy":
                p.detach().copy_(w)
            elif how == "data_assigned":
                p.data = w.clone()

    def rebuild(model, opt):
        plain = opt.state_dict()
        plain.pop("accumkernels")
        fresh = mlp(dtype=torch.bfloat16)
        fresh_opt = ak.AdamW(fresh.parameters(), lr=1e-2, weight_decay=0.1, master_weights=True)
        fresh_opt.load_state_dict(plain)
        return fresh, fresh_opt

    followed, _ = _master_weights_run(write)
    reference, _ = _master_weights_run(rebuild)
    assert all(torch.equal(a, b) for a, b in zip(followed.parameters(), reference.parameters()))
    untouched, _ = _master_weights_run()
    assert not torch.equal(followed[0].weight, untouched[0].weight)


@pytest.mark.parametrize("write", ["clamp", "copy"])
def test_master_weights_follow_writes_through_data(write):
    """A write through ``p.data`` (WGAN's weight clipping ``p.data.clamp_``,
    ``p.data.copy_(w)``) bumps no version counter, so only the step sees it:
    element by element, where the param no longer is its master rounded, the
    step starts from the param (master_or_param), as torch.optim steps from
    the param as it is. Reference: the same write made on a checkpoint (the
    masters set to the written params where these changed) and loaded
    beside the written model into a fresh optimizer."""
    start = mlp(dtype=torch.bfloat16).state_dict()

    def written(model):
        before = [p.detach().clone() for p in model.parameters()]
        for p, w in zip(model.parameters(), start.values()):
            if write == "clamp":
                p.data.clamp_(-0.1, 0.1)
            else:
                p.data.copy_(w)
        return [p.detach() != b for p, b in zip(model.parameters(), before)]

    def write(model, opt):
        written(model)

    def rebuild(model, opt):
        saved = copy.deepcopy(opt.state_dict())
        masters = saved["accumkernels"]["master_weights"].values()
        for changed, p, master in zip(written(model), model.parameters(), masters):
            master[changed] = p.detach()[changed].float()
        fresh = mlp(dtype=torch.bfloat16)
        fresh.load_state_dict(model.state_dict())
        fresh_opt = ak.AdamW(fresh.parameters(), lr=1e-2, weight_decay=0.1, master_weights=True)
        fresh_opt.load_state_dict(saved)
        return fresh, fresh_opt

    followed, _ = _master_weights_run(write)
    reference, _ = _master_weights_run(rebuild)
    assert all(torch.equal(a, b) for a, b in zip(followed.parameters(), reference.parameters()))
    untouched, _ = _master_weights_run()
    assert not torch.equal(followed[0].weight, untouched[0].weight)


@pytest.mark.parametrize("model_first", [True, False])
def test_master_weights_of_a_checkpoint_stay_whichever_is_loaded_first(model_first):
    """Resuming loads the model's weights and the optimizer's checkpoint (its
    fp32 masters) in either order: the masters round to the loaded params, so
    they are kept, and the resumed run is the straight one bit for bit."""
    straight, _ = _master_weights_run()

    def resume(model, opt):
        saved_model, saved_opt = copy.deepcopy(model.state_dict()), copy.deepcopy(opt.state_dict())
        fresh = mlp(dtype=torch.bfloat16)
        fresh_opt = ak.AdamW(fresh.parameters(), lr=1e-2, weight_decay=0.1, master_weights=True)
        if model_first:
            fresh.load_state_dict(saved_model)
        fresh_opt.load_state_dict(saved_opt)
        if not model_first:
            fresh.load_state_dict(saved_model)
        return fresh, fresh_opt

    resumed, _ = _master_weights_run(resume)
    assert all(torch.equal(a, b) for a, b in zip(resumed.parameters(), straight.parameters()))


def test_close_gives_bf16_params_their_grad_dtype_back_with_an_assigned_grad():
    """intake "grad" makes a bf16 param's grad_dtype fp32, so a gradient
    assigned by hand is fp32; close() gives the grad_dtype back, and such a
    .grad is converted to it (torch refuses the change while an fp32 .grad is
    held, which failed here), while the buffer itself leaves .grad: a copy of
    what it held (the backward's gradient) stays there, in bf16, as torch's
    .grad would hold it; a cleared one leaves None."""
    model = mlp(dtype=torch.bfloat16)
    first, head = model[0].weight, model[3].weight
    before = first.grad_dtype
    opt = ak.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(4, 12).bfloat16()).float().sum().backward()
    first.grad = torch.full(first.shape, 0.3)
    held = head.grad.clone()
    opt.close()
    assert first.grad_dtype == before and head.grad_dtype == before
    assert first.grad.dtype == torch.bfloat16 and torch.equal(first.grad, torch.full_like(first, 0.3))
    assert head.grad.dtype == torch.bfloat16 and torch.equal(head.grad, held.bfloat16())
    opt = ak.AdamW(model.parameters(), lr=1e-2)
    opt.zero_grad()
    opt.close()
    assert head.grad is None and first.grad is None
    ak.AdamW(model.parameters(), lr=1e-2).close()  # the params are free again


@pytest.mark.parametrize("intake", ["grad", "hooks"])
def test_a_closed_optimizer_refuses_what_would_use_the_params(intake):
    """After close() the params are free: step() took no gradient, silently
    (intake "hooks": nothing moved), or took .grad back as its buffer (intake
    "grad"); now it, zero_grad(), load_state_dict(), clip_grad_norm_() and
    accumulated_grad() are refused by name, while state_dict() saves the
    window as close() left it, touching no .grad (before, the "hooks" path put
    the closed wrapper's marker back there)."""
    model, (x, y) = mlp(), data(8)
    opt = ak.AdamW(model.parameters(), lr=1e-2, accum_steps=2, intake=intake)
    F.mse_loss(model(x), y).backward()
    saved = opt.state_dict()
    opt.close()
    F.mse_loss(model(x), y).backward()
    grads = [p.grad for p in model.parameters()]
    before = [p.detach().clone() for p in model.parameters()]
    for call in (
        opt.step,
        opt.zero_grad,
        lambda: opt.load_state_dict(saved),
        lambda: opt.clip_grad_norm_(1.0),
        lambda: opt.accumulated_grad(model[0].weight),
    ):
        with pytest.raises(RuntimeError, match="closed"):
            call()
    again = opt.state_dict()
    assert torch.equal(again["accumkernels"]["flat_buffer"], saved["accumkernels"]["flat_buffer"])
    assert all(p.grad is g for p, g in zip(model.parameters(), grads))
    assert all(map(torch.equal, model.parameters(), before))
    opt.close()  # twice: nothing more


def test_bf16_params_holding_a_gradient_when_built_or_added():
    """A gradient a bf16 param holds before the optimizer takes it (a backward
    before it is built; backwards while it trained outside the optimizer,
    before add_param_group) counts, as torch.optim's: .grad becomes the fp32
    buffer holding it (torch refuses the fp32 grad_dtype while a bf16 .grad is
    held, which failed here) and the step equals the one given that gradient
    as an fp32 .grad."""
    x = torch.randn(4, 12)

    def run(assign: bool, late: bool):
        model = mlp(dtype=torch.bfloat16)
        head, first = list(model[3].parameters()), list(model[0].parameters())
        opt = ak.AdamW(head, lr=1e-2, seed=0) if late else None
        model(x.bfloat16()).float().sum().backward()
        if late:
            opt.step()  # the head's window; the first layer's bf16 .grad stays
            opt.zero_grad()
        held = [p.grad.float() for p in first]
        if assign:
            for p in first:
                p.grad = None
        if late:
            opt.add_param_group({"params": first})
        else:
            opt = ak.AdamW([*head, *first], lr=1e-2, seed=0)
        if assign:
            for p, g in zip(first, held):
                p.grad = g
        assert all(p.grad.dtype == torch.float32 and torch.equal(p.grad, g) for p, g in zip(first, held))
        opt.step()
        return [p.detach().clone() for p in model.parameters()]

    for late in (False, True):
        assert all(torch.equal(a, b) for a, b in zip(run(False, late), run(True, late))), late


def _unfreezing_run(cls, dtype, late: bool, **options):
    """mlp's first layer starts frozen; at the fifth window it is unfrozen and
    (``late``) added as a param group, or (not ``late``) held from the start.
    The params after 8 windows, and the optimizer's param groups."""
    model = mlp(dtype=dtype)
    for p in model[0].parameters():
        p.requires_grad_(False)
    head = [*model[1].parameters(), *model[3].parameters()]
    first = {"params": list(model[0].parameters()), "lr": 3e-3}
    kwargs = dict(lr=1e-2, **options) if cls is ak.SGD else dict(lr=1e-2, eps=ADAM_EPS, **options)
    opt = cls(head, **kwargs) if late else cls([{"params": head}, first], **kwargs)
    n = options.get("accum_steps") or 1
    g = torch.Generator().manual_seed(3)
    for i in range(8 * n):
        if i == 4 * n:
            for p in model[0].parameters():
                p.requires_grad_(True)
            if late:
                opt.add_param_group(first)
        x, y = torch.randn(4, 12, generator=g), torch.randn(4, 3, generator=g)
        F.mse_loss(model(x.to(dtype)).float(), y).backward()
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], opt.param_groups


@pytest.mark.parametrize("accum_steps", [None, 1, 3])
@pytest.mark.parametrize(
    "dtype, options",
    [
        (torch.float32, {}),
        (torch.float32, {"state_dtype": "8bit"}),
        (torch.float32, {"max_grad_norm": 0.05}),
        (torch.bfloat16, {}),
        (torch.bfloat16, {"master_weights": True}),
        (torch.bfloat16, {"master_weights": "remainders"}),
        (torch.bfloat16, {"state_dtype": "8bit"}),
    ],
)
def test_add_param_group_trains_as_if_the_group_was_there_from_the_start(accum_steps, dtype, options):
    """Fine-tuning that unfreezes a layer and adds it with add_param_group
    trains bit for bit as the optimizer built with that group (frozen until
    then): the params held before keep their state, master weights and
    stochastic-rounding streams across the new layout."""
    for cls in (ak.AdamW, ak.SGD):
        if cls is ak.SGD and options.get("state_dtype") == "8bit":
            continue
        kwargs = dict(options, accum_steps=accum_steps)
        built, built_groups = _unfreezing_run(cls, dtype, late=False, **kwargs)
        added, added_groups = _unfreezing_run(cls, dtype, late=True, **kwargs)
        assert all(torch.equal(a, b) for a, b in zip(added, built)), (cls.__name__, "params")
        assert [{k: v for k, v in g.items() if k != "params"} for g in added_groups] == [
            {k: v for k, v in g.items() if k != "params"} for g in built_groups
        ]


def test_add_param_group_steps_as_torchs():
    """Against torch.optim.AdamW doing the same, fp32: within the fused step's
    rounding (PARITY: 8 fp32 ulps of the largest param a window)."""
    ours, _ = _unfreezing_run(ak.AdamW, torch.float32, late=True)
    model = mlp()
    for p in model[0].parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW([*model[1].parameters(), *model[3].parameters()], lr=1e-2, eps=ADAM_EPS)
    g = torch.Generator().manual_seed(3)
    for i in range(8):
        if i == 4:
            for p in model[0].parameters():
                p.requires_grad_(True)
            opt.add_param_group({"params": list(model[0].parameters()), "lr": 3e-3})
        x, y = torch.randn(4, 12, generator=g), torch.randn(4, 3, generator=g)
        F.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad()
    for a, b in zip(ours, model.parameters()):
        assert (a - b.detach()).abs().max() <= PARITY * b.detach().abs().max()
    assert not torch.equal(ours[0], mlp()[0].weight.detach()), "the added layer must train"


@pytest.mark.parametrize("intake", ["grad", "hooks"])
def test_add_param_group_refused_mid_window_and_on_bad_groups_leaves_the_optimizer_as_it_was(intake):
    model, (x, y) = mlp(), data(8)
    extra = nn.Parameter(torch.randn(3))
    opt = ak.AdamW(model[0].parameters(), lr=1e-2, accum_steps=2 if intake == "hooks" else None, intake=intake)
    twin = copy.deepcopy((model, opt))
    for m in (model, twin[0]):
        F.mse_loss(m(x), y).backward()
    with pytest.raises(RuntimeError, match="add_param_group mid-window"):
        opt.add_param_group({"params": [extra]})
    assert len(opt.param_groups) == 1
    for m, o in ((model, opt), twin):
        o.step()
        if intake == "hooks":
            F.mse_loss(m(x), y).backward()
            o.step()
    assert opt.window_stepped
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin[0].parameters()))
    with pytest.raises(ValueError, match="more than one parameter group"):  # torch's own check
        opt.add_param_group({"params": [model[0].weight]})
    with pytest.raises(TypeError, match="neither float32, bfloat16 nor float16"):  # ours
        opt.add_param_group({"params": [nn.Parameter(torch.randn(3, dtype=torch.float64))]})
    assert len(opt.param_groups) == 1
    # The wrapper goes on as it was.
    for m, o in ((model, opt), twin):
        o.zero_grad()
        for _ in range(2 if intake == "hooks" else 1):
            F.mse_loss(m(x), y).backward()
            o.step()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin[0].parameters()))


def _regrouping_run(regroup: bool, **options):
    """bf16 mlp, AdamW with fp32 master weights, zero_grad(set_to_none=False):
    the LayerNorm's weight never gets a gradient, the last bias stops getting
    one after window 3 (its zero .grad is stepped on), and (``regroup``) at
    window 5 the param groups are assigned in the other order."""
    model = mlp(dtype=torch.bfloat16)
    model[1].weight.requires_grad_(False)
    groups = [{"params": list(model[0].parameters())}, {"params": [*model[1].parameters(), *model[3].parameters()]}]
    opt = ak.AdamW(groups, lr=1e-2, weight_decay=0.1, master_weights=True, **options)
    g = torch.Generator().manual_seed(4)
    for i in range(8):
        if i == 3:
            model[3].bias.requires_grad_(False)
        if regroup and i == 5:
            opt.param_groups = opt.param_groups[::-1]
        x, y = torch.randn(4, 12, generator=g), torch.randn(4, 3, generator=g)
        F.mse_loss(model(x.bfloat16()).float(), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("intake", ["grad", "hooks"])
def test_param_groups_assigned_over_other_params_lay_the_buffers_out_anew(intake):
    """Assigning param_groups (as Lightning's BaseFinetuning does when resuming)
    renumbers the params: their master weights and zero-.grad flags follow them
    (the steps do not depend on the order: bit for bit the run left alone)."""
    left = _regrouping_run(False, intake=intake)
    regrouped = _regrouping_run(True, intake=intake)
    assert all(torch.equal(a, b) for a, b in zip(regrouped, left))
    assert torch.equal(left[2], mlp(dtype=torch.bfloat16)[1].weight), "a param never given a gradient is not stepped"
    # Mid-window it is refused, and the groups are left as they were.
    model, (x, y) = mlp(), data(8)
    opt = ak.SGD([{"params": list(model[0].parameters())}, {"params": list(model[3].parameters())}], lr=0.1)
    F.mse_loss(model(x), y).backward()
    groups = opt.param_groups
    with pytest.raises(RuntimeError, match="assigning param_groups over other params mid-window"):
        opt.param_groups = groups[::-1]
    assert opt.param_groups is groups
    opt.param_groups = list(groups)  # the same params: set as it is, mid-window too
    opt.step()


@pytest.mark.parametrize("intake", ["grad", "hooks"])
def test_add_param_group_failing_half_way_leaves_the_optimizer_as_it_was(intake, monkeypatch):
    """A failure once the old layout is given up (here: the new intake, after it
    has claimed the params and hooked them) restores the wrapper over its
    groups as they were: the error is the failure's, and training goes on as
    the twin's that never tried."""
    from accumkernels.optim import _intake

    model, (x, y) = mlp(), data(8)
    opt = ak.AdamW(model[0].parameters(), lr=1e-2, eps=ADAM_EPS, intake=intake)
    twin = copy.deepcopy((model, opt))
    cls = _intake.INTAKE_CLASSES[intake]
    built = cls.__init__

    def fails_once(self, *args, **kwargs):
        built(self, *args, **kwargs)
        monkeypatch.setattr(cls, "__init__", built)
        raise MemoryError("the new intake failed")

    monkeypatch.setattr(cls, "__init__", fails_once)
    with pytest.raises(MemoryError, match="the new intake failed") as failure:  # (kept: its frames hold the intake)
        opt.add_param_group({"params": list(model[3].parameters())})
    assert len(opt.param_groups) == 1
    for m, o in ((model, opt), twin):
        for _ in range(2):
            F.mse_loss(m(x), y).backward()
            o.step()
            o.zero_grad()
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin[0].parameters()))
    assert torch.equal(model[3].weight.grad, twin[0][3].weight.grad), "the layer left out keeps plain .grad"
    assert failure.value is not None


def test_params_added_to_the_wrapped_optimizer_are_refused_at_step():
    model = mlp()
    extra = nn.Parameter(torch.randn(3))
    inner = torch.optim.SGD(model[0].parameters(), lr=0.1)
    opt = ak.AccumulatingOptimizer(inner)
    inner.add_param_group({"params": [extra]})
    with pytest.raises(RuntimeError, match="group added to the optimizer it wraps"):
        opt.step()


def test_sparse_gradients_refused_by_hooks_and_densified_by_grad_intake():
    emb = nn.Embedding(10, 4, sparse=True)
    opt = ak.AccumulatingOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1), accum_steps=2, intake="hooks")
    with pytest.raises(RuntimeError, match="sparse"):
        emb(torch.tensor([1, 2])).sum().backward()
    opt.close()
    emb.weight.grad = None  # left by the refused backward
    # intake="grad": autograd adds the sparse gradient into the dense fp32 view.
    plain = copy.deepcopy(emb)
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    opt = ak.AccumulatingOptimizer(torch.optim.SGD(emb.parameters(), lr=0.1), accum_steps=2, intake="grad")
    for idx in (torch.tensor([1, 2]), torch.tensor([2, 7])):
        emb(idx).square().sum().backward()
        opt.step()
        plain(idx).square().sum().div(2).backward()
    plain_opt.step()
    torch.testing.assert_close(emb.weight, plain.weight)


@pytest.mark.parametrize("name", ["Adam", "AdamW"])
def test_sparse_gradients_step_as_torchs_dense_adam(name):
    """torch's Adam and AdamW refuse sparse gradients; ours (intake "grad", the
    default here) add them into the dense fp32 buffer and step the dense
    gradient they equal: torch's step on the same embedding with dense
    gradients (docs/optimizers.md, different on purpose)."""
    sparse = nn.Embedding(10, 4, sparse=True)
    dense = copy.deepcopy(sparse)
    dense.sparse = False
    with pytest.raises(RuntimeError, match="sparse gradients"):
        probe = copy.deepcopy(sparse)
        probe(torch.tensor([1])).sum().backward()
        getattr(torch.optim, name)(probe.parameters()).step()
    ours = getattr(ak, name)(sparse.parameters(), lr=0.01, weight_decay=0.1)
    plain = getattr(torch.optim, name)(dense.parameters(), lr=0.01, weight_decay=0.1)
    for idx in (torch.tensor([1, 2, 2]), torch.tensor([7, 1]), torch.tensor([3])):
        for emb, opt in ((sparse, ours), (dense, plain)):
            emb(idx).square().sum().backward()
            opt.step()
            opt.zero_grad()
    # The same fp32 gradient each step: only the update's operation order
    # differs, at most 8 fp32 ulps of the largest weight a step (test_conformance's bound).
    bound = 3 * 8 * torch.finfo(torch.float32).eps * dense.weight.detach().abs().max().item()
    torch.testing.assert_close(sparse.weight, dense.weight, rtol=0, atol=bound)


def test_items_mode_needs_positive_num_items():
    model = mlp()
    opt = ak.AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), normalize="items")
    x, y = data(4)
    F.mse_loss(model(x), y).backward()
    with pytest.raises(ValueError, match="num_items"):
        opt.step()
    with pytest.raises(ValueError, match="num_items"):
        opt.step(num_items=0)
    mean_opt = ak.AccumulatingOptimizer(torch.optim.SGD(mlp().parameters(), lr=0.1))
    with pytest.raises(ValueError, match="num_items"):
        mean_opt.step(num_items=3)


def test_stochastic_rounding_keeps_small_updates(backend):
    """bf16 params whose every update is a tenth of a bf16 ulp: round to nearest
    never moves them; stochastic rounding moves them by the right amount on average."""
    n, windows, lr = 4096, 40, 1e-3
    results = {}
    for sr in (False, True):
        w = nn.Parameter(torch.ones(n, dtype=torch.bfloat16))
        opt = ak.AccumulatingOptimizer(
            torch.optim.SGD([w], lr=lr), accum_steps=2, stochastic_rounding=sr, backend=backend
        )
        for _ in range(windows * 2):
            (w.float() * 0.5).sum().backward()  # gradient 0.5 per micro-step: mean 0.5, update 5e-4 = ulp / 16
            opt.step()
        results[sr] = w.detach().double().mean().item()
    expected = 1.0 - windows * lr * 0.5
    assert results[False] == 1.0, "round to nearest loses every update"
    assert abs(results[True] - expected) < 0.1 * (1.0 - expected), (results, expected)


def test_stochastic_rounding_excludes_master_weights():
    with pytest.raises(ValueError, match="exclude"):
        ak.AccumulatingOptimizer(
            torch.optim.SGD(mlp().parameters(), lr=0.1), master_weights=True, stochastic_rounding=True
        )


def test_a_dropped_wrapper_is_freed_and_unhooked():
    """The grad hooks hold the wrapper weakly: dropping it frees it (and its
    buffers) at once, and the model trains on with plain .grad afterwards."""
    import gc
    import weakref

    model = mlp()
    opt = ak.AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accum_steps=2)
    x, y = data(8)
    F.mse_loss(model(x), y).backward()
    gc.disable()
    try:
        ref = weakref.ref(opt)
        del opt
        assert ref() is None
    finally:
        gc.enable()
    F.mse_loss(model(x), y).backward()
    assert all(p.grad is not None for p in model.parameters())


# ---- what must never be silent -------------------------------------------------


@pytest.mark.parametrize("intake", ak.AccumulatingOptimizer.INTAKES)
def test_staged_unfreezing(backend, intake):
    """A param frozen when the wrapper is built and unfrozen later (a
    fine-tuning schedule) gets its gradients applied, as with plain AdamW."""
    windows = [data() for _ in range(4)]
    plain, ours = mlp(), mlp()
    for m in (plain, ours):
        m[0].weight.requires_grad_(False)
    plain_opt = torch.optim.AdamW(plain.parameters(), lr=1e-2, eps=ADAM_EPS)
    opt = ak.AccumulatingOptimizer(
        torch.optim.AdamW(ours.parameters(), lr=1e-2, eps=ADAM_EPS), accum_steps=4, intake=intake, backend=backend
    )
    frozen = ours[0].weight.detach().clone()
    for w, (x, y) in enumerate(windows):
        if w == 1:
            for m in (plain, ours):
                m[0].weight.requires_grad_(True)
        if w == 3:  # and frozen again
            for m in (plain, ours):
                m[3].bias.requires_grad_(False)
        big_batch_run(plain, plain_opt, [(x, y)])
        micro_batch_run(ours, opt, [(x, y)], 4)
        if w == 0:
            assert torch.equal(ours[0].weight, frozen)
    assert not torch.equal(ours[0].weight, frozen), "the unfrozen weight must train"
    assert rel_diff(ours, plain) <= PARITY


def test_a_refused_checkpoint_changes_nothing(backend):
    """Another model with as many params of other shapes, or our own
    checkpoint with a param's Adam step missing (torch's AdamW would raise
    KeyError half-loaded), negative or fractional, or a window entry naming a
    param the model lacks or a negative count of gradients: load_state_dict
    raises before anything is written, and the wrapper trains on as before."""
    x, y = data()

    def trained(model):
        opt = ak.AccumulatingOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-2), accum_steps=2, master_weights=False, backend=backend
        )
        micro_batch_run(model, opt, [(x, y)], 2)
        F.mse_loss(model(x[:8]), y[:8]).backward()
        opt.step()  # mid-window
        return opt

    ours, twin = mlp(), mlp()
    opt = trained(ours)
    other = nn.Sequential(nn.Linear(12, 33), nn.LayerNorm(33), nn.GELU(), nn.Linear(33, 3))
    other_opt = ak.AccumulatingOptimizer(torch.optim.AdamW(other.parameters(), lr=1e-2), accum_steps=2, backend=backend)
    F.mse_loss(other(x), y).backward()
    other_opt.step()
    other_opt.step()
    snapshot = copy.deepcopy(opt.state_dict())

    def with_step(step):
        bad = copy.deepcopy(snapshot)
        bad["state"][0].pop("step")
        if step is not None:
            bad["state"][0]["step"] = step
        return bad

    bads = [other_opt.state_dict(), {k: v for k, v in other_opt.state_dict().items() if k != "accumkernels"}]

    def with_window(**entries):
        bad = copy.deepcopy(snapshot)
        bad["accumkernels"].update(entries)
        return bad

    bads += [with_step(None), with_step(torch.tensor(-1.0)), with_step(1.5), with_step(torch.ones(2))]
    bads += [with_window(touched=[0, 99]), with_window(arrivals=[[99, 1]]), with_window(arrivals=[[0, -1]])]
    bads += [with_window(arrivals=[[0, 1.5]]), with_window(arrivals=[0])]
    for bad in bads:
        with pytest.raises(ValueError, match="shape|elements|'step'|checkpoint window"):
            opt.load_state_dict(copy.deepcopy(bad))
        after = opt.state_dict()
        for p in snapshot["state"]:
            for key, value in snapshot["state"][p].items():
                assert torch.equal(after["state"][p][key], value), f"state {key} of param {p} changed"
        assert torch.equal(after["accumkernels"]["flat_buffer"], snapshot["accumkernels"]["flat_buffer"])
        assert after["accumkernels"]["micro_steps"] == 1
    # ... and it trains on exactly like an untouched twin.
    twin_opt = trained(twin)
    for model, o in ((ours, opt), (twin, twin_opt)):
        F.mse_loss(model(x[8:16]), y[8:16]).backward()
        o.step()
    assert rel_diff(ours, twin) == 0


def test_a_second_wrapper_on_the_same_params_is_refused():
    model = mlp()
    first = ak.AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accum_steps=2)
    with pytest.raises(RuntimeError, match="another AccumulatingOptimizer"):
        ak.AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accum_steps=2)
    first.close()  # the explicit hand-over
    second = ak.AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accum_steps=2)
    x, y = data(8)
    F.mse_loss(model(x), y).backward()
    second.step()
    second.step()
    assert second.state_dict()["accumkernels"]["windows"] == 1
    del second  # dropping a wrapper releases its params too
    ak.AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1))


def test_stochastic_rounding_streams_are_per_param_and_per_run(backend):
    """Two groups of identical bf16 params with identical gradients: every
    param draws its own bits (its index in the wrapper is its stream); a run
    draws its seed from torch's generator and saves it."""

    def run(seed=None):
        params = [nn.Parameter(torch.ones(2048, dtype=torch.bfloat16)) for _ in range(4)]
        inner = torch.optim.SGD([{"params": params[:2]}, {"params": params[2:], "momentum": 0.5}], lr=1e-3)
        opt = ak.AccumulatingOptimizer(inner, accum_steps=1, stochastic_rounding=True, seed=seed, backend=backend)
        sum((p.float() * 0.37).sum() for p in params).backward()
        opt.step()
        return params, opt

    params, opt = run(seed=1234)
    assert opt.state_dict()["accumkernels"]["seed"] == 1234
    assert not torch.equal(params[0], params[1]) and not torch.equal(params[0], params[2])
    again, _ = run(seed=1234)
    assert all(torch.equal(a, b) for a, b in zip(params, again)), "the same seed, the same bits"
    torch.manual_seed(1)
    drawn, opt_a = run()
    torch.manual_seed(2)
    other, opt_b = run()
    assert opt_a.state_dict()["accumkernels"]["seed"] != opt_b.state_dict()["accumkernels"]["seed"]
    assert not torch.equal(drawn[0], other[0]), "runs seeded differently draw different noise"


def test_grad_views_survive_module_to(backend):
    """module.to() with another spelling of the device ('cpu:0' for 'cpu', as
    Accelerate's prepare does) replaces .grad's data with a copy: the grad
    intake notices and puts its views back, and training is unchanged."""
    windows = [data() for _ in range(2)]
    plain, ours = mlp(), mlp()
    big_batch_run(plain, torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9), windows)
    opt = ak.AccumulatingOptimizer(torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9), backend=backend)
    for k, (x, y) in enumerate(windows):
        for j, (xb, yb) in enumerate(zip(x.chunk(4), y.chunk(4))):
            if k == j == 1:  # (mid-window: .grad is None before a window's first gradient)
                ours.to(torch.device(torch.get_default_device().type, 0))
            (F.mse_loss(ours(xb), yb) / 4).backward()
        assert all(opt._layout.aliased(r) and r.param.grad is r.buffer for r in opt._layout)
        opt.step()
        opt.zero_grad()
    assert rel_diff(ours, plain) <= PARITY


class _Checkpointed(nn.Module):
    """mlp() with its hidden block recomputed in backward (activation checkpointing)."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        first, *rest = self.inner
        return torch.utils.checkpoint.checkpoint(nn.Sequential(*rest), first(x), use_reentrant=False)


@pytest.mark.parametrize("intake", ["hooks", "grad", "hooks-no-buffer"])
@pytest.mark.parametrize("wrap_model", ["compile", "checkpoint"])
def test_compiled_and_checkpointed_models(intake, wrap_model):
    """torch.compile (inductor) and activation checkpointing change how backward
    runs, not what the window is: against torch's accumulation through the same
    wrapping (a compiled backward rounds otherwise than the eager one, so the
    plain run compiles too and gets the same window gradient). "hooks-no-buffer":
    windows of one micro-batch (accum_steps=1), where the wrapper holds no buffer."""
    windows = [data() for _ in range(2)]
    plain, ours = mlp(), mlp()
    n_micro = 1 if intake == "hooks-no-buffer" else 4

    def wrapped(m):
        return torch.compile(m) if wrap_model == "compile" else _Checkpointed(m)

    big_batch_run(
        wrapped(plain), torch.optim.AdamW(plain.parameters(), lr=1e-2, eps=ADAM_EPS), windows, n_micro=n_micro
    )
    opt = ak.AccumulatingOptimizer(
        torch.optim.AdamW(ours.parameters(), lr=1e-2, eps=ADAM_EPS),
        accum_steps=n_micro,
        intake=intake.removesuffix("-no-buffer"),
    )
    assert (opt._layout.flat is None) == (n_micro == 1)
    micro_batch_run(wrapped(ours), opt, windows, n_micro)
    assert opt.optimizer.state[next(ours.parameters())]["step"].item() == 2
    assert rel_diff(ours, plain) <= PARITY


def test_intake_grad_under_compiled_autograd_trains_as_torch():
    """Compiled autograd (torch._dynamo.compiled_autograd) traces the backward
    with its hooks: intake "grad"'s are Python, traced with it, so the classic
    loop (accum_steps=None, torch's clip) trains as torch's AdamW under the
    same compiled backward (intake "hooks"'s native hook refuses it by name:
    tests/test_grad_inbox.py). A native pre-hook for intake "grad" would have
    to keep this."""

    def run(make):
        model = mlp()
        opt = make(model.parameters())
        with torch._dynamo.compiled_autograd._enable(torch.compile(backend="eager")):
            for xb, yb in [data() for _ in range(2)]:
                for x, y in zip(xb.chunk(2), yb.chunk(2)):
                    (F.mse_loss(model(x), y) / 2).backward()
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
                opt.step()
                opt.zero_grad()
        return model

    plain = run(lambda params: torch.optim.AdamW(params, lr=1e-2, eps=ADAM_EPS))
    ours = run(lambda params: ak.AdamW(params, lr=1e-2, eps=ADAM_EPS))
    assert rel_diff(ours, plain) <= PARITY


@pytest.mark.parametrize(
    "dtype, options",
    [
        (torch.bfloat16, {}),
        (torch.bfloat16, {"state_dtype": "8bit"}),
        (torch.bfloat16, {"accum_steps": 2}),
        (torch.float32, {}),
    ],
    ids=["bf16-defaults", "bf16-8bit", "bf16-accum_steps=2", "fp32"],
)
def test_a_compiled_step_steps_as_the_eager_one(dtype, options):
    """torch.compile(opt.step), torch's recipe for compiling an optimizer (and
    a compiled function calling it with an LR scheduler's step), gives the
    eager run's params bit for bit: the step runs as it is (with intake "grad"
    on bf16 params, tracing it failed in torch's fakeification)."""
    torch.manual_seed(0)
    xs = [torch.randn(4, 8, dtype=dtype) for _ in range(4)]

    def run(compiled: bool):
        model = nn.Linear(8, 4).to(dtype)
        model.load_state_dict({k: v.clone() for k, v in start.items()})
        opt = ak.AdamW(model.parameters(), lr=1e-2, seed=3, **options)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda i: 1 / (i + 1))

        def step():
            opt.step()
            if opt.window_stepped:
                sched.step()

        stepper = torch.compile(step) if compiled else step
        for x in xs:
            model(x).float().square().sum().backward()
            stepper()
            if opt.window_stepped:
                opt.zero_grad()
        return [p.detach() for p in model.parameters()]

    start = nn.Linear(8, 4).to(dtype).state_dict()
    for eager, compiled in zip(run(False), run(True)):
        assert torch.equal(eager, compiled)


# ---- natural mistakes: the plain run's result, or an error naming the setting ----


def classic_loop(model, opt, windows, n_micro, *, clip=None):
    """The loop people port: loss / N, step() every N-th batch (and torch's clip before it)."""
    for x, y in windows:
        for xb, yb in zip(x.chunk(n_micro), y.chunk(n_micro)):
            (F.mse_loss(model(xb), yb) / n_micro).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("clip", [None, 0.5], ids=["no-clip", "clip"])
def test_the_classic_loop_with_the_wrapper_swapped_in_equals_plain(backend, clip):
    """The one-line swap: the same loop, the wrapper with its defaults
    (accum_steps=None: every step() ends a window; intake 'grad': .grad is the
    window's fp32 sum, which torch's clip_grad_norm_ clips)."""
    windows = [(x * 30, y) for x, y in (data() for _ in range(3))]
    plain, ours = mlp(), mlp()
    classic_loop(plain, torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9), windows, 4, clip=clip)
    opt = ak.AccumulatingOptimizer(torch.optim.SGD(ours.parameters(), lr=0.05, momentum=0.9), backend=backend)
    classic_loop(ours, opt, windows, 4, clip=clip)
    assert rel_diff(ours, plain) <= PARITY


def test_the_classic_loop_with_accum_steps_is_refused():
    """accum_steps=N added to a loop that accumulates itself: N backward passes
    reach step(), which refuses (instead of a window of N*N micro-batches)."""
    model = mlp()
    opt = ak.AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), accum_steps=4)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"accum_steps=None.*got 4 gradients|got 4 gradients.*accum_steps=None"):
        classic_loop(model, opt, [data()], 4)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), before))


def test_torch_clip_with_the_hooks_intake_is_refused():
    """accum_steps=N (intake 'hooks'): .grad holds the FoldedGrad marker, so
    torch's clip_grad_norm_ raises, naming max_grad_norm=, instead of clipping
    nothing and returning 0; so does any read of .grad. close() leaves the
    window's sum in .grad, as a plain tensor."""
    model = mlp()
    opt = ak.AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), accum_steps=4)
    x, y = data(8)
    F.mse_loss(model(x), y).backward()
    with pytest.raises(RuntimeError, match="max_grad_norm="):
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    with pytest.raises(RuntimeError, match="intake='grad'"):
        model[0].weight.grad.norm()
    with pytest.raises(RuntimeError, match="intake='grad'"):
        model[0].weight.grad.add_(1.0)  # only autograd's own accumulation is absorbed
    assert "accumulated_grad" in repr(model[0].weight.grad)
    opt.step()
    sums = [opt.accumulated_grad(p).clone() for p in model.parameters()]
    opt.close()
    # torch.optim's .grad holds the window's sum: a plain tensor now (docs/optimizers.md)
    assert all(type(p.grad) is torch.Tensor and torch.equal(p.grad, s) for p, s in zip(model.parameters(), sums))


def test_model_zero_grad_between_backward_and_step_is_refused_by_the_hooks_intake():
    """Plain PyTorch discards a gradient dropped before step(); the hooks
    intake has folded it already and cannot tell, for a param the backward
    did not reach, whether the drop came before it (harmless) or after, so
    a drop of params' .grad there is refused (optimizer.zero_grad() there
    discards the whole window so far: tests/test_contract.py)."""
    model = mlp()
    opt = ak.AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.05), accum_steps=2)
    x, y = data(8)
    F.mse_loss(model(x), y).backward()
    opt.step()
    opt.zero_grad()  # after step(): harmless
    F.mse_loss(model(x), y).backward()
    model.zero_grad()
    with pytest.raises(RuntimeError, match="zero_grad"):
        opt.step()


@pytest.mark.parametrize("placement", ["before-backward", "after-step"])
def test_zero_grad_placements_equal_plain(backend, placement):
    """zero_grad() at the start of each iteration or after step(): the window goes on."""
    windows = [data() for _ in range(3)]
    plain, ours = mlp(), mlp()
    big_batch_run(plain, torch.optim.AdamW(plain.parameters(), lr=1e-2, eps=ADAM_EPS), windows)
    opt = ak.AccumulatingOptimizer(
        torch.optim.AdamW(ours.parameters(), lr=1e-2, eps=ADAM_EPS), accum_steps=4, backend=backend
    )
    for x, y in windows:
        for xb, yb in zip(x.chunk(4), y.chunk(4)):
            if placement == "before-backward":
                opt.zero_grad()
            F.mse_loss(ours(xb), yb).backward()
            opt.step()
            if placement == "after-step":
                opt.zero_grad()
    assert rel_diff(ours, plain) <= PARITY


def test_two_backward_passes_per_micro_step(backend):
    """Two losses, two backward passes per micro-batch: with accum_steps=N
    refused (a step() call is one micro-step); with accum_steps=None (step()
    once per window, as the plain loop) equal to plain."""
    windows = [data() for _ in range(2)]
    plain, ours, refused = mlp(), mlp(), mlp()

    def two_losses(model, xb, yb, divisor):
        out = model(xb)
        (F.mse_loss(out[:, :2], yb[:, :2]) / divisor).backward(retain_graph=True)
        (F.mse_loss(out[:, 2:], yb[:, 2:]) / divisor).backward()

    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    opt = ak.AccumulatingOptimizer(torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9), backend=backend)
    for x, y in windows:
        for model, o in ((plain, plain_opt), (ours, opt)):
            for xb, yb in zip(x.chunk(4), y.chunk(4)):
                two_losses(model, xb, yb, 4)
            o.step()
            o.zero_grad()
    assert rel_diff(ours, plain) <= PARITY
    opt_n = ak.AccumulatingOptimizer(torch.optim.SGD(refused.parameters(), lr=0.1), accum_steps=4, backend=backend)
    two_losses(refused, *data(8), 1)
    with pytest.raises(RuntimeError, match="sum their losses"):
        opt_n.step()


def test_a_gradient_assigned_to_grad_is_taken_in(backend):
    """Code that writes .grad itself (a pipeline schedule's weight gradients, a
    hand-written update) with the hooks intake: taken in at step(), as plain
    PyTorch would use it."""
    plain, ours = mlp(), mlp()
    grads = [torch.randn_like(p) for p in plain.parameters()]
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1)
    for p, g in zip(plain.parameters(), grads):
        p.grad = g.clone()
    plain_opt.step()
    opt = ak.AccumulatingOptimizer(
        torch.optim.SGD(ours.parameters(), lr=0.1), accum_steps=1, intake="hooks", backend=backend
    )
    for p, g in zip(ours.parameters(), grads):
        p.grad = g.clone()
    opt.step()
    assert rel_diff(ours, plain) <= 1e-6


def test_a_scheduler_built_on_the_inner_optimizer(backend, recwarn):
    """The LR scheduler built on the wrapped optimizer (not the wrapper), stepped
    once per window: the same LRs and params as plain, and no warning that the
    scheduler stepped before the optimizer."""
    windows = [data() for _ in range(4)]
    plain, ours = mlp(), mlp()
    plain_opt = torch.optim.SGD(plain.parameters(), lr=0.1, momentum=0.9)
    big_batch_run(plain, plain_opt, windows, scheduler=torch.optim.lr_scheduler.StepLR(plain_opt, 1, gamma=0.5))
    inner = torch.optim.SGD(ours.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(inner, 1, gamma=0.5)
    opt = ak.AccumulatingOptimizer(inner, accum_steps=4, backend=backend)
    micro_batch_run(ours, opt, windows, 4, scheduler=scheduler)
    assert rel_diff(ours, plain) <= PARITY
    assert inner.param_groups[0]["lr"] == plain_opt.param_groups[0]["lr"] == pytest.approx(0.1 / 16)
    assert not [w for w in recwarn if "lr_scheduler.step()" in str(w.message)]


@pytest.mark.parametrize("change", ["dtype", "device-spelling"])
def test_model_to_after_wrapping(backend, change):
    """model.to(bfloat16) after wrapping: the buffers, state dtype and rounding
    were chosen for fp32 params: refused at the next gradient. (Another
    spelling of the same device, as Accelerate's prepare does, is fine: see
    test_grad_views_survive_module_to.)"""
    model = mlp()
    opt = ak.AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), accum_steps=2, backend=backend)
    x, y = data(8)
    F.mse_loss(model(x), y).backward()
    opt.step()
    if change == "dtype":
        with pytest.raises(RuntimeError, match=r"model.to\(\)"):
            model.to(torch.bfloat16)  # intake "hooks": .grad's marker refuses the conversion
        grad_model = mlp()
        grad_opt = ak.AccumulatingOptimizer(torch.optim.AdamW(grad_model.parameters(), lr=1e-2), backend=backend)
        F.mse_loss(grad_model(x), y).backward()
        grad_opt.step()
        grad_model.to(torch.bfloat16)  # intake "grad": refused at the next gradient
        with pytest.raises(RuntimeError, match=r"model.to\(\) after wrapping"):
            F.mse_loss(grad_model(x.bfloat16()).float(), y).backward()
    else:
        model.to(torch.device(torch.get_default_device().type, 0))
        F.mse_loss(model(x), y).backward()
        opt.step()
        assert opt.window_stepped


@pytest.mark.parametrize("accum_steps", [None, 2])
@pytest.mark.parametrize(
    "before,after",
    [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16), (torch.bfloat16, torch.float16)],
    ids=["bf16-fp32", "fp32-bf16", "bf16-fp16"],
)
def test_model_to_after_a_windows_last_gradient(backend, before, after, accum_steps):
    """Intake "grad", model.to() after the window's last backward, before its
    step(): the step is refused, before a param is written (before
    2026-12-07 the step went on from bf16, on params and state of another
    dtype, and from fp32 to bf16 failed in torch, giving the fp32 buffer
    back as .grad); close() lets the params go (it failed alike), leaving .grad as torch's conversion made it (the
    window's gradient in the new dtype) and the new dtype's grad_dtype; a new
    optimizer trains the converted model."""
    model = mlp().to(before)
    opt = ak.AdamW(model.parameters(), lr=1e-2, intake="grad", accum_steps=accum_steps, backend=backend)
    x, y = data(8)
    for _ in range(accum_steps or 1):
        F.mse_loss(model(x.to(before)).float(), y).backward()
        if accum_steps is not None and opt.micro_steps + 1 < accum_steps:
            opt.step()
    window = [opt.accumulated_grad(p) for p in model.parameters()]
    model.to(after)
    converted = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"model.to\(\) after wrapping.*opt.close\(\)"):
        opt.step()
    assert all(map(torch.equal, model.parameters(), converted))
    opt.close()
    for p, grad in zip(model.parameters(), window):
        assert p.grad.dtype == p.grad_dtype == after
        normalized = p.grad.float() / (accum_steps or 1)
        torch.testing.assert_close(normalized, grad.to(after).float(), rtol=0, atol=0)
    torch.optim.AdamW(model.parameters(), lr=1e-2).step()  # (the .grad torch.optim would hold)
    model.zero_grad()
    converted = [p.detach().clone() for p in model.parameters()]
    opt = ak.AdamW(model.parameters(), lr=1e-2, intake="grad", backend=backend)
    F.mse_loss(model(x.to(after)).float(), y).backward()
    opt.step()
    assert not all(map(torch.equal, model.parameters(), converted))


@pytest.mark.parametrize("accum_steps", [None, 2])
def test_a_gradient_penalty_through_grad_is_refused_by_name(backend, accum_steps):
    """backward(create_graph=True) makes torch's .grad part of the graph, and a
    gradient penalty computed from it trains the params through it. Intake
    "grad"'s .grad is the fp32 buffer, which carries no graph, so such a
    penalty cannot reach the step (before 2026-12-07 the penalty's backward
    failed in autograd, on an in-place write, naming no way out). Refused
    in the backward with create_graph=True, naming
    torch.autograd.grad, before a param is written; intake "hooks" refuses
    the penalty's read of .grad by name."""
    for intake in ak.AccumulatingOptimizer.INTAKES:
        model = mlp()
        opt = ak.AdamW(model.parameters(), lr=1e-2, intake=intake, accum_steps=accum_steps, backend=backend)
        x, y = data(8)
        before = [p.detach().clone() for p in model.parameters()]
        if intake == "grad":
            with pytest.raises(RuntimeError, match=r"create_graph=True.*torch.autograd.grad"):
                F.mse_loss(model(x), y).backward(create_graph=True)
        else:
            F.mse_loss(model(x), y).backward(create_graph=True)
            with pytest.raises(RuntimeError, match="holds no values"):
                sum(p.grad.pow(2).sum() for p in model.parameters())
        assert all(map(torch.equal, model.parameters(), before))
        opt.close()


@pytest.mark.parametrize("intake", ak.AccumulatingOptimizer.INTAKES)
def test_another_layout_after_wrapping_is_refused_by_name(backend, intake):
    """model.to(memory_format=torch.channels_last) after wrapping (torch.optim
    steps on; the buffers, state and master weights here are laid out as the
    params were): intake "hooks" refuses the conversion of .grad's marker,
    intake "grad" the next gradient (the kernels refused it at the step
    before, naming no way out); a param's .data swapped for a tensor laid out
    otherwise, at the step, before any param is written."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 3))
    opt = ak.AdamW(model.parameters(), lr=1e-2, intake=intake, backend=backend)
    x = torch.randn(2, 3, 7, 7)
    model(x).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()
    if intake == "hooks":
        model(x).pow(2).mean().backward()
        with pytest.raises(RuntimeError, match="memory_format"):
            model.to(memory_format=torch.channels_last)
    else:
        model.to(memory_format=torch.channels_last)
        with pytest.raises(RuntimeError, match=r"strides .*model.to\(memory_format"):
            model(x).pow(2).mean().backward()
    opt.close()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 3))
    opt = ak.AdamW(model.parameters(), lr=1e-2, intake=intake, backend=backend)
    model(x).pow(2).mean().backward()
    weight = model[0].weight
    weight.data = weight.data.contiguous(memory_format=torch.channels_last)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match="p.data = a tensor laid out otherwise"):
        opt.step()
    assert all(map(torch.equal, model.parameters(), before))


@pytest.mark.parametrize("where", ["mid-window", "boundary"])
def test_resuming_with_another_accum_steps(backend, where):
    """A checkpoint saved 2 micro-steps into a window of 4, loaded into a
    wrapper with accum_steps=8, would end that window elsewhere: refused,
    naming the setting. Saved at a window boundary, any window length loads."""
    model = mlp()
    opt = ak.AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), accum_steps=4, backend=backend)
    for _ in range(2 if where == "mid-window" else 4):
        F.mse_loss(model(data(8)[0]), data(8)[1]).backward()
        opt.step()
    saved = copy.deepcopy(opt.state_dict())
    opt.close()
    longer = ak.AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), accum_steps=8, backend=backend)
    if where == "mid-window":
        with pytest.raises(ValueError, match="accum_steps=4"):
            longer.load_state_dict(saved)
    else:
        longer.load_state_dict(saved)
        assert longer.micro_steps == 0


@pytest.mark.parametrize("saved, loaded", [("mean", "items"), ("items", "mean"), ("sum", "mean"), ("items", "sum")])
@pytest.mark.parametrize("where", ["mid-window", "boundary"])
def test_resuming_with_another_normalize(backend, where, saved, loaded):
    """A checkpoint saved 2 micro-steps into a window of 4, loaded into a
    wrapper that normalizes otherwise, would divide that window's sum by
    another count (loaded with normalize="items", by the items of its last 2
    micro-steps only: a step twice too large, silently, before 2026-12-08):
    refused, naming the setting, nothing loaded. Saved at a window
    boundary, it loads into any."""

    def step(opt, normalize):
        F.mse_loss(model(data(8)[0]), data(8)[1]).backward()
        opt.step(**({"num_items": 8} if normalize == "items" else {}))

    model = mlp()
    opt = ak.AccumulatingOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), accum_steps=4, normalize=saved, backend=backend
    )
    for _ in range(2 if where == "mid-window" else 4):
        step(opt, saved)
    checkpoint = copy.deepcopy(opt.state_dict())
    opt.close()
    other = ak.AccumulatingOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), accum_steps=4, normalize=loaded, backend=backend
    )
    if where == "mid-window":
        with pytest.raises(ValueError, match=f"normalize='{saved}'.*normalize='{loaded}'"):
            other.load_state_dict(checkpoint)
        assert other.micro_steps == 0 and not other.state  # nothing loaded
    else:
        other.load_state_dict(checkpoint)
        assert other.micro_steps == 0
        before = [p.detach().clone() for p in model.parameters()]
        for _ in range(4):
            step(other, loaded)
        assert not all(map(torch.equal, model.parameters(), before)), "the window after the resume steps"


@pytest.mark.parametrize("intake", ak.AccumulatingOptimizer.INTAKES)
def test_autograd_grad_does_not_feed_the_window(backend, intake):
    """torch.autograd.grad (a gradient penalty, a per-example norm) computes
    gradients without accumulating them into .grad: the window ignores them,
    as torch.optim does."""
    windows = [data() for _ in range(2)]
    plain, ours = mlp(), mlp()
    big_batch_run(plain, torch.optim.SGD(plain.parameters(), lr=0.1), windows)
    opt = ak.AccumulatingOptimizer(
        torch.optim.SGD(ours.parameters(), lr=0.1), accum_steps=4, intake=intake, backend=backend
    )
    for x, y in windows:
        for xb, yb in zip(x.chunk(4), y.chunk(4)):
            torch.autograd.grad(F.mse_loss(ours(xb), yb), list(ours.parameters()))
            F.mse_loss(ours(xb), yb).backward()
            opt.step()
    assert rel_diff(ours, plain) <= PARITY


def test_a_param_swapped_in_its_group_is_refused_before_the_window_steps():
    """step() checks the groups' count and lengths at every call and every
    param once a window, before anything is stepped: a param replaced in place
    in its group's list (same length) is refused at the window's last step()."""
    model = mlp()
    opt = ak.AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accum_steps=2)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.randn(4, 12)).sum().backward()
    opt.step()
    opt.param_groups[0]["params"][0] = nn.Parameter(torch.randn_like(before[0]))
    model(torch.randn(4, 12)).sum().backward()
    with pytest.raises(RuntimeError, match="change the groups through the wrapper, between windows"):
        opt.step()
    assert all(torch.equal(p, b) for p, b in zip(list(model.parameters())[1:], before[1:]))


def test_hooks_intake_gives_autograd_no_gradient_to_add():
    """Intake "hooks" takes each gradient in a pre-hook of the param's
    accumulator and hands autograd none back: .grad stays the FoldedGrad marker
    (autograd never adds into it), a post-accumulate-grad hook of the user's
    still runs once per backward, and the window sums every gradient."""
    from accumkernels.optim._folded import FoldedGrad

    model = nn.Linear(5, 3)
    seen = []
    model.weight.register_post_accumulate_grad_hook(lambda p: seen.append(type(p.grad)))
    opt = ak.AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accum_steps=3, normalize="sum")
    xs = [torch.randn(4, 5) for _ in range(2)]
    for x in xs:
        model(x).sum().backward()
        opt.step()
    marker = model.weight.grad
    assert isinstance(marker, FoldedGrad) and seen == [FoldedGrad, FoldedGrad]
    expected = sum(torch.ones(4, 3).T @ x for x in xs)
    torch.testing.assert_close(opt.accumulated_grad(model.weight), expected, rtol=0, atol=1e-5)
    assert model.weight.grad is marker


def test_prepared_backend_checks_the_numbers_not_the_tensors():
    """ops.Prepared (the wrapper's backend for its own tensors) skips the
    tensor checks of the public ops, never the numbers: a bad hyperparameter is
    refused as by the public call, before anything is written."""
    from accumkernels import ops

    p, b = torch.zeros(4), torch.ones(4)
    m, v, s = torch.zeros(4), torch.zeros(4), torch.zeros(())
    with pytest.raises(ValueError, match="lr"):
        ops.adamw_step_and_zero_([p], [b], [m], [v], [s], lr=-1.0, backend=ops.Prepared(None))
    with pytest.raises(ValueError, match="betas"):
        ops.adamw_step_and_zero_([p], [b], [m], [v], [s], lr=1e-3, betas=(1.0, 0.9), backend=ops.Prepared(None))
    assert torch.equal(b, torch.ones(4)) and torch.equal(s, torch.zeros(()))
    ops.adamw_step_and_zero_([p], [b], [m], [v], [s], lr=1e-3, backend=ops.Prepared(None))
    assert float(s) == 1.0 and torch.equal(b, torch.zeros(4))
