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

# A run writes to bench/results/local/ (not tracked by git) unless told where;
# the reference results committed with the code live in bench/results/ and are
# written there only on purpose (--results-dir bench/results).
RESULTS = Path(__file__).resolve().parent / "results" / "local"


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def interleaved_medians(fns: list, device: torch.device, *, reps: int, warmup: int = 2) -> list[float]:
    """Median wall time of each function, timed in interleaved rounds (one run
    of each per round), so that drift in the machine's speed over the run hits
    every function alike."""
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
    return [statistics.median(t) for t in times]


def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str:
    root = Path(__file__).resolve().parent.parent
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], cwd=root, capture_output=True, text=True, check=True)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=root,
                               capture_output=True, text=True, check=True)  # fmt: skip
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
