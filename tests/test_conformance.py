"""torch.optim's contract, on accumkernels.SGD / Adam / AdamW and on the wrapper
around torch's own, over every input torch's optimizer database gives for them
(``torch.testing._internal.common_optimizers.optim_db``, shipped with torch,
with the global flags foreach / fused as torch's tests vary them).

The guarantees are those pytorch's ``test/test_optim.py`` (``TestOptimRenewed``)
checks for every optimizer, written here for ours: the same steps as
torch.optim (params and every state tensor) with contiguous and non-contiguous
params and with two param groups of their own lr and weight decay, the right
direction, a no-op without gradients and for zero gradients, printable,
deterministic state dicts, older state dicts (no flag keys, non-tensor steps),
deep copies that keep the public attributes, torch's random stream left
as torch.optim leaves it (untouched), and torch's error inputs.

What we refuse on purpose: ``differentiable=True`` (the fused step is not
differentiable; docs/optimizers.md lists it).

Bounds: the same gradient reaches both (one backward per step, or micro-batches
of loss / 2 into .grad against the wrapper's fp32 sum of the unscaled ones,
which is the same sum times an exact 1/2), so the only difference is the
order of the update's fp32 operations: at most STEP_ULPS fp32 ulps of the
largest value of the tensor per step, and where a gradient element cancels
to ~0 (Adam's L2 decay) at most lr per step (the eps term turns its last-bit
rounding into a step of up to lr; see tests/test_steps.py).
"""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
from torch.testing._internal.common_optimizers import (
    OptimizerErrorEnum,
    _get_optim_inputs_including_global_cliquey_kwargs,
    optim_db,
)

import accumkernels as ak

STEPS = 5
STEP_ULPS = 8
EPS32 = torch.finfo(torch.float32).eps
CANCELLED = 1e-5  # |g| below this: the eps term may turn g's rounding into a step of up to lr
OURS = {torch.optim.SGD: ak.SGD, torch.optim.Adam: ak.Adam, torch.optim.AdamW: ak.AdamW}
INFOS = {info.optim_cls: info for info in optim_db if info.optim_cls in OURS}


def _inputs():
    cases = []
    for cls, info in INFOS.items():
        for i, oi in enumerate(
            _get_optim_inputs_including_global_cliquey_kwargs("cpu", torch.float32, info, skip=("differentiable",))
        ):
            flags = "-".join(f for f in ("foreach", "fused") if oi.kwargs.get(f)) or "forloop"
            cases.append(pytest.param(cls, oi.kwargs, id=f"{cls.__name__}-{i}-{oi.desc.replace(' ', '_')}-{flags}"))
    return cases


INPUTS = _inputs()
WAYS = ["class", "wrapper-accum2"]


def _params(contiguous: bool, generator: torch.Generator) -> list[torch.Tensor]:
    """torch's right-direction model: weight (10, 5) and bias (10), or the same
    shapes as non-contiguous views (torch's own: ``randn(10, 5, 2)[..., 0]``)."""
    if contiguous:
        w, b = torch.randn(10, 5, generator=generator), torch.randn(10, generator=generator)
    else:
        w, b = torch.randn(10, 5, 2, generator=generator)[..., 0], torch.randn(10, 2, generator=generator)[..., 0]
        assert not w.is_contiguous() and not b.is_contiguous()
    return [w.requires_grad_(), b.requires_grad_()]


def _loss(params, x):
    w, b = params
    return (torch.sigmoid(w @ x + b) ** 2).sum()


def _kwargs(kwargs: dict) -> dict:
    # A tensor lr is shared by both runs' param groups: give each its own.
    return {k: v.clone() if torch.is_tensor(v) else v for k, v in kwargs.items()}


def _build(way, cls, params, kwargs):
    if way == "torch":
        # The reference is torch's for-loop step: foreach and fused choose an
        # implementation of the same update (and torch 2.14.1's fused CPU step
        # departs from it on non-contiguous params, by up to 6e-3 here).
        forloop = {k: v for k, v in _kwargs(kwargs).items() if k not in ("foreach", "fused")}
        return cls(params, foreach=False, **forloop)
    if way == "class":
        return OURS[cls](params, **_kwargs(kwargs))
    return ak.AccumulatingOptimizer(cls(params, **_kwargs(kwargs)), accum_steps=2)


def _train(way, cls, kwargs, *, contiguous=True, groups=None, steps=STEPS, seed=0, edits=None):
    """``steps`` windows of two micro-batches: torch and the class as torch's
    accumulation loop (loss / 2 into .grad), the wrapper counting the window;
    ``edits`` (a dict) is set on every param group before the second window.
    Returns the params, the optimizer and the window gradients seen."""
    gen = torch.Generator().manual_seed(seed)
    params = _params(contiguous, gen)
    spec = params if groups is None else [dict(params=[p], **g) for p, g in zip(params, groups)]
    opt = _build(way, cls, spec, kwargs)
    grads = []
    for window in range(steps):
        if edits and window == 1:
            for group in opt.param_groups:
                group.update(edits)
        xs = [torch.randn(5, generator=gen) for _ in range(2)]
        for x in xs:
            if way == "wrapper-accum2":
                _loss(params, x).backward()
                opt.step()
            else:
                (_loss(params, x) / 2).backward()
        if way != "wrapper-accum2":
            grads.append([p.grad.clone() for p in params])
            opt.step()
            opt.zero_grad()
    return params, opt, grads


def _lrs(kwargs, groups) -> list[float]:
    lr = float(kwargs.get("lr", 1e-3))
    return [float(g.get("lr", lr)) for g in groups] if groups else [lr, lr]


def assert_same_steps(ours, plain, plain_opt, ours_opt, grads, lrs):
    """Params and every state tensor within the bound of the module docstring."""
    for i, (a, b) in enumerate(zip(ours, plain)):
        cancelled = torch.zeros_like(b, dtype=torch.bool)
        for step_grads in grads:
            cancelled |= step_grads[i].abs() < CANCELLED
        bound = STEP_ULPS * STEPS * EPS32 * b.detach().abs().max() + cancelled * STEPS * lrs[i]
        err = (a.detach().double() - b.detach().double()).abs()
        assert (err <= bound).all(), f"param {i}: error {err.max().item():.3g}, bound {bound.max().item():.3g}"
        state_plain, state_ours = plain_opt.state[b], ours_opt.state[a]
        assert set(state_plain) == set(state_ours), (set(state_plain), set(state_ours))
        for key, value in state_plain.items():
            mine = state_ours[key]
            if key == "step":
                assert float(mine) == float(value)
                continue
            if value is None:
                assert mine is None
                continue
            limit = STEP_ULPS * STEPS * EPS32 * value.abs().max() + 1e-30
            assert mine.shape == value.shape and mine.dtype == value.dtype, key
            if cancelled.any() and key != "momentum_buffer":
                limit = limit + value.abs().max() * 1e-3 * cancelled.any()  # moments of a cancelled element
            gap = (mine.double() - value.double()).abs().max()
            assert gap <= limit, f"param {i} state {key!r}: {gap.item():.3g} > {float(limit):.3g}"


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("contiguous", [True, False], ids=["contiguous", "non-contiguous"])
@pytest.mark.parametrize("cls,kwargs", INPUTS)
def test_steps_as_torch(cls, kwargs, contiguous, way):
    plain, plain_opt, grads = _train("torch", cls, kwargs, contiguous=contiguous)
    ours, ours_opt, _ = _train(way, cls, kwargs, contiguous=contiguous)
    assert_same_steps(ours, plain, plain_opt, ours_opt, grads, _lrs(kwargs, None))


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("cls,kwargs", INPUTS)
def test_param_groups_with_their_own_lr_and_weight_decay(cls, kwargs, way):
    groups = [dict(lr=0.02, weight_decay=0.1), dict(lr=0.005, weight_decay=0.0)]
    if torch.is_tensor(kwargs.get("lr")):
        groups = [dict(g, lr=torch.tensor(g["lr"])) for g in groups]
    plain, plain_opt, grads = _train("torch", cls, kwargs, groups=groups)
    ours, ours_opt, _ = _train(way, cls, kwargs, groups=groups)
    assert_same_steps(ours, plain, plain_opt, ours_opt, grads, _lrs(kwargs, groups))


def _each_edit(edits_by_class: dict):
    """Parametrizes (cls, edits) over a dict of each class's group edits."""
    cases = [
        pytest.param(cls, e, id=f"{cls.__name__}-" + "-".join(f"{k}={v}" for k, v in e.items()))
        for cls, edits in edits_by_class.items()
        for e in edits
    ]
    return pytest.mark.parametrize("cls,edits", cases)


# Hyperparameters torch.optim's steps read from the param group at every
# step, set by hand between windows (as a schedule or a user does).
_ADAM_EDITS = [dict(betas=(0.5, 0.9)), dict(eps=1e-2), dict(weight_decay=0.2), dict(maximize=True)]
GROUP_EDITS = {
    torch.optim.SGD: [
        dict(momentum=0.5),
        dict(dampening=0.3),
        dict(nesterov=True, momentum=0.9),
        dict(weight_decay=0.2),
        dict(maximize=True),
    ],
    # (each switched to the other's decay: torch's Adam step reads the key from the group)
    torch.optim.Adam: [*_ADAM_EDITS, dict(decoupled_weight_decay=True, weight_decay=0.2)],
    torch.optim.AdamW: [*_ADAM_EDITS, dict(decoupled_weight_decay=False, weight_decay=0.2)],
}


@pytest.mark.parametrize("way", WAYS)
@_each_edit(GROUP_EDITS)
def test_group_hyperparameters_set_between_windows_step_as_torch(cls, edits, way):
    """A param group's key set by hand takes effect at the next step, as in
    torch.optim: decoupled_weight_decay too, which torch's Adam and AdamW
    both read from the group (an AdamW group set to False decays as Adam's
    L2; before 2026-12-07 ours kept AdamW's decay, 1.5e-2 off)."""
    kwargs = dict(lr=0.01, momentum=0.9) if cls is torch.optim.SGD else dict(lr=0.01, weight_decay=0.05)
    plain, plain_opt, grads = _train("torch", cls, kwargs, edits=edits)
    ours, ours_opt, _ = _train(way, cls, kwargs, edits=edits)
    assert_same_steps(ours, plain, plain_opt, ours_opt, grads, _lrs(kwargs, None))


# Values torch.optim's constructors refuse, set on a group later (torch steps with them).
OUT_OF_BOUNDS = {
    torch.optim.SGD: [dict(lr=-0.01), dict(weight_decay=-0.1), dict(momentum=-0.5), dict(nesterov=True, momentum=0.0)],
    torch.optim.AdamW: [dict(lr=-0.01), dict(weight_decay=-0.1), dict(betas=(1.0, 0.999)), dict(eps=-1e-8)],
}


@pytest.mark.parametrize("way", WAYS)
@_each_edit(OUT_OF_BOUNDS)
def test_a_group_set_out_of_bounds_is_refused_before_any_group_steps(cls, edits, way):
    """The second of two param groups set to a value the fused step refuses:
    the window's step() refuses it by name before any group is stepped or
    any state made (before 2026-12-07 the kernel refused it after stepping
    the first group, and the step() called again once it was set back
    stepped the first group twice); set back, the window steps as torch's."""
    kwargs = dict(lr=0.01, momentum=0.9) if cls is torch.optim.SGD else dict(lr=0.01)
    params = _params(True, torch.Generator().manual_seed(0))
    plain = [p.detach().clone().requires_grad_() for p in params]
    opt = _build(way, cls, [dict(params=[p]) for p in params], kwargs)
    plain_opt = _build("torch", cls, [dict(params=[p]) for p in plain], kwargs)
    x = torch.randn(5, generator=torch.Generator().manual_seed(1))
    for _ in range(2 if way == "wrapper-accum2" else 1):
        _loss(params, x).backward()
        if way == "wrapper-accum2" and opt.micro_steps == 0:
            opt.step()
    _loss(plain, x).backward()  # (the wrapper's mean of two equal micro-batches is this gradient)
    before = [p.detach().clone() for p in params]
    kept = {key: opt.param_groups[1][key] for key in edits}
    opt.param_groups[1].update(edits)
    with pytest.raises((ValueError, TypeError), match=r"param group 1: .*nothing was stepped"):
        opt.step()
    assert all(map(torch.equal, params, before)) and not opt.state
    opt.param_groups[1].update(kept)
    opt.step()
    plain_opt.step()
    assert_same_steps(params, plain, plain_opt, opt, [[p.grad for p in plain]], _lrs(kwargs, None))


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("cls,kwargs", INPUTS)
def test_goes_the_right_direction(cls, kwargs, way):
    """torch's test_forloop_goes_right_direction: the loss falls over 20 steps."""
    gen = torch.Generator().manual_seed(1)
    params = _params(True, gen)
    x = torch.randn(5, generator=gen)
    opt = _build(
        way, cls, params, dict(_kwargs(kwargs), lr=torch.tensor(0.01) if torch.is_tensor(kwargs.get("lr")) else 0.01)
    )
    sign = -1.0 if kwargs.get("maximize") else 1.0  # maximize: the objective -loss rises, so the loss falls
    initial = _loss(params, x).item()
    for _ in range(20):
        for _ in range(2 if way == "wrapper-accum2" else 1):
            (sign * _loss(params, x)).backward()
            opt.step()
        opt.zero_grad()
    assert _loss(params, x).item() < initial


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("cls,kwargs", INPUTS)
def test_no_op_without_gradients(cls, kwargs, way):
    """torch's test_step_is_noop_when_params_have_no_grad: nothing moves, no state."""
    params = _params(True, torch.Generator().manual_seed(2))
    before = [p.detach().clone() for p in params]
    opt = _build(way, cls, params, kwargs)
    for _ in range(2):
        opt.step()
    assert all(torch.equal(a, b) for a, b in zip(params, before))
    assert all(not opt.state.get(p) for p in params)


@pytest.mark.parametrize("cls,kwargs", INPUTS)
def test_no_op_for_zero_gradients(cls, kwargs):
    """torch's test_step_is_noop_for_zero_grads: without weight decay (and with
    AdamW's default decay at lr 1e-5, as torch's test), zero gradients leave
    the params where they were, to fp32 rounding."""
    if kwargs.get("weight_decay", 0) != 0:
        pytest.skip("weight decay moves params without gradients (torch's test skips these too)")
    kwargs = _kwargs(kwargs)
    if cls is torch.optim.AdamW:
        kwargs["lr"] = torch.tensor(1e-5) if torch.is_tensor(kwargs.get("lr")) else 1e-5
    param = torch.randn(5, 1, generator=torch.Generator().manual_seed(3)).requires_grad_()
    old = param.detach().clone()
    opt = OURS[cls]([param], **kwargs)
    param.grad = torch.zeros_like(param)
    opt.step()
    torch.testing.assert_close(param.detach(), old)


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("cls,kwargs", INPUTS)
def test_printable(cls, kwargs, way):
    text = repr(_build(way, cls, _params(True, torch.Generator().manual_seed(4)), kwargs))
    assert cls.__name__ in text


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("cls,kwargs", INPUTS)
def test_state_dict_is_deterministic(cls, kwargs, way):
    """torch's test_state_dict_deterministic: a copy loaded from the state dict
    steps exactly as the original, and saves the same state dict."""
    params, opt, _ = _train(way, cls, kwargs, steps=2)
    twins = [p.detach().clone().requires_grad_() for p in params]
    twin_opt = _build(way, cls, twins, kwargs)
    twin_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    for ps, o in ((params, opt), (twins, twin_opt)):
        _windows(way, ps, o, windows=2, seed=5)
    assert all(torch.equal(a, b) for a, b in zip(params, twins))
    _assert_same_state_dict(opt.state_dict(), twin_opt.state_dict())


def _windows(way, params, opt, *, windows, seed):
    """``windows`` more windows on one fixed input (two micro-steps each for the counting wrapper)."""
    x = torch.randn(5, generator=torch.Generator().manual_seed(seed))
    for _ in range(windows):
        for _ in range(2 if way == "wrapper-accum2" else 1):
            _loss(params, x).backward()
            opt.step()
        opt.zero_grad()


def _assert_same_state_dict(a, b):
    assert a["param_groups"] == b["param_groups"] or all(
        {k: v for k, v in ga.items() if not torch.is_tensor(v)}
        == {k: v for k, v in gb.items() if not torch.is_tensor(v)}
        for ga, gb in zip(a["param_groups"], b["param_groups"])
    )
    for i, state in a["state"].items():
        for key, value in state.items():
            other = b["state"][i][key]
            assert torch.equal(torch.as_tensor(value), torch.as_tensor(other)), (i, key)


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("cls,kwargs", INPUTS)
def test_loads_older_state_dicts(cls, kwargs, way):
    """torch's test_can_load_older_state_dict and test_load_nontensor_step: a
    state dict without the flag keys of newer torch versions and with steps
    as Python numbers loads, and training goes on as from the original."""
    params, opt, _ = _train(way, cls, kwargs, steps=2)
    old = copy.deepcopy(opt.state_dict())
    old.pop("accumkernels", None)
    for group in old["param_groups"]:
        for flag in ("foreach", "fused", "capturable", "differentiable", "maximize", "decoupled_weight_decay"):
            if flag in group and not group[flag]:
                del group[flag]
    for state in old["state"].values():
        if "step" in state:
            state["step"] = float(state["step"])
    twins = [p.detach().clone().requires_grad_() for p in params]
    twin_opt = _build(way, cls, twins, kwargs)
    twin_opt.load_state_dict(old)
    for ps, o in ((params, opt), (twins, twin_opt)):
        _windows(way, ps, o, windows=1, seed=6)
    for a, b in zip(params, twins):
        torch.testing.assert_close(a, b, rtol=STEP_ULPS * EPS32, atol=0)


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("cls,kwargs", INPUTS[:1] + INPUTS[-1:])
def test_deepcopy_keeps_the_public_attributes(cls, kwargs, way):
    opt = _build(way, cls, _params(True, torch.Generator().manual_seed(7)), kwargs)
    copied = copy.deepcopy(opt)
    public = {k for k in vars(opt) if not k.startswith("_")}
    assert public == {k for k in vars(copied) if not k.startswith("_")}
    for key in public - {"optimizer", "param_groups", "state", "defaults"}:
        assert getattr(copied, key) == getattr(opt, key), key


@pytest.mark.parametrize("way", WAYS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("cls", list(OURS), ids=lambda c: c.__name__)
def test_leaves_torchs_random_stream_as_torch(cls, dtype, way):
    """torch.optim draws no random numbers: constructing ours and stepping it
    leave torch's CPU generator where it was too, so a run that swaps in ours
    gets the same data order and dropout. The stochastic-rounding seed drawn
    in its place still follows torch.manual_seed."""

    def seed_after(manual_seed: int) -> int:
        torch.manual_seed(manual_seed)
        before = torch.get_rng_state()
        gen = torch.Generator().manual_seed(1)
        params = [torch.randn(10, 5, generator=gen).to(dtype).requires_grad_(), torch.zeros(10, dtype=dtype)]
        params[1].requires_grad_()
        opt = _build(way, cls, params, {"lr": 0.01})
        for _ in range(2):
            for _ in range(2 if way == "wrapper-accum2" else 1):
                (params[0].float().sin().sum() + params[1].float().square().sum()).backward()
                opt.step()
            opt.zero_grad()
        assert torch.equal(torch.get_rng_state(), before), "the optimizer moved torch's generator"
        return opt.state_dict()["accumkernels"]["seed"]

    assert seed_after(3) == seed_after(3)
    assert seed_after(3) != seed_after(4)


def _error_cases():
    cases = []
    for cls, info in INFOS.items():
        for i, e in enumerate(info.optim_error_inputs_func(device="cpu", dtype=torch.float32)):
            cases.append(
                pytest.param(cls, e, id=f"{cls.__name__}-{i}-{e.optimizer_error_input.desc[:40].replace(' ', '_')}")
            )
    return cases


@pytest.mark.parametrize("cls,error", _error_cases())
def test_error_inputs_as_torch(cls, error):
    """torch's test_errors: each of torch's bad inputs raises (or warns) as it
    does with torch.optim, with torch's message."""
    oi = error.optimizer_error_input
    params = oi.params if oi.params is not None else [torch.randn(3, requires_grad=True)]
    assert error.error_on == OptimizerErrorEnum.CONSTRUCTION_ERROR  # all of SGD's, Adam's and AdamW's
    if "duplicate parameters" in oi.desc and issubclass(error.error_type, Warning):
        # torch warns and would step the param twice per step; refused on purpose (docs/optimizers.md).
        with pytest.raises(ValueError, match="list each param once"):
            OURS[cls](params, **oi.kwargs)
    elif issubclass(error.error_type, Warning):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            OURS[cls](params, **oi.kwargs)
        assert any(
            issubclass(w.category, error.error_type) and re.search(error.error_regex, str(w.message)) for w in caught
        ), [str(w.message) for w in caught]
    else:
        with pytest.raises(error.error_type, match=error.error_regex):
            OURS[cls](params, **oi.kwargs)


@pytest.mark.parametrize("name", ["AdamW", "Adam", "SGD"])
def test_differentiable_is_refused(name):
    with pytest.raises(ValueError, match="differentiable=True"):
        getattr(ak, name)([torch.randn(3, requires_grad=True)], differentiable=True)


@pytest.mark.parametrize("cls", [torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD], ids=lambda c: c.__name__)
def test_differentiable_is_refused_through_the_wrapper_too(cls):
    """A wrapped torch optimizer with differentiable=True would step through
    the fused step, which records no graph: refused when wrapped, when set on
    a group later (at the window's step, before anything is stepped; set back,
    the same step() goes on) and in a checkpoint (before anything is loaded).
    A fallback optimizer runs its own step, differentiable as torch's."""
    with pytest.raises(ValueError, match="param group 0 has differentiable=True"):
        ak.AccumulatingOptimizer(cls([torch.randn(3, requires_grad=True)], lr=0.1, differentiable=True))
    ak.AccumulatingOptimizer(torch.optim.RMSprop([torch.randn(3, requires_grad=True)], differentiable=True))

    p = torch.nn.Parameter(torch.randn(5))
    opt = ak.AccumulatingOptimizer(cls([p], lr=0.1), accum_steps=2)
    p.square().sum().backward()
    opt.step()
    p.square().sum().backward()
    opt.param_groups[0]["differentiable"] = True
    before = p.detach().clone()
    with pytest.raises(ValueError, match="param group 0 has differentiable=True"):
        opt.step()
    assert torch.equal(p, before)
    opt.param_groups[0]["differentiable"] = False
    opt.step()
    assert not torch.equal(p, before), "the window stepped once the flag was set back"

    plain = cls([torch.nn.Parameter(torch.randn(5))], lr=0.1, differentiable=True)
    saved = copy.deepcopy(opt.state_dict())
    with pytest.raises(ValueError, match="the checkpoint's param group 0 has differentiable=True"):
        opt.load_state_dict(plain.state_dict())
    assert opt.state_dict()["param_groups"] == saved["param_groups"]
