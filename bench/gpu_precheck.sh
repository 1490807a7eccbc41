#!/usr/bin/env bash
# Before a GPU run (bench/gpu_check.sh), here and without a GPU: every native
# source, and bench/cuda_variants.cu, compiles against the headers of the
# torch that the GPU machine has (torch 2.11.0+cu130 on the lent H200s;
# GPU_TORCH=torch==X overrides), with this machine's nvcc for sm_90a. A header that a newer torch includes for us
# and an older one does not fails here instead of costing the GPU run's build
# (it did once: the 2026-12-04 run's first build). About 2 minutes on 2 cores;
# downloads the torch wheel (about 530 MB) into a temporary folder.
set -euo pipefail
cd "$(dirname "$0")/.."
GPU_TORCH="${GPU_TORCH:-torch==2.11.0}"
PY="${PY:-.venv/bin/python}"
CUDA_HOME="${CUDA_HOME:-/usr/local/cuda}"
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$PY" -m pip download --quiet --no-deps -d "$work" "$GPU_TORCH"
(cd "$work" && unzip -q -o torch-*.whl 'torch/include/*')
inc="$work/torch/include"
python_inc=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['include'])")
flags=(-DACCUMKERNELS_WITH_CUDA=1 -Icsrc/include -Icsrc -I"$inc" -I"$inc/torch/csrc/api/include"
       -I"$CUDA_HOME/include" -I"$python_inc" -DTORCH_API_INCLUDE_EXTENSION_H -DTORCH_EXTENSION_NAME=_C)
failed=0
for src in csrc/*.cpp csrc/cpu/*.cpp; do
    g++ -fsyntax-only -std=c++20 -fopenmp -fPIC "${flags[@]}" "$src" || { echo "FAILED: $src"; failed=1; }
done
for src in csrc/cuda/*.cu bench/cuda_variants.cu; do
    "$CUDA_HOME/bin/nvcc" -c -std=c++20 --expt-relaxed-constexpr -D__CUDA_NO_HALF_OPERATORS__ \
        -D__CUDA_NO_HALF_CONVERSIONS__ -D__CUDA_NO_BFLOAT16_CONVERSIONS__ -D__CUDA_NO_HALF2_OPERATORS__ \
        -gencode=arch=compute_90a,code=sm_90a --compiler-options -fPIC "${flags[@]}" "$src" \
        -o "$work/$(basename "$src").o" || { echo "FAILED: $src"; failed=1; }
done
[ "$failed" = 0 ] && echo "every source compiles against $GPU_TORCH's headers"
exit "$failed"
