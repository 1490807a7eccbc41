"""The drop-in classes accumkernels.AdamW, Adam and SGD: torch.optim's
signatures with its defaults, built from params or param groups, equal to the
plain optimizer in the loops people write, state dicts interchangeable with
torch.optim's, LR schedulers built on them. (In the frameworks:
tests/test_frameworks.py.)"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from test_optimizer import ADAM_EPS, PARITY, big_batch_run, classic_loop, data, mlp, rel_diff
from torch.nn import functional as F

import accumkernels as ak

CLASSES = {"AdamW": torch.optim.AdamW, "Adam": torch.optim.Adam, "SGD": torch.optim.SGD}
HYPER = {
    "AdamW": dict(lr=1e-2, eps=ADAM_EPS, weight_decay=0.1),
    "Adam": dict(lr=1e-2, eps=ADAM_EPS, amsgrad=True),
    "SGD": dict(lr=0.05, momentum=0.9, nesterov=True),
}


@pytest.mark.parametrize("name", list(CLASSES))
def test_signature_is_torchs(name):
    """Every parameter of the torch.optim class, with its default, then the wrapper's keywords."""
    ours = inspect.signature(getattr(ak, name).__init__).parameters
    theirs = inspect.signature(CLASSES[name].__init__).parameters
    for param_name, param in theirs.items():
        assert param_name in ours, param_name
        assert ours[param_name].default == param.default, param_name
        assert ours[param_name].kind == param.kind, param_name
    assert ours["accum_steps"].default is None and ours["accum_steps"].kind is inspect.Parameter.KEYWORD_ONLY
    opt = getattr(ak, name)(mlp().parameters())
    assert isinstance(opt, torch.optim.Optimizer) and isinstance(opt, ak.AccumulatingOptimizer)
    assert opt.defaults == CLASSES[name](mlp().parameters()).defaults


@pytest.mark.parametrize("name", list(CLASSES))
def test_the_one_line_swap_equals_plain(backend, name):
    """The classic loop (loss / N, torch's clip, step() every N-th batch) with
    torch.optim.X replaced by accumkernels.X and nothing else changed."""
    windows = [(x * 10, y) for x, y in (data() for _ in range(3))]
    plain, ours = mlp(), mlp()
    classic_loop(plain, CLASSES[name](plain.parameters(), **HYPER[name]), windows, 4, clip=0.5)
    classic_loop(ours, getattr(ak, name)(ours.parameters(), backend=backend, **HYPER[name]), windows, 4, clip=0.5)
    assert rel_diff(ours, plain) <= PARITY  # the same window gradient: the fused step's rounding only


def test_param_groups_named_params_and_a_scheduler(backend):
    """Param groups with their own hyperparameters, named params (torch >= 2.6)
    and an LR scheduler built on the class, as with torch.optim.AdamW."""
    windows = [data() for _ in range(4)]
    plain, ours = mlp(), mlp()

    def groups(model):
        named = list(model.named_parameters())
        return [
            {"params": [(n, p) for n, p in named if "weight" in n], "weight_decay": 0.1},
            {"params": [(n, p) for n, p in named if "weight" not in n], "weight_decay": 0.0, "lr": 5e-3},
        ]

    plain_opt = torch.optim.AdamW(groups(plain), lr=1e-2, eps=ADAM_EPS)
    # ours steps once per step() call on one backward of the whole batch: so does the plain run (n_micro=1)
    scheduler = torch.optim.lr_scheduler.LinearLR(plain_opt, 1.0, 0.1, 4)
    big_batch_run(plain, plain_opt, windows, scheduler=scheduler, n_micro=1)
    opt = ak.AdamW(groups(ours), lr=1e-2, eps=ADAM_EPS, backend=backend)
    scheduler = torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.1, 4)
    for x, y in windows:
        F.mse_loss(ours(x), y).backward()
        opt.step()
        opt.zero_grad()
        scheduler.step()
    assert rel_diff(ours, plain) <= PARITY  # the same window gradient: the fused step's rounding only
    assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in plain_opt.param_groups]
    assert (
        opt.state_dict()["param_groups"][0]["param_names"] == plain_opt.state_dict()["param_groups"][0]["param_names"]
    )


@pytest.mark.parametrize("name", list(CLASSES))
def test_state_dicts_interchange_with_torch_optim(backend, name):
    """Two windows with the class, one with the torch.optim class loaded from
    its state dict, one with the class loaded back: the plain run of four."""
    windows = [data() for _ in range(4)]
    ours, plain = mlp(), mlp()
    big_batch_run(plain, CLASSES[name](plain.parameters(), **HYPER[name]), windows)
    opt = getattr(ak, name)(ours.parameters(), backend=backend, **HYPER[name])
    big_batch_run(ours, opt, windows[:2])
    torch_opt = CLASSES[name](ours.parameters(), **HYPER[name])
    torch_opt.load_state_dict(copy.deepcopy(opt.state_dict()))
    opt.close()
    big_batch_run(ours, torch_opt, windows[2:3])
    back = getattr(ak, name)(ours.parameters(), backend=backend, **HYPER[name])
    back.load_state_dict(copy.deepcopy(torch_opt.state_dict()))
    big_batch_run(ours, back, windows[3:])
    assert rel_diff(ours, plain) <= PARITY  # the same window gradient: the fused step's rounding only


def test_accum_steps_and_options_pass_through(backend):
    """accum_steps=N: the class counts the window (no division by N)."""
    windows = [data() for _ in range(2)]
    plain, ours = mlp(), mlp()
    big_batch_run(plain, torch.optim.SGD(plain.parameters(), lr=0.05, momentum=0.9), windows, clip=0.5)
    opt = ak.SGD(ours.parameters(), lr=0.05, momentum=0.9, accum_steps=4, max_grad_norm=0.5, backend=backend)
    for x, y in windows:
        for xb, yb in zip(x.chunk(4), y.chunk(4)):
            F.mse_loss(ours(xb), yb).backward()
            opt.step()
    assert rel_diff(ours, plain) <= PARITY  # the same window gradient: the fused step's rounding only
    assert opt.intake == "hooks" and opt.last_grad_norm is not None


def test_refusals_name_the_argument():
    with pytest.raises(ValueError, match="differentiable"):
        ak.AdamW(mlp().parameters(), differentiable=True)
    with pytest.raises(ValueError, match="Invalid learning rate"):  # torch's own check
        ak.SGD(mlp().parameters(), lr=-1.0)
    with pytest.raises(TypeError, match="unexpected keyword"):
        ak.Adam(mlp().parameters(), acum_steps=4)
