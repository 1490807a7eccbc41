"""Seed sweep: the randomized numeric tests at fresh seeds (CI runs it after make test).

``make test`` runs at one fixed seed (tests/conftest.py), so a user's run is
CI's run. Every tolerance in the numeric tests is a bound (fp32 summation, an
ulp, the optimizer's sensitivity), so they must pass at *every* seed: this
draws ``--seeds`` new ones, runs the numeric modules at each (pytest-xdist, as
make test does), prints each seed with the command that replays it, and exits
non-zero if any seed failed.

    .venv/bin/python tests/seed_sweep.py --seeds 10
    .venv/bin/python tests/seed_sweep.py --seed 1234      # replay one
"""

from __future__ import annotations

import argparse
import os
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# The modules whose tests draw random data and assert a numeric bound on it.
# (The framework, docs, planner, benchmark and build tests run at make test's
# seed only: minutes of fresh processes each; test_native checks the native
# ops' registration and ISA variants bit for bit, not bounds.)
NUMERIC_MODULES = [
    "tests/test_accumulate.py",
    "tests/test_steps.py",
    "tests/test_state8.py",
    "tests/test_grad_norm.py",
    "tests/test_optimizer.py",
    "tests/test_lean_window.py",
    "tests/test_grad_inbox.py",
    "tests/test_optimizers.py",
    "tests/test_conformance.py",
    "tests/test_contract.py",
    "tests/test_amp.py",
    "tests/test_fsdp.py",
    "tests/test_distributed.py",
    "tests/test_pipeline.py",
]


def command(modules: list[str], workers: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-n",
        str(workers),
        "--dist",
        "loadscope",
        "-m",
        "not slow",
        *modules,
    ]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=10, help="how many fresh seeds to draw (default 10)")
    parser.add_argument("--seed", type=int, action="append", help="run this seed (repeatable) instead of drawing")
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers (default 2, as make test)")
    parser.add_argument("modules", nargs="*", default=NUMERIC_MODULES, help="test modules (default: the numeric ones)")
    args = parser.parse_args()
    seeds = args.seed or [random.SystemRandom().randrange(2**31) for _ in range(args.seeds)]
    cmd = command(args.modules, args.workers)
    print(f"seed sweep: {len(seeds)} seeds {seeds} over {len(args.modules)} modules", flush=True)
    failed, start = [], time.monotonic()
    for i, seed in enumerate(seeds, 1):
        t0 = time.monotonic()
        env = dict(os.environ, ACCUMKERNELS_TEST_SEED=str(seed))
        done = subprocess.run(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        summary = done.stdout.strip().splitlines()[-1] if done.stdout.strip() else "(no output)"
        print(f"[{i}/{len(seeds)}] seed {seed}: {summary} ({time.monotonic() - t0:.0f} s)", flush=True)
        if done.returncode != 0:
            failed.append(seed)
            print(done.stdout[-20000:], flush=True)
            replay = " ".join(shlex.quote(c) for c in cmd).replace(sys.executable, ".venv/bin/python")
            print(f"replay: ACCUMKERNELS_TEST_SEED={seed} {replay}", flush=True)
    print(
        f"seed sweep: {len(seeds) - len(failed)} passed, {len(failed)} failed "
        f"({time.monotonic() - start:.0f} s){f'; failing seeds {failed}' if failed else ''}",
        flush=True,
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
