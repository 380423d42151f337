#!/usr/bin/env bash
# Runs the whole test suite: the GoogleTest suite of the torch-free kernels (ctest; also on emulated
# older CPUs, and again under AddressSanitizer and UndefinedBehaviorSanitizer), a bounded run of the
# decoder fuzzers (tools/fuzz.sh), then pytest against the installed gradcomp. Exits non-zero on any
# failure or sanitizer finding, and when a suite ran no test.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

echo "== C++ kernels (GoogleTest) =="
cmake -S . -B build/cpp-tests -G Ninja -DGRADCOMP_TESTS=ON -DGRADCOMP_PYTHON=OFF -DGRADCOMP_CUDA=OFF >/dev/null
cmake --build build/cpp-tests
ctest --test-dir build/cpp-tests --output-on-failure --no-tests=error -j2

# The portable and AVX2 variants must run on CPUs without AVX-512 (and without AVX at all): run
# the kernel tests on emulated Nehalem (SSE4.2) and Haswell (AVX2) CPUs, where any stray wider
# instruction is an illegal-instruction crash.
if command -v qemu-x86_64 >/dev/null && [ "$(uname -m)" = x86_64 ]; then
  for cpu in Nehalem Haswell; do
    echo "-- kernel tests on an emulated $cpu CPU"
    qemu-x86_64 -cpu "$cpu" build/cpp-tests/gradcomp_cpp_tests --gtest_brief=1 2>&1 | grep -v "TCG doesn't support"
  done
fi

echo "== C++ kernels under AddressSanitizer and UndefinedBehaviorSanitizer =="
cmake -S . -B build/cpp-asan -G Ninja -DGRADCOMP_TESTS=ON -DGRADCOMP_SANITIZE=ON -DGRADCOMP_PYTHON=OFF \
  -DGRADCOMP_CUDA=OFF >/dev/null
cmake --build build/cpp-asan
ctest --test-dir build/cpp-asan --output-on-failure --no-tests=error -j2

echo "== Decoder fuzzers (libFuzzer with ASan and UBSan) =="
bash tools/fuzz.sh

echo "== Python (pytest) =="
# Run from outside the source tree so that the installed package is what gets imported.
status=0
(cd tests && "$PYTHON" -m pytest -q -p no:cacheprovider python "$@") || status=$?
if [ "$status" = 5 ]; then
  echo "pytest collected no tests: that is a failure here" >&2
  exit 1
fi
exit "$status"
