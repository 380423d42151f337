#!/usr/bin/env bash
# Builds gradcomp with its CUDA codecs and checks that build on this machine, GPU or not (the last stage
# of tools/test.sh): a venv (build/cuda-venv, kept between runs) gets the CUDA build of torch
# (TORCH_CUDA_SPEC, default torch==2.14.1), then tools/gpu_check.sh runs with it. A compile or link error
# fails this script; without a GPU, gpu_check.sh runs the kernel tests (the CUDA ones skip) and the pytest
# suite against that build and says which GPU stages it skipped. Its summary goes to build/gpu-check/out.
# Without an nvcc it says so and exits 0: there is nothing to check.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_CUDA_SPEC=${TORCH_CUDA_SPEC:-torch==2.14.1}
VENV=build/cuda-venv

nvcc=${CUDACXX:-$(command -v nvcc || true)}
[ -n "$nvcc" ] || [ ! -x /usr/local/cuda/bin/nvcc ] || nvcc=/usr/local/cuda/bin/nvcc
if [ -z "$nvcc" ]; then
  echo "no CUDA toolkit (nvcc) on this machine: the CUDA build is not checked here"
  exit 0
fi

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -c "import torch; assert torch.version.cuda" 2>/dev/null ||
  "$VENV/bin/python" -m pip install -q "$TORCH_CUDA_SPEC"
"$VENV/bin/python" -m pip install -q "scikit-build-core>=0.10" "pybind11>=2.12" numpy pytest
CUDACXX=$nvcc PYTHON=$VENV/bin/python bash tools/gpu_check.sh build/gpu-check/out
