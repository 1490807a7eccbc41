"""The GPU backends. On any machine: a CUDA build registers a CUDA kernel for
every op, a GPU never meets a CPU-only build silently, a CUDA build is
required where asked for, and the compiled 8-bit steps move a lane's codes in
one access (their SASS). With GPUs: both GPU backends (``cuda`` and
``triton``) on every device present (the last one is never the current
device) against the reference, over the options of every step op; opcheck of
every op; the found_inf skip; grad_norm determinism; CUDA graph capture.
(Every numeric test of the suite also runs on the GPUs through the shared
backend fixture, wrapper tests included.)"""

from __future__ import annotations

import itertools
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import assert_fp32_close, opcheck_cases, random_sizes

import accumkernels as ak
from accumkernels import _native

ROOT = Path(__file__).resolve().parent.parent
OPS = ["accumulate_", "sgd_step_and_zero_", "adam_step_and_zero_", "adamw_step_and_zero_", "grad_norm"]
DEVICES = [f"cuda:{i}" for i in sorted({0, torch.cuda.device_count() - 1})] if torch.cuda.is_available() else []
BACKENDS = [b for b in ("cuda", "triton") if b in ak.available_backends()]
TARGETS = [(b, d) for d in DEVICES for b in BACKENDS]
GRAD_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
needs_gpu = pytest.mark.skipif(not TARGETS, reason="no CUDA device")
target_ids = [f"{b}@{d}" for b, d in TARGETS]


@pytest.mark.skipif(not _native.with_cuda(), reason="the extension was built without CUDA")
def test_every_op_has_a_cuda_kernel():
    for op in OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"accumkernels::{op}", "CUDA"), op


def test_a_gpu_gets_the_cuda_build():
    """Where a GPU is visible, a build without the CUDA kernels is a failure, not a skip."""
    if torch.cuda.is_available():
        assert _native.with_cuda(), "a GPU is present but accumkernels was built without its CUDA kernels"
        assert "cuda" in ak.available_backends()
    else:
        assert "cuda" not in ak.available_backends()


def test_build_refuses_a_missing_toolkit_when_cuda_is_required():
    out = subprocess.run(
        [sys.executable, "setup.py", "--name"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "CUDA_HOME": "/nonexistent", "ACCUMKERNELS_REQUIRE_CUDA": "1"},
    )
    assert out.returncode != 0
    assert "cannot be built" in out.stderr and ("CUDA toolkit" in out.stderr or "CPU-only" in out.stderr)


def _views(sizes, dtype, device, scale=1.0):
    # Odd storage offsets put every other tensor off 16-byte alignment.
    return [(torch.randn(n + i % 3, device=device) * scale).to(dtype)[i % 3 :] for i, n in enumerate(sizes)]


def _cuobjdump() -> Path | None:
    """The toolkit's cuobjdump, or the one Triton ships (the toolkit here has none)."""
    home = Path(os.environ.get("CUDA_HOME", "/usr/local/cuda"))
    found = [home / "bin" / "cuobjdump"]
    try:
        import triton

        found.append(Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump")
    except ImportError:
        pass
    return next((p for p in found if p.exists()), None)


CUOBJDUMP = _cuobjdump()


@pytest.mark.skipif(not _native.with_cuda(), reason="the extension was built without CUDA")
@pytest.mark.skipif(CUOBJDUMP is None, reason="no cuobjdump (CUDA toolkit or Triton)")
def test_8bit_steps_move_a_lanes_codes_in_one_access():
    """The compiled 8-bit steps (every architecture built, every variant) read
    and write each code array 8 codes at a time (one 8-byte access a lane) and
    their params and sums in 16-byte ones: the layout that replaced one byte an
    access, which ran the Adam step at 0.34 of the copy's bandwidth on an H200."""
    sass = subprocess.run(
        [str(CUOBJDUMP), "-sass", _native._C.__file__], capture_output=True, text=True, check=True
    ).stdout
    kernels = {}
    for text in sass.split("Function : ")[1:]:
        name = text.split()[0]
        if "Adam8Functor" in name or "Sgd8Functor" in name:
            kernels.setdefault(name, []).append(text)
    # Every kind is there: Adam, SGD's first step (Momentum 1) and running momentum (2).
    kinds = ("Adam8Functor", "MomentumE1E", "MomentumE2E")
    assert all(any(kind in name for name in kernels) for kind in kinds), sorted(kernels)
    for name, texts in kernels.items():
        # Adam reads and writes two code arrays; SGD one, which its first step only writes.
        reads, writes = (2, 2) if "Adam8Functor" in name else (0 if "MomentumE1E" in name else 1, 1)
        for text in texts:  # one per architecture built
            count = {op: text.count(f" {op} ") for op in ("LDG.E.64", "STG.E.64", "LDG.E.128", "STG.E.128")}
            assert (count["LDG.E.64"], count["STG.E.64"]) == (reads, writes), (name, count)
            assert count["LDG.E.128"] >= 2 and count["STG.E.128"] >= 1, (name, count)


@needs_gpu
@pytest.mark.parametrize("backend,device", TARGETS, ids=target_ids)
@pytest.mark.parametrize("overwrite", [False, True], ids=["add", "overwrite"])
def test_accumulate(backend, device, overwrite):
    sizes = [0, 1, 7, 65536, 65537, 200003] + random_sizes(150)
    buffers = _views(sizes, torch.float32, device)
    grads = [g for i, n in enumerate(sizes) for g in _views([n], GRAD_DTYPES[i % 3], device, 4.0)]
    grads[5][123] = float("inf")
    expected = [(0 if overwrite else b.double()) + 0.5 * g.double() for b, g in zip(buffers, grads)]
    magnitude = [(0 if overwrite else b.double().abs()) + 0.5 * g.double().abs() for b, g in zip(buffers, grads)]
    found_inf = torch.zeros(1, device=device)
    ak.accumulate_(
        buffers, grads, torch.tensor([0.5], device=device), overwrite=overwrite, found_inf=found_inf, backend=backend
    )
    assert found_inf.item() == 1.0
    for i, (b, e, m) in enumerate(zip(buffers, expected, magnitude)):
        if i == 5:
            assert b[123].item() == float("inf")
            b, e, m = b[:123], e[:123], m[:123]
        assert_fp32_close(b, e, m)


# (param dtype, master weights: False, True (fp32) or "remainders" (int16, bf16 params))
PARAM_KINDS = [
    (torch.float32, False),
    (torch.bfloat16, False),
    (torch.bfloat16, True),
    (torch.bfloat16, "remainders"),
    (torch.float16, False),
    (torch.float16, True),
]
OPTIONS = ["plain", "maximize", "stochastic", "first-step", "keep-buffers", "amsgrad", "bf16-state"]


def _step_case(device, dtype, master, option="plain"):
    from accumkernels.backends import reference

    sizes = [1, 31, 65537, 4099] + random_sizes(60)
    weights = _views(sizes, torch.float32, device)
    state_dtype = torch.bfloat16 if option == "bf16-state" else torch.float32
    if master == "remainders":
        pairs = [reference.split_remainder(w) for w in weights]
        params, masters = [p for p, _ in pairs], [r for _, r in pairs]
    else:
        params = [w.to(dtype) for w in weights]
        masters = [p.float() for p in params] if master else None
    state = {
        "buffers": _views(sizes, torch.float32, device),
        "a": [(torch.rand_like(w) * 0.1).to(state_dtype) for w in weights],
        "b": [(torch.rand_like(w) * 0.01).to(state_dtype) for w in weights],
        "c": [(torch.rand_like(w) * 0.01).to(state_dtype) for w in weights],
        "steps": [torch.tensor(float(i % 5), device=device) for i in range(len(sizes))],
        "masters": masters,
    }
    return params, state


def _run(kind, backend, option, params, s):
    device = params[0].device
    common = dict(
        grad_scale=torch.tensor([0.7], device=device),
        master_params=s["masters"],
        backend=backend,
        maximize=option == "maximize",
        zero_buffers=option != "keep-buffers",
        stochastic_rounding=option == "stochastic",
        seed=12345,
        positions=[3 * i + 1 for i in range(len(params))],
    )
    if kind == "sgd":
        ak.sgd_step_and_zero_(
            params,
            s["buffers"],
            s["a"],
            lr=0.1,
            momentum=0.9,
            weight_decay=0.01,
            nesterov=True,
            is_first_step=option == "first-step",
            **common,
        )
    else:
        fn = ak.adam_step_and_zero_ if kind == "adam" else ak.adamw_step_and_zero_
        amsgrad = option == "amsgrad"
        fn(
            params,
            s["buffers"],
            s["a"],
            s["b"],
            s["steps"],
            max_exp_avg_sqs=s["c"] if amsgrad else None,
            amsgrad=amsgrad,
            lr=1e-2,
            weight_decay=0.1,
            **common,
        )


def _step_cases():
    for kind, (dtype, master), option in itertools.product(("sgd", "adam", "adamw"), PARAM_KINDS, OPTIONS):
        if option == "stochastic" and (dtype != torch.bfloat16 or master):
            continue  # stochastic rounding is for bf16 params without master weights
        if option == "first-step" and kind != "sgd" or option == "amsgrad" and kind == "sgd":
            continue
        yield kind, dtype, master, option


@needs_gpu
@pytest.mark.parametrize("backend,device", TARGETS, ids=target_ids)
@pytest.mark.parametrize(
    "kind,dtype,master,option",
    list(_step_cases()),
    ids=lambda v: (
        {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}.get(v, None)
        if isinstance(v, torch.dtype)
        else ("master" if v is True else None if v is False else v)
    ),
)
def test_steps_match_reference(backend, device, kind, dtype, master, option):
    from accumkernels.backends import reference

    params, state = _step_case(device, dtype, master, option)
    ref_params = [p.clone() for p in params]
    ref_state = {k: None if v is None else [t.clone() for t in v] for k, v in state.items()}
    _run(kind, backend, option, params, state)
    _run(kind, "reference", option, ref_params, ref_state)
    for a, b in zip(params, ref_params):
        if option == "stochastic":  # the same random bits; the fp32 value may differ by an ulp (sqrt)
            torch.testing.assert_close(a.float(), b.float(), rtol=2 * torch.finfo(dtype).eps, atol=1e-6)
        else:
            tol = 1e-6 if dtype == torch.float32 else torch.finfo(dtype).eps
            torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=1e-6)
    if master == "remainders":  # the fp32 masters the (param, remainder) pairs hold
        state["masters"] = [reference.join_remainder(p, r) for p, r in zip(params, state["masters"])]
        ref_state["masters"] = [reference.join_remainder(p, r) for p, r in zip(ref_params, ref_state["masters"])]
    # bf16 state is rounded stochastically with the same bits; the fp32 value may differ by an ulp.
    state_tol = (
        dict(rtol=2 * torch.finfo(torch.bfloat16).eps, atol=1e-7)
        if option == "bf16-state"
        else dict(rtol=2e-6, atol=1e-7)
    )
    for key in ("a", "b", "c", "steps", "masters"):
        if state[key] is not None:
            for a, b in zip(state[key], ref_state[key]):
                torch.testing.assert_close(
                    a, b, **(state_tol if key in ("a", "b", "c") else dict(rtol=2e-6, atol=1e-7))
                )
    for a, b in zip(state["buffers"], ref_state["buffers"]):
        assert torch.equal(a, b), "buffers: cleared, or kept untouched with zero_buffers=False"


@needs_gpu
@pytest.mark.parametrize("backend,device", TARGETS, ids=target_ids)
def test_stochastic_rounding_same_bits_as_reference(backend, device):
    # lr = 1, no momentum: w = p - g rounds once in fp32 everywhere, so the
    # stochastic result agrees bit for bit (no contraction on the GPU either).
    sizes = [1, 7, 65537, 1000]
    params = [torch.randn(n, device=device).bfloat16() for n in sizes]
    buffers = [torch.randn(n, device=device) * 1e-2 for n in sizes]
    ours, ref = [p.clone() for p in params], [p.clone() for p in params]
    for out, b in ((ours, backend), (ref, "reference")):
        ak.sgd_step_and_zero_(
            out,
            [x.clone() for x in buffers],
            lr=1.0,
            stochastic_rounding=True,
            seed=2**31 + 5,
            positions=[9, 4, 7, 1],
            backend=b,
        )
    for a, b in zip(ours, ref):
        assert torch.equal(a, b)


@needs_gpu
@pytest.mark.parametrize("backend,device", TARGETS, ids=target_ids)
def test_found_inf_skips(backend, device):
    params, state = _step_case(device, torch.bfloat16, True)
    before = [t.clone() for t in params + state["a"] + state["b"] + state["steps"] + state["masters"]]
    ak.adamw_step_and_zero_(
        params,
        state["buffers"],
        state["a"],
        state["b"],
        state["steps"],
        lr=0.1,
        found_inf=torch.ones(1, device=device),
        master_params=state["masters"],
        backend=backend,
    )
    after = params + state["a"] + state["b"] + state["steps"] + state["masters"]
    assert all(torch.equal(a, b) for a, b in zip(after, before))
    assert all(not b.any() for b in state["buffers"])


@needs_gpu
@pytest.mark.parametrize("backend,device", TARGETS, ids=target_ids)
def test_grad_norm_deterministic(backend, device):
    xs = _views([1, 300001, 65536, 7, 1 << 20] + random_sizes(100), torch.float32, device)
    xs += _views([300001] + random_sizes(40), torch.bfloat16, device)
    xs += _views([65537] + random_sizes(40), torch.float16, device)
    first = ak.grad_norm(xs, backend=backend)
    expected = torch.cat([x.double().flatten() for x in xs]).norm().item()
    assert abs(first.item() - expected) <= 2e-7 * expected
    for _ in range(5):
        assert torch.equal(ak.grad_norm(xs, backend=backend), first)


@needs_gpu
@pytest.mark.skipif(not _native.with_cuda(), reason="the extension was built without CUDA")
@pytest.mark.parametrize("device", DEVICES)
def test_opcheck_every_op(device):
    for op, args in opcheck_cases(device):
        torch.library.opcheck(getattr(torch.ops.accumkernels, op).default, args)


@needs_gpu
@pytest.mark.skipif(not _native.with_cuda(), reason="the extension was built without CUDA")
def test_native_ops_are_capturable_in_a_cuda_graph():
    """Everything the native kernels need travels in their arguments: a captured
    window (accumulate, then the AdamW step) replays with the values of replay time."""
    device = "cuda:0"
    p = [torch.randn(70001, device=device).bfloat16()]
    buf, grad = [torch.zeros(70001, device=device)], [torch.randn(70001, device=device).bfloat16()]
    m, v, step = (
        [torch.zeros(70001, device=device)],
        [torch.zeros(70001, device=device)],
        [torch.zeros((), device=device)],
    )
    scale = torch.ones(1, device=device)

    def window():
        ak.accumulate_(buf, grad, scale, overwrite=True, backend="cuda")
        ak.adamw_step_and_zero_(p, buf, m, v, step, lr=1e-3, grad_scale=scale, zero_buffers=False, backend="cuda")

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        window()  # warm-up outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        window()
    expected_p, expected_m = [p[0].clone()], [m[0].clone()]
    expected_v, expected_step = [v[0].clone()], [step[0].clone()]
    grad[0].copy_(torch.randn_like(grad[0].float()).bfloat16())
    scale.fill_(0.25)
    ak.accumulate_(buf, grad, scale, overwrite=True, backend="cuda")
    ak.adamw_step_and_zero_(
        expected_p,
        buf,
        expected_m,
        expected_v,
        expected_step,
        lr=1e-3,
        grad_scale=scale,
        zero_buffers=False,
        backend="cuda",
    )
    graph.replay()
    torch.cuda.synchronize()
    assert (
        torch.equal(p[0], expected_p[0]) and torch.equal(m[0], expected_m[0]) and torch.equal(step[0], expected_step[0])
    )
