"""The benchmark suite: `make bench` runs it (or `python -m bench.run [--quick]`).

On the best device present (CUDA if any, else the CPU) it runs, in order:

1. the kernel benchmark (bench/kernels.py): accumulate_ and the step ops, every
   backend, against the paths users write today, GB/s against a ceiling timed
   in the same run;
2. a size sweep of accumulate_ against torch's mixed-dtype add_ (1M to 256M
   elements; 1M and 4M with --quick);
3. training windows of a GPT-style model (bench/e2e.py): plain .grad paths
   against AccumulatingOptimizer over model sizes and window lengths N: time,
   peak memory, the step's share, the summed gradient's error against float64;
4. the trade itself: one effective batch of 64 sequences as N micro-batches,
   N = 1..64: peak memory and time, plain and with the wrapper.

It prints progress and tables and writes bench/results/suite-<device>.json
(machine, versions, commit, every median) and PNG plots beside it. No timing is
ever asserted; --quick finishes in about a minute on a 2-core CPU.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from . import common, e2e, kernels


def _plots(result: dict, folder: Path, stem: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    device = result["machine"]["device"]

    # Size sweep: GB/s against size.
    fig, ax = plt.subplots(figsize=(6.5, 4))
    series: dict[str, list[tuple[int, float]]] = {}
    for r in result["size_sweep"]:
        label = "ceiling" if r["key"].startswith("ceiling") else r["name"]
        series.setdefault(label, []).append((r["numel"], r["gbps"]))
    for label, points in series.items():
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
    ax.set(xscale="log", xlabel="elements", ylabel="GB/s (bytes model)", title=f"accumulate_ vs torch add_ ({device})")
    ax.legend(fontsize=8)
    fig.tight_layout()
    written.append(folder / f"{stem}-sizes.png")
    fig.savefig(written[-1], dpi=120)

    # Windows: time against N (largest model) and against model size (largest N).
    rows = result["windows"]
    models = sorted({r["model"] for r in rows}, key=lambda m: next(x["params"] for x in rows if x["model"] == m))
    ns = sorted({r["n_micro"] for r in rows})
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for path in e2e.PATHS:
        pts = [r for r in rows if r["path"] == path and r["model"] == models[-1]]
        left.plot([r["n_micro"] for r in pts], [r["window_ms"] for r in pts], marker="o", label=path)
        pts = [r for r in rows if r["path"] == path and r["n_micro"] == ns[-1]]
        right.plot([r["params"] for r in pts], [r["window_ms"] for r in pts], marker="o", label=path)
    left.set(xscale="log", yscale="log", xlabel="micro-batches per window (N)", ylabel="ms per window",
             title=f"{models[-1]}")  # fmt: skip
    right.set(xscale="log", yscale="log", xlabel="parameters", ylabel="ms per window", title=f"N = {ns[-1]}")
    left.legend(fontsize=8)
    fig.tight_layout()
    written.append(folder / f"{stem}-windows.png")
    fig.savefig(written[-1], dpi=120)

    # The trade: peak memory and time per effective batch against N.
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for path in sorted({r["path"] for r in result["trade"]}):
        pts = [r for r in result["trade"] if r["path"] == path]
        left.plot([r["n_micro"] for r in pts], [r["peak_mib"] for r in pts], marker="o", label=path)
        right.plot([r["n_micro"] for r in pts], [r["window_ms"] for r in pts], marker="o", label=path)
    batch = result["trade"][0]["n_micro"] * result["trade"][0]["micro_batch"]
    label = f"N (a batch of {batch} as N micro-batches of {batch}/N)"
    left.set(xscale="log", xlabel=label, ylabel="peak memory (MiB)", title="memory")
    right.set(xscale="log", xlabel=label, ylabel="ms per effective batch", title="time")
    left.legend(fontsize=8)
    fig.tight_layout()
    written.append(folder / f"{stem}-trade.png")
    fig.savefig(written[-1], dpi=120)
    plt.close("all")
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present, else cpu)")
    parser.add_argument("--quick", action="store_true", help="small sizes and few repetitions (about a minute)")
    parser.add_argument("--results-dir", default=None, help="where to write (default bench/results/local/; the committed results: bench/results)")
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    folder = Path(args.results_dir) if args.results_dir else common.RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"suite-{device.type}{'-quick' if args.quick else ''}"
    record = common.machine_record(device)
    print(f"accumkernels benchmark suite on {device}, commit {record['commit']}{' (quick)' if args.quick else ''}")

    print("\n[1/4] kernels")
    numel = 4 * 2**20 if args.quick else (64 if device.type == "cuda" else 32) * 2**20
    kernel_result = kernels.run(device, numel, 5 if args.quick else 15, args.quick)
    import accumkernels

    backend = "cuda" if device.type == "cuda" else "cpu"
    heads = kernels.headline(kernel_result, backend, device.type) if backend in accumkernels.available_backends() else []

    print("\n[2/4] size sweep")
    sizes = [2**20, 4 * 2**20] if args.quick else [2**20, 4 * 2**20, 16 * 2**20, 64 * 2**20, 256 * 2**20]
    sweep = kernels.size_sweep(device, sizes, 3 if args.quick else 7)

    print("\n[3/4] training windows (each measurement in its own process)")
    windows = e2e.windows_suite(device.type, args.quick)
    print("\n[4/4] one big batch against N micro-batches")
    trade = e2e.trade_suite(device.type, args.quick)

    result = {"machine": record, "quick": args.quick, "kernels": kernel_result, "headline": heads,
              "size_sweep": sweep, "windows": windows, "trade": trade}  # fmt: skip
    path = common.write_results(stem, result, folder)
    plots = _plots(result, folder, stem)

    print("\n" + common.table(kernel_result["rows"], [("group", "group", "s"), ("name", "path", "s"),
                                                     ("median_ms", "median ms", ".3f"), ("gbps", "GB/s", ".1f"),
                                                     ("fraction_of_ceiling", "of ceiling", ".2f")]))  # fmt: skip
    print("\n" + common.table(windows, [("model", "model", "s"), ("n_micro", "N", "d"), ("path", "path", "s"),
                                        ("window_ms", "ms/window", ".1f"), ("peak_mib", "peak MiB", ".1f"),
                                        ("step_share", "step share", ".3f"),
                                        ("grad_rel_error", "grad error", ".1e")]))  # fmt: skip
    print("\n" + common.table(trade, [("n_micro", "N", "d"), ("micro_batch", "micro-batch", "d"), ("path", "path", "s"),
                                      ("window_ms", "ms/batch", ".1f"), ("peak_mib", "peak MiB", ".1f")]))  # fmt: skip
    if heads:
        print("\n" + common.table(heads, [("figure", f"headline [{backend}]", "s"), ("value", "value", ".2f"),
                                          ("target", "target", ".2f"), ("met", "met", "")]))  # fmt: skip
    print(f"\nwrote {path}")
    for p in plots:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
