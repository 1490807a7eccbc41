"""accum_steps=1 on one process (intake "hooks") holds no fp32 buffer: each
param's gradient is held as it arrived, in its own dtype, and the fused step
reads it (accumkernels.optim._intake: HookIntake's lean mode). What the buffer
held is exact here: a bf16 or fp16 gradient is an fp32 value, and the window
of one micro-batch adds nothing to it. So every run is compared, bit for bit,
with the same run holding the buffer (the wrapper forced to keep one):
precisions, SGD and AdamW, clipping, GradScaler, skip_nonfinite,
zero_grad(set_to_none=False), the fallback optimizer, checkpoints mid-window
both ways, and the windows that must sum after all (a gradient assigned to
``.grad`` before the backward, which adds to it; one of another dtype)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import accumkernels as ak
from accumkernels.optim import _intake


@pytest.fixture(autouse=True)
def _data_seed():
    """Both runs of a comparison start from the same weights and batches,
    drawn from the test's seed (tests/conftest.py; the seed sweep varies it)."""
    global _SEED
    _SEED = int(torch.randint(0, 2**31, ()))


_SEED = 0


def _model(dtype) -> nn.Module:
    torch.manual_seed(_SEED)
    return nn.Sequential(nn.Linear(33, 64), nn.GELU(), nn.Linear(64, 5)).to(dtype)


def _batch(k: int, dtype) -> torch.Tensor:
    return torch.randn(16, 33, generator=torch.Generator().manual_seed(_SEED + k)).to(dtype)


def _loss(model, k):
    out = model(_batch(k, next(model.parameters()).dtype)).float()
    return out.pow(2).mean() * (1 + k)


def _pair(make, run, monkeypatch):
    """``run(model, opt)`` on a lean wrapper and on one that holds the buffer
    (``make(model)`` builds each); returns both models' params."""
    out = []
    import accumkernels.optim.wrapper as wrapper

    for hold in (False, True):
        with monkeypatch.context() as m:
            if hold:
                m.setattr(wrapper, "holds_buffers", lambda *args, **kwargs: True)
            model, opt = make()
        assert (opt._layout.flat is None) != hold
        run(model, opt)
        out.append([p.detach().clone() for p in model.parameters()])
    return out


def _assert_same(pair):
    lean, held = pair
    for a, b in zip(lean, held):
        assert torch.equal(a, b)


def _windows(model, opt, n=4, check=None, after=None):
    """``n`` windows; ``check(opt)`` between each backward and its step(), ``after(opt)`` after it."""
    for k in range(n):
        _loss(model, k).backward()
        if check:
            check(opt)
        opt.step()
        if after:
            after(opt)
        opt.zero_grad()


def _holds_nothing(opt):
    """Between windows a lean wrapper holds neither a flat buffer nor a gradient."""
    assert opt._layout.flat is None and all(r.buffer is None for r in opt._layout)


CASES = {
    "bf16-defaults": (torch.bfloat16, torch.optim.AdamW, {}),
    "bf16-8bit": (torch.bfloat16, torch.optim.AdamW, dict(state_dtype="8bit")),
    "bf16-fp32-state-clip": (torch.bfloat16, torch.optim.AdamW, dict(state_dtype=torch.float32, max_grad_norm=0.05)),
    "bf16-remainders": (torch.bfloat16, torch.optim.AdamW, dict(master_weights="remainders")),
    "fp16-masters-clip": (torch.float16, torch.optim.Adam, dict(master_weights=True, max_grad_norm=0.05)),
    "fp32-sgd-clip": (torch.float32, torch.optim.SGD, dict(max_grad_norm=0.05)),
    "bf16-sgd-8bit": (torch.bfloat16, torch.optim.SGD, dict(state_dtype="8bit")),
    "bf16-fallback": (torch.bfloat16, torch.optim.RMSprop, {}),
}


@pytest.mark.parametrize("case", CASES, ids=CASES.keys())
def test_lean_windows_step_as_with_the_buffer_bit_for_bit(backend, case, monkeypatch):
    """Without clipping, bit for bit. With clipping, the norm of the held
    gradients is their squares summed in float64, the buffer's too (in
    another order): both are the fp32 rounding of the same float64 value,
    so they differ by at most one fp32 ulp, and only where that value lies
    within float64 noise of a rounding tie; given equal norms, the runs are
    equal bit for bit."""
    dtype, cls, options = CASES[case]
    hyper = dict(lr=0.05, momentum=0.9, weight_decay=0.01) if cls is torch.optim.SGD else dict(lr=1e-2)
    norms = []

    def make():
        model = _model(dtype)
        opt = ak.AccumulatingOptimizer(cls(model.parameters(), **hyper), accum_steps=1, seed=3, **options)
        return model, opt

    def run(model, opt):
        _windows(model, opt, check=None, after=lambda opt: norms.append(opt.last_grad_norm))
        if opt._intake.lean:
            _holds_nothing(opt)

    pair = _pair(make, run, monkeypatch)
    lean, held = norms[: len(norms) // 2], norms[len(norms) // 2 :]
    if "max_grad_norm" not in options:
        assert all(n is None for n in norms)
    else:
        assert all(torch.equal(a, b) or (a - b).abs() <= torch.finfo(torch.float32).eps * b for a, b in zip(lean, held))
        if not all(torch.equal(a, b) for a, b in zip(lean, held)):
            return  # a rounding tie (see above): the norms differ by an ulp, so the runs may too
    _assert_same(pair)


def test_norm_accumulated_grad_and_clip_grad_norm_read_the_held_gradients(backend, monkeypatch):
    """What the window shows between backward and step() equals the buffer's."""
    seen = []

    def make():
        model = _model(torch.bfloat16)
        return model, ak.AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), accum_steps=1, seed=3)

    def run(model, opt):
        def check(opt):
            seen.append([opt.accumulated_grad(p) for p in model.parameters()])
            seen.append([opt.clip_grad_norm_(0.05)])

        _windows(model, opt, check=check)

    _assert_same(_pair(make, run, monkeypatch))
    half = len(seen) // 2
    for a, b in zip(seen[:half], seen[half:]):
        assert all(x.dtype == torch.float32 and torch.equal(x, y) for x, y in zip(a, b))


@pytest.mark.parametrize("how", ["given", "adopted"])
def test_grad_scaler_unscales_the_held_gradients_in_fp32(backend, how, monkeypatch):
    """fp16 params, a GradScaler (given, or found calling step()), one window
    with an inf: skipped and backed off alike; the held fp16 gradients are
    unscaled at the step (in fp32), where unscaling them in place would flush
    small ones to zero."""

    def make():
        model = _model(torch.float16)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**14)
        opt = ak.AccumulatingOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-2),
            accum_steps=1,
            seed=3,
            grad_scaler=scaler if how == "given" else None,
        )
        opt.test_scaler = scaler
        return model, opt

    scales = []

    def run(model, opt):
        scaler = opt.test_scaler
        for k in range(4):
            loss = _loss(model, k) * (float("inf") if k == 2 else 1.0)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
        scales.append(scaler.get_scale())

    _assert_same(_pair(make, run, monkeypatch))
    assert scales[0] == scales[1] == 2.0**13


def test_skip_nonfinite_and_set_to_none_false(backend, monkeypatch):
    """An inf gradient skips the lean window; params kept with a zero gradient
    by zero_grad(set_to_none=False) are stepped with it (weight decay moves them)."""

    def make():
        model = _model(torch.bfloat16)
        opt = ak.AccumulatingOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.5), accum_steps=1, seed=3, skip_nonfinite=True
        )
        return model, opt

    def run(model, opt):
        before = None
        for k in range(5):
            if k == 3:
                model[2].weight.requires_grad_(False)
            loss = _loss(model, k) * (float("nan") if k == 1 else 1.0)
            loss.backward()
            if k == 1:
                before = [p.detach().clone() for p in model.parameters()]
            opt.step()
            if k == 1:
                assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before)), "skipped"
            opt.zero_grad(set_to_none=False)
        model[2].weight.requires_grad_(True)

    _assert_same(_pair(make, run, monkeypatch))


@pytest.mark.parametrize("saved_by,loaded_by", [("lean", "held"), ("held", "lean"), ("lean", "lean")])
def test_a_checkpoint_between_backward_and_step_resumes_bitwise(backend, saved_by, loaded_by, monkeypatch):
    """Saved between a window's backward and its step(): the lean wrapper
    saves the held gradients as the buffer would hold them (fp32, unscaled),
    so either kind loads the other's checkpoint and steps as the uninterrupted run."""
    import accumkernels.optim.wrapper as wrapper

    def build(kind, model):
        with monkeypatch.context() as m:
            if kind == "held":
                m.setattr(wrapper, "holds_buffers", lambda *args, **kwargs: True)
            return ak.AccumulatingOptimizer(
                torch.optim.AdamW(model.parameters(), lr=1e-2), accum_steps=1, seed=3, state_dtype="8bit"
            )

    reference = _model(torch.bfloat16)
    opt = build(saved_by, reference)
    _windows(reference, opt, n=2)
    _loss(reference, 2).backward()
    sd = copy.deepcopy(opt.state_dict())
    model_sd = copy.deepcopy(reference.state_dict())
    assert sd["accumkernels"]["flat_buffer"] is not None
    opt.step()
    opt.zero_grad()
    _windows(reference, opt, n=1)

    resumed = _model(torch.bfloat16)
    resumed.load_state_dict(model_sd)
    opt2 = build(loaded_by, resumed)
    opt2.load_state_dict(sd)
    opt2.step()
    opt2.zero_grad()
    if loaded_by == "lean":
        _holds_nothing(opt2)
    _windows(resumed, opt2, n=1)
    assert all(torch.equal(a, b) for a, b in zip(reference.parameters(), resumed.parameters()))


def test_a_window_that_sums_gets_the_buffer_for_that_window(backend, monkeypatch):
    """A gradient assigned to .grad before the backward (which adds to it, as
    in plain PyTorch: a second gradient of the window) is summed in fp32 as
    with the buffer; the buffer is dropped after that window's step."""

    def make():
        model = _model(torch.bfloat16)
        return model, ak.AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), accum_steps=1, seed=3)

    def run(model, opt):
        _windows(model, opt, n=1)
        w = model[0].weight
        w.grad = torch.full_like(w, 1e-3)  # taken in at the backward, beside the hook's gradient
        _loss(model, 1).backward()
        opt.step()
        opt.zero_grad()
        if opt._intake.lean:
            _holds_nothing(opt)
        _windows(model, opt, n=1)

    _assert_same(_pair(make, run, monkeypatch))


def test_a_second_backward_is_still_refused(backend):
    model = _model(torch.bfloat16)
    opt = ak.AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), accum_steps=1)
    _loss(model, 0).backward()
    _loss(model, 1).backward()
    with pytest.raises(RuntimeError, match="backward"):
        opt.step()


def test_who_holds_a_buffer():
    assert not _intake.holds_buffers("hooks", 1, 1, fsdp=False)
    assert _intake.holds_buffers("hooks", 2, 1, fsdp=False)
    assert _intake.holds_buffers("hooks", None, 1, fsdp=False)  # frameworks may call backward more than once
    assert _intake.holds_buffers("grad", 1, 1, fsdp=False)  # .grad is the buffer
    assert _intake.holds_buffers("hooks", 1, 2, fsdp=False)  # reduced across ranks in place
    assert _intake.holds_buffers("hooks", 1, 1, fsdp=True)


def test_static_bytes_count_the_gradients_instead_of_buffers():
    """The planner's count: no fp32 buffers, the gradients in the params'
    dtype; with 8-bit state, 2 + 2 + 2 bytes and the scales (4 per 256) per
    param, torchao AdamW8bit's figure."""
    model = nn.Linear(1024, 1024, bias=False).bfloat16()
    n = 1024 * 1024
    lean = ak.plan.static_bytes(torch.optim.AdamW(model.parameters()), accum_steps=1, state_dtype="8bit")
    held = ak.plan.static_bytes(torch.optim.AdamW(model.parameters()), accum_steps=2, state_dtype="8bit")
    assert lean["fp32 buffers"] == 0 and lean["gradients"] == 2 * n
    assert held["fp32 buffers"] == 4 * n and "gradients" not in held
    assert sum(lean.values()) == 2 * n + 2 * n + 2 * (n + 4 * n // 256) + 4


def test_staged_unfreezing_and_a_deepcopy_mid_window(backend, monkeypatch):
    """A param unfrozen after wrapping joins a lean window as with the buffer;
    a copy taken between a backward and its step() (copy.deepcopy goes
    through the state dict) steps as the original."""

    def make():
        model = _model(torch.bfloat16)
        model[0].weight.requires_grad_(False)
        return model, ak.AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), accum_steps=1, seed=3)

    def run(model, opt):
        _windows(model, opt, n=2)
        model[0].weight.requires_grad_(True)
        _windows(model, opt, n=2)
        _loss(model, 9).backward()
        twin_model, twin = copy.deepcopy((model, opt))
        opt.step()
        twin.step()
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), twin_model.parameters()))

    _assert_same(_pair(make, run, monkeypatch))


class _Scaled(nn.Module):
    """A model with a 0-dim param (a learned temperature)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(_SEED)
        self.body = nn.Linear(33, 5)
        self.temperature = nn.Parameter(torch.tensor(1.5))

    def forward(self, x):
        return self.body(x) * self.temperature


def test_a_0_dim_param_under_a_grad_scaler(backend, monkeypatch):
    """accumulated_grad() keeps a 0-dim param's shape, and a checkpoint taken
    between the backward and step() loads, with the held gradients unscaled by
    a GradScaler's factor."""
    shapes = []

    def make():
        model = _Scaled().to(torch.float16)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
        opt = ak.AccumulatingOptimizer(
            torch.optim.AdamW(model.parameters(), lr=1e-2), accum_steps=1, seed=3, grad_scaler=scaler
        )
        opt.test_scaler = scaler
        return model, opt

    def run(model, opt):
        scaler = opt.test_scaler
        for k in range(3):
            scaler.scale(_loss(model, k)).backward()
            shapes.append(tuple(opt.accumulated_grad(model.temperature).shape))
            sums = opt.state_dict()["accumkernels"]["flat_buffer"]
            assert sums is not None and torch.isfinite(sums).all()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()

    _assert_same(_pair(make, run, monkeypatch))
    assert shapes == [()] * 6
