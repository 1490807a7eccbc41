"""Every Triton kernel variant the launchers can produce, compiled ahead of
time for sm_90 without a GPU (run as a script by tests/test_triton.py: the
Triton interpreter must be off). Prints one JSON line per variant: its name,
whether it is an ALIGNED variant of a memory kernel, the kinds of global loads
and stores in its PTX, its count of fused fp32 multiply-adds and its count of
unordered clears (in the TTGIR)."""

from __future__ import annotations

import itertools
import json
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor

import triton
import triton.language as tl
from triton.backends.compiler import GPUTarget

from accumkernels.backends.triton import _common, accumulate, adam, grad_norm, sgd

TARGET = GPUTarget("cuda", 90, 32)
DTYPES = {"fp32": tl.float32, "bf16": tl.bfloat16, "fp16": tl.float16}
BOOLS = (False, True)
# The param kinds a step launch is compiled for: (dtype, MASTER_KIND, stochastic rounding).
PARAM_KINDS = [
    ("fp32", 0, False),
    ("bf16", 0, False),
    ("bf16", 0, True),
    ("bf16", 1, False),
    ("bf16", 2, False),
    ("fp16", 0, False),
    ("fp16", 1, False),
]
STATE_DTYPES = ("fp32", "bf16")
# The buffers a step reads: fp32 sums, or gradients of the param's dtype.
GRAD_KINDS = ("sums", "param")
TABLE = {"table": "*i64", "T": "i32", "C": "i32"}
# The optional scale and inf-flag tensors (a flag and a pointer each) and the
# buffers' zeroing are runtime arguments, not variants.
SCALARS = {
    "grad_scale": "fp32",
    "grad_scale_ptr": "*fp32",
    "has_grad_scale_tensor": "i1",
    "found_inf_ptr": "*fp32",
    "has_found_inf": "i1",
    "zero_buffers": "i1",
    "seed": "i32",
}


def variants():
    blocks = dict(CHUNK=_common.CHUNK, BLOCK=_common.BLOCK)
    for dtype, overwrite, aligned in itertools.product(DTYPES, BOOLS, BOOLS):
        yield (
            f"accumulate-{dtype}-overwrite{overwrite:d}-aligned{aligned:d}",
            "accumulate",
            {
                **TABLE,
                "scale": "fp32",
                "scale_ptr": "*fp32",
                "has_scale_tensor": "i1",
                "found_inf_ptr": "*fp32",
                "has_found_inf": "i1",
            },
            dict(GRAD_DTYPE=DTYPES[dtype], OVERWRITE=overwrite, ALIGNED=aligned, **blocks),
            aligned,
        )
    sgd_types = {
        **TABLE,
        **SCALARS,
        "lr": "fp32",
        "momentum": "fp32",
        "one_minus_dampening": "fp32",
        "weight_decay": "fp32",
        "nesterov": "i1",
        "has_weight_decay": "i1",
    }
    adam_types = {
        **TABLE,
        **SCALARS,
        "scalars": "*fp64",
        "eps": "fp32",
        "weight_decay": "fp32",
        "one_minus_beta1": "fp32",
        "one_minus_beta2": "fp32",
        "beta2_f": "fp32",
        "adamw_decay": "fp32",
        "adamw": "i1",
        "has_weight_decay": "i1",
    }
    for (dtype, master, sr), state, grads, aligned in itertools.product(PARAM_KINDS, STATE_DTYPES, GRAD_KINDS, BOOLS):
        if grads == "param" and dtype == "fp32":
            continue  # the same variant as fp32 sums
        common = dict(
            PARAM_DTYPE=DTYPES[dtype],
            MASTER_KIND=master,
            STOCHASTIC=sr,
            STATE_DTYPE=DTYPES[state],
            GRAD_DTYPE=DTYPES[dtype if grads == "param" else "fp32"],
            ALIGNED=aligned,
            **blocks,
        )
        tag = f"{dtype}-master{master:d}-sr{sr:d}-state{state}-grads{grads}-aligned{aligned:d}"
        for momentum in (0, 1, 2):
            yield f"sgd-{tag}-momentum{momentum}", "sgd", sgd_types, dict(MOMENTUM=momentum, **common), aligned
        for amsgrad in BOOLS:
            yield f"adam-{tag}-amsgrad{amsgrad:d}", "adam", adam_types, dict(AMSGRAD=amsgrad, **common), aligned
    # 8-bit state (uint8 codes with block scales): Adam without amsgrad, SGD with momentum.
    for (dtype, master, sr), grads, aligned in itertools.product(PARAM_KINDS, GRAD_KINDS, BOOLS):
        if grads == "param" and dtype == "fp32":
            continue
        constexprs = dict(
            PARAM_DTYPE=DTYPES[dtype],
            MASTER_KIND=master,
            STOCHASTIC=sr,
            STATE_DTYPE=tl.uint8,
            GRAD_DTYPE=DTYPES[dtype if grads == "param" else "fp32"],
            ALIGNED=aligned,
            AMSGRAD=False,
            **blocks,
        )
        tag = f"{dtype}-master{master:d}-sr{sr:d}-state8bit-grads{grads}-aligned{aligned:d}"
        name = f"adam-{tag}"
        yield name, "adam", adam_types, constexprs, aligned
        for momentum in (1, 2):  # SGD's 8-bit momentum buffer: first step, running
            sgd_constexprs = {k: v for k, v in constexprs.items() if k != "AMSGRAD"}
            name = f"sgd-{tag}-momentum{momentum}"
            yield name, "sgd", sgd_types, dict(MOMENTUM=momentum, **sgd_constexprs), aligned
    yield (
        "increment-steps",
        "increment",
        {"table": "*i64", "T": "i32", "found_inf_ptr": "*fp32", "has_found_inf": "i1"},
        {},
        False,
    )
    for dtype, aligned in itertools.product(DTYPES, BOOLS):
        yield (
            f"norm-partials-{dtype}-aligned{aligned:d}",
            "partials",
            {**TABLE, "partials_ptr": "*fp64"},
            dict(DTYPE=DTYPES[dtype], ALIGNED=aligned, **blocks),
            aligned,
        )
    yield (
        "norm-finish",
        "finish",
        {"partials_ptr": "*fp64", "count": "i32", "out_ptr": "*fp32"},
        dict(BLOCK=1024),
        False,
    )


KERNELS = {
    "accumulate": accumulate._accumulate_kernel,
    "sgd": sgd._sgd_kernel,
    "adam": adam._adam_kernel,
    "increment": adam._increment_steps_kernel,
    "partials": grad_norm._partials_kernel,
    "finish": grad_norm._finish_kernel,
}


def unordered_clears(ttgir: str) -> int:
    """Stores of a constant (the clears of the summed buffers) in a loop body
    that loads, with no barrier between the body's last load and the store.
    Such a store does not depend on what the body loaded, so the compiler may
    give it another thread layout than the load of the same elements: without
    a barrier one thread's zero can land before another thread read the sum."""
    lines = ttgir.splitlines()
    count = 0
    for i, line in enumerate(lines):
        if "scf.for" not in line:
            continue
        close = " " * (len(line) - len(line.lstrip())) + "}"
        body = []
        for later in lines[i + 1 :]:
            if later.rstrip() == close or later.startswith(close + " "):
                break
            body.append(later)
        ordered = True  # no load yet, or a barrier since the last one
        for op in body:
            if "tt.load" in op:
                ordered = False
            elif re.search(r"\b(?:gpu|ttg)\.barrier\b", op):
                ordered = True
            elif (store := re.search(r"tt\.store %[\w.]+, (%[\w.]+)", op)) and store.group(1).startswith("%cst"):
                count += 0 if ordered else 1
    return count


def compile_one(variant) -> dict:
    name, kernel, types, constexprs, aligned = variant
    fn = KERNELS[kernel]
    signature = {arg: types.get(arg, "constexpr") for arg in fn.arg_names}
    source = triton.compiler.ASTSource(fn=fn, signature=signature, constexprs=constexprs)
    options = {k: v for k, v in _common.OPTIONS.items()} or {"num_warps": _common.NUM_WARPS, "enable_fp_fusion": False}
    asm = triton.compile(source, target=TARGET, options=options).asm
    ptx = asm["ptx"]
    accesses = sorted(set(re.findall(r"\b((?:ld|st)\.global(?:\.[a-z0-9]+)*)", ptx)))
    return {
        "name": name,
        "kernel": kernel,
        "aligned": aligned,
        "accesses": accesses,
        "fma_f32": len(re.findall(r"\bfma\.rn(?:\.ftz)?\.f32\b", ptx)),
        "unordered_clears": unordered_clears(asm["ttgir"]),
    }


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") == "1":
        sys.exit("run without TRITON_INTERPRET=1: this compiles for sm_90")
    todo = list(variants())
    with ProcessPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        for result in pool.map(compile_one, todo, chunksize=4):
            print(json.dumps(result), flush=True)
