"""The native build: torch.library.opcheck on every op, every CPU ISA variant
this machine runs, what a missing extension does, and > 2^31 elements."""

from __future__ import annotations

import ast
import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers import opcheck_cases

import accumkernels as ak
from accumkernels._op_table import OPS
from accumkernels.backends import BACKENDS


@pytest.mark.parametrize("op,args", list(opcheck_cases()), ids=lambda x: x if isinstance(x, str) else "")
def test_opcheck(native_only, op, args):
    torch.library.opcheck(getattr(torch.ops.accumkernels, op).default, args)


def test_every_op_has_a_cpu_kernel(native_only):
    for op in OPS:
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"accumkernels::{op}", "CPU"), op


def test_op_table_is_the_extensions_op_list(native_only):
    """The op table (accumkernels._op_table) names every op csrc/ops.cpp
    declares, no other, with the arguments each schema marks as written."""
    registered = {
        name.removeprefix("accumkernels::")
        for name in torch._C._dispatch_get_all_op_names()
        if name.startswith("accumkernels::")
    }
    assert registered == set(OPS)
    for name, op in OPS.items():
        schema = getattr(torch.ops.accumkernels, name).default._schema
        written = tuple(a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write)
        assert written == op.mutates, name
        assert (op.returns is None) == (len(schema.returns) == 0), name


def test_every_backend_implements_every_op():
    for name, backend in BACKENDS.items():
        for op in OPS:
            assert callable(getattr(backend, op, None)), (name, op)


def _supported_isas() -> list[str]:
    flags = open("/proc/cpuinfo").read() if os.path.exists("/proc/cpuinfo") else ""
    isas = ["default"]
    if all(f in flags for f in (" avx2", " fma", " f16c")):
        isas.append("avx2")
    if all(f in flags for f in (" avx512f", " avx512bw", " avx512vl", " avx512dq")):
        isas.append("avx512")
    return isas


ISA_CHECK = textwrap.dedent(
    """
    import torch, accumkernels as ak
    from accumkernels import _native
    assert _native.cpu_isa() == "{isa}", _native.cpu_isa()
    torch.manual_seed({seed})
    # Every ISA variant rounds exactly like the reference (no contraction, the
    # same formulas): accumulate_ and SGD to the bit; Adam to 4 fp32 ulps of the
    # terms (the bias corrections' pow may differ by an ulp) and, for 16-bit
    # params, to one ulp of their dtype after rounding.
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        ulp = torch.finfo(dtype).eps
        for n in (0, 1, 7, 65537, 200003):
            b, g = torch.randn(n), (torch.randn(n) * 5).to(dtype)
            want = b.clone()
            ak.accumulate_([b], [g], 0.75, backend="cpu")
            ak.accumulate_([want], [g], 0.75, backend="reference")
            assert torch.equal(b, want), (dtype, n)
            for maker in (ak.adam_step_and_zero_, ak.adamw_step_and_zero_):
                ps, bs = [torch.randn(n).to(dtype)], [torch.randn(n)]
                qs = [p.clone() for p in ps]
                state = lambda: [[torch.zeros(n)], [torch.zeros(n)], [torch.tensor(0.0)]]
                s1, s2 = state(), state()
                maker(ps, [x.clone() for x in bs], *s1, lr=0.1, weight_decay=0.1, backend="cpu")
                maker(qs, [x.clone() for x in bs], *s2, lr=0.1, weight_decay=0.1, backend="reference")
                terms = qs[0].float().abs() + 0.2  # |p| and the step (lr * |m/denom| <= ~lr)
                bound = 4 * 2**-23 * terms + (ulp * qs[0].float().abs() if dtype != torch.float32 else 0)
                assert ((ps[0].float() - qs[0].float()).abs() <= bound).all(), (maker.__name__, dtype, n)
            p, buf, mom = [torch.randn(n).to(dtype)], [torch.randn(n)], [torch.randn(n)]
            q = [p[0].clone()]
            moms = [mom[0].clone()], [mom[0].clone()]
            ak.sgd_step_and_zero_(p, [buf[0].clone()], moms[0], lr=0.1, momentum=0.9, backend="cpu")
            ak.sgd_step_and_zero_(q, [buf[0].clone()], moms[1], lr=0.1, momentum=0.9, backend="reference")
            assert torch.equal(p[0], q[0]) and torch.equal(moms[0][0], moms[1][0]), (dtype, n)
    # bf16 momentum (stochastically rounded) and bf16 params with int16 remainders:
    # SGD's update rounds alike everywhere, so the same bits as the reference.
    from accumkernels.backends import reference
    for n in (1, 7, 65537, 200003):
        for sr in (False, True):
            w = torch.randn(n)
            p, r = reference.split_remainder(w)
            buf, mom = torch.randn(n), torch.randn(n).bfloat16()
            runs = []
            for backend in ("cpu", "reference"):
                ps = [p.clone() if not sr else w.bfloat16()]
                extra = None if sr else [r.clone()]
                moms = [mom.clone()]
                ak.sgd_step_and_zero_(ps, [buf.clone()], moms, lr=0.1, momentum=0.9, weight_decay=0.01,
                                      master_params=extra, stochastic_rounding=sr, seed=4242, backend=backend)
                runs.append((ps[0], moms[0], extra[0] if extra else None))
            (a, ma, ra), (b, mb, rb) = runs
            assert torch.equal(a, b) and torch.equal(ma, mb), ("bf16 state", sr, n)
            assert sr or torch.equal(ra, rb), ("remainders", n)
    # 8-bit state: codes and scales to the bit (the moments do not depend on
    # the bias corrections), bf16 params rounded stochastically.
    from accumkernels import _state8 as s8
    for n in (1, 257, 65537, 200003):
        like = torch.empty(n, dtype=torch.uint8)
        mc, ms = s8.encode_exp_avg(torch.randn(n) * 0.1, like, None)
        vc, vs = s8.encode_exp_avg_sq(torch.rand(n) * 0.01, like, None)
        p, buf = torch.randn(n).bfloat16(), torch.randn(n)
        runs = []
        for backend in ("cpu", "reference"):
            state = [mc.clone()], [vc.clone()], [ms.clone()], [vs.clone()]
            ak.adamw_step_and_zero_([p.clone()], [buf.clone()], state[0], state[1], [torch.tensor(0.0)],
                                    exp_avg_scales=state[2], exp_avg_sq_scales=state[3], lr=0.1, weight_decay=0.1,
                                    stochastic_rounding=True, seed=77, backend=backend)
            runs.append([x[0] for x in state])
        assert all(torch.equal(a, b) for a, b in zip(*runs)), ("8-bit state", n)
    # A gradient of the param's dtype read in place of the fp32 buffer steps as
    # its (exact) fp32 value: SGD with momentum and 8-bit AdamW, to the bit.
    for dtype in (torch.bfloat16, torch.float16):
        for n in (1, 257, 65537):
            p, g = torch.randn(n).to(dtype), torch.randn(n).to(dtype)
            runs = []
            for grad in (g, g.float()):
                ps, moms = [p.clone()], [torch.randn(n, generator=torch.Generator().manual_seed(n))]
                ak.sgd_step_and_zero_(ps, [grad.clone()], moms, lr=0.1, momentum=0.9, zero_buffers=False,
                                      backend="cpu")
                state = [torch.zeros(n, dtype=torch.uint8)], [torch.zeros(n, dtype=torch.uint8)]
                scales = [torch.zeros(-(-n // 256))], [torch.zeros(-(-n // 256))]
                ak.adamw_step_and_zero_(ps, [grad.clone()], *state, [torch.tensor(0.0)], exp_avg_scales=scales[0],
                                        exp_avg_sq_scales=scales[1], lr=0.1, zero_buffers=False,
                                        stochastic_rounding=dtype == torch.bfloat16, seed=5, backend="cpu")
                runs.append([ps[0], moms[0], *state[0], *state[1], *scales[0], *scales[1]])
            assert all(torch.equal(a, b) for a, b in zip(*runs)), ("narrow gradients", dtype, n)
    xs = [torch.randn(300001)]
    assert abs(ak.grad_norm(xs, backend="cpu").item() - xs[0].double().norm().item()) < 1e-3
    print("ok")
    """
)


@pytest.mark.parametrize("isa", _supported_isas())
def test_every_cpu_isa_variant(native_only, isa):
    env = {**os.environ, "ACCUMKERNELS_CPU_ISA": isa}
    code = ISA_CHECK.format(isa=isa, seed=int(torch.randint(0, 2**31, ())))
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


CSRC = Path(__file__).resolve().parent.parent / "csrc"


def _build_cxx_flags() -> list[str]:
    """setup.py's CXX_FLAGS, read without running setup.py."""
    tree = ast.parse((CSRC.parent / "setup.py").read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and [getattr(t, "id", None) for t in node.targets] == ["CXX_FLAGS"]:
            return ast.literal_eval(node.value)
    raise AssertionError("setup.py has no module-level CXX_FLAGS")


def _simd_loop_lines(source: Path) -> list[tuple[int, int]]:
    """(first, last) line of each `#pragma omp simd` loop, pragma included."""
    lines = source.read_text().splitlines()
    ranges = []
    for i, line in enumerate(lines):
        if line.strip().startswith("#pragma omp simd"):
            depth, j = 0, i + 1
            while True:
                depth += lines[j].count("{") - lines[j].count("}")
                if depth <= 0 and (lines[j].rstrip().endswith(("}", ";"))):
                    break
                j += 1
            ranges.append((i + 1, j + 1))
    return ranges


@pytest.mark.slow
@pytest.mark.skipif(platform.machine() not in ("x86_64", "AMD64"), reason="the AVX2 and AVX-512 loops are x86 only")
def test_every_simd_loop_is_vectorized_for_avx2_and_avx512():
    """GCC vectorizes every `#pragma omp simd` loop of kernels_impl.h, in every
    template instance, for AVX2 and AVX-512. A loop it cannot vectorize still
    compiles and gives the same bits, only 3-6x slower: the bf16-state AdamW
    step ran scalar for AVX2 until a lerp computed its (1 - weight) under a
    condition, and a bool read in the loop, were removed. The loops are
    compiled as the build compiles them, with GCC's report of missed loops."""
    cxx = os.environ.get("CXX", "c++")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    if "GCC" not in version and "g++" not in version and "Free Software Foundation" not in version:
        pytest.skip(f"{cxx} is not GCC: the loops' vectorization is checked with GCC's -fopt-info")
    flags = [*_build_cxx_flags(), f"-I{CSRC / 'include'}", f"-I{CSRC / 'cpu'}", "-fopt-info-vec-missed"]
    runs = {
        isa: subprocess.Popen(
            [cxx, *flags, "-c", str(CSRC / "cpu" / f"kernels_{isa}.cpp"), "-o", os.devnull],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for isa in ("avx2", "avx512")
    }
    loops = _simd_loop_lines(CSRC / "cpu" / "kernels_impl.h")
    assert len(loops) >= 10, loops
    for isa, run in runs.items():
        _, report = run.communicate(timeout=900)
        assert run.returncode == 0, report[-3000:]
        missed = set()
        for line in report.splitlines():
            where = line.split("kernels_impl.h:", 1)
            # a loop left scalar, and why (other "missed" notes are about statements)
            if len(where) == 2 and ("couldn't vectorize loop" in line or "not vectorized:" in line):
                number = int(where[1].split(":", 1)[0])
                if any(first <= number <= last for first, last in loops):
                    missed.add(where[1])
        assert not missed, f"{isa}: simd loops of kernels_impl.h GCC did not vectorize:\n" + "\n".join(sorted(missed))


def test_forcing_an_unknown_isa_fails_the_import_clearly(native_only):
    env = {**os.environ, "ACCUMKERNELS_CPU_ISA": "sse9"}
    code = "import accumkernels._native as n; print(n.LOAD_ERROR)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert "ACCUMKERNELS_CPU_ISA" in out.stdout


MISSING_EXTENSION = textwrap.dedent(
    """
    import sys, warnings
    sys.modules["accumkernels._C"] = None  # as if it was never built
    import torch, accumkernels as ak
    backends = ak.available_backends()
    assert "reference" in backends and not {"cpu", "cuda"} & set(backends), backends
    try:
        ak.accumulate_([torch.zeros(3)], [torch.ones(3)], backend="cpu")
    except RuntimeError as e:
        assert "pip install --no-build-isolation" in str(e), e
    else:
        raise AssertionError("backend='cpu' must raise without the extension")
    b = torch.zeros(3)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ak.accumulate_([b], [torch.ones(3)])
    assert b.tolist() == [1.0, 1.0, 1.0]
    assert any("reference" in str(w.message) for w in caught), [str(w.message) for w in caught]
    print("ok")
    """
)


def test_missing_extension_imports_and_says_how_to_build():
    out = subprocess.run([sys.executable, "-c", MISSING_EXTENSION], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


def _available_memory() -> int:
    """MemAvailable in bytes (0 where unknown: the test then skips rather than
    risk the OOM killer, since torch.zeros touches every page)."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


@pytest.mark.slow
def test_more_than_2_31_elements(native_only):
    """64-bit indexing: accumulate_, grad_norm and an SGD step on 2^31 + 4099 elements."""
    n = 2**31 + 4099
    need = n * (4 + 2) + 2 * 2**30  # fp32 buffer + bf16 grad, then bf16 params in the grad's place
    if _available_memory() < need:
        pytest.skip(f"needs {need / 2**30:.1f} GiB of free memory; {_available_memory() / 2**30:.1f} GiB available")
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)  # memory-bound: under pytest-xdist a worker has one thread
    try:
        _more_than_2_31_elements(n)
    finally:
        torch.set_num_threads(threads)


def _more_than_2_31_elements(n: int) -> None:
    buffer = torch.zeros(n)
    grad = torch.ones(n, dtype=torch.bfloat16)
    tail = torch.arange(1, 65, dtype=torch.float32)
    grad[-64:] = tail.bfloat16()
    grad[2**31 - 3 : 2**31 + 1] = 3.0
    ak.accumulate_([buffer], [grad], 0.5, backend="cpu")
    ak.accumulate_([buffer], [grad], 0.25, backend="cpu")
    assert buffer[:4].tolist() == [0.75] * 4
    assert buffer[2**31 - 3 : 2**31 + 1].tolist() == [2.25] * 4
    assert torch.equal(buffer[-64:], tail * 0.75)
    expected = ((n - 64 - 4) * 0.75**2 + 4 * 2.25**2 + float((tail * 0.75).double().pow(2).sum())) ** 0.5
    assert abs(ak.grad_norm([buffer], backend="cpu").item() - expected) <= 1e-6 * expected
    del grad
    params = [torch.zeros(n, dtype=torch.bfloat16)]
    ak.sgd_step_and_zero_(params, [buffer], lr=2.0, backend="cpu")
    assert params[0][-1].item() == -2.0 * 48.0
    assert params[0][2**31].item() == -4.5
    assert buffer[-1].item() == 0.0 and buffer[2**31].item() == 0.0


THREADS_CHECK = textwrap.dedent(
    """
    import sys, torch, accumkernels as ak
    from accumkernels import _state8 as s8
    torch.set_num_threads(int(sys.argv[1]))
    torch.manual_seed(int(sys.argv[2]))
    # Sizes across FlatIndex's pieces, chunks and grains (parallel.h): lists
    # that stay on one thread and lists shared in runs ending mid-chunk and
    # mid-piece, tensors from 1 element to 2^18 + 4099, with 8-bit blocks.
    sizes = [(1, 4099, 65537), (300001, 7, 65536, 12289), ((1 << 18) + 4099, 3, 131073)]
    out, flags = [], []
    for numels in sizes:
        grads = [torch.randn(n).bfloat16() for n in numels]
        grads[1][-1] = float("inf") if numels[0] == 300001 else 1.0  # the flag of one list only
        buffers, found = [torch.empty(n) for n in numels], torch.zeros(1)
        ak.accumulate_(buffers, grads, 0.5, overwrite=True, found_inf=found, backend="cpu")
        ak.accumulate_(buffers, [g.float() for g in grads], 0.25, backend="cpu")
        out += buffers
        flags.append(found.item())
        finite = [b.nan_to_num(posinf=0.0) for b in buffers]
        for state in (torch.bfloat16, "8bit"):
            params = [torch.randn(n).bfloat16() for n in numels]
            if state == "8bit":
                moments = [[torch.zeros(n, dtype=torch.uint8) for n in numels] for _ in range(2)]
                scales = [[torch.zeros(s8.scales_numel(n)) for n in numels] for _ in range(2)]
            else:
                moments, scales = [[torch.zeros(n, dtype=state) for n in numels] for _ in range(2)], [None, None]
            steps = [torch.zeros(()) for _ in numels]
            for seed in (3, 4):
                ak.adamw_step_and_zero_(params, [f.clone() for f in finite], *moments, steps,
                                        exp_avg_scales=scales[0], exp_avg_sq_scales=scales[1], lr=0.01,
                                        weight_decay=0.1, stochastic_rounding=True, seed=seed, backend="cpu")
            momentum = [torch.zeros(n, dtype=torch.bfloat16) for n in numels]
            ak.sgd_step_and_zero_(params, [f.clone() for f in finite], momentum, lr=0.1, momentum=0.9,
                                  stochastic_rounding=True, seed=5, backend="cpu")
            out += params + moments[0] + moments[1] + momentum + (scales[0] + scales[1] if state == "8bit" else [])
    torch.save((flags, out), sys.argv[3])
    """
)


def test_elementwise_ops_same_bits_at_any_thread_count(native_only, tmp_path):
    """accumulate_ (overwrite, add, the inf flag) and the AdamW (bf16 and
    8-bit state, stochastic rounding) and SGD steps split their lists over
    threads by elements (FlatIndex::parallel_for_elements): 1, 2 and 3 threads
    give the same bits, on lists that stay on one thread and lists that are
    shared. (Under pytest-xdist a worker runs one thread, so a subprocess.)"""
    seed = str(int(torch.randint(0, 2**31, ())))
    runs = []
    for threads in (1, 2, 3):
        path = tmp_path / f"out{threads}.pt"
        done = subprocess.run(
            [sys.executable, "-c", THREADS_CHECK, str(threads), seed, str(path)], capture_output=True, text=True
        )
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(torch.load(path))
    for flags, tensors in runs:
        assert flags == [0.0, 1.0, 0.0]
        assert all(torch.equal(a, b) for a, b in zip(runs[0][1], tensors, strict=True))
