#!/usr/bin/env bash
# Builds gradcomp with its CUDA codecs and checks that build on this machine, GPU or not:
#   1. a venv (build/cuda-venv, kept between runs) with the CUDA build of torch (TORCH_CUDA_SPEC,
#      default torch==2.14.1);
#   2. gradcomp built there with GRADCOMP_CUDA=ON (nvcc from CUDACXX, PATH or /usr/local/cuda), together
#      with the GoogleTest suite: a compile or link error fails this script;
#   3. the kernel tests of that build (the CUDA ones run where a GPU is usable, else they skip), then
#      the CPU pytest suite against it, without the example and benchmark scripts and the framework glue
#      that do not depend on the build (tools/test.sh runs those against the CPU build).
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
echo "-- nvcc: $nvcc ($("$nvcc" --version | tail -1))"

if [ ! -x "$VENV/bin/python" ]; then
  "$PYTHON" -m venv "$VENV"
fi
"$VENV/bin/python" -c "import torch; assert torch.version.cuda" 2>/dev/null ||
  "$VENV/bin/python" -m pip install -q "$TORCH_CUDA_SPEC"
"$VENV/bin/python" -m pip install -q "scikit-build-core>=0.10" "pybind11>=2.12" numpy pytest
"$VENV/bin/python" -c "import torch; print('-- torch', torch.__version__, 'CUDA', torch.version.cuda)"

CUDACXX=$nvcc GRADCOMP_CUDA=ON "$VENV/bin/python" -m pip install -q --no-build-isolation \
  -C build-dir=build/cuda -C cmake.define.GRADCOMP_TESTS=ON .
(cd tests && ../"$VENV"/bin/python -c "import gradcomp; assert gradcomp.cuda_built, 'built without CUDA codecs'; print('-- gradcomp', gradcomp.__version__, 'with CUDA codecs')")

echo "-- kernel tests of the CUDA build"
build/cuda/gradcomp_cpp_tests --gtest_brief=1 | grep -v "^no CUDA GPU usable\|: Skipped$" | tail -5

echo "-- pytest against the CUDA build"
status=0
(cd tests && ../"$VENV"/bin/python -m pytest -q -p no:cacheprovider python \
  --ignore=python/test_examples.py --ignore=python/test_benchmarks.py --ignore=python/test_frameworks.py \
  --ignore=python/test_checkpoint.py) || status=$?
if [ "$status" = 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$status"
