#!/usr/bin/env bash
# The GPU run, as one call on a fresh GPU machine that has torch, triton, nvcc
# and ninja but no network:
#
#   bash bench/gpu_precheck.sh         # here: every source compiles against that machine's torch
#   make gpu-deps                      # here, once: setuptools into .gpu-deps/
#   OUT=... bash bench/gpu_check.sh    # there, carrying .gpu-deps
#
# It writes 12 files; a lent machine returns 8 from its $OUT, so there run it as
#   R=$OUT; OUT=/tmp/gc bash bench/gpu_check.sh; tar czf $R/gpu-check.tgz -C /tmp gc
#
# In order, each step with its own time limit so that a hang costs one step
# (the times of the 2026-12-04 run on one H200 with 16 cores):
#   1. build for the GPU present (a CPU-only build is refused: ACCUMKERNELS_REQUIRE_CUDA=1): 188 s
#   2. the GPU tests: CUDA kernels and Triton on the GPU, every Triton variant
#      compiled, recompiles, the CUDA-vs-Triton-vs-reference parity: 114 s
#   3. the numeric and wrapper tests on the GPU targets (reference, cuda and
#      triton on cuda:0 and, with several GPUs, the last one), 8-bit state and
#      lean windows included: 91 s without those two (the 2026-12-04 run lacked them)
#   4. the kernel benchmark (64M elements, copy bandwidth as the ceiling): 27 s
#   5. variants of the AdamW steps (defaults, fp32 state, 8-bit; bench/cuda_variants.py:
#      which change moves them toward the memory bound, each checked bit for bit
#      against the extension before timing): built in the background from step 1's
#      end on (about 2 minutes here on one core), seconds to run (not yet run)
#   6. training windows of GPT d=256 and d=1024 (8 layers) at N = 8, plain bf16
#      against the wrapper's defaults: about 18 s a row (a fresh process each), 4 rows
# Logs, JSON and a summary go to $OUT (default bench/results/gpu-check); the
# tables are printed last. About 10 minutes to step 5 (the machine's start
# adds about half a minute). BUDGET_S (default 540) bounds the whole script:
# each step's limit is cut to what is left of it and a step with under 20 s
# left is skipped, so that a call of at most 10 minutes ends in time to pack
# $OUT (the windows' step is the one cut short). A lent machine of 15 minutes
# has no room for a second full run: a rerun takes the steps it needs.
set -uo pipefail
DEADLINE=$((SECONDS + ${BUDGET_S:-540}))
cd "$(dirname "$0")/.."
OUT="${OUT:-bench/results/gpu-check}"
mkdir -p "$OUT"
export CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
export MAX_JOBS="${MAX_JOBS:-$(nproc)}"
export ACCUMKERNELS_REQUIRE_CUDA=1
export PYTHONPATH="$PWD:$PWD/.gpu-deps${PYTHONPATH:+:$PYTHONPATH}"
# Only the architecture present: the default list takes longer to build.
TORCH_CUDA_ARCH_LIST="${TORCH_CUDA_ARCH_LIST:-$(python -c 'import torch; print("%d.%d" % torch.cuda.get_device_capability())')}"
export TORCH_CUDA_ARCH_LIST

step() {  # step NAME LIMIT_S COMMAND...: run, log to $OUT/NAME.log, record the exit code
    local name=$1 limit=$2
    shift 2
    local left=$((DEADLINE - SECONDS))
    if [ "$left" -lt 20 ]; then
        echo "$name: skipped ($left s of BUDGET_S left)" | tee -a "$OUT/summary.txt"
        return 124
    fi
    [ "$limit" -gt "$left" ] && limit=$left
    local start=$SECONDS
    timeout "$limit" "$@" > "$OUT/$name.log" 2>&1
    local rc=$?
    echo "$name: exit $rc in $((SECONDS - start)) s (limit $limit s)" | tee -a "$OUT/summary.txt"
    return $rc
}

: > "$OUT/summary.txt"
{
    date -u +%Y-%m-%dT%H:%M:%SZ
    echo "commit ${ACCUMKERNELS_COMMIT:-$(git rev-parse HEAD 2>/dev/null || echo unknown)}"
    nvidia-smi
    python -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda)"
    python -c "import triton; print('triton', triton.__version__)"
    nvcc --version | tail -n 2
    echo "cores $(nproc)"
} > "$OUT/machine.txt" 2>&1

if ! step build 300 python setup.py build_ext --inplace; then
    tail -n 60 "$OUT/build.log"
    exit 1
fi
python -c "import accumkernels as ak, accumkernels._native as n; print('backends', ak.available_backends(), 'with_cuda', n.with_cuda())" | tee -a "$OUT/summary.txt"
# Step 5's module builds meanwhile (one nvcc process, about two minutes), beside the tests.
VARIANTS_BUILD=/tmp/ak-cuda-variants
python -m bench.cuda_variants --build-only --build-dir "$VARIANTS_BUILD" > "$OUT/cuda-variants-build.log" 2>&1 &
variants_build=$!

if python -c "import pytest" 2>/dev/null; then
    # Eight pytest-xdist workers where it is installed: the Triton compiles and
    # the CUDA start-up of each module overlap.
    workers=$(python -c "import xdist" 2>/dev/null && echo "-n 8 --dist loadscope")
    step tests-gpu 180 python -m pytest -q -p no:cacheprovider -ra $workers tests/test_cuda.py tests/test_triton.py
    step tests-on-gpu 180 python -m pytest -q -p no:cacheprovider -ra $workers -m "not slow" -k "cuda" \
        tests/test_accumulate.py tests/test_steps.py tests/test_grad_norm.py tests/test_optimizer.py tests/test_optimizers.py \
        tests/test_state8.py tests/test_lean_window.py tests/test_grad_inbox.py tests/test_validation.py
else
    echo "tests: pytest is missing on this machine (carry it as wheels: the device tool README says how)" | tee -a "$OUT/summary.txt"
fi

step bench-kernels 150 python -m bench.kernels --device cuda --results-dir "$OUT" --out kernels-cuda
# The background build may take until 30 s before the deadline, no longer.
while kill -0 "$variants_build" 2>/dev/null && [ $((DEADLINE - SECONDS)) -gt 30 ]; do sleep 1; done
kill "$variants_build" 2>/dev/null
wait "$variants_build"
echo "cuda-variants-build: exit $? (in the background since step 1; $SECONDS s into the run)" | tee -a "$OUT/summary.txt"
step cuda-variants 120 python -m bench.cuda_variants --build-dir "$VARIANTS_BUILD" --results-dir "$OUT"
step bench-windows 120 python -m bench.e2e --windows --device cuda --models gpt-d256,gpt-d1024 --ns 8 \
    --paths plain-bf16,ours-hooks --results-dir "$OUT"

echo
for log in tests-gpu tests-on-gpu; do
    [ -f "$OUT/$log.log" ] && { echo "== $log"; grep -E "^(FAILED|ERROR)|passed|failed" "$OUT/$log.log" | tail -n 25; }
done
echo "== kernels"
sed -n '/^group/,$p' "$OUT/bench-kernels.log" 2>/dev/null
echo "== step variants"
sed -n '/^AdamW step variants/,$p' "$OUT/cuda-variants.log" 2>/dev/null
echo "== training windows"
sed -n '/^model/,$p' "$OUT/bench-windows.log" 2>/dev/null
echo "== summary"
cat "$OUT/summary.txt"
