"""The benchmark suite: `make bench` runs it (or `python -m bench.run [--quick]`).

On the best device present (CUDA if any, else the CPU) it runs, in order:

1. the kernel benchmark (bench/kernels.py): accumulate_ and the step ops, every
   backend, against the paths users write today, GB/s against a ceiling timed
   in the same run;
2. a size sweep of accumulate_ against torch's mixed-dtype add_ (1M to 256M
   elements; 1M and 4M with --quick);
3. training windows of a GPT-style model (bench/e2e.py): plain .grad paths
   against AccumulatingOptimizer (both intakes) over model sizes and window
   lengths N: time, peak memory, the step's share;
4. the precision of each path's window gradient for N = 1..128, against the
   float64 sum of the same micro-batch gradients and against the float64
   gradient of the big batch;
5. the trade itself: one effective batch of 64 sequences as N micro-batches,
   N = 1..64: peak memory and time, plain and with the wrapper;
6. convergence (bench/convergence.py): the held-out loss each recipe trains a
   GPT to on Python's standard library, beside fp32 and the peers (torchao,
   bitsandbytes where installed), 3 seeds; bytes/param of training state.

It prints progress and tables and writes bench/results/local/suite-<device>.json
(machine, versions, commit, every median; --results-dir elsewhere) and PNG
plots beside it. No timing is ever asserted; --quick finishes in about a
minute on a 2-core CPU.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch

from . import common, convergence, e2e, kernels


def _powers_of_two(ax, values) -> None:
    """Log2 x axis labelled 1, 2, 4, 8, ... (not 2x10^0)."""
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(values))
    ax.set_xticklabels([str(v) for v in sorted(values)])


def _plots(result: dict, folder: Path, stem: str) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    device = result["machine"]["device"]

    def save(fig, name):
        fig.tight_layout()
        written.append(folder / f"{stem}-{name}.png")
        fig.savefig(written[-1], dpi=120)

    # Size sweep: GB/s against size.
    fig, ax = plt.subplots(figsize=(6.5, 4))
    series: dict[str, list[tuple[int, float]]] = {}
    for r in result["size_sweep"]:
        label = "ceiling: torch fp32 add_" if r["key"].startswith("ceiling") else r["name"]
        series.setdefault(label, []).append((r["numel"], r["gbps"]))
    for label, points in series.items():
        ax.plot([p[0] / 2**20 for p in points], [p[1] for p in points], marker="o", label=label)
    _powers_of_two(ax, sorted({r["numel"] // 2**20 for r in result["size_sweep"]}))
    ax.set(
        xlabel="elements (Mi)",
        ylabel="GB/s (bytes model)",
        title=f"bf16 -> fp32 accumulation: one fused pass vs torch's mixed-dtype add_ ({device})",
    )
    ax.title.set_size(9)
    ax.legend(fontsize=8)
    save(fig, "sizes")

    # Windows of the largest model: time relative to the plain path, and peak memory, against N.
    rows = result["windows"]
    models = sorted({r["model"] for r in rows}, key=lambda m: next(x["params"] for x in rows if x["model"] == m))
    big = [r for r in rows if r["model"] == models[-1]]
    ns = sorted({r["n_micro"] for r in big})
    plain = {r["n_micro"]: r["window_ms"] for r in big if r["path"] == "plain-bf16"}
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for path in e2e.PATHS:
        pts = sorted((r["n_micro"], r) for r in big if r["path"] == path)
        left.plot([n for n, _ in pts], [r["window_ms"] / plain[n] for n, r in pts], marker="o", label=path)
        right.plot([n for n, _ in pts], [r["peak_mib"] for _, r in pts], marker="o", label=path)
    left.axhline(1.0, color="grey", lw=0.8)
    for ax in (left, right):
        _powers_of_two(ax, ns)
        ax.set_xlabel("micro-batches per window (N)")
    left.set(ylabel="time per window / plain bf16 .grad", title=f"{models[-1]}: time, relative to the plain path")
    right.set(ylabel="peak memory (MiB)", title=f"{models[-1]}: peak memory")
    left.legend(fontsize=8)
    save(fig, "windows")

    # Precision: both errors against N.
    prec = result["precision"]
    ns = sorted({r["n_micro"] for r in prec})
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for path in e2e.PRECISION_PATHS:
        pts = sorted((r["n_micro"], r) for r in prec if r["path"] == path)
        style = {"marker": "o", "label": path, **({"ls": "--", "marker": "x"} if path == "ours-grad" else {})}
        summed = [(n, r["sum_error"]) for n, r in pts if r["sum_error"] > 0]  # N = 1 sums nothing: exact
        left.plot([n for n, _ in summed], [e for _, e in summed], **style)
        right.plot([n for n, _ in pts], [r["total_error"] for _, r in pts], **style)
    for ax in (left, right):
        _powers_of_two(ax, ns)
        ax.set(yscale="log", xlabel="micro-batches per window (N)", ylabel="relative L2 error")
    model = prec[0]["model"]
    left.set_title(f"{model}: accumulation error\n(vs float64 sum of the same micro-batch gradients)", fontsize=9)
    right.set_title(f"{model}: total error\n(vs float64 gradient of the big batch)", fontsize=9)
    left.legend(fontsize=8)
    save(fig, "precision")

    # The trade: peak memory and time per effective batch against N.
    trade = result["trade"]
    batch = trade[0]["n_micro"] * trade[0]["micro_batch"]
    ns = sorted({r["n_micro"] for r in trade})
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    for path in sorted({r["path"] for r in trade}):
        pts = sorted((r["n_micro"], r) for r in trade if r["path"] == path)
        left.plot([n for n, _ in pts], [r["peak_mib"] for _, r in pts], marker="o", label=path)
        right.plot([n for n, _ in pts], [r["window_ms"] for _, r in pts], marker="o", label=path)
    for ax in (left, right):
        _powers_of_two(ax, ns)
        ax.set_xlabel(f"N (a batch of {batch} as N micro-batches of {batch}/N)")
    left.set(ylabel="peak memory (MiB)", title="memory falls with N")
    right.set(ylabel="ms per effective batch", title="time per batch")
    left.legend(fontsize=8)
    save(fig, "trade")
    plt.close("all")
    return written


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if present, else cpu)")
    parser.add_argument("--quick", action="store_true", help="small sizes and few repetitions (about a minute)")
    parser.add_argument(
        "--results-dir",
        default=None,
        help="where to write (default bench/results/local/; the committed results: bench/results)",
    )
    args = parser.parse_args(argv)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    folder = Path(args.results_dir) if args.results_dir else common.RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    stem = f"suite-{device.type}{'-quick' if args.quick else ''}"
    record = common.machine_record(device)
    print(f"accumkernels benchmark suite on {device}, commit {record['commit']}{' (quick)' if args.quick else ''}")

    print("\n[1/6] kernels")
    numel = 4 * 2**20 if args.quick else (64 if device.type == "cuda" else 32) * 2**20
    kernel_result = kernels.run(device, numel, 5 if args.quick else 15, args.quick)
    import accumkernels

    backend = "cuda" if device.type == "cuda" else "cpu"
    heads = (
        kernels.headline(kernel_result, backend, device.type) if backend in accumkernels.available_backends() else []
    )

    print("\n[2/6] size sweep")
    sizes = [2**20, 4 * 2**20] if args.quick else [2**20, 4 * 2**20, 16 * 2**20, 64 * 2**20, 256 * 2**20]
    sweep = kernels.size_sweep(device, sizes, 3 if args.quick else 7)

    print("\n[3/6] training windows (each measurement in its own process)")
    windows = e2e.windows_suite(device.type, args.quick)
    print("\n[4/6] precision of the window gradient against N")
    precision = e2e.precision_suite(device.type, args.quick)
    print("\n[5/6] one big batch against N micro-batches")
    trade = e2e.trade_suite(device.type, args.quick)

    print("\n[6/6] convergence: held-out loss on real text, every recipe on the same batches and seeds")
    setting = "quick" if args.quick else "default"
    converged = convergence.run(setting)
    convergence_path = common.write_results(f"convergence-{setting}", converged, folder)

    result = {
        "machine": record,
        "quick": args.quick,
        "kernels": kernel_result,
        "headline": heads,
        "size_sweep": sweep,
        "windows": windows,
        "precision": precision,
        "trade": trade,
    }
    path = common.write_results(stem, result, folder)
    try:
        plots = _plots(result, folder, stem)
        convergence.plot(converged, convergence_path.with_suffix(".png"))
        plots.append(convergence_path.with_suffix(".png"))
    except ImportError:
        print("no plots: matplotlib is not installed")
        plots = []

    print(
        "\n"
        + common.table(
            kernel_result["rows"],
            [
                ("group", "group", "s"),
                ("name", "path", "s"),
                ("median_ms", "median ms", ".3f"),
                ("gbps", "GB/s", ".1f"),
                ("fraction_of_ceiling", "of ceiling", ".2f"),
            ],
        )
    )
    print("\n" + common.table(windows, e2e.WINDOWS_TABLE))
    print(
        "\n"
        + common.table(
            precision,
            [
                ("n_micro", "N", "d"),
                ("path", "path", "s"),
                ("sum_error", "error vs float64 sum of the same grads", ".1e"),
                ("total_error", "error vs float64 big-batch gradient", ".1e"),
            ],
        )
    )
    print(
        "\n"
        + common.table(
            trade,
            [
                ("n_micro", "N", "d"),
                ("micro_batch", "micro-batch", "d"),
                ("path", "path", "s"),
                ("window_ms", "ms/batch", ".1f"),
                ("peak_mib", "peak MiB", ".1f"),
            ],
        )
    )
    if heads:
        print(
            "\n"
            + common.table(
                heads,
                [
                    ("figure", f"headline [{backend}]", "s"),
                    ("value", "value", ".2f"),
                    ("target", "target", ".2f"),
                    ("met", "met", ""),
                ],
            )
        )
    print("\n" + common.table(converged["rows"], convergence.TABLE))
    for name, why in converged["skipped"].items():
        print(f"not run: {name}: {why}")
    print(f"\nwrote {path} and {convergence_path}")
    for p in plots:
        print(f"wrote {p}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
