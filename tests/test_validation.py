"""Bad input: each raises a clear error naming the argument and index, before
any tensor is written (checked by comparing every tensor before and after)."""

from __future__ import annotations

import pytest
import torch

import accumkernels as ak


def _snapshot(*groups):
    tensors = [
        t
        for g in groups
        for t in (g if isinstance(g, (list, tuple)) else [g])
        if isinstance(t, torch.Tensor) and t.layout == torch.strided and t.device.type == "cpu"
    ]
    return tensors, [t.clone() for t in tensors]


def _assert_untouched(snapshot):
    tensors, copies = snapshot
    for t, c in zip(tensors, copies):
        assert torch.equal(t, c) or (t.isnan() == c.isnan()).all(), "a rejected call wrote into a tensor"


def _good_accumulate():
    buffers = [torch.randn(10), torch.randn(3, 4)]
    grads = [torch.randn(10).bfloat16(), torch.randn(3, 4).half()]
    return buffers, grads


ACCUMULATE_CASES = {
    # name: (mutate(buffers, grads) -> kwargs, exception, words the message must hold)
    "fp16-buffer": (lambda b, g: b.__setitem__(1, b[1].half()), TypeError, ["buffers[1]", "float32"]),
    "int-grad": (lambda b, g: g.__setitem__(0, torch.ones(10, dtype=torch.int64)), TypeError, ["grads[0]", "int64"]),
    "numel-mismatch": (lambda b, g: g.__setitem__(1, torch.randn(13).half()), ValueError, ["grads[1]", "13", "12"]),
    "length-mismatch": (lambda b, g: g.pop(), ValueError, ["grads", "1", "2"]),
    "device-mismatch": (
        lambda b, g: g.__setitem__(0, torch.randn(10, device="meta")),
        RuntimeError,
        ["grads[0]", "meta"],
    ),
    "sparse-grad": (lambda b, g: g.__setitem__(0, torch.randn(10).to_sparse()), TypeError, ["grads[0]", "sparse"]),
    "strided-grad": (lambda b, g: g.__setitem__(0, torch.randn(20).bfloat16()[::2]), ValueError, ["grads[0]", "dense"]),
    "layout-mismatch": (
        lambda b, g: g.__setitem__(1, torch.randn(4, 3).half().t()),
        ValueError,
        ["grads[1]", "laid out"],
    ),
    "alias-own-grad": (lambda b, g: g.__setitem__(1, b[1]), ValueError, ["grads[1]", "buffers[1]"]),
    "overlapping-buffers": (lambda b, g: _overlap(b), ValueError, ["buffers[", "shares memory"]),
    "not-a-list": (lambda b, g: "tensor", TypeError, ["buffers", "list"]),
}


def _overlap(buffers):
    base = torch.randn(20)
    buffers[0] = base[:10]
    buffers[1] = base[5:17].view(3, 4)


@pytest.mark.parametrize("case", list(ACCUMULATE_CASES))
def test_accumulate_rejects(backend, case):
    mutate, exc, words = ACCUMULATE_CASES[case]
    buffers, grads = _good_accumulate()
    result = mutate(buffers, grads)
    if result == "tensor":
        buffers = buffers[0]
    snap = _snapshot(buffers, grads)
    with pytest.raises(exc) as info:
        ak.accumulate_(buffers, grads, 2.0, backend=backend)
    for w in words:
        assert w in str(info.value), f"{w!r} not in: {info.value}"
    _assert_untouched(snap)


@pytest.mark.parametrize(
    "scale,exc,word",
    [
        (torch.ones(2), ValueError, "1 element"),
        (torch.ones(1, dtype=torch.float64), TypeError, "float32"),
        (torch.ones(1, device="meta"), RuntimeError, "meta"),
        ("2", TypeError, "float"),
        (True, TypeError, "float"),
    ],
    ids=["two-elements", "float64", "wrong-device", "string", "bool"],
)
def test_accumulate_rejects_scale(backend, scale, exc, word):
    buffers, grads = _good_accumulate()
    snap = _snapshot(buffers, grads)
    with pytest.raises(exc, match="scale") as info:
        ak.accumulate_(buffers, grads, scale, backend=backend)
    assert word in str(info.value)
    _assert_untouched(snap)


@pytest.mark.parametrize(
    "found_inf,exc",
    [(torch.zeros(1, dtype=torch.int32), TypeError), (torch.zeros(2), ValueError), ("x", TypeError)],
    ids=["int", "two-elements", "string"],
)
def test_accumulate_rejects_found_inf(backend, found_inf, exc):
    buffers, grads = _good_accumulate()
    snap = _snapshot(buffers, grads)
    with pytest.raises(exc, match="found_inf"):
        ak.accumulate_(buffers, grads, found_inf=found_inf, backend=backend)
    _assert_untouched(snap)


def test_found_inf_must_not_alias_a_buffer(backend):
    buffers, grads = _good_accumulate()
    with pytest.raises(ValueError, match="found_inf"):
        ak.accumulate_(buffers, grads, found_inf=buffers[0][3:4], backend=backend)


def _adam_args():
    params = [torch.randn(10).bfloat16(), torch.randn(4, 3).bfloat16()]
    buffers = [torch.randn(10), torch.randn(4, 3)]
    m = [torch.zeros(10), torch.zeros(4, 3)]
    v = [torch.zeros(10), torch.zeros(4, 3)]
    steps = [torch.tensor(0.0), torch.tensor(0.0)]
    masters = [p.float() for p in params]
    return dict(params=params, buffers=buffers, exp_avgs=m, exp_avg_sqs=v, state_steps=steps, master_params=masters)


ADAM_CASES = {
    "fp16-state": (lambda a: a["exp_avgs"].__setitem__(0, torch.zeros(10).half()), TypeError, "exp_avgs[0]"),
    "state-numel": (lambda a: a["exp_avg_sqs"].__setitem__(1, torch.zeros(11)), ValueError, "exp_avg_sqs[1]"),
    "missing-step": (lambda a: a["state_steps"].pop(), ValueError, "state_steps"),
    "step-two-elements": (lambda a: a["state_steps"].__setitem__(0, torch.zeros(2)), ValueError, "state_steps[0]"),
    "int-param": (lambda a: a["params"].__setitem__(0, torch.zeros(10, dtype=torch.int32)), TypeError, "params[0]"),
    "master-for-fp32": (lambda a: a["params"].__setitem__(0, torch.zeros(10)), TypeError, "master"),
    "master-length": (lambda a: a["master_params"].pop(), ValueError, "master_params"),
    "state-aliases-buffer": (lambda a: a["exp_avgs"].__setitem__(0, a["buffers"][0]), ValueError, "shares memory"),
    "amsgrad-without-state": (lambda a: a.__setitem__("amsgrad", True), ValueError, "max_exp_avg_sqs"),
    "bad-beta": (lambda a: a.__setitem__("betas", (0.9, 1.0)), ValueError, "betas[1]"),
    "negative-lr": (lambda a: a.__setitem__("lr", -1.0), ValueError, "lr"),
    "sparse-buffer": (lambda a: a["buffers"].__setitem__(0, torch.randn(10).to_sparse()), TypeError, "buffers[0]"),
}


@pytest.mark.parametrize("kind", ["adam", "adamw"])
@pytest.mark.parametrize("case", list(ADAM_CASES))
def test_adam_rejects(backend, kind, case):
    args = _adam_args()
    mutate, exc, word = ADAM_CASES[case]
    mutate(args)
    snap = _snapshot(*[a for a in args.values() if isinstance(a, list)])
    fn = ak.adam_step_and_zero_ if kind == "adam" else ak.adamw_step_and_zero_
    with pytest.raises(exc) as info:
        fn(**args, backend=backend)
    assert word in str(info.value), str(info.value)
    _assert_untouched(snap)


SGD_CASES = {
    "momentum-without-state": (dict(momentum=0.9), ValueError, "momentum_buffers"),
    "state-without-momentum": (
        dict(momentum_buffers=[torch.zeros(10), torch.zeros(4, 3)]),
        ValueError,
        "momentum_buffers",
    ),
    "nesterov-without-momentum": (dict(nesterov=True), ValueError, "nesterov"),
    "grad-scale-wrong-dtype": (dict(grad_scale=torch.ones(1, dtype=torch.bfloat16)), TypeError, "grad_scale"),
    "lr-string": (dict(lr="0.1"), TypeError, "lr"),
}


@pytest.mark.parametrize("case", list(SGD_CASES))
def test_sgd_rejects(backend, case):
    params = [torch.randn(10), torch.randn(4, 3)]
    buffers = [torch.randn(10), torch.randn(4, 3)]
    kwargs, exc, word = SGD_CASES[case]
    kwargs = {"lr": 0.1, **kwargs}
    snap = _snapshot(params, buffers)
    with pytest.raises(exc) as info:
        ak.sgd_step_and_zero_(params, buffers, **kwargs, backend=backend)
    assert word in str(info.value), str(info.value)
    _assert_untouched(snap)


def test_grad_norm_rejects(backend):
    with pytest.raises(ValueError, match="empty"):
        ak.grad_norm([], backend=backend)
    with pytest.raises(TypeError, match=r"buffers\[1\]"):
        ak.grad_norm([torch.randn(3), torch.randn(3).double()], backend=backend)


def test_unknown_backend():
    with pytest.raises(ValueError, match="backend"):
        ak.grad_norm([torch.randn(3)], backend="nope")


def test_backend_for_wrong_device(native_only):
    with pytest.raises(ValueError, match="cpu"):
        ak.grad_norm([torch.randn(3, device="meta")], backend="cpu")


def test_native_ops_check_arguments_too(native_only):
    # Direct torch.ops calls skip the Python checks; the C++ entry points must
    # still refuse what would read or write out of bounds.
    ops = torch.ops.accumkernels
    with pytest.raises(ValueError, match=r"grads\[0\]"):
        ops.accumulate_([torch.zeros(10)], [torch.zeros(11)], 1.0, None, False, None)
    with pytest.raises(TypeError, match=r"buffers\[0\]"):
        ops.accumulate_([torch.zeros(10).half()], [torch.zeros(10)], 1.0, None, False, None)
    sgd = dict(
        momentum_buffers=[],
        master_params=[],
        momentum_buffer_scales=[],
        lr=0.1,
        momentum=0.0,
        dampening=0.0,
        weight_decay=0.0,
        nesterov=False,
        is_first_step=False,
        grad_scale=1.0,
        grad_scale_tensor=None,
        found_inf=None,
        zero_buffers=True,
        stochastic_rounding=False,
        seed=0,
        positions=[],
    )
    with pytest.raises(ValueError, match=r"buffers\[0\]"):
        ops.sgd_step_and_zero_(params=[torch.zeros(10)], buffers=[torch.zeros(9)], **sgd)
    bf16 = [torch.zeros(10).bfloat16(), torch.zeros(10).bfloat16()]
    with pytest.raises(TypeError, match=r"buffers\[0\] has dtype Float and params\[0\] BFloat16"):
        ops.sgd_step_and_zero_(params=bf16, buffers=[torch.zeros(10), torch.zeros(10).bfloat16()], **sgd)
    with pytest.raises(TypeError, match=r"buffers\[0\]"):
        ops.sgd_step_and_zero_(params=bf16[:1], buffers=[torch.zeros(10).half()], **sgd)
    with pytest.raises(ValueError, match="positions"):
        ops.sgd_step_and_zero_(params=[torch.zeros(10)], buffers=[torch.zeros(10)], **{**sgd, "positions": [1, 2]})
    with pytest.raises(ValueError, match=r"positions\[0\]"):
        ops.sgd_step_and_zero_(params=[torch.zeros(10)], buffers=[torch.zeros(10)], **{**sgd, "positions": [-1]})
    with pytest.raises(ValueError, match="state_steps"):
        ops.adamw_step_and_zero_(
            [torch.zeros(3)],
            [torch.zeros(3)],
            [torch.zeros(3)],
            [torch.zeros(3)],
            [],
            [],
            [],
            [],
            [],
            0.1,
            0.9,
            0.99,
            1e-8,
            0.0,
            False,
            1.0,
            None,
            None,
            True,
            False,
            0,
            [],
        )
