"""The benchmarks' quick modes keep working (no timing is asserted)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _quick_run(module: str, results: Path) -> subprocess.CompletedProcess:
    """`python -m <module> --quick --device cpu`, which must succeed."""
    out = subprocess.run(
        [sys.executable, "-m", module, "--quick", "--device", "cpu", "--results-dir", str(results)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    return out


def test_kernel_benchmark_quick_mode(native_only, tmp_path):
    out = _quick_run("bench.kernels", tmp_path)
    result = json.loads((tmp_path / "kernels-cpu-quick.json").read_text())
    keys = {r["key"] for r in result["rows"]}
    assert {"ceiling", "accumulate_bf16[cpu]", "list512[cpu]", "adamw[cpu]", "adamw_torch_fused"} <= keys
    assert result["machine"]["commit"] and result["machine"]["torch"] == __import__("torch").__version__
    assert all(r["median_ms"] > 0 and r["fraction_of_ceiling"] > 0 for r in result["rows"])
    heads = {h["figure"]: h for h in result["headline"]}
    assert "accumulate_ bf16 GB/s / ceiling GB/s" in heads
    assert all(h["value"] > 0 and h["target"] > 0 and isinstance(h["met"], bool) for h in heads.values())
    # Item 4's ratio is against the issue's fp32-state step (bf16 params, fp32 state), paired by rounds.
    assert heads["adamw bf16 params: bf16 state GB/s / fp32 state GB/s"]["paired"]
    assert all(len(r["round_ms"]) == 5 for r in result["rows"])
    assert "headline [cpu]" in out.stdout
    # Each AdamW step beside its arithmetic floor (one thread, in cache) and its bytes at the ceiling:
    # the floor is a difference of two timings, so only its presence and finiteness are asserted.
    floors = {f["name"]: f for f in result["floors"]}
    assert len(floors) == 4 and any("8-bit state" in name for name in floors)
    assert all(math.isfinite(f["floor_compute_ms"]) and f["floor_memory_ms"] > 0 for f in floors.values())
    assert "arithmetic floor ms" in out.stdout


@pytest.mark.slow
def test_suite_quick_mode(native_only, tmp_path):
    """`python -m bench.run --quick`: kernels, size sweep, training windows,
    the batch/micro-batch trade, JSON and plots, in about a minute."""
    _quick_run("bench.run", tmp_path)
    result = json.loads((tmp_path / "suite-cpu-quick.json").read_text())
    assert {r["path"] for r in result["windows"]} == {
        "plain-bf16",
        "plain-autocast",
        "ours-hooks",
        "ours-grad",
        "ours-master",
    }
    assert all(r["window_ms"] > 0 and r["peak_mib"] >= 0 for r in result["windows"] + result["trade"])
    # The wrapper's fp32 accumulation adds far less error than bf16 .grad (N = 16 here) ...
    n16 = {r["path"]: r for r in result["precision"] if r["n_micro"] == 16}
    for intake in ("ours-hooks", "ours-grad"):
        assert n16[intake]["sum_error"] * 100 <= n16["plain-bf16"]["sum_error"]
        # ... but the bf16 backward's own error stays: far above fp32 compute's.
        assert n16[intake]["total_error"] > 100 * n16["plain-fp32"]["total_error"]
    assert {p.name for p in tmp_path.glob("*.png")} == {
        f"suite-cpu-quick-{k}.png" for k in ("sizes", "windows", "precision", "trade")
    } | {"convergence-quick.png"}
    # Convergence: the training state each recipe keeps, measured on its objects (bytes per param):
    # fp32 params, .grad and two moments; bf16 params, .grad and torch's bf16 moments; the wrapper's
    # defaults on bf16 params (bf16 params and moments, fp32 buffers); remainders (fp32 moments, +2).
    converged = json.loads((tmp_path / "convergence-quick.json").read_text())
    rows = {r["recipe"]: r for r in converged["rows"]}
    assert {name: rows[name]["bytes_per_param"] for name in rows} == {
        "fp32": 16.0,
        "bf16-plain": 8.0,
        "ours": 10.0,
        "ours-remainders": 16.0,
    }
    untrained = 5.5452  # ln(256): a byte-level model that knows nothing
    assert all(r["held_out_loss"] < untrained for r in converged["rows"]), "every recipe learns"
    assert rows["fp32"]["vs_fp32"] == 0
    for name in ("sizes", "windows", "trade"):
        assert (tmp_path / f"suite-cpu-quick-{name}.png").stat().st_size > 0


def test_a_users_run_does_not_overwrite_the_committed_results():
    from bench import common

    assert common.RESULTS != ROOT / "bench" / "results"
    probe = common.RESULTS / "suite-cpu.json"
    ignored = subprocess.run(["git", "check-ignore", "-q", str(probe)], cwd=ROOT)
    assert ignored.returncode == 0, f"{probe} must be ignored by git"


def test_headline_ratios_are_paired_by_round_within_a_group():
    """headline(): a GB/s figure is a's GB/s over b's, a time figure a's time
    over b's; within one group the median of the per-round ratios (torch
    fused over ours: 3, 2 and 3, median 3, where the medians' ratio is 2),
    across groups the ratio of the medians."""
    from bench import kernels

    def row(key, group, bpe, rounds):
        ms = sorted(rounds)[len(rounds) // 2]
        return {"key": key, "group": group, "bytes_per_element": bpe, "numel": 10, "median_ms": ms, "round_ms": rounds}

    rows = [
        row("adamw_bf16_state[cpu]", "adamw", 20, [1.0, 2.0, 4.0]),
        row("adamw_bf16_fp32_state[cpu]", "adamw", 28, [2.0, 4.0, 8.0]),
        row("adamw_torch_fused", "adamw", 32, [3.0, 6.0, 12.0]),
        row("adamw[cpu]", "adamw", 32, [1.0, 3.0, 4.0]),
        row("accumulate_bf16[cpu]", "accumulate", 10, [1.0, 1.0, 1.0]),
        row("ceiling", "accumulate", 12, [1.0, 1.0, 1.0]),
        row("torch_add_bf16", "other", 10, [3.0, 3.0, 3.0]),
    ]
    heads = {h["figure"]: h for h in kernels.headline({"rows": rows}, "cpu", "cpu")}
    sr = heads["adamw bf16 params: bf16 state GB/s / fp32 state GB/s"]
    assert sr["paired"] and sr["value"] == pytest.approx(2.0 * 20 / 28)
    fused = heads["adamw_step_and_zero_ vs torch fused + zero_"]
    assert fused["paired"] and fused["value"] == pytest.approx(3.0)
    mixed = heads["accumulate_ bf16 speedup vs torch mixed add_"]
    assert not mixed["paired"] and mixed["value"] == pytest.approx(3.0)


def test_the_gpu_run_tests_every_module_of_the_backend_fixture():
    # bench/gpu_check.sh names the test files it runs on the GPU targets; one
    # missing there is a backend's tests that never run on a GPU (the 8-bit
    # state's were, in the first GPU run). A module takes the targets through a
    # test's `backend` argument (tests/conftest.py's fixture).
    import ast
    import re

    script = (ROOT / "bench" / "gpu_check.sh").read_text()
    listed = set(re.findall(r"tests/(test_\w+\.py)", script))
    on_targets = set()
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        tests = [n for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef)]
        if any(n.name.startswith("test_") and "backend" in [a.arg for a in n.args.args] for n in tests):
            on_targets.add(path.name)
    assert "test_state8.py" in on_targets
    assert not on_targets - listed, f"gpu_check.sh does not run {sorted(on_targets - listed)}"
