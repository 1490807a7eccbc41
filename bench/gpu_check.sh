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
timeout 240 python -m pytest -q -m "not slow" -p no:cacheprovider tests > "$OUT/tests.log" 2>&1
echo "pytest exit code $?"
grep -E "passed|failed|error" "$OUT/tests.log" | tail -n 5
grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -n 20

echo "== benchmark"
timeout 300 python -m bench.kernels --device cuda --results-dir "$OUT" --out kernels-cuda > "$OUT/bench.log" 2>&1
echo "benchmark exit code $?"
sed -n '/^group/,$p' "$OUT/bench.log"
