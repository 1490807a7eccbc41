"""Shared test fixtures: the backends under test and fresh random data.

Every run draws a new seed (printed in the header; set ACCUMKERNELS_TEST_SEED
to replay one), so the kernels meet new data each time.
"""

from __future__ import annotations

import os
import random
import zlib

import pytest
import torch

import accumkernels
from accumkernels import _native

SEED = int(os.environ.get("ACCUMKERNELS_TEST_SEED", random.SystemRandom().randrange(2**31)))

# The backends that run on CPU tensors. The native one is required unless the
# build was skipped on purpose: a broken build must fail the tests, not skip them.
NATIVE_SKIPPED = os.environ.get("ACCUMKERNELS_SKIP_NATIVE", "") not in ("", "0")
CPU_BACKENDS = ["reference"] + ([] if NATIVE_SKIPPED else ["cpu"])


def pytest_report_header(config):
    return [
        f"accumkernels: seed {SEED} (ACCUMKERNELS_TEST_SEED), backends {accumkernels.available_backends()}, "
        f"cpu isa {_native.cpu_isa()}, torch {torch.__version__}"
    ]


@pytest.fixture(autouse=True)
def _seed(request):
    """A seed per test, derived from the run's seed and the test id."""
    torch.manual_seed(SEED ^ zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(params=CPU_BACKENDS)
def backend(request):
    return request.param


@pytest.fixture
def native_only():
    if NATIVE_SKIPPED:
        pytest.skip("ACCUMKERNELS_SKIP_NATIVE is set: no native ops to test")
    _native.require()
