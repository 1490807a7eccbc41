"""The Triton backend beyond the numeric tests (which run it through the shared
backend fixture, in the interpreter where there is no GPU): every kernel
compiles for sm_90 ahead of time, and the backend is listed only where it runs."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("triton")

ENV_WITHOUT_INTERPRETER = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}

AOT = textwrap.dedent(
    """
    import itertools
    import triton
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from accumkernels.backends.triton import _common, accumulate, adam, grad_norm, sgd

    TARGET = GPUTarget("cuda", 90, 32)
    DTYPES = [tl.float32, tl.bfloat16, tl.float16]
    compiled = 0

    def build(fn, types, constexprs):
        global compiled
        signature = {name: types.get(name, "constexpr") for name in fn.arg_names}
        src = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
        triton.compile(src, target=TARGET, options={"num_warps": _common.NUM_WARPS})
        compiled += 1

    blocks = dict(CHUNK=_common.CHUNK, BLOCK=_common.BLOCK)
    meta = {"meta": "*i64", "T": "i64", "C": "i64"}
    for dtype, overwrite, flags in itertools.product(DTYPES, (False, True), (False, True)):
        build(accumulate._accumulate_kernel, {**meta, "scale": "fp32", "scale_ptr": "*fp32", "found_inf_ptr": "*fp32"},
              dict(GRAD_DTYPE=dtype, OVERWRITE=overwrite, HAS_SCALE_TENSOR=flags, HAS_FOUND_INF=flags, **blocks))
    build(adam._increment_steps_kernel, {"meta": "*i64", "found_inf_ptr": "*fp32"}, dict(HAS_FOUND_INF=True))
    floats = ["eps", "weight_decay", "one_minus_beta1", "one_minus_beta2", "beta2_f", "adamw_decay", "grad_scale"]
    for dtype, master, adamw, amsgrad in itertools.product(DTYPES, (False, True), (False, True), (False, True)):
        build(adam._adam_kernel, {**meta, **{f: "fp32" for f in floats}, "grad_scale_ptr": "*fp32",
                                  "found_inf_ptr": "*fp32"},
              dict(PARAM_DTYPE=dtype, HAS_MASTER=master, ADAMW=adamw, AMSGRAD=amsgrad, WEIGHT_DECAY=True,
                   HAS_GRAD_SCALE_TENSOR=True, HAS_FOUND_INF=True, ZERO_BUFFERS=True, **blocks))
    floats = ["lr", "momentum", "one_minus_dampening", "weight_decay", "grad_scale"]
    for dtype, master, momentum, nesterov in itertools.product(DTYPES, (False, True), (0, 1, 2), (False, True)):
        build(sgd._sgd_kernel, {**meta, **{f: "fp32" for f in floats}, "grad_scale_ptr": "*fp32",
                                "found_inf_ptr": "*fp32"},
              dict(PARAM_DTYPE=dtype, HAS_MASTER=master, MOMENTUM=momentum, NESTEROV=nesterov, WEIGHT_DECAY=True,
                   HAS_GRAD_SCALE_TENSOR=False, HAS_FOUND_INF=True, ZERO_BUFFERS=True, **blocks))
    build(grad_norm._partials_kernel, {**meta, "partials_ptr": "*fp64"}, blocks)
    build(grad_norm._finish_kernel, {"partials_ptr": "*fp64", "count": "i64", "out_ptr": "*fp32"}, dict(BLOCK=1024))
    print("compiled", compiled)
    """
)


def test_every_kernel_compiles_for_sm90():
    out = subprocess.run([sys.executable, "-c", AOT], env=ENV_WITHOUT_INTERPRETER, capture_output=True, text=True,
                         timeout=900)  # fmt: skip
    assert out.returncode == 0, out.stderr[-4000:]
    assert out.stdout.strip().startswith("compiled")


def test_listed_only_where_it_runs():
    code = "import torch, accumkernels as ak; print('triton' in ak.available_backends(), torch.cuda.is_available())"
    out = subprocess.run([sys.executable, "-c", code], env=ENV_WITHOUT_INTERPRETER, capture_output=True, text=True,
                         check=True)  # fmt: skip
    listed, has_cuda = out.stdout.split()
    assert listed == has_cuda, "without a GPU or the interpreter, triton must not be listed"
