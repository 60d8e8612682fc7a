#!/usr/bin/env bash
# Fuzz (a script, not a test): runs the fuzz targets of src/fuzz.rs — the
# environment key decoder, key round trips, the job payload reader and the
# settings parser — with CASES generated inputs each (random and mutated valid
# inputs; default 1,000,000) in an optimised build, and prints a Markdown
# table: target, cases, seconds, result. The test suite runs the same targets
# with DORMANT_FUZZ_CASES (default 2,000).
#
# Usage: scripts/fuzz.sh [CASES]
set -euo pipefail
cd "$(dirname "$0")/.."
CASES=${1:-1000000}
TARGETS=(fuzz_key_decoder fuzz_key_round_trip fuzz_payload_reader fuzz_settings_parser)

# Build once (no AWS SDK: the targets do not need it), then run the test binary directly.
build_log=$(cargo test --release --no-default-features --lib --no-run 2>&1) || {
  echo "$build_log" >&2
  exit 1
}
bin=$(echo "$build_log" | grep -o 'target/release/deps/dormant-[0-9a-f]*' | tail -1)
[ -x "$bin" ] || { echo "fuzz.sh: no test binary found in the build output" >&2; exit 1; }

logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
failed=0
echo "| target | cases | seconds | result |"
echo "|---|---:|---:|---|"
for t in "${TARGETS[@]}"; do
  start=$(date +%s.%N)
  if DORMANT_FUZZ_CASES=$CASES "$bin" --exact "fuzz::$t" --test-threads 1 >"$logs/$t" 2>&1; then
    result=pass
  else
    result=FAIL
    failed=1
  fi
  end=$(date +%s.%N)
  printf '| %s | %s | %.1f | %s |\n' "$t" "$CASES" "$(echo "$end - $start" | bc)" "$result"
done
if [ "$failed" = 1 ]; then
  for t in "${TARGETS[@]}"; do
    if ! grep -q "test result: ok" "$logs/$t"; then
      echo; echo "== $t =="; tail -40 "$logs/$t"
    fi
  done
  exit 1
fi
