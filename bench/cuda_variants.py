"""Which change brings the CUDA AdamW steps toward the memory bound: the
variants of bench/cuda_variants.cu, built with csrc's formulas and functors,
timed against the extension's own ``adamw_step_and_zero_`` and a
device-to-device fp32 copy in the same interleaved rounds.

Three groups, each on bf16 params with stochastic rounding, from the fp32
buffer:
  defaults    bf16 state: csrc's AdamFunctor and variants of its loop (flags
              as template constants, the next pack loaded before this pack's
              arithmetic, two packs loaded first, other launch bounds), and two
              floors: the step rounded to nearest (what the hashes cost) and
              its loads and stores around a single add (what its access
              pattern costs)
  fp32 state  the same for fp32 state: issue #27's yardstick, the defaults'
              GB/s over this step's (a change that speeds both moves it less)
  8bit        8-bit state: csrc's Adam8Functor under other launch bounds

Bytes model (per element): defaults 20 (read p 2, g 4, m 2, v 2; write p 2,
m 2, v 2, g = 0 4); fp32 state 28 (m and v 4 each way); 8bit 16 + 16/256 (p 4,
g 8, codes 4, two fp32 scales read and written per block of 256); the copy 8.
Every variant that computes the step must give the extension's bits (params,
state and the cleared buffer, checked on the timed tensors before timing);
registers, spills and resident blocks an SM are read off each kernel on the
device. Last, for each variant both state groups have, the defaults' GB/s over
the fp32-state step's (ratio of medians: the groups are timed one after the
other).

Needs a CUDA GPU, nvcc and ninja; builds in about two minutes.
``python -m bench.cuda_variants`` (bench/gpu_check.sh runs it).
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from pathlib import Path

import torch

import accumkernels as ak
from accumkernels import _state8

from . import common

ROOT = Path(__file__).resolve().parent.parent
BYTES_PER_ELEMENT = {"defaults": 20, "fp32 state": 28, "8bit": 16 + 16 / 256}
HYPER = dict(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01, seed=3)


def build(directory: str | None = None):
    """The variants' module, built with the extension's nvcc flags (no
    contraction) in ``directory`` (a fresh temporary one by default; ninja
    rebuilds nothing where an earlier build there is up to date)."""
    from torch.utils.cpp_extension import load

    if directory:
        Path(directory).mkdir(parents=True, exist_ok=True)
    return load(
        name="ak_cuda_variants",
        sources=[str(ROOT / "bench" / "cuda_variants.cu")],
        extra_include_paths=[str(ROOT / "csrc" / "include"), str(ROOT / "csrc")],
        extra_cflags=["-O3", "-std=c++20"],
        extra_cuda_cflags=["-O3", "-std=c++20", "-lineinfo", "--fmad=false"],
        build_directory=directory or tempfile.mkdtemp(prefix="ak-cuda-variants-"),
    )


def extension_step(t: dict, step: torch.Tensor) -> None:
    """The extension's op on group tensors ``t`` (the step count from 0)."""
    step.zero_()  # the op counts the step itself: 0 -> 1
    scales = {}
    if "ms" in t:
        scales = dict(exp_avg_scales=[t["ms"]], exp_avg_sq_scales=[t["vs"]])
    ak.adamw_step_and_zero_(
        [t["p"]],
        [t["g"]],
        [t["m"]],
        [t["v"]],
        [step],
        **scales,
        lr=HYPER["lr"],
        betas=(HYPER["beta1"], HYPER["beta2"]),
        eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"],
        stochastic_rounding=True,
        seed=HYPER["seed"],
        backend="cuda",
    )


def inputs(group: str, n: int, device) -> dict[str, torch.Tensor]:
    """Fresh random state of a step in progress (nothing zero). 8-bit: the
    codes and scales that one extension step from zero moments leaves."""
    gen = torch.Generator(device=device).manual_seed(0)
    t = {
        "p": torch.randn(n, device=device, generator=gen).bfloat16(),
        "g": torch.randn(n, device=device, generator=gen) * 1e-3,
    }
    if group != "8bit":
        dtype = torch.bfloat16 if group == "defaults" else torch.float32
        t["m"] = (torch.randn(n, device=device, generator=gen) * 1e-3).to(dtype)
        t["v"] = (torch.randn(n, device=device, generator=gen) * 1e-3).square().to(dtype)
        return t
    t["m"] = torch.zeros(n, device=device, dtype=torch.uint8)
    t["v"] = torch.zeros(n, device=device, dtype=torch.uint8)
    t["ms"] = torch.zeros(_state8.scales_numel(n), device=device)
    t["vs"] = torch.zeros(_state8.scales_numel(n), device=device)
    extension_step(t, torch.zeros((), device=device))
    t["g"].copy_(torch.randn(n, device=device, generator=gen) * 1e-3)
    return t


def lists(t: dict, step: torch.Tensor) -> list:
    """The group's tensors in the extension's list order (csrc/cuda/adam.cuh)."""
    out = [t["p"], None, t["g"], t["m"], t["v"], None, step]
    return out + [t["ms"], t["vs"]] if "ms" in t else out


def time_group(module, group, indices, n, reps, device) -> list[dict]:
    """The copy, the extension's step and the group's variants, timed in
    interleaved rounds (inputs restored before each call, outside its events)."""
    pristine = inputs(group, n, device)
    work = {k: v.clone() for k, v in pristine.items()}
    step = torch.zeros((), device=device)

    def restore():
        for k, v in pristine.items():
            work[k].copy_(v)

    def variant(index):
        def fn():
            step.fill_(1.0)  # the step count the update uses, as the op's after counting
            h = HYPER
            module.run(
                index, lists(work, step), h["lr"], h["beta1"], h["beta2"], h["eps"], h["weight_decay"], h["seed"]
            )

        return fn

    variants = module.variants()
    restore()
    extension_step(work, step)
    want = {k: v.clone() for k, v in work.items()}
    same = {}
    for i in indices:
        restore()
        variant(i)()
        same[i] = all(torch.equal(work[k], want[k]) for k in want) if variants[i][2] else None

    a, b = torch.empty(n, device=device), torch.randn(n, device=device)
    bpe = BYTES_PER_ELEMENT[group]
    cases = [("torch fp32 device-to-device copy_ (ceiling)", 8, lambda: a.copy_(b), None)]
    cases.append(("extension's adamw_step_and_zero_ (cuda)", bpe, lambda: extension_step(work, step), None))
    cases += [(variants[i][0], bpe, variant(i), i) for i in indices]
    times = [[] for _ in cases]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for r in range(reps + 2):  # two warm-up rounds
        for (_, _, fn, _), out in zip(cases, times):
            restore()
            start.record()
            fn()
            end.record()
            end.synchronize()
            if r >= 2:
                out.append(start.elapsed_time(end))
    copy_gbps = 8 * n / statistics.median(times[0]) / 1e6
    extension_ms = statistics.median(times[1])
    rows = []
    for (name, case_bpe, _, index), t in zip(cases, times):
        ms = statistics.median(t)
        gbps = case_bpe * n / ms / 1e6
        row = {
            "group": group,
            "name": name,
            "median_ms": ms,
            "gbps": gbps,
            "of_copy": gbps / copy_gbps,
            "vs_extension": ms / extension_ms,
            "round_ms": t,
        }
        if index is not None:
            registers, local_bytes, blocks = module.resources(index)
            row.update(
                registers=registers,
                spill_bytes=local_bytes,
                blocks_per_sm=blocks,
                same_bits={None: "", True: "yes", False: "NO"}[same[index]],
            )
        rows.append(row)
    return rows


def state_ratios(rows: list[dict]) -> list[dict]:
    """For each case both state groups timed (the extension's step and the
    variants of one name), the defaults' GB/s over the fp32-state step's; and
    the defaults' variants over the extension's fp32-state step (a change made
    to the defaults' step alone)."""
    by_group = {}
    for row in rows:
        by_group.setdefault(row["group"], {})[row["name"]] = row["gbps"]
    defaults, fp32 = by_group.get("defaults", {}), by_group.get("fp32 state", {})
    extension = "extension's adamw_step_and_zero_ (cuda)"
    out = [{"name": name, "ratio": gbps / fp32[name]} for name, gbps in defaults.items() if name in fp32]
    if extension in fp32:
        out += [
            {"name": f"{name}, over the extension's fp32-state step", "ratio": gbps / fp32[extension]}
            for name, gbps in defaults.items()
            if name != extension and not name.startswith("torch")
        ]
    return [r for r in out if not r["name"].startswith("torch")]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--numel", type=int, default=64 * 2**20, help="elements (whole chunks of 65536, at most 2048; default 64M)"
    )
    parser.add_argument("--reps", type=int, default=15, help="interleaved timed rounds (median reported)")
    parser.add_argument("--results-dir", default=None, help="where to write cuda-variants.json")
    parser.add_argument("--build-dir", default=None, help="build (or reuse the build) there (default: a fresh one)")
    parser.add_argument("--build-only", action="store_true", help="build the module and stop (no GPU needed)")
    args = parser.parse_args(argv)
    if args.build_only:
        build(args.build_dir)
        return 0
    if not torch.cuda.is_available() or "cuda" not in ak.available_backends():
        raise SystemExit("bench.cuda_variants needs a CUDA GPU and the extension's cuda backend")
    device = torch.device("cuda")
    module = build(args.build_dir)
    groups = {}
    for i, (_, group, _) in enumerate(module.variants()):
        groups.setdefault(group, []).append(i)
    rows = [
        row
        for group, indices in groups.items()
        for row in time_group(module, group, indices, args.numel, args.reps, device)
    ]
    ratios = state_ratios(rows)
    record = common.machine_record(device)
    path = common.write_results(
        "cuda-variants",
        {"machine": record, "numel": args.numel, "reps": args.reps, "hyper": HYPER, "rows": rows, "ratios": ratios},
        args.results_dir,
    )
    print(
        f"AdamW step variants on {record.get('gpu')}, {args.numel} elements, median of {args.reps}, {record['commit']}"
    )
    print(
        common.table(
            rows,
            [
                ("group", "group", "s"),
                ("name", "variant", "s"),
                ("median_ms", "median ms", ".3f"),
                ("gbps", "GB/s", ".0f"),
                ("of_copy", "of copy", ".2f"),
                ("vs_extension", "vs ext.", ".3f"),
                ("registers", "regs", "d"),
                ("spill_bytes", "spill B", "d"),
                ("blocks_per_sm", "blocks/SM", "d"),
                ("same_bits", "same bits", "s"),
            ],
        )
    )
    print()
    print("defaults' GB/s over the fp32-state step's (issue #27: 0.9 or more)")
    print(common.table(ratios, [("name", "variant", "s"), ("ratio", "defaults / fp32 state", ".3f")]))
    print(f"wrote {path}")
    return 1 if any(row.get("same_bits") == "NO" for row in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
