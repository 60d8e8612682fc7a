#!/usr/bin/env bash
# EC2 API calls per transition, as a table.
#
# Runs the test `ec2_calls::ec2_api_calls_per_transition_are_the_readmes` of
# the integration test binary and shows the table it prints: whole jobs
# through the built binary against moto's EC2 emulator behind the recording
# proxy (a loopback sshd stands in for every instance).
# For each storage mode a new environment is created and suspended, resumed
# and suspended again, resumed and released; the proxy's calls are split at
# the first run stage of each job (prepare before it, cleanup after it) and
# printed as a table: the total and the calls by action. moto's transitions
# are instant, so every wait makes one poll: on EC2 add one describe per
# second of transition. The suite runs the same test: it fails on any count
# that differs from docs/performance.md's (action by action).
#
# Usage: scripts/bench-ec2-calls.sh
# Env:   DORMANT_TEST_MOTO_SERVER, DORMANT_TEST_SSHD as for scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
export DORMANT_TEST_MOTO_SERVER=${DORMANT_TEST_MOTO_SERVER:-$PWD/.venv/bin/moto_server}
export DORMANT_TEST_SSHD=${DORMANT_TEST_SSHD:-/usr/sbin/sshd}
if [ ! -x "$DORMANT_TEST_MOTO_SERVER" ] || [ ! -x "$DORMANT_TEST_SSHD" ]; then
  echo "bench-ec2-calls: needs moto and sshd: run scripts/install-test-deps.sh" >&2
  exit 1
fi
echo "command: scripts/bench-ec2-calls.sh"
cargo test --quiet --all-features --test integration -- \
  --exact ec2_calls::ec2_api_calls_per_transition_are_the_readmes --nocapture --test-threads 1
