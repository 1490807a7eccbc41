#!/usr/bin/env bash
# The GPU check, for a fresh GPU machine that has torch, nvcc and ninja but no
# network: build the extension for the GPU present, run the tests (the CUDA
# ones included), run the kernel benchmark, print its tables last. Logs and
# the results file go to $OUT (default bench/results/gpu-check). Fits in about
# 8 minutes on one H200 with 16 cores.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results/gpu-check}"
mkdir -p "$OUT"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
# Only the architecture present: the default build (8.0 and 9.0+PTX) takes longer.
export TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$(python -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')}"

{
    nvidia-smi
    python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
    python -c "import triton; print('triton', triton.__version__)"
    nproc
} > "$OUT/machine.txt" 2>&1

echo "== build (TORCH_CUDA_ARCH_LIST=$TORCH_CUDA_ARCH_LIST)"
start=$SECONDS
if ! python setup.py build_ext --inplace > "$OUT/build.log" 2>&1; then
    tail -n 60 "$OUT/build.log"
    exit 1
fi
echo "built in $((SECONDS - start)) s"
python -c "import accumkernels as ak, accumkernels._native as n; print('backends', ak.available_backends(), 'with_cuda', n.with_cuda())"

echo "== tests"
if python -c "import pytest" 2>/dev/null; then
    # The CUDA and Triton tests first: they are what this machine is for.
    timeout 120 python -m pytest -q -p no:cacheprovider tests/test_cuda.py tests/test_triton.py > "$OUT/tests-gpu.log" 2>&1
    echo "GPU tests: pytest exit code $?"
    tail -n 3 "$OUT/tests-gpu.log"
    timeout 150 python -m pytest -q -m "not slow" -p no:cacheprovider tests > "$OUT/tests.log" 2>&1
    echo "all tests: pytest exit code $?"
    grep -E "passed|failed|error" "$OUT/tests.log" | tail -n 3
    grep -E "^(FAILED|ERROR)" "$OUT/tests-gpu.log" "$OUT/tests.log" | head -n 20
else
    echo "pytest is not installed here: skipping the test suite (the benchmark still checks every path before timing it)"
fi

echo "== benchmark"
timeout 300 python -m bench.kernels --device cuda --results-dir "$OUT" --out kernels-cuda > "$OUT/bench.log" 2>&1
echo "benchmark exit code $?"
sed -n '/^group/,$p' "$OUT/bench.log"
