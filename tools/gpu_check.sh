#!/usr/bin/env bash
# Proves gradcomp's CUDA path on a machine with an NVIDIA GPU, in one command, with no package index
# and no internet: it needs only a CUDA build of torch, nvcc, cmake, ninja, scikit-build-core,
# pybind11 and pytest already installed.
#
#   bash tools/gpu_check.sh OUT_DIR
#
# Stages (each runs even when an earlier one failed; each one's time, outcome and why are in the summary):
#   build      gradcomp with its CUDA codecs for the GPU's compute capability, against the installed
#              torch, into build/gpu-check/site (the Python environment is left as it was), with the
#              GoogleTest suite and its CUDA tests
#   gtest      the GoogleTest suite (its CUDA tests compare every CUDA codec with the CPU codec bit for bit)
#   sanitizer  the CUDA GoogleTests under compute-sanitizer: memcheck, then racecheck
#              (GPU_CHECK_SANITIZER_TOOLS=memcheck for memcheck alone: racecheck takes about 7x as long)
#   gpu-tests  pytest's GPU tests (tests/python/test_cuda.py): every codec, dtype and size CPU against
#              CUDA bit for bit, the two-phase ops, the device payload checks, DDP with 2 ranks on one GPU
#              over gloo, a DDP step of every codec on NCCL with host-device syncs made errors, and
#              policy="time" on the GPU (one decision on 2 ranks; no host-device sync once it is taken)
#   suite      the rest of the pytest suite against this build (without a GPU: the tests of what the
#              build changes, see suite())
#   kernels    benchmarks/kernels.py --device cuda (with the PowerSGD hook step against torch's
#              powerSGD_hook) and benchmarks/two_phase_ops.py --device cuda
# Then it writes OUT_DIR/gpu_check.md and .json (every stage passed, failed or skipped, with why, and
# each speed target met or missed), gpu_check.log (all that it printed), kernels_cuda.{json,csv,png} and
# two_phase_ops_cuda.{json,png}: at most 8 files. It exits non-zero if a stage failed; a missed speed
# target is reported, not a failure.
#
# Tests that need an optional package or program the machine lacks (mnist1d, Debian's bible-kjv, a
# framework) skip, naming it. Without a GPU it builds what it can (the CUDA kernels and their tests; the extension too where torch
# is a CUDA build), runs the tests that need no GPU, says which stages it skipped and why, and exits 0
# unless something it ran failed. tools/cuda_build_check.sh runs it that way in CI.
#
# Environment: PYTHON (default python3); CUDACXX (nvcc; else PATH, else /usr/local/cuda/bin/nvcc);
# GRADCOMP_GTEST_SOURCE (GoogleTest's sources, where no installed GoogleTest is found, e.g. a copy of
# Debian's /usr/src/googletest); GPU_CHECK_STAGES (a comma-separated subset of the stages above, to
# split a run; default all); GPU_CHECK_SANITIZER_TOOLS (default "memcheck racecheck"); GPU_CHECK_JOBS
# (pytest-xdist workers for the suite where xdist is installed; default 4 with a GPU, 0 without).
# Within a short lease, the suite left to tools/test.sh (on an H200 with 16 cores: build 43 s, gtest 14 s,
# memcheck 15 s, racecheck 105 s, gpu-tests 83 s, kernels 30 s; about 5 minutes in all):
#   GPU_CHECK_STAGES=build,gtest,sanitizer,gpu-tests,kernels
# (add GPU_CHECK_SANITIZER_TOOLS=memcheck to leave racecheck out where even that is too long).
set -uo pipefail
if [ $# -ne 1 ] || [ -z "$1" ]; then
  echo "usage: bash tools/gpu_check.sh OUT_DIR" >&2
  exit 2
fi
mkdir -p "$1" || exit 2
OUT=$(cd "$1" && pwd)
PYTHON=${PYTHON:-python3}
case $PYTHON in */*) PYTHON=$(cd "$(dirname "$PYTHON")" && pwd)/$(basename "$PYTHON") ;; esac  # the stages cd
cd "$(dirname "$0")/.."
REPO=$(pwd)
rm -f "$OUT"/gpu_check.{md,json,log} "$OUT"/kernels_cuda.{json,csv,png} "$OUT"/two_phase_ops_cuda.{json,png}
WORK=$REPO/build/gpu-check
SITE=$WORK/site
mkdir -p "$WORK"
# An earlier run's records are not this one's: its kernel timings would report speed targets this run never measured.
rm -f "$WORK"/stages.tsv "$WORK"/*.xml "$WORK"/machine.json "$WORK"/kernels_cuda.{json,csv,png} \
  "$WORK"/two_phase_ops_cuda.{json,csv,png}
exec > >(tee "$OUT/gpu_check.log") 2>&1
log_writer=$!

# ------------------------------------------------------------------------------------- the machine

nvcc=${CUDACXX:-$(command -v nvcc || true)}
[ -n "$nvcc" ] || [ ! -x /usr/local/cuda/bin/nvcc ] || nvcc=/usr/local/cuda/bin/nvcc
sanitizer=$(command -v compute-sanitizer || true)
for candidate in "${nvcc:+$(dirname "$nvcc")/compute-sanitizer}" /usr/local/cuda/bin/compute-sanitizer; do
  [ -n "$sanitizer" ] || [ ! -x "$candidate" ] || sanitizer=$candidate
done
# torch's version, its CUDA version ('none' for a CPU build), the usable GPUs, the first one's compute
# capability (e.g. 90) and name; also written to machine.json for the summary.
probe=$(CUDACXX=$nvcc SANITIZER=$sanitizer "$PYTHON" tools/gpu_check.py probe "$WORK") || probe="missing none 0 - -"
read -r torch_version torch_cuda gpu_count gpu_cc gpu_name <<<"$probe"
has_gpu=false
[ "$gpu_count" -gt 0 ] && has_gpu=true
echo "== gpu_check $(date -u +%FT%TZ): torch $torch_version (CUDA $torch_cuda), $gpu_count GPU(s)$(
  [ "$has_gpu" = false ] || echo ", the first: $gpu_name, compute capability $gpu_cc")"
echo "   nvcc: ${nvcc:-none}$([ -z "$nvcc" ] || echo " ($("$nvcc" --version | tail -1))"); compute-sanitizer: ${sanitizer:-none}"

# --------------------------------------------------------------------------------------- stages

skip() {  # skip REASON; return: inside a stage, ends it as skipped
  echo "$1" >"$WORK/skip_reason"
  return 77
}

note() {  # note TEXT: a fact about the stage for the summary
  echo "$1" >>"$WORK/stage_note"
}

stage() {  # stage NAME FUNCTION: runs it unless GPU_CHECK_STAGES leaves it out; records the outcome
  local name=$1 function=$2 rc start outcome=passed note=""
  if [ -n "${GPU_CHECK_STAGES:-}" ] && [[ ",$GPU_CHECK_STAGES," != *",$name,"* ]]; then
    printf '%s\tskipped\t0\tnot asked for (GPU_CHECK_STAGES=%s)\n' "$name" "$GPU_CHECK_STAGES" >>"$WORK/stages.tsv"
    return
  fi
  echo
  echo "== $name =="
  rm -f "$WORK/skip_reason" "$WORK/stage_note"
  start=$SECONDS
  (set -uo pipefail; "$function")
  rc=$?
  if [ "$rc" = 77 ] && [ -f "$WORK/skip_reason" ]; then
    outcome=skipped
    note=$(cat "$WORK/skip_reason")
  elif [ "$rc" != 0 ]; then
    outcome=failed
    note="exit $rc"
  fi
  [ ! -f "$WORK/stage_note" ] || note="${note:+$note; }$(paste -sd';' "$WORK/stage_note" | sed 's/;/; /g')"
  echo "-- $name: $outcome${note:+ ($note)}, $((SECONDS - start)) s"
  printf '%s\t%s\t%s\t%s\n' "$name" "$outcome" "$((SECONDS - start))" "$note" >>"$WORK/stages.tsv"
}

gtest_available() {
  [ -n "${GRADCOMP_GTEST_SOURCE:-}" ] || compgen -G "/usr/lib/*/cmake/GTest/GTestConfig.cmake" >/dev/null ||
    compgen -G "/usr/lib/cmake/GTest/GTestConfig.cmake" >/dev/null ||
    compgen -G "/usr/local/lib*/cmake/GTest/GTestConfig.cmake" >/dev/null
}

build() {
  if [ -z "$nvcc" ]; then
    [ "$has_gpu" = false ] || { echo "no nvcc: set CUDACXX or put nvcc on PATH" >&2; return 1; }
    skip "no CUDA toolkit (nvcc) on this machine: nothing CUDA to build"; return
  fi
  [ "$torch_version" != missing ] || { echo "$PYTHON cannot import torch" >&2; return 1; }
  # GPU's own machine code where there is a GPU; else the build's default architectures.
  local defines=(GRADCOMP_CUDA=ON GRADCOMP_TESTS=OFF)
  [ "$has_gpu" = false ] || defines+=("GRADCOMP_CUDA_ARCHS=${gpu_cc}-real")
  if gtest_available; then
    defines[1]=GRADCOMP_TESTS=ON
    [ -z "${GRADCOMP_GTEST_SOURCE:-}" ] || defines+=("GRADCOMP_GTEST_SOURCE=$GRADCOMP_GTEST_SOURCE")
  else
    note "no GoogleTest (install libgtest-dev, or set GRADCOMP_GTEST_SOURCE): its suite was not built"
  fi
  echo "-- ${defines[*]}"
  rm -rf "$SITE"
  # A build tree made for another Python or torch keeps their settings in its cache: start it afresh.
  local made_for="$PYTHON torch $torch_version CUDA $torch_cuda"
  if [ "$(cat "$WORK/build/made-for" 2>/dev/null)" != "$made_for" ]; then
    rm -rf "$WORK/build"
    mkdir -p "$WORK/build"
    echo "$made_for" >"$WORK/build/made-for"
  fi
  if [ "$torch_cuda" = none ]; then
    # A CPU build of torch: the torch-free CUDA kernels and their tests build, the extension cannot.
    note "torch $torch_version is a CPU build: the CUDA kernels and their GoogleTests were built, not the extension"
    CUDACXX=$nvcc cmake -S . -B "$WORK/build" -G Ninja -DGRADCOMP_PYTHON=OFF "${defines[@]/#/-D}" >/dev/null &&
      cmake --build "$WORK/build"
    return
  fi
  CUDACXX=$nvcc "$PYTHON" -m pip install -q --no-index --no-deps --no-build-isolation --target "$SITE" \
    -C build-dir="$WORK/build" "${defines[@]/#/-Ccmake.define.}" -Ccmake.define.GRADCOMP_PYTHON=ON . || return 1
  (cd tests && PYTHONPATH=$SITE "$PYTHON" -c "
import gradcomp
assert gradcomp.cuda_built, 'built without CUDA codecs'
print('-- gradcomp', gradcomp.__version__, 'with CUDA codecs, in', gradcomp.__file__)") || return 1
  # A copy of libstdc++'s iostreams inside the extension crashes at the first integer it formats.
  local extension
  extension=$(ls "$SITE"/gradcomp/_C*.so)
  if command -v nm >/dev/null && nm -D --defined-only "$extension" | grep -q "_ZNSo9_M_insert"; then
    echo "$extension holds its own copy of libstdc++ (std::ostream::_M_insert is defined in it): see CMakeLists.txt" >&2
    return 1
  fi
}

extension_built() { [ -f "$SITE/gradcomp/__init__.py" ]; }
GTEST=$WORK/build/gradcomp_cpp_tests

gtest() {
  [ -x "$GTEST" ] || { skip "no GoogleTest binary (see the build stage)"; return; }
  [ "$has_gpu" = true ] || note "no GPU: the CUDA GoogleTests skip"
  "$GTEST" --gtest_brief=1 --gtest_output="xml:$WORK/gtest.xml" | grep -v ": Skipped$\|^no CUDA GPU usable"
}

sanitizer() {
  [ "$has_gpu" = true ] || { skip "no GPU: compute-sanitizer needs one"; return; }
  [ -n "$sanitizer" ] || { skip "compute-sanitizer is not on this machine"; return; }
  [ -x "$GTEST" ] || { echo "no GoogleTest binary to run under compute-sanitizer" >&2; return 1; }
  local status=0 tool filter rc
  # memcheck over every CUDA test; racecheck (far slower) over all but the 3M-element cases.
  for tool in ${GPU_CHECK_SANITIZER_TOOLS:-memcheck racecheck}; do
    filter='*Cuda*'
    [ "$tool" = memcheck ] || filter='*Cuda*:-*n3000017*'
    echo "-- compute-sanitizer --tool $tool, tests $filter"
    timeout 420 "$sanitizer" --tool "$tool" --error-exitcode 1 --print-limit 20 \
      "$GTEST" --gtest_brief=1 --gtest_filter="$filter" 2>&1 | grep -v ": Skipped$" | tail -40
    rc=${PIPESTATUS[0]}
    if [ "$rc" != 0 ]; then
      note "$tool: exit $rc$([ "$rc" != 124 ] || echo ', timed out after 420 s')"
      status=1
    fi
  done
  return "$status"
}

run_pytest() {  # run_pytest JUNIT_NAME PYTEST_ARGS...: against this build; no tests collected is a failure
  local junit=$1 rc=0
  shift
  # A GPU machine may lack the optional datasets and frameworks: their tests skip, saying so.
  (cd tests && PYTHONPATH=$SITE GRADCOMP_REQUIRE_OPTIONAL=0 "$PYTHON" -m pytest -q -p no:cacheprovider -rfE \
    --junitxml="$WORK/$junit.xml" "$@") || rc=$?
  if [ "$rc" = 5 ]; then
    echo "pytest collected no tests: that is a failure here" >&2
    return 1
  fi
  return "$rc"
}

gpu_tests() {
  [ "$has_gpu" = true ] || { skip "no GPU: every test of tests/python/test_cuda.py would skip"; return; }
  extension_built || { echo "gradcomp with CUDA codecs was not built" >&2; return 1; }
  run_pytest pytest-gpu python/test_cuda.py
}

suite() {
  extension_built || { skip "no CUDA build of gradcomp to test (see the build stage)"; return; }
  local args=(python --ignore=python/test_cuda.py) jobs
  if [ "$has_gpu" = true ]; then
    note "all but test_cuda.py, which gpu-tests ran"
    # One line per test (run_pytest's -q, less two): a run a short lease cuts off still names its failures. The
    # whole suite needs over 6 minutes on an H200's 16 cores even with 14 workers (97% in about 360 s): give it a
    # call of its own there (GPU_CHECK_STAGES=build,suite GPU_CHECK_JOBS=14).
    args+=(-v -v)
  else
    # Without a GPU, what this build changes is the extension (built with CUDA) and the torch it runs
    # on: the ops, the codecs and the seams of DDP and FSDP2 are tested against it. The schemes, the
    # policy, checkpoints and the rest are the same Python over the same CPU kernels: tools/test.sh
    # runs them against the CPU build; running them twice kept CI past its time budget.
    local file
    for file in test_examples test_benchmarks test_frameworks test_checkpoint test_elastic test_policy \
                test_plan test_hierarchical test_reliability test_corruption test_two_phase; do
      args+=(--ignore="python/$file.py")
    done
    note "no GPU: the ops', codecs', DDP and FSDP2 tests only (the rest runs in tools/test.sh, on the CPU build)"
  fi
  jobs=${GPU_CHECK_JOBS:-$([ "$has_gpu" = true ] && echo 4 || echo 0)}
  if [ "$jobs" -gt 0 ] && "$PYTHON" -c "import xdist" 2>/dev/null; then
    args+=(-n "$jobs")
  fi
  run_pytest pytest-suite "${args[@]}"
}

kernels() {
  [ "$has_gpu" = true ] || { skip "no GPU: GPU timings need one"; return; }
  extension_built || { echo "gradcomp with CUDA codecs was not built" >&2; return 1; }
  local status=0
  # References up to 256 MB: topk's target is against torch.topk on 64M elements.
  (cd benchmarks && PYTHONPATH=$SITE timeout 600 "$PYTHON" kernels.py --device cuda --skip-reference-above 256 \
    --out-dir "$WORK" --tag kernels_cuda) || status=1
  (cd benchmarks && PYTHONPATH=$SITE timeout 300 "$PYTHON" two_phase_ops.py --device cuda --out "$WORK") || status=1
  cp "$WORK"/kernels_cuda.{json,csv,png} "$WORK"/two_phase_ops_cuda.{json,png} "$OUT"/ 2>/dev/null
  return "$status"
}

stage build build
stage gtest gtest
stage sanitizer sanitizer
stage gpu-tests gpu_tests
stage suite suite
stage kernels kernels

echo
status=0
"$PYTHON" tools/gpu_check.py report "$WORK" "$OUT" || status=1
! grep -q $'\tfailed\t' "$WORK/stages.tsv" || status=1
exec >&- 2>&-
wait "$log_writer"  # the log is whole when the script returns
exit "$status"
