"""Which change brings the CUDA defaults step (bf16 params and state,
stochastic rounding, from the fp32 buffer) toward the memory bound: the
variants of bench/cuda_variants.cu, each built with csrc's formulas and
multi-tensor launcher, timed against the extension's own
``adamw_step_and_zero_`` and a device-to-device fp32 copy in the same rounds.

Bytes model: 20 B/element (read p 2, g 4, m 2, v 2; write p 2, m 2, v 2,
g = 0 4), the same for every variant; the copy moves 8. The variants that
compute the step must give the extension's bits (checked on the timed
tensors before timing: params, moments and the cleared buffer); the other two
are floors: the step rounded to nearest (what the stochastic rounding's
hashes cost) and the step's loads and stores around one add (what its access
pattern costs). Registers per thread are read from the built module where
cuobjdump is found (occupancy: 512-thread blocks, 64K registers an SM).

Needs a CUDA GPU, nvcc and ninja; builds in about a minute. ``python -m
bench.cuda_variants`` (bench/gpu_check.sh runs it).
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

import torch

import accumkernels as ak

from . import common

ROOT = Path(__file__).resolve().parent.parent
BYTES_PER_ELEMENT = 20
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, seed=3)


def build():
    """The variants' module, built with the extension's nvcc flags (no contraction)."""
    from torch.utils.cpp_extension import load

    folder = Path(tempfile.mkdtemp(prefix="ak-cuda-variants-"))
    module = load(
        name="ak_cuda_variants",
        sources=[str(ROOT / "bench" / "cuda_variants.cu")],
        extra_include_paths=[str(ROOT / "csrc" / "include"), str(ROOT / "csrc")],
        extra_cflags=["-O3", "-std=c++20"],
        extra_cuda_cflags=["-O3", "-std=c++20", "-lineinfo", "--fmad=false"],
        build_directory=str(folder),
    )
    return module, folder


def resources(folder: Path) -> dict[str, dict]:
    """Registers a thread and stack bytes (spills) of each variant's kernel
    (cuobjdump -res-usage), keyed by its template arguments from the step's
    on as the module's variants() gives them, e.g. '1, false, false, 0>, 512, 1'
    (threads a block, minimum blocks), read off the mangled name (c++filt
    need not be there)."""
    tool = shutil.which("cuobjdump") or str(Path(os.environ.get("CUDA_HOME", "/usr/local/cuda")) / "bin" / "cuobjdump")
    so = next(folder.glob("ak_cuda_variants*.so"), None)
    if so is None or not Path(tool).exists():
        return {}
    lines = subprocess.run([tool, "-res-usage", str(so)], capture_output=True, text=True).stdout.splitlines()
    mangled = re.compile(r"12DefaultsStepILi(\d+)ELb([01])ELb([01])ELi(\d+)EEELi(\d+)ELi(\d+)E")
    found = {}
    for line, following in zip(lines, lines[1:]):
        kernel = mangled.search(line)
        usage = re.search(r"REG:(\d+) STACK:(\d+)", following)
        if line.lstrip().startswith("Function") and kernel and usage:
            packs, pipelined, static, math, threads, min_blocks = kernel.groups()
            flag = {"0": "false", "1": "true"}
            key = f"{packs}, {flag[pipelined]}, {flag[static]}, {math}>, {threads}, {min_blocks}"
            found[key] = {"registers": int(usage.group(1)), "stack": int(usage.group(2))}
    return found


def blocks_per_sm(registers: int, threads: int) -> int:
    """Resident blocks an SM (sm_90: 64K registers, allocated 8 a thread at a
    time, at most 2048 threads), as far as registers and threads bound it."""
    return min(65536 // (-(-registers // 8) * 8 * threads), 2048 // threads)


def inputs(n: int, device) -> dict[str, torch.Tensor]:
    """Fresh random state of a step in progress (nothing zero)."""
    gen = torch.Generator(device=device).manual_seed(0)
    return {
        "p": torch.randn(n, device=device, generator=gen).bfloat16(),
        "g": torch.randn(n, device=device, generator=gen) * 1e-3,
        "m": (torch.randn(n, device=device, generator=gen) * 1e-3).bfloat16(),
        "v": (torch.randn(n, device=device, generator=gen) * 1e-3).square().bfloat16(),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--numel", type=int, default=64 * 2**20, help="elements (a multiple of 65536; default 64M)")
    parser.add_argument("--reps", type=int, default=15, help="interleaved timed rounds (median reported)")
    parser.add_argument("--results-dir", default=None, help="where to write cuda-variants.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or "cuda" not in ak.available_backends():
        raise SystemExit("bench.cuda_variants needs a CUDA GPU and the extension's cuda backend")
    device = torch.device("cuda")
    module, folder = build()
    usage = resources(folder)
    variants = module.variants()
    n = args.numel
    pristine = inputs(n, device)
    work = {k: v.clone() for k, v in pristine.items()}
    step = torch.zeros((), device=device)
    h = HYPER

    def restore():
        for k, v in pristine.items():
            work[k].copy_(v)

    def extension():
        step.zero_()  # the op counts the step itself: 0 -> 1
        ak.adamw_step_and_zero_(
            [work["p"]],
            [work["g"]],
            [work["m"]],
            [work["v"]],
            [step],
            lr=h["lr"],
            betas=(h["beta1"], h["beta2"]),
            eps=h["eps"],
            weight_decay=h["weight_decay"],
            stochastic_rounding=True,
            seed=h["seed"],
            backend="cuda",
        )

    def variant(index):
        def fn():
            step.fill_(1.0)  # the step count the update uses, as the op's after counting
            module.run(
                index,
                work["p"],
                work["g"],
                work["m"],
                work["v"],
                step,
                h["lr"],
                h["beta1"],
                h["beta2"],
                h["eps"],
                h["weight_decay"],
                h["seed"],
            )

        return fn

    restore()
    extension()
    want = {k: v.clone() for k, v in work.items()}
    same = []
    for i, (_, exact, _) in enumerate(variants):
        restore()
        variant(i)()
        same.append(all(torch.equal(work[k], want[k]) for k in want) if exact else None)

    a, b = torch.empty(n, device=device), torch.randn(n, device=device)
    cases = [("torch fp32 device-to-device copy_ (ceiling)", 8, lambda: a.copy_(b))]
    cases.append(("extension's adamw_step_and_zero_ (cuda)", BYTES_PER_ELEMENT, extension))
    cases += [(name, BYTES_PER_ELEMENT, variant(i)) for i, (name, _, _) in enumerate(variants)]
    times = [[] for _ in cases]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for r in range(args.reps + 2):  # two warm-up rounds
        for (_, _, fn), out in zip(cases, times):
            restore()
            start.record()
            fn()
            end.record()
            end.synchronize()
            if r >= 2:
                out.append(start.elapsed_time(end))
    copy_ms = statistics.median(times[0])
    copy_gbps = 8 * n / copy_ms / 1e6
    ext_ms = statistics.median(times[1])
    rows = []
    exact = [None, None] + same
    for (name, bpe, _), t, ok in zip(cases, times, exact):
        ms = statistics.median(t)
        gbps = bpe * n / ms / 1e6
        rows.append(
            {
                "name": name,
                "median_ms": ms,
                "gbps": gbps,
                "of_copy": gbps / copy_gbps,
                "vs_extension": ms / ext_ms,
                "same_bits": {None: "", True: "yes", False: "NO"}[ok],
                "round_ms": t,
            }
        )
    for row, (_, _, key) in zip(rows[2:], variants):
        if key in usage:
            threads = int(key.split(">, ")[1].split(",")[0])
            row.update(usage[key], blocks_per_sm=blocks_per_sm(usage[key]["registers"], threads))
    record = common.machine_record(device)
    path = common.write_results(
        "cuda-variants",
        {"machine": record, "numel": n, "reps": args.reps, "hyper": h, "rows": rows},
        args.results_dir,
    )
    print(f"defaults-step variants on {record.get('gpu')}, {n} elements, median of {args.reps}, {record['commit']}")
    print(
        common.table(
            rows,
            [
                ("name", "variant", "s"),
                ("median_ms", "median ms", ".3f"),
                ("gbps", "GB/s", ".0f"),
                ("of_copy", "of copy", ".2f"),
                ("vs_extension", "vs ext.", ".3f"),
                ("registers", "regs", "d"),
                ("stack", "stack B", "d"),
                ("blocks_per_sm", "blocks/SM", "d"),
                ("same_bits", "same bits", "s"),
            ],
        )
    )
    print(f"wrote {path}")
    return 0 if all(ok is not False for ok in same) else 1


if __name__ == "__main__":
    raise SystemExit(main())
