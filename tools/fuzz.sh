#!/usr/bin/env bash
# Fuzzes every codec's validate-then-decode-and-sum (tests/fuzz/fuzz_decode.cpp) with libFuzzer under
# AddressSanitizer and UndefinedBehaviorSanitizer, for a bounded time per codec. Exits non-zero on
# any finding; the input that caused it is kept under build/fuzz/findings/.
#   bash tools/fuzz.sh                      # GRADCOMP_FUZZ_SECONDS per codec (default 7)
set -euo pipefail
cd "$(dirname "$0")/.."
SECONDS_EACH=${GRADCOMP_FUZZ_SECONDS:-7}
CODECS=(none fp16 bf16 signsgd terngrad qsgd topk randomk)

if ! command -v clang++ >/dev/null; then
  echo "gradcomp: the fuzzers need clang++ with libFuzzer (bash tools/install.sh installs them)" >&2
  exit 1
fi
cmake -S . -B build/fuzz -G Ninja -DCMAKE_CXX_COMPILER=clang++ -DGRADCOMP_FUZZ=ON -DGRADCOMP_SANITIZE=ON \
  -DGRADCOMP_PYTHON=OFF -DGRADCOMP_CUDA=OFF >/dev/null
cmake --build build/fuzz
rm -rf build/fuzz/seeds build/fuzz/findings
build/fuzz/fuzz_make_seeds build/fuzz/seeds
mkdir -p build/fuzz/findings

status=0
printf '%-9s %10s %8s %8s  %s\n' codec runs coverage corpus result
for codec in "${CODECS[@]}"; do
  mkdir -p "build/fuzz/corpus/$codec"  # grows across local runs; seeds are rewritten each time
  log="build/fuzz/$codec.log"
  if build/fuzz/fuzz_decode_"$codec" -max_total_time="$SECONDS_EACH" -print_final_stats=1 -rss_limit_mb=4096 \
      -artifact_prefix="build/fuzz/findings/$codec-" "build/fuzz/corpus/$codec" "build/fuzz/seeds/$codec" >"$log" 2>&1; then
    result=clean
  else
    result="FINDING (see $log)"
    status=1
  fi
  # A fuzzer that crashes on a seed prints no stats: the table shows "?" and the loop goes on.
  runs=$(sed -n 's/^stat::number_of_executed_units: *//p' "$log")
  coverage=$(grep -o 'cov: [0-9]*' "$log" | tail -1 | cut -d' ' -f2 || true)
  corpus=$(grep -o 'corp: [0-9]*' "$log" | tail -1 | cut -d' ' -f2 || true)
  printf '%-9s %10s %8s %8s  %s\n' "$codec" "${runs:-?}" "${coverage:-?}" "${corpus:-?}" "$result"
  [ "$result" = clean ] || grep -E "ERROR|SUMMARY|runtime error" "$log" | head -5 >&2 || true
done
exit "$status"
