#!/usr/bin/env bash
# Concurrency stress (tests/integration/stress/): ROUNDS rounds (default 20)
# of 19 jobs at once in one state dir through the built binary, with
# `dormant sweep` looping, `dormant release` by hand and races for one key;
# prints one line per round and a table of failure kinds with their causes.
#
#   scripts/stress.sh [ROUNDS]
#   DORMANT_STRESS_SWEEP_LOOPS=0 scripts/stress.sh 20   # no sweep loops: only cleanups' own sweeps
#   DORMANT_STRESS_SWEEP_LOOPS=0 DORMANT_STRESS_TTL=7d scripts/stress.sh 20   # plain: nothing expires
#   (DORMANT_STRESS_TTL: the short TTL of one sweep loop and half the cleanups, default 2s)
#
# Exits non-zero if any round found a failure. CI runs the same test with 2 rounds.
set -euo pipefail
cd "$(dirname "$0")/.."
rounds="${1:-20}"
case "$rounds" in
  ''|*[!0-9]*) echo "usage: scripts/stress.sh [ROUNDS]  (ROUNDS: a number, got '$rounds')" >&2; exit 2 ;;
esac
export DORMANT_STRESS_ROUNDS="$rounds"
exec cargo test --all-features --test integration -- --exact \
  stress::many_jobs_at_once_with_sweeps_releases_and_key_races_leave_consistent_state --nocapture
