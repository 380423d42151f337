#!/usr/bin/env bash
# Installs everything gradcomp needs on a fresh Debian machine, then gradcomp itself.
#   bash tools/install.sh            # CPU torch 2.13, build and test tools (gtest, clang, qemu, Lightning,
#                                    # Accelerate, transformers), the benchmarks' data, gradcomp
# Environment: TORCH_SPEC (default torch==2.13.0), GRADCOMP_CUDA (auto|ON|OFF), PYTHON (default python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
TORCH_SPEC=${TORCH_SPEC:-torch==2.13.0}

need_apt=()
compgen -G "/usr/lib/*/cmake/GTest/GTestConfig.cmake" >/dev/null || compgen -G "/usr/lib/cmake/GTest/GTestConfig.cmake" >/dev/null || need_apt+=(libgtest-dev)
command -v cmake >/dev/null || need_apt+=(cmake)
command -v ninja >/dev/null || need_apt+=(ninja-build)
command -v g++ >/dev/null || need_apt+=(g++)
# clang with libFuzzer and its sanitizer runtimes: the decoder fuzzers (tools/fuzz.sh).
command -v clang++ >/dev/null || need_apt+=(clang)
compgen -G "/usr/lib/llvm-*/lib/clang/*/lib/linux/libclang_rt.fuzzer-$(uname -m).a" >/dev/null || need_apt+=(libclang-rt-dev)
# qemu-user lets the tests run the kernels on emulated older x86 CPUs (see tools/test.sh).
[ "$(uname -m)" != x86_64 ] || command -v qemu-x86_64 >/dev/null || need_apt+=(qemu-user)
# The King James Bible: benchmarks/lm.py's corpus.
command -v bible >/dev/null || need_apt+=(bible-kjv)
if [ ${#need_apt[@]} -gt 0 ]; then
  if [ "$(id -u)" != 0 ]; then
    echo "gradcomp: please install with your package manager: ${need_apt[*]}" >&2
    exit 1
  fi
  apt-get update -qq
  DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need_apt[@]}"
fi

# torch first and on its own: the extension is built against the torch that is installed.
"$PYTHON" -c "import torch" 2>/dev/null || "$PYTHON" -m pip install -q "$TORCH_SPEC"
"$PYTHON" -m pip install -q "scikit-build-core>=0.10" "pybind11>=2.12" numpy pytest matplotlib mnist1d tokenizers
# The frameworks gradcomp.lightning, gradcomp.accelerate and gradcomp.transformers plug into (optional extras;
# the tests use them).
"$PYTHON" -m pip install -q "lightning>=2.1" "accelerate>=0.26" "transformers>=4.46"
"$PYTHON" -m pip install -q --no-build-isolation .
"$PYTHON" -c "import gradcomp, torch; print('gradcomp', gradcomp.__version__, 'on torch', torch.__version__, '| CUDA codecs built:', gradcomp.cuda_built)"
