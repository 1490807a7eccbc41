"""The benchmark's quick mode keeps working (no timing is asserted)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_kernel_benchmark_quick_mode(native_only, tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "bench.kernels", "--quick", "--device", "cpu", "--results-dir", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads((tmp_path / "kernels-cpu-quick.json").read_text())
    keys = {r["key"] for r in result["rows"]}
    assert {"ceiling", "accumulate_bf16[cpu]", "list512[cpu]", "adamw[cpu]", "adamw_torch_fused"} <= keys
    assert result["machine"]["commit"] and result["machine"]["torch"] == __import__("torch").__version__
    assert all(r["median_ms"] > 0 and r["fraction_of_ceiling"] > 0 for r in result["rows"])
    assert "headline" in out.stdout or "headline" in result
