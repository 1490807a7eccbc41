"""The GradScaler internals accumkernels/optim/_amp.py relies on, one test each,
against the installed torch: if torch changes one of them, the test that names
it fails here rather than the wrapper misbehaving in training."""

from __future__ import annotations

import torch
from torch.amp.grad_scaler import OptState

from accumkernels.optim import _amp


def _scaled_backward(scaler, param, value=1.0):
    scaler.scale((param * value).sum()).backward()


def _setup(init_scale=2.0**8):
    param = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([param], lr=0.1)
    return param, opt, torch.amp.GradScaler("cpu", init_scale=init_scale)


def test_scale_is_the_private_scale_tensor():
    """_amp.inverse_scale reads ``scaler._scale``: a 1-element tensor equal to get_scale()."""
    param, _, scaler = _setup(init_scale=512.0)
    assert scaler._scale is None  # before the first scale(): inverse_scale refuses
    _scaled_backward(scaler, param)
    assert scaler._scale.numel() == 1 and scaler._scale.item() == scaler.get_scale() == 512.0
    assert _amp.inverse_scale(scaler, torch.device("cpu")).item() == 1 / 512


def test_update_consumes_found_inf_per_device():
    """_amp.report_found_inf writes ``_per_optimizer_states[id(opt)]["found_inf_per_device"]``,
    which update() reads: a 1 there backs the scale off, a 0 lets it grow."""
    for flag, expected in ((1.0, 256.0), (0.0, 1024.0)):
        param, opt, scaler = _setup(init_scale=512.0)
        scaler.set_growth_interval(1)
        _scaled_backward(scaler, param)
        _amp.report_found_inf(scaler, opt, torch.device("cpu"), torch.tensor([flag]))
        scaler.update()
        assert scaler.get_scale() == expected


def test_stage_is_unscaled_after_unscale():
    """_amp.was_unscaled reads ``_per_optimizer_states[id(opt)]["stage"] is OptState.UNSCALED``."""
    param, opt, scaler = _setup()
    _scaled_backward(scaler, param)
    assert not _amp.was_unscaled(scaler, opt)
    scaler.unscale_(opt)
    assert scaler._per_optimizer_states[id(opt)]["stage"] is OptState.UNSCALED
    assert _amp.was_unscaled(scaler, opt)


def test_the_scaler_calling_step_is_found_on_the_stack():
    """_amp.scaler_driving finds the scaler by the code of GradScaler.step /
    _maybe_opt_step on the call stack, and its ``self``; none outside it."""
    seen = []

    class Recording(torch.optim.SGD):
        def step(self, closure=None):
            seen.append(_amp.scaler_driving(self))
            return super().step(closure)

    param = torch.nn.Parameter(torch.ones(4))
    opt, scaler = Recording([param], lr=0.1), torch.amp.GradScaler("cpu")
    _scaled_backward(scaler, param)
    scaler.step(opt)
    opt.step()
    assert seen == [scaler, None]


def test_an_optimizer_that_supports_amp_scaling_is_stepped_directly():
    """With ``_step_supports_amp_scaling = True`` GradScaler.step calls step()
    even when the gradients hold an inf (no unscale_, no skip: the optimizer
    does both), the hooks intake's contract."""
    calls = []

    class Scaling(torch.optim.SGD):
        _step_supports_amp_scaling = True

        def step(self, closure=None):
            calls.append(self.grad_scale)
            return None

    param = torch.nn.Parameter(torch.ones(4))
    opt, scaler = Scaling([param], lr=0.1), torch.amp.GradScaler("cpu", init_scale=4.0)
    _scaled_backward(scaler, param, float("inf"))
    scaler.step(opt)
    assert len(calls) == 1 and calls[0] is not None and float(calls[0]) == 4.0


def test_fused_unscale_and_inf_check():
    """_amp.unscale_and_check uses ``torch._amp_foreach_non_finite_check_and_unscale_``."""
    views = [torch.full((3,), 8.0), torch.tensor([2.0, float("inf")])]
    found_inf = torch.zeros(1)
    _amp.unscale_and_check(views, torch.tensor([0.5]), found_inf)
    assert views[0].tolist() == [4.0] * 3 and views[1][0].item() == 1.0 and found_inf.item() == 1.0
