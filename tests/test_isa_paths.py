"""The wrapper's parity tests under every other CPU ISA path this machine has.

CI runs on whatever machine it lands on, and users' machines differ (AVX2-only
EPYCs beside AVX-512 ones): a comparison that holds with one ISA's summation
order can fail with another's. The main run uses the widest ISA; here the
tests that compare the wrapper with plain torch (its CPU backend), and the HF
Trainer comparison that once failed that way, run again in a process whose
loops are the other ISA's, ours (ACCUMKERNELS_CPU_ISA) and torch's
(ATEN_CPU_CAPABILITY) alike. (Our kernels themselves are checked bitwise
across ISAs in tests/test_native.py.)
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_native import _supported_isas

from accumkernels import _native

ROOT = Path(__file__).resolve().parent.parent
OTHER_ISAS = [isa for isa in _supported_isas() if isa != _native.cpu_isa()]
SELECTION = [
    "tests/test_optimizer.py",
    "tests/test_optimizers.py",
    "-k",
    "cpu or hf_trainer and no-clip",
    "tests/test_frameworks.py::TestHuggingFace::test_hf_trainer",
]


@pytest.mark.slow
@pytest.mark.skipif(not OTHER_ISAS, reason="this machine runs one CPU ISA path only")
@pytest.mark.parametrize("isa", OTHER_ISAS)
def test_parity_tests_under_another_isa(native_only, isa):
    env = {**os.environ, "ACCUMKERNELS_CPU_ISA": isa, "ATEN_CPU_CAPABILITY": isa}
    env.pop("PYTEST_XDIST_WORKER", None)
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", *SELECTION],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert " passed" in out.stdout, out.stdout[-2000:]
