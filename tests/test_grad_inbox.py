"""The native gradient inbox of intake "hooks" (csrc/grad_inbox.cpp).

A C++ pre-hook per param queues the common gradient without Python and hands a
bucket over when it is complete; every other gradient goes to the Python
pre-hook. What a run computes or refuses must not depend on which one took a
gradient: each scenario runs twice, through the inbox and through the Python
hooks only (``_intake.NATIVE_INBOX = False``, as without the extension), and
the params (bit for bit), the errors and what ``.grad`` holds are compared.
The windows after the first are the inbox's (the first watches for a late
``init_process_group``, which needs Python at every gradient).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import accumkernels as ak
from accumkernels import _native
from accumkernels.optim import _intake

pytestmark = pytest.mark.skipif(not _native.is_loaded(), reason="the native extension is not built")

N = 2  # micro-steps per window


@pytest.fixture
def seed():
    """Both runs of a comparison start from the same weights and batches, drawn
    from the test's seed (tests/conftest.py; the seed sweep varies it)."""
    return int(torch.randint(0, 2**31, ()))


class _TransposedGrad(torch.autograd.Function):
    """The identity, whose backward hands the gradient over in transposed
    layout (same values), as some ops' backwards do."""

    @staticmethod
    def forward(ctx, w):
        return w.view_as(w)

    @staticmethod
    def backward(ctx, grad):
        return grad.t().contiguous().t()


class _Net(nn.Module):
    """Three params of three shapes; with ``transposed``, ``w``'s gradient
    arrives laid out unlike its (contiguous) buffer."""

    def __init__(self) -> None:
        super().__init__()
        self.first = nn.Linear(13, 24)
        self.w = nn.Parameter(torch.randn(24, 7) * 0.2)
        self.scale = nn.Parameter(torch.ones(7))

    def forward(self, x, transposed=False, scaled=True):
        h = torch.tanh(self.first(x)) @ (_TransposedGrad.apply(self.w) if transposed else self.w)
        return (h * self.scale if scaled else h).square().mean()


def _batches(seed: int, count: int):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 13, generator=g).bfloat16() for _ in range(count)]


def _build(native: bool, monkeypatch, seed: int, **options):
    monkeypatch.setattr(_intake, "NATIVE_INBOX", native)
    torch.manual_seed(seed)
    model = _Net().bfloat16()
    opt = ak.AccumulatingOptimizer(
        torch.optim.AdamW(model.parameters(), lr=1e-2), accum_steps=N, intake="hooks", **options
    )
    assert (opt._intake._inbox is not None) is native
    return model, opt


def _both(scenario, monkeypatch, seed, **options):
    """The scenario's (params, outcome) through the inbox and through the Python hooks."""
    results = []
    for native in (True, False):
        model, opt = _build(native, monkeypatch, seed, **options)
        try:
            outcome = scenario(model, opt, _batches(seed, 16))
        except RuntimeError as error:
            outcome = ("raised", str(error))
        results.append(([p.detach().clone() for p in model.parameters()], outcome))
        opt.close()
    (native_params, native_outcome), (python_params, python_outcome) = results
    assert native_outcome == python_outcome
    for a, b in zip(native_params, python_params):
        assert torch.equal(a, b)
    return native_outcome


def _windows(model, opt, batches, windows=3, transposed=False):
    for w in range(windows):
        for i in range(N):
            model(batches[(w * N + i) % len(batches)], transposed).backward()
            opt.step()


def _count_python_calls(monkeypatch):
    calls = {"arrive": 0, "deliver": 0, "folded": 0}
    for name in calls:
        original = getattr(_intake.HookIntake, f"_{name}")

        def counted(self, *args, name=name, original=original):
            calls[name] += 1
            return original(self, *args)

        monkeypatch.setattr(_intake.HookIntake, f"_{name}", counted)
    return calls


@pytest.mark.parametrize("bucket_cap_mb", [25.0, 0.0005])
def test_after_the_first_window_the_inbox_folds_each_bucket_itself(bucket_cap_mb, monkeypatch, seed):
    calls = _count_python_calls(monkeypatch)
    model, opt = _build(True, monkeypatch, seed, bucket_cap_mb=bucket_cap_mb)
    batches = _batches(seed, 16)
    buckets = len(opt._layout.buckets)
    _windows(model, opt, batches, windows=1)
    assert calls == {"arrive": 4 * N, "deliver": 0, "folded": 0}  # window 0: every gradient through Python
    _windows(model, opt, batches, windows=2)
    # The first micro-step after window 0 still went through Python (it watched until then).
    assert calls["arrive"] == 4 * (N + 1)
    assert calls == {"arrive": 4 * (N + 1), "deliver": 0, "folded": buckets * (2 * N - 1)}
    opt.close()


def test_with_a_loss_scaler_python_folds_each_bucket(monkeypatch, seed):
    """A GradScaler's scale is read at a micro-step's first fold (after the
    previous update()): the inbox hands the bucket to Python, which folds it."""
    calls = _count_python_calls(monkeypatch)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4)
    model, opt = _build(True, monkeypatch, seed, grad_scaler=scaler)
    batches = _batches(seed, 16)
    for w in range(3):
        for i in range(N):
            scaler.scale(model(batches[w * N + i])).backward()
            scaler.step(opt)
            scaler.update()
    assert calls["folded"] == 0
    assert calls["deliver"] == 2 * N - 1
    opt.close()


def test_same_params_through_the_inbox_and_the_python_hooks(monkeypatch, seed):
    """Plain windows, windows where one gradient arrives transposed (Python
    takes it and the rest of its micro-step), one bucket and several."""

    def scenario(model, opt, batches):
        _windows(model, opt, batches, windows=3)
        _windows(model, opt, batches, windows=2, transposed=True)  # w's gradient through Python
        _windows(model, opt, batches, windows=2)
        return "ok"

    assert _both(scenario, monkeypatch, seed) == "ok"
    assert _both(scenario, monkeypatch, seed, bucket_cap_mb=0.0005, max_grad_norm=0.5) == "ok"


@pytest.mark.parametrize("bucket_cap_mb", [25.0, 0.0005])
def test_a_param_without_a_gradient_in_some_micro_steps(bucket_cap_mb, monkeypatch, seed):
    """``scale`` gets no gradient in a window's first micro-step: its bucket is
    folded at step() (incomplete), and at the second micro-step holds params
    in the window and one new to it, which the inbox hands to Python."""

    def scenario(model, opt, batches):
        _windows(model, opt, batches, windows=2)
        for w in range(3):
            for i in range(N):
                model(batches[w * N + i], scaled=i > 0).backward()
                opt.step()
        _windows(model, opt, batches, windows=2)
        return "ok"

    assert _both(scenario, monkeypatch, seed, bucket_cap_mb=bucket_cap_mb) == "ok"


def test_an_inf_gradient_skips_its_window_the_same_way(monkeypatch, seed):
    """skip_nonfinite: the inbox's folds check into the micro-step's flag."""

    def scenario(model, opt, batches):
        batches[2 * N + 1][0, 0] = float("inf")  # the third window's second micro-batch
        _windows(model, opt, batches, windows=5)
        return "ok"

    assert _both(scenario, monkeypatch, seed, skip_nonfinite=True) == "ok"


def test_a_checkpoint_loaded_mid_window_goes_on_as_saved(monkeypatch, seed):
    """A window saved after its first micro-step and loaded where a window
    starts (the inbox armed to overwrite) must add to the loaded sums."""

    def scenario(model, opt, batches):
        _windows(model, opt, batches, windows=2)
        model(batches[0]).backward()
        opt.step()
        saved = copy.deepcopy((model.state_dict(), opt.state_dict()))
        model(batches[1]).backward()
        opt.step()  # ends the window...
        ended = [p.detach().clone() for p in model.parameters()]
        model.load_state_dict(saved[0])
        opt.load_state_dict(saved[1])  # ...which starts again from its first micro-step
        model(batches[1]).backward()
        opt.step()
        return all(torch.equal(a, b) for a, b in zip(ended, model.parameters()))

    assert _both(scenario, monkeypatch, seed) is True


@pytest.mark.parametrize("options", [{"backend": "reference"}, {"accum_steps": 1}], ids=["reference", "lean"])
def test_python_folds_where_the_inbox_cannot(options, monkeypatch, seed):
    """Another backend than the native kernels, or no flat buffer (accum_steps=1):
    the inbox hands each bucket to Python."""
    calls = _count_python_calls(monkeypatch)
    monkeypatch.setattr(_intake, "NATIVE_INBOX", True)
    torch.manual_seed(seed)
    model = _Net().bfloat16()
    opt = ak.AccumulatingOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-2), **{"accum_steps": N, **options})
    for x in _batches(seed, 6):
        model(x).backward()
        opt.step()
    assert calls["folded"] == 0 and calls["deliver"] > 0
    opt.close()


@pytest.mark.parametrize("frozen", [False, True], ids=["hooked", "frozen-when-wrapped"])
def test_zero_grad_drops_a_grad_put_there_by_other_code(frozen, monkeypatch, seed):
    """As in plain PyTorch: a .grad assigned after step() and before
    zero_grad() is dropped, on a hooked param and on one without a hook."""
    if frozen:
        monkeypatch.setattr(_Net, "__init__", _frozen_scale_init)

    def scenario(model, opt, batches):
        _windows(model, opt, batches, windows=2)
        model(batches[0]).backward()
        opt.step()
        model.scale.grad = torch.full_like(model.scale, 0.25)
        opt.zero_grad()
        dropped = model.scale.grad is None
        model(batches[1]).backward()
        opt.step()
        _windows(model, opt, batches, windows=2)
        return dropped

    assert _both(scenario, monkeypatch, seed) is True


def _frozen_scale_init(self) -> None:
    nn.Module.__init__(self)
    self.first = nn.Linear(13, 24)
    self.w = nn.Parameter(torch.randn(24, 7) * 0.2)
    self.scale = nn.Parameter(torch.ones(7), requires_grad=False)


def test_a_grad_put_there_by_other_code_is_taken_in(monkeypatch, seed):
    def scenario(model, opt, batches):
        _windows(model, opt, batches, windows=2)
        model.scale.grad = torch.full_like(model.scale, 0.25)  # beside the marker: a gradient too
        _windows(model, opt, batches, windows=2)
        return "ok"

    assert _both(scenario, monkeypatch, seed) == "ok"


def test_frozen_param_leaves_its_bucket_to_step(monkeypatch, seed):
    """A bucket never completes in backward: what reads the window between a
    backward and step() (accumulated_grad, clip_grad_norm_) and step() itself
    take what the inbox queued."""

    def scenario(model, opt, batches):
        _windows(model, opt, batches, windows=2)
        model.scale.requires_grad_(False)
        model(batches[0]).backward()
        seen = opt.accumulated_grad(model.first.weight).sum().item()
        opt.step()
        model(batches[1]).backward()
        norm = opt.clip_grad_norm_(1e-3).item()
        opt.step()
        _windows(model, opt, batches, windows=2)
        model.scale.requires_grad_(True)
        _windows(model, opt, batches, windows=2)
        return seen, norm

    seen, norm = _both(scenario, monkeypatch, seed)
    assert seen != 0 and norm > 0


# frozen: a param frozen after wrapping leaves its bucket incomplete, so the
# micro-step's gradients are still in the inbox when the refusal is decided.
@pytest.mark.parametrize("frozen", [False, True], ids=["bucket-complete", "bucket-incomplete"])
@pytest.mark.parametrize("where", ["first", "second"])
def test_a_second_backward_is_refused_the_same_way(where, frozen, monkeypatch, seed):
    def scenario(model, opt, batches):
        _windows(model, opt, batches, windows=2)
        model.scale.requires_grad_(not frozen)
        if where == "second":
            model(batches[0]).backward()
            opt.step()
        model(batches[1]).backward()
        model(batches[2]).backward()
        opt.step()

    outcome = _both(scenario, monkeypatch, seed)
    assert outcome[0] == "raised" and "backward" in outcome[1]


@pytest.mark.parametrize("frozen", [False, True], ids=["bucket-complete", "bucket-incomplete"])
def test_model_zero_grad_between_backward_and_step_is_refused_the_same_way(frozen, monkeypatch, seed):
    """The model's zero_grad() (.grad set to None) there is found at step()."""

    def scenario(model, opt, batches):
        _windows(model, opt, batches, windows=2)
        model.scale.requires_grad_(not frozen)
        model(batches[0]).backward()
        model.zero_grad()
        opt.step()

    outcome = _both(scenario, monkeypatch, seed)
    assert outcome[0] == "raised" and "zero_grad()" in outcome[1]


@pytest.mark.parametrize("frozen", [False, True], ids=["bucket-complete", "bucket-incomplete"])
def test_zero_grad_between_backward_and_step_discards_the_window_the_same_way(frozen, monkeypatch, seed):
    """The wrapper's zero_grad() there discards the window so far: the sums
    the inbox folded, the gradients it queued for a bucket not complete (a
    frozen param's), the count of step() calls. Through the inbox and the
    Python hooks alike, the params end bitwise as where the discarded
    micro-steps never ran (bf16 params: the stochastic rounding stream
    counts windows stepped, which the discard is not)."""

    calls = _count_python_calls(monkeypatch)

    def run(native: bool, discard: bool):
        model, opt = _build(native, monkeypatch, seed)
        batches = _batches(seed, 16)
        _windows(model, opt, batches, windows=2)
        model.scale.requires_grad_(not frozen)
        if discard:
            model(batches[0]).backward()
            opt.step()  # (the window's first micro-step)
            model(batches[1]).backward()
            opt.zero_grad()
            assert opt.micro_steps == 0
        before = dict(calls)
        _windows(model, opt, batches[2:], windows=2)
        if native and not frozen:  # the inbox is armed again: it folds the next backward itself
            assert calls["arrive"] == before["arrive"] and calls["deliver"] == before["deliver"]
        params = [p.detach().clone() for p in model.parameters()]
        opt.close()
        return params

    reference = run(True, discard=False)
    for native in (True, False):
        assert all(map(torch.equal, run(native, discard=True), reference))


def test_model_to_after_wrapping_is_named_from_inside_backward(monkeypatch, seed):
    """The inbox hands a param no longer as wrapped to Python, whose error
    comes out of backward() as it would from a Python hook."""

    def scenario(model, opt, batches):
        _windows(model, opt, batches, windows=2)
        model.float()
        model(batches[0].float()).backward()

    outcome = _both(scenario, monkeypatch, seed)
    assert outcome[0] == "raised" and "model.to()" in outcome[1]


def test_closed_or_dropped_wrappers_hooks_pass_gradients_through(monkeypatch, seed):
    model, opt = _build(True, monkeypatch, seed)
    batches = _batches(seed, 4)
    _windows(model, opt, batches, windows=2)
    opt.close()
    model.zero_grad(set_to_none=True)
    model(batches[0]).backward()
    grads = [p.grad.clone() for p in model.parameters()]
    assert all(type(g) is torch.Tensor and g.dtype == torch.bfloat16 for g in grads)

    # A new wrapper over the same params: the old hooks pass through, the new ones take.
    model.zero_grad(set_to_none=True)
    second = ak.AccumulatingOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), accum_steps=N, intake="hooks")
    _windows(model, second, batches, windows=2)
    model(batches[0]).backward()
    assert second._intake._inbox is not None and second.micro_steps == 0
    del second  # dropped without close(): its finalizer releases the hooks
    import gc

    gc.collect()
    model.zero_grad(set_to_none=True)
    model(batches[0]).backward()
    for p, g in zip(model.parameters(), grads):
        assert type(p.grad) is torch.Tensor and p.grad.shape == g.shape


def test_compiled_autograd_is_refused_naming_it(monkeypatch, seed):
    """The wrapper's bookkeeping does not trace: compiled autograd asks the
    native hook to describe itself, which it refuses by name."""
    model, opt = _build(True, monkeypatch, seed)
    with pytest.raises(NotImplementedError, match="does not run under compiled autograd"):
        with torch._dynamo.compiled_autograd._enable(torch.compile(backend="eager")):
            model(_batches(seed, 1)[0]).backward()
    opt.close()
