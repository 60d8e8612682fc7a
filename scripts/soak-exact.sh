#!/usr/bin/env bash
# The exactness property test (tests/integration/exact.rs) with many cases:
# N generated cases on `local` and N on `ssh` (a private sshd), from a random
# base seed it prints. Each case prints one line; a failing one prints its
# seed, its script and events and what broke. Replay one case with
#
#   DORMANT_EXACT_SEED=<seed> cargo test --all-features --test integration exact::exact_generated -- --nocapture
#
#   scripts/soak-exact.sh [N]   (default 100)
#
# Exits non-zero if any case failed. The suite runs a fixed handful of seeds.
set -euo pipefail
cd "$(dirname "$0")/.."
n="${1:-100}"
case "$n" in
  ''|*[!0-9]*) echo "usage: scripts/soak-exact.sh [N]  (N: a number of cases per provider, got '$n')" >&2; exit 2 ;;
esac
export DORMANT_EXACT_CASES="$n"
exec cargo test --all-features --test integration -- --test-threads 2 --nocapture \
  exact::exact_generated_cases_on_local exact::exact_generated_cases_on_ssh
