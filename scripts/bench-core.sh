#!/usr/bin/env bash
# Benchmark (not a test): wall time of `dormant config` and of a whole
# `dormant try` (two jobs, every stage, suspend + resume + release) on the
# local provider. Prints a Markdown table. Usage:
#   scripts/bench-core.sh                 # debug build
#   DORMANT_BIN=target/release/dormant scripts/bench-core.sh
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${DORMANT_BIN:-target/debug/dormant}
[ -x "$BIN" ] || cargo build --quiet
N=${N:-200}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export DORMANT_STATE_DIR=$tmp/state JOB_RESPONSE_FILE=$tmp/response.json DORMANT_CONFIG=$tmp/empty.toml
echo '{"id": 1, "job_info": {"project_id": 2}, "variables": [{"key": "CI_RUNNER_ID", "value": "1"}]}' >"$JOB_RESPONSE_FILE"
: >"$DORMANT_CONFIG"

measure() { # name runs command...
  local name=$1 runs=$2
  shift 2
  for _ in $(seq "$runs"); do
    local s e
    s=$(date +%s%N)
    "$@" >/dev/null 2>&1
    e=$(date +%s%N)
    echo $(((e - s) / 1000))
  done | sort -n | awk -v n="$name" '{a[NR]=$1} END {printf "| %-16s | %4d | %8.2f | %8.2f | %8.2f |\n", n, NR, a[int(NR*0.5)+1]/1000, a[int(NR*0.9)]/1000, a[NR]/1000}'
}

echo "binary: $BIN ($(du -h "$BIN" | cut -f1)), $(nproc) cores"
echo "| command          | runs |   p50 ms |   p90 ms |   max ms |"
echo "|------------------|------|----------|----------|----------|"
measure "dormant config" "$N" "$BIN" config
measure "dormant try" 10 "$BIN" try
