"""accumulate_: every backend and grad dtype against float64, on awkward sizes and lists."""

from __future__ import annotations

import pytest
import torch
from helpers import DTYPE_IDS, SIZES, assert_fp32_close, randn, random_sizes

import accumkernels as ak

GRAD_DTYPES = [torch.bfloat16, torch.float16, torch.float32]


def _expected(buffer, grad, scale32: float, overwrite: bool):
    g = grad.double().reshape(buffer.shape) * scale32
    start = torch.zeros_like(buffer, dtype=torch.float64) if overwrite else buffer.double()
    return start + g, start.abs() + g.abs()


def _f32(x: float) -> float:
    return torch.tensor(x, dtype=torch.float32).item()


@pytest.mark.parametrize("overwrite", [False, True], ids=["add", "overwrite"])
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=DTYPE_IDS.get)
def test_matches_float64(backend, dtype, n, overwrite):
    # Views with storage offsets: neither tensor starts 16-byte aligned.
    buffer = randn(n, torch.float32, offset=1)
    grad = randn(n, dtype, offset=3, scale=8.0)
    scale = float(torch.empty(()).uniform_(-3, 3))
    expected, magnitude = _expected(buffer, grad, _f32(scale), overwrite)
    ak.accumulate_([buffer], [grad], scale, overwrite=overwrite, backend=backend)
    assert_fp32_close(buffer, expected, magnitude)


@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=DTYPE_IDS.get)
def test_scale_tensor(backend, dtype):
    buffer = randn(1021, torch.float32)
    grad = randn(1021, dtype)
    scale = torch.empty(1).uniform_(0.1, 2.0)
    expected, magnitude = _expected(buffer, grad, scale.item(), False)
    ak.accumulate_([buffer], [grad], scale, backend=backend)
    assert_fp32_close(buffer, expected, magnitude)


@pytest.mark.parametrize("count", [1, 2, 37, 200])
def test_lists_of_mixed_dtypes(backend, count):
    sizes = random_sizes(count)
    buffers = [randn(n, torch.float32, offset=i % 3) for i, n in enumerate(sizes)]
    grads = [randn(n, GRAD_DTYPES[i % 3], offset=i % 5, scale=4.0) for i, n in enumerate(sizes)]
    expected = [_expected(b, g, 0.25, False) for b, g in zip(buffers, grads)]
    ak.accumulate_(buffers, grads, 0.25, backend=backend)
    for b, (e, m) in zip(buffers, expected):
        assert_fp32_close(b, e, m)


def test_shapes_and_dense_layouts(backend):
    # A 1-D buffer for a 2-D contiguous grad, and a transposed pair with equal strides.
    flat = torch.randn(35)
    grad2d = torch.randn(5, 7).bfloat16()
    buffer_t = torch.randn(7, 5).t()
    grad_t = torch.randn(7, 5).half().t()
    expected = [_expected(flat, grad2d, 1.0, False), _expected(buffer_t, grad_t, 1.0, False)]
    ak.accumulate_([flat, buffer_t], [grad2d, grad_t], backend=backend)
    for b, (e, m) in zip([flat, buffer_t], expected):
        assert_fp32_close(b, e, m)


@pytest.mark.parametrize("bad", [float("inf"), float("-inf"), float("nan")], ids=["inf", "-inf", "nan"])
@pytest.mark.parametrize("dtype", GRAD_DTYPES, ids=DTYPE_IDS.get)
def test_found_inf(backend, dtype, bad):
    sizes = [3, 70001, 0, 129]
    buffers = [torch.zeros(n) for n in sizes]
    grads = [randn(n, dtype) for n in sizes]
    found_inf = torch.zeros(1)
    ak.accumulate_(buffers, grads, found_inf=found_inf, backend=backend)
    assert found_inf.item() == 0.0, "finite grads must leave found_inf at 0"

    grads[1][int(torch.randint(0, sizes[1], ()))] = bad
    ak.accumulate_(buffers, grads, found_inf=found_inf, backend=backend)
    assert found_inf.item() == 1.0

    clean = [randn(n, dtype) for n in sizes]
    ak.accumulate_(buffers, clean, found_inf=found_inf, backend=backend)
    assert found_inf.item() == 1.0, "a later clean call must not clear the flag"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_every_16_bit_pattern(backend, dtype):
    # Every bit pattern: exact conversion, including subnormals, inf and NaN.
    bits = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16)
    grad = bits.view(dtype)
    buffer = torch.zeros(grad.numel())
    ak.accumulate_([buffer], [grad], overwrite=True, backend=backend)
    torch.testing.assert_close(buffer, grad.float(), equal_nan=True, rtol=0, atol=0)


def test_empty_list_is_a_no_op(backend):
    found_inf = torch.zeros(1)
    ak.accumulate_([], [], 2.0, found_inf=found_inf, backend=backend)
    assert found_inf.item() == 0.0
    # ... that still checks its scale.
    with pytest.raises(TypeError, match="scale"):
        ak.accumulate_([], [], "2", backend=backend)


def test_overwrite_ignores_old_nan(backend):
    buffer = torch.full((1000,), float("nan"))
    grad = torch.randn(1000).bfloat16()
    ak.accumulate_([buffer], [grad], 2.0, overwrite=True, backend=backend)
    torch.testing.assert_close(buffer, grad.float() * 2)
