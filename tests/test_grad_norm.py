"""grad_norm: value against float64 (fp32 buffers, 16-bit gradients, both in
one list), determinism, non-finite inputs.

Bound: the squares are exact in float64 and their float64 sum is off by at
most n * 2^-53 relative, so the result is the float64 norm rounded to fp32
(half an fp32 ulp) plus that: within 2 fp32 epsilons of it."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from helpers import SIZES, randn, random_sizes

import accumkernels as ak


@pytest.mark.parametrize("n", SIZES)
def test_single_tensor_matches_float64(backend, n):
    x = randn(n, torch.float32, offset=1, scale=3.0)
    out = ak.grad_norm([x], backend=backend)
    assert out.dtype == torch.float32 and out.shape == () and out.device == x.device
    expected = x.double().norm().item()
    assert abs(out.item() - expected) <= 2 * torch.finfo(torch.float32).eps * expected


@pytest.mark.parametrize("count", [1, 5, 200])
def test_lists_match_float64(backend, count):
    xs = [randn(n, torch.float32, scale=float(i % 7) + 0.1) for i, n in enumerate(random_sizes(count, 70000))]
    expected = torch.cat([x.double() for x in xs]).norm().item()
    out = ak.grad_norm(xs, backend=backend).item()
    assert abs(out - expected) <= 2 * torch.finfo(torch.float32).eps * expected


# (dtype, scale): fp16 also at 1e-6, most of its values subnormal.
SIXTEEN_BIT = [(torch.bfloat16, 3.0), (torch.float16, 3.0), (torch.float16, 1e-6)]


@pytest.mark.parametrize("dtype,scale", SIXTEEN_BIT, ids=["bf16", "fp16", "fp16-subnormal"])
@pytest.mark.parametrize("n", SIZES)
def test_16bit_gradients_match_float64(backend, dtype, scale, n):
    x = randn(n, dtype, offset=3, scale=scale)
    out = ak.grad_norm([x], backend=backend)
    assert out.dtype == torch.float32 and out.shape == () and out.device == x.device
    expected = x.double().norm().item()
    assert abs(out.item() - expected) <= 2 * torch.finfo(torch.float32).eps * expected


@pytest.mark.parametrize("count", [3, 60])
def test_mixed_dtypes_match_float64(backend, count):
    """fp32, bf16 and fp16 tensors interleaved in one list, as the gradients of
    a model with params of several dtypes come."""
    kinds = [(torch.float32, 1.0), *SIXTEEN_BIT]
    xs = []
    for i, n in enumerate(random_sizes(count, 70000)):
        dtype, scale = kinds[i % len(kinds)]
        xs.append(randn(n, dtype, scale=scale))
    expected = torch.cat([x.double().flatten() for x in xs]).norm().item()
    out = ak.grad_norm(xs, backend=backend).item()
    assert abs(out - expected) <= 2 * torch.finfo(torch.float32).eps * expected


def test_strided_dense_layout(backend):
    x = torch.randn(300, 7).t()
    assert not x.is_contiguous()
    expected = x.double().norm().item()
    assert abs(ak.grad_norm([x], backend=backend).item() - expected) <= 2e-7 * expected


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
@pytest.mark.parametrize("bad,expect", [(float("inf"), "inf"), (float("nan"), "nan")])
def test_nonfinite(backend, dtype, bad, expect):
    x = torch.randn(1000, dtype=dtype)
    x[17] = bad
    out = ak.grad_norm([torch.randn(5), x], backend=backend).item()
    assert (out == float("inf")) if expect == "inf" else (out != out)


def test_all_empty_is_zero(backend):
    assert ak.grad_norm([torch.empty(0), torch.empty(0)], backend=backend).item() == 0.0


def test_same_bits_on_repeat_and_across_thread_counts(native_only):
    xs = [torch.randn(n) for n in (1, 300001, 65536, 7, 1 << 20)]
    xs += [torch.randn(n).bfloat16() for n in (300001, 5)] + [torch.randn(n).half() for n in (65537, 3)]
    first = ak.grad_norm(xs, backend="cpu")
    for _ in range(3):
        assert torch.equal(ak.grad_norm(xs, backend="cpu"), first)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = ak.grad_norm(xs, backend="cpu")
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, first), "the result must not depend on the thread count"


def test_same_bits_in_a_process_with_other_thread_count(native_only, tmp_path):
    xs = [torch.randn(n) for n in (300001, 1 << 20, 13)]
    path = tmp_path / "xs.pt"
    torch.save(xs, path)
    here = ak.grad_norm(xs, backend="cpu")
    code = (
        "import sys, torch, accumkernels as ak; torch.set_num_threads(int(sys.argv[2]));"
        "xs = torch.load(sys.argv[1]); print(ak.grad_norm(xs, backend='cpu').view(torch.int32).item())"
    )
    for threads in (1, 3):
        out = subprocess.run(
            [sys.executable, "-c", code, str(path), str(threads)], capture_output=True, text=True, check=True
        )
        assert int(out.stdout) == here.view(torch.int32).item()
