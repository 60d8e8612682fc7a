#!/usr/bin/env bash
# Pause benchmark (a script, not a test): what pausing a job costs, on the
# `ssh` provider (a loopback sshd) and on EC2 in `hibernate` mode (moto
# behind the test proxy, the loopback sshd standing in for the instance).
#
# Runs the ignored test `pause_bench::bench_pause` of the integration test
# binary. Per row and run: job A pauses (its script runs `dormant-ask`, or
# `dormant pause` freezes it from the host; a `not paused` row suspends by
# trigger, as the baseline), then job B resumes it by its key and runs
# `dormant-continue`; on EC2 the proxy holds B's StartInstances `pending` for
# P s (default 20 s: the public figure for resuming a hibernated small Linux
# instance) and the "instance" answers SSH only after it. Prints a table:
# the pause, the paused job's suspension (its cleanup), the resume's hold and
# prepare, and from B's first prepare call to the first byte the continued
# script prints after the answer (and that minus the hold: dormant's part).
# The columns are explained in tests/integration/pause_bench.rs.
#
# Usage: scripts/bench-pause.sh [--providers ssh,ec2] [--pending S] [--runs N]
# Env:   DORMANT_TEST_MOTO_SERVER, DORMANT_TEST_SSHD as for scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
PROVIDERS=ssh,ec2 PENDING=20 RUNS=3
while [ $# -gt 0 ]; do
  case "$1" in
    --providers) PROVIDERS=$2; shift 2 ;;
    --pending) PENDING=$2; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    *) echo "bench-pause: unknown argument $1 (see the usage at the top of $0)" >&2; exit 2 ;;
  esac
done
export DORMANT_TEST_MOTO_SERVER=${DORMANT_TEST_MOTO_SERVER:-$PWD/.venv/bin/moto_server}
export DORMANT_TEST_SSHD=${DORMANT_TEST_SSHD:-/usr/sbin/sshd}
if [ ! -x "$DORMANT_TEST_SSHD" ] || { [[ $PROVIDERS == *ec2* ]] && [ ! -x "$DORMANT_TEST_MOTO_SERVER" ]; }; then
  echo "bench-pause: needs sshd (and moto for ec2): run scripts/install-test-deps.sh" >&2
  exit 1
fi
echo "command: scripts/bench-pause.sh --providers $PROVIDERS --pending $PENDING --runs $RUNS ($(nproc) cores, load $(cut -d' ' -f1 /proc/loadavg))"
DORMANT_BENCH_PROVIDERS=$PROVIDERS DORMANT_BENCH_PENDING=$PENDING DORMANT_BENCH_RUNS=$RUNS \
  cargo test --quiet --all-features --test integration -- \
  --ignored --exact pause_bench::bench_pause --nocapture --test-threads 1
