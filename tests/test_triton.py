"""The Triton backend beyond the numeric tests (which run it through the shared
backend fixture, in the interpreter where there is no GPU): every kernel
variant the launchers produce compiles for sm_90 ahead of time, with 16-byte
vector accesses where ALIGNED, no fused fp32 multiply-add and every buffer
clear behind a barrier; every op launches
on its tensors' device; per-call values never recompile; the backend is listed
only where it runs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

import accumkernels as ak  # noqa: E402
from accumkernels.backends import triton_backend  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ENV_WITHOUT_INTERPRETER = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}


@pytest.fixture(scope="module")
def compiled_variants():
    out = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "triton_variants.py")],
        cwd=ROOT,
        env={**ENV_WITHOUT_INTERPRETER, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert out.returncode == 0, out.stderr[-4000:]
    return [json.loads(line) for line in out.stdout.splitlines()]


@pytest.mark.slow
def test_every_variant_compiles_for_sm90(compiled_variants):
    import triton_variants  # tests/ is on sys.path (pytest's rootdir conftest)

    expected = {v[0] for v in triton_variants.variants()}
    assert {r["name"] for r in compiled_variants} == expected
    # accumulate: dtype x overwrite x aligned; steps: every param kind (dtype, master weights or
    # remainders, stochastic rounding) x the buffers it reads (fp32 sums; 16-bit params also their
    # own dtype's gradients: 1 + 6 * 2 = 13) x state dtype x aligned x family variant; 8-bit state:
    # the 13 x aligned x (Adam, SGD's two momentum modes); grad_norm's partials: dtype x aligned;
    # 2 others
    assert len(expected) == 12 + 13 * 2 * 2 * 5 + 13 * 2 * 3 + 3 * 2 + 2


def test_aligned_variants_use_16_byte_accesses(compiled_variants):
    aligned = [r for r in compiled_variants if r["aligned"]]
    assert aligned
    scalar_only = [r["name"] for r in aligned if not any(".v4." in a for a in r["accesses"] if a.startswith("ld"))]
    assert not scalar_only, f"aligned variants without a 16-byte load: {scalar_only[:5]}"
    writers = [r for r in aligned if r["kernel"] != "partials"]  # grad_norm writes one partial per chunk
    scalar_only = [r["name"] for r in writers if not any(".v4." in a for a in r["accesses"] if a.startswith("st"))]
    assert not scalar_only, f"aligned variants without a 16-byte store: {scalar_only[:5]}"


def test_no_fp32_contraction(compiled_variants):
    fused = [r["name"] for r in compiled_variants if r["fma_f32"]]
    assert not fused, f"variants with fused fp32 multiply-adds (they would round differently): {fused[:5]}"


def test_buffer_clears_wait_for_the_loads(compiled_variants):
    # A step's buffer = 0 after its block read the sums must be ordered behind
    # every thread's load: the compiler lays the two out apart (8 elements a
    # thread for 16-bit params, 4 for the fp32 zeros), and without the barrier
    # the Triton steps of 16-bit params dropped random gradients on an H200.
    racy = [r["name"] for r in compiled_variants if r["unordered_clears"]]
    assert not racy, f"variants that clear what they loaded with no barrier between: {racy[:5]}"


@pytest.mark.skipif("triton" not in ak.available_backends(), reason="triton does not run here")
def test_every_op_launches_under_its_tensors_device(monkeypatch):
    from accumkernels.backends.triton import _common

    seen = []
    real = _common.device_guard
    monkeypatch.setattr(_common, "device_guard", lambda device: seen.append(device) or real(device))
    device = torch.device("cuda", torch.cuda.device_count() - 1) if torch.cuda.is_available() else torch.device("cpu")
    p, b = [torch.randn(40, device=device)], [torch.randn(40, device=device)]
    ak.accumulate_(b, [torch.randn(40, device=device).bfloat16()], backend="triton")
    ak.sgd_step_and_zero_(p, b, lr=0.1, backend="triton")
    ak.adamw_step_and_zero_(
        p, b, [torch.zeros_like(p[0])], [torch.zeros_like(p[0])], [torch.zeros((), device=device)], backend="triton"
    )
    ak.grad_norm(b, backend="triton")
    assert seen == [device] * 4


NOT_SPECIALIZED = """
from accumkernels.backends.triton import _common, accumulate, adam, grad_norm, sgd
for kernel, per_call in [(accumulate._accumulate_kernel, {"T", "C"}), (sgd._sgd_kernel, {"T", "C", "seed"}),
                         (adam._adam_kernel, {"T", "C", "seed"}), (adam._increment_steps_kernel, {"T"}),
                         (grad_norm._partials_kernel, {"T", "C"}), (grad_norm._finish_kernel, {"count"})]:
    names = {kernel.arg_names[i] if isinstance(i, int) else i for i in kernel.do_not_specialize}
    assert per_call <= names, (kernel.fn.__name__, per_call - names)
# The seed's Triton type must not change with its value (i32 below 2^31, i64 above).
assert all(-(2**31) <= _common.seed_argument(s) < 2**31 for s in (0, 1, 2**31 - 1, 2**31, 2**32 - 1))
print("ok")
"""


def test_per_call_values_are_not_specialized():
    """Tensor and chunk counts and the seed change from call to call: a
    specialization on their value (== 1, divisible by 16, i32 or i64) would
    compile new variants during training. Checked on the compiled (not the
    interpreted) kernels."""
    out = subprocess.run(
        [sys.executable, "-c", NOT_SPECIALIZED], env=ENV_WITHOUT_INTERPRETER, capture_output=True, text=True
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


@pytest.mark.skipif(not torch.cuda.is_available() or "triton" not in ak.available_backends(), reason="needs a GPU")
def test_a_second_call_with_other_values_hits_the_cache():
    from accumkernels.backends.triton import sgd

    def run(n, seed, lr):
        p = [torch.randn(n, device="cuda").bfloat16()]
        ak.sgd_step_and_zero_(
            p, [torch.randn(n, device="cuda")], lr=lr, stochastic_rounding=True, seed=seed, backend="triton"
        )

    run(1000, 3, 0.1)
    compiled = (
        sum(len(c) for c in sgd._sgd_kernel.device_caches.values())
        if hasattr(sgd._sgd_kernel, "device_caches")
        else len(sgd._sgd_kernel.cache)
    )
    run(4000, 2**31 + 5, 0.01)  # other numel, chunk count, seed and lr
    after = (
        sum(len(c) for c in sgd._sgd_kernel.device_caches.values())
        if hasattr(sgd._sgd_kernel, "device_caches")
        else len(sgd._sgd_kernel.cache)
    )
    assert after == compiled


def test_listed_only_where_it_runs():
    code = "import torch, accumkernels as ak; print('triton' in ak.available_backends(), torch.cuda.is_available())"
    out = subprocess.run(
        [sys.executable, "-c", code], env=ENV_WITHOUT_INTERPRETER, capture_output=True, text=True, check=True
    )
    listed, has_cuda = out.stdout.split()
    assert listed == has_cuda, "without a GPU or the interpreter, triton must not be listed"


def test_unavailable_reason_names_the_fix():
    if triton_backend.unavailable_reason() is None:
        pytest.skip("triton runs here")
    assert "TRITON_INTERPRET" in triton_backend.unavailable_reason()
