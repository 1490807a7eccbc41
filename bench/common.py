"""Shared benchmark plumbing: timing by medians, the machine record, results files."""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from accumkernels.plan import profiled_peak  # noqa: F401  (the benchmarks' CPU peak, the planner's too)

# A run writes to bench/results/local/ (not tracked by git) unless told where;
# the reference results committed with the code live in bench/results/ and are
# written there only on purpose (--results-dir bench/results).
RESULTS = Path(__file__).resolve().parent / "results" / "local"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_times(fns: list, device: torch.device, *, reps: int, warmup: int = 2) -> list[list[float]]:
    """Wall times of each function, timed in ``reps`` interleaved rounds (one
    run of each per round, in the same order), so that drift in the machine's
    speed over the run hits every function alike; ``times[f][r]`` is function
    f's time in round r."""
    for fn in fns:
        for _ in range(warmup):
            fn()
    synchronize(device)
    times = [[] for _ in fns]
    for _ in range(reps):
        for fn, out in zip(fns, times):
            t0 = time.perf_counter()
            fn()
            synchronize(device)
            out.append(time.perf_counter() - t0)
    return times


def interleaved_medians(fns: list, device: torch.device, *, reps: int, warmup: int = 2) -> list[float]:
    """The median of each function's interleaved_times."""
    return [statistics.median(t) for t in interleaved_times(fns, device, reps=reps, warmup=warmup)]


def paired_ratio(a: list[float], b: list[float]) -> float:
    """The median over rounds of a[r] / b[r], two functions' interleaved_times:
    a ratio of neighbours in time, which a machine whose speed drifts between
    rounds (a shared VM) moves less than it moves the ratio of the medians."""
    return statistics.median(x / y for x, y in zip(a, b, strict=True))


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str:
    # A copy of the tree sent elsewhere (the lent GPU machine gets one, with a
    # .git that need not be the tree's): the sender names the commit it sent.
    if os.environ.get("ACCUMKERNELS_COMMIT"):
        return os.environ["ACCUMKERNELS_COMMIT"]
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root,
            capture_output=True,
            text=True,
            check=True,
        )
        return commit.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def machine_record(device: torch.device) -> dict:
    import accumkernels
    from accumkernels import _native

    record = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": git_commit(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "accumkernels": accumkernels.__version__,
        "backends": accumkernels.available_backends(),
        "platform": platform.platform(),
        "cpu": cpu_model(),
        "cpu_cores": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cpu_isa": _native.cpu_isa(),
        "device": str(device),
    }
    if device.type == "cuda":
        record["gpu"] = torch.cuda.get_device_name(device)
        record["cuda"] = torch.version.cuda
    return record


def write_results(name: str, payload: dict, directory: str | Path | None = None) -> Path:
    folder = Path(directory) if directory else RESULTS
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def table(rows: list[dict], columns: list[tuple[str, str, str]]) -> str:
    """Plain-text table; columns are (key, header, format)."""
    cells = [[h for _, h, _ in columns]]
    for r in rows:
        cells.append([("" if r.get(k) is None else format(r[k], f)) for k, _, f in columns])
    widths = [max(len(c[i]) for c in cells) for i in range(len(columns))]
    lines = ["  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(row, widths))) for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def run_ranks(worker, what: str, device_type: str, quick: bool, world: int) -> tuple[str, list[dict]]:
    """A multi-process benchmark: ``worker(rank, world, init_file, cfg, out)``
    on ``world`` spawned processes (gloo on the CPU where there are fewer GPUs
    than ranks), rank 0 saving its rows to ``out``; returns (device, rows)."""
    import tempfile

    import torch.multiprocessing as mp

    if device_type == "cuda" and torch.cuda.device_count() < world:
        print(f"  {torch.cuda.device_count()} GPU(s) for {world} ranks: the {what} runs on the CPU (gloo)")
        device_type = "cpu"
    cfg = dict(
        device=device_type,
        n_micro=4,
        micro_batch=4 if quick else 8,
        ctx=64,
        d=64 if quick else 256,
        layers=2 if quick else 4,
        warmup=1,
        reps=3 if quick else 7,
        threads=max(1, (os.cpu_count() or 2) // world),
    )
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "rows.pt")
        mp.spawn(worker, args=(world, os.path.join(tmp, "init"), cfg, out), nprocs=world)
        rows = torch.load(out, weights_only=False)
    for r in rows:
        r["device"] = device_type
    return device_type, rows


def init_rank(rank: int, world: int, init_file: str, cfg: dict) -> torch.device:
    """A run_ranks worker's process group (nccl on one GPU a rank, else gloo
    with cfg["threads"] threads a rank); returns its device."""
    import torch.distributed as dist

    cuda = cfg["device"] == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(cfg["threads"])
    dist.init_process_group("nccl" if cuda else "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    return torch.device("cuda", rank) if cuda else torch.device("cpu")


def ranks_main(argv, doc: str, name: str, what: str, worker, columns) -> int:
    """The command line of a multi-process benchmark (see run_ranks): runs it,
    prints the table, writes the JSON."""
    import argparse

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default=None, help="cpu or cuda (default: cuda if enough GPUs, else cpu)")
    parser.add_argument("--world", type=int, default=2)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--results-dir", default=None, help="default bench/results/local/")
    args = parser.parse_args(argv)
    device = args.device or ("cuda" if torch.cuda.device_count() >= args.world else "cpu")
    print(f"{what}, {args.world} ranks on {device}, commit {git_commit()}")
    device, rows = run_ranks(worker, what, device, args.quick, args.world)
    print(table(rows, columns))
    record = machine_record(torch.device(device))
    path = write_results(
        f"{name}-{device}{'-quick' if args.quick else ''}",
        {"machine": record, "quick": args.quick, "rows": rows},
        args.results_dir,
    )
    print(f"wrote {path}")
    return 0


def in_fresh_process(module: str, cfg: dict) -> dict:
    """``python -m <module> --one <cfg as JSON>`` in a new process (so that its
    peak memory is its own); its last stdout line, parsed as JSON."""
    out = subprocess.run(
        [sys.executable, "-m", module, "--one", json.dumps(cfg)], capture_output=True, text=True, timeout=900
    )
    if out.returncode != 0:
        raise RuntimeError(f"{module} --one {cfg} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])
