#!/usr/bin/env bash
# Runs the whole test suite: the GoogleTest suite of the torch-free kernels (ctest; also on emulated
# older CPUs, and again under AddressSanitizer and UndefinedBehaviorSanitizer), a bounded run of the
# decoder fuzzers (tools/fuzz.sh), pytest against the installed gradcomp, then a build with the CUDA
# codecs against the CUDA build of torch, and its tests (tools/cuda_build_check.sh, which runs
# tools/gpu_check.sh: its GPU stages skip where there is no GPU, saying so). Every part runs
# even when an earlier one failed; exits non-zero if any failed, found a sanitizer error, or ran no test.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

kernel_tests() {
  cmake -S . -B build/cpp-tests -G Ninja -DGRADCOMP_TESTS=ON -DGRADCOMP_PYTHON=OFF -DGRADCOMP_CUDA=OFF >/dev/null
  cmake --build build/cpp-tests
  ctest --test-dir build/cpp-tests --output-on-failure --no-tests=error -j2
}

# The portable and AVX2 variants must run on CPUs without AVX-512 (and without AVX at all): run
# the kernel tests on emulated Nehalem (SSE4.2) and Haswell (AVX2) CPUs, where any stray wider
# instruction is an illegal-instruction crash.
emulated_cpus() {
  if [ "$(uname -m)" != x86_64 ]; then
    echo "not an x86-64 machine: no x86 variants to check"
    return 0
  fi
  if ! command -v qemu-x86_64 >/dev/null; then
    echo "qemu-user is missing (bash tools/install.sh installs it)" >&2
    return 1
  fi
  for cpu in Nehalem Haswell; do
    echo "-- kernel tests on an emulated $cpu CPU"
    qemu-x86_64 -cpu "$cpu" build/cpp-tests/gradcomp_cpp_tests --gtest_brief=1 2>&1 | grep -v "TCG doesn't support"
  done
}

sanitized_kernel_tests() {
  cmake -S . -B build/cpp-asan -G Ninja -DGRADCOMP_TESTS=ON -DGRADCOMP_SANITIZE=ON -DGRADCOMP_PYTHON=OFF \
    -DGRADCOMP_CUDA=OFF >/dev/null
  cmake --build build/cpp-asan
  ctest --test-dir build/cpp-asan --output-on-failure --no-tests=error -j2
}

python_tests() {
  # Run from outside the source tree so that the installed package is what gets imported.
  local status=0
  # Tests that need an optional package or program (Lightning, Accelerate, mnist1d, bible-kjv) fail
  # here rather than skip when it is missing (tests/python/conftest.py).
  (cd tests && GRADCOMP_REQUIRE_OPTIONAL=1 "$PYTHON" -m pytest -q -p no:cacheprovider python "$@") || status=$?
  if [ "$status" = 5 ]; then
    echo "pytest collected no tests: that is a failure here" >&2
    return 1
  fi
  return "$status"
}

failed=()
stage() {  # stage TITLE FUNCTION [ARGS...]: a failure is recorded, and the next stage still runs
  local title=$1 rc
  shift
  echo "== $title =="
  set +e
  (set -euo pipefail; "$@")
  rc=$?
  set -e
  [ "$rc" = 0 ] || failed+=("$title (exit $rc)")
}

stage "C++ kernels (GoogleTest)" kernel_tests
stage "C++ kernels on emulated older CPUs" emulated_cpus
stage "C++ kernels under AddressSanitizer and UndefinedBehaviorSanitizer" sanitized_kernel_tests
stage "Decoder fuzzers (libFuzzer with ASan and UBSan)" bash tools/fuzz.sh
stage "Python (pytest)" python_tests "$@"
stage "CUDA build: compiled and linked here, its tests run (tools/gpu_check.sh; GPU stages where a GPU is)" bash tools/cuda_build_check.sh

if [ ${#failed[@]} -gt 0 ]; then
  printf 'FAILED: %s\n' "${failed[@]}" >&2
  exit 1
fi
echo "all test stages passed"
