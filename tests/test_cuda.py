"""The CUDA backend: registration (checked on any machine where the build has
CUDA), and every op against the reference and float64 on every CUDA device
present (skipped where there is none)."""

from __future__ import annotations

import pytest
import torch

import accumkernels as ak
from accumkernels import _native
from helpers import DTYPE_IDS, assert_fp32_close, random_sizes

OPS = ["accumulate_", "sgd_step_and_zero_", "adam_step_and_zero_", "adamw_step_and_zero_", "grad_norm"]
DEVICES = [f"cuda:{i}" for i in range(torch.cuda.device_count())]
GRAD_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
needs_cuda = pytest.mark.skipif(not DEVICES or not _native.with_cuda(), reason="no CUDA device or no CUDA build")


@pytest.mark.skipif(not _native.with_cuda(), reason="the extension was built without CUDA")
def test_every_op_has_a_cuda_kernel():
    for op in OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"accumkernels::{op}", "CUDA"), op


def test_cuda_backend_is_listed_only_where_it_runs():
    assert ("cuda" in ak.available_backends()) == (_native.with_cuda() and torch.cuda.is_available())


def _views(sizes, dtype, device, scale=1.0):
    # Odd storage offsets put every other tensor off 16-byte alignment.
    return [(torch.randn(n + i % 3, device=device) * scale).to(dtype)[i % 3 :] for i, n in enumerate(sizes)]


@needs_cuda
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("overwrite", [False, True], ids=["add", "overwrite"])
def test_accumulate(device, overwrite):
    sizes = [0, 1, 7, 65536, 65537, 200003] + random_sizes(150)
    buffers = _views(sizes, torch.float32, device)
    grads = [g for i, n in enumerate(sizes) for g in _views([n], GRAD_DTYPES[i % 3], device, 4.0)]
    grads[5][123] = float("inf")
    expected = [(0 if overwrite else b.double()) + 0.5 * g.double() for b, g in zip(buffers, grads)]
    magnitude = [(0 if overwrite else b.double().abs()) + 0.5 * g.double().abs() for b, g in zip(buffers, grads)]
    found_inf = torch.zeros(1, device=device)
    ak.accumulate_(buffers, grads, torch.tensor([0.5], device=device), overwrite=overwrite, found_inf=found_inf,
                   backend="cuda")  # fmt: skip
    assert found_inf.item() == 1.0
    for i, (b, e, m) in enumerate(zip(buffers, expected, magnitude)):
        if i == 5:
            assert b[123].item() == float("inf")
            b, e, m = b[:123], e[:123], m[:123]
        assert_fp32_close(b, e, m)


def _step_case(kind, device, dtype, master):
    sizes = [1, 31, 65537, 4099] + random_sizes(60)
    weights = _views(sizes, torch.float32, device)
    params = [w.to(dtype) for w in weights]
    state = {
        "buffers": _views(sizes, torch.float32, device),
        "a": [torch.rand_like(w) * 0.1 for w in weights],
        "b": [torch.rand_like(w) * 0.01 for w in weights],
        "c": [torch.rand_like(w) * 0.01 for w in weights],
        "steps": [torch.tensor(float(i % 5), device=device) for i in range(len(sizes))],
        "masters": [p.float() for p in params] if master else None,
    }
    return params, state


def _run(kind, backend, params, s):
    common = dict(grad_scale=torch.tensor([0.7], device=params[0].device), master_params=s["masters"], backend=backend)
    if kind == "sgd":
        ak.sgd_step_and_zero_(params, s["buffers"], s["a"], lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True,
                              **common)  # fmt: skip
    else:
        fn = ak.adam_step_and_zero_ if kind == "adam" else ak.adamw_step_and_zero_
        fn(params, s["buffers"], s["a"], s["b"], s["steps"], max_exp_avg_sqs=s["c"], amsgrad=True, lr=1e-2,
           weight_decay=0.1, **common)  # fmt: skip


@needs_cuda
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype,master", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True),
                                          (torch.float16, True)], ids=["fp32", "bf16", "bf16-master", "fp16-master"])  # fmt: skip
@pytest.mark.parametrize("kind", ["sgd", "adam", "adamw"])
def test_steps_match_reference(device, kind, dtype, master):
    params, state = _step_case(kind, device, dtype, master)
    ref_params = [p.clone() for p in params]
    ref_state = {k: None if v is None else [t.clone() for t in v] for k, v in state.items()}
    _run(kind, "cuda", params, state)
    _run(kind, "reference", ref_params, ref_state)
    for a, b in zip(params, ref_params):
        tol = 1e-6 if dtype == torch.float32 else torch.finfo(dtype).eps
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=1e-6)
    for key in ("a", "b", "c", "steps", "masters"):
        if state[key] is not None:
            for a, b in zip(state[key], ref_state[key]):
                torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-7)
    assert all(not b.any() for b in state["buffers"])


@needs_cuda
@pytest.mark.parametrize("device", DEVICES)
def test_found_inf_skips(device):
    params, state = _step_case("adamw", device, torch.bfloat16, True)
    before = [t.clone() for t in params + state["a"] + state["b"] + state["steps"] + state["masters"]]
    ak.adamw_step_and_zero_(params, state["buffers"], state["a"], state["b"], state["steps"], lr=0.1,
                            found_inf=torch.ones(1, device=device), master_params=state["masters"], backend="cuda")  # fmt: skip
    after = params + state["a"] + state["b"] + state["steps"] + state["masters"]
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    assert all(not b.any() for b in state["buffers"])


@needs_cuda
@pytest.mark.parametrize("device", DEVICES)
def test_grad_norm_deterministic(device):
    xs = _views([1, 300001, 65536, 7, 1 << 20] + random_sizes(100), torch.float32, device)
    first = ak.grad_norm(xs, backend="cuda")
    expected = torch.cat([x.double().flatten() for x in xs]).norm().item()
    assert abs(first.item() - expected) <= 2e-7 * expected
    for _ in range(5):
        assert torch.equal(ak.grad_norm(xs, backend="cuda"), first)


@needs_cuda
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck(device):
    bufs = [torch.randn(37, device=device), torch.randn(5, 3, device=device)]
    grads = [torch.randn(37, device=device).bfloat16(), torch.randn(5, 3, device=device).half()]
    torch.library.opcheck(torch.ops.accumkernels.accumulate_.default,
                          (bufs, grads, 2.0, None, False, torch.zeros(1, device=device)))  # fmt: skip
    torch.library.opcheck(torch.ops.accumkernels.grad_norm.default, (bufs,))
