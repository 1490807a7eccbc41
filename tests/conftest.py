"""Shared test fixtures: the backends under test and their random data.

The run's seed is fixed (DEFAULT_SEED), so a user's ``make test`` is CI's run;
``ACCUMKERNELS_TEST_SEED=N`` picks another and ``ACCUMKERNELS_TEST_SEED=random``
draws one (printed in the header). pytest-xdist's workers share it. Fresh data
comes from the seed sweep (tests/seed_sweep.py), which CI runs at new seeds.
"""

from __future__ import annotations

import os
import random
import zlib

import pytest
import torch

# Without a GPU, Triton kernels run on CPU tensors in Triton's interpreter,
# which must be chosen before any kernel is defined.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import accumkernels  # noqa: E402
from accumkernels import _native  # noqa: E402
from accumkernels.backends import triton_backend  # noqa: E402

DEFAULT_SEED = 20261201


def _run_seed() -> int:
    value = os.environ.get("ACCUMKERNELS_TEST_SEED", "").strip()
    if not value:
        return DEFAULT_SEED
    if value == "random":
        return random.SystemRandom().randrange(2**31)
    try:
        seed = int(value)
    except ValueError:
        seed = -1
    if not 0 <= seed < 2**31:
        raise pytest.UsageError(f"ACCUMKERNELS_TEST_SEED must be an int in [0, 2**31) or 'random'; got {value!r}")
    return seed


SEED = _run_seed()
# pytest-xdist's workers start after this runs in the controller and inherit
# its environment: every worker draws from the seed the header prints.
os.environ["ACCUMKERNELS_TEST_SEED"] = str(SEED)
if os.environ.get("PYTEST_XDIST_WORKER"):
    # One intra-op thread per worker: make test runs one worker per core.
    torch.set_num_threads(1)

# ACCUMKERNELS_PYTHON_HOOKS=1: intake "hooks" takes every gradient through
# its Python pre-hooks, as without the extension, instead of the native inbox
# (csrc/grad_inbox.cpp); make test-python-hooks runs the intake's tests so.
if os.environ.get("ACCUMKERNELS_PYTHON_HOOKS", "") not in ("", "0"):
    from accumkernels.optim import _intake  # noqa: E402

    _intake.NATIVE_INBOX = False

# The backends that run on CPU tensors. The native one is required unless the
# build was skipped on purpose: a broken build must fail the tests, not skip them.
NATIVE_SKIPPED = os.environ.get("ACCUMKERNELS_SKIP_NATIVE", "") not in ("", "0")
CPU_BACKENDS = ["reference"] + ([] if NATIVE_SKIPPED else ["cpu"])
# Triton joins them where its interpreter runs on CPU tensors (where triton is installed).
if triton_backend.unavailable_reason() is None and triton_backend.supports(torch.device("cpu")):
    CPU_BACKENDS.append("triton")

# Where there are GPUs, every numeric test also runs on them: the reference,
# the CUDA kernels and Triton, on the first device and (with several) on the
# last one, which is never the current device. A GPU with a build that lacks
# the CUDA kernels fails in tests/test_cuda.py rather than skipping here.
GPU_DEVICES = [f"cuda:{i}" for i in sorted({0, torch.cuda.device_count() - 1})] if torch.cuda.is_available() else []
GPU_BACKENDS = ["reference", "cuda", "triton"]
# ACCUMKERNELS_TEST_BACKENDS=reference,cpu: only these (the seed sweep's
# fresh data need not go through Triton's slow interpreter each time).
_CHOSEN = [b for b in os.environ.get("ACCUMKERNELS_TEST_BACKENDS", "").split(",") if b]
if _CHOSEN:
    unknown = set(_CHOSEN) - {"reference", "cpu", "cuda", "triton"}
    if unknown:
        raise pytest.UsageError(f"ACCUMKERNELS_TEST_BACKENDS names unknown backends {sorted(unknown)}")
    CPU_BACKENDS = [b for b in CPU_BACKENDS if b in _CHOSEN]
    GPU_BACKENDS = [b for b in GPU_BACKENDS if b in _CHOSEN]
TARGETS = [(name, "cpu") for name in CPU_BACKENDS] + [
    (name, device) for device in GPU_DEVICES for name in GPU_BACKENDS if name in accumkernels.available_backends()
]


def pytest_report_header(config):
    return [
        f"accumkernels: seed {SEED} (replay: ACCUMKERNELS_TEST_SEED={SEED}), "
        f"backends {accumkernels.available_backends()}, "
        f"cpu isa {_native.cpu_isa()}, torch {torch.__version__}"
    ]


@pytest.fixture(autouse=True)
def _seed(request):
    """A seed per test, derived from the run's seed and the test id."""
    torch.manual_seed(SEED ^ zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(params=TARGETS, ids=[name if device == "cpu" else f"{name}@{device}" for name, device in TARGETS])
def backend(request):
    """A backend name; the test's tensors are made on the backend's device
    (torch's default device is set for the test)."""
    name, device = request.param
    with torch.device(device):
        yield name


@pytest.fixture
def device(backend):
    """The device the current backend's tensors live on."""
    return torch.get_default_device()


@pytest.fixture
def native_only():
    if NATIVE_SKIPPED:
        pytest.skip("ACCUMKERNELS_SKIP_NATIVE is set: no native ops to test")
    _native.require()
