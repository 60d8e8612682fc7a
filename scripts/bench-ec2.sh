#!/usr/bin/env bash
# EC2 prepare benchmark (a script, not a test): prepare's time and EC2 calls
# for a new environment and a resume, in machine and volume mode, when EC2
# takes its time.
#
# Runs the ignored test `ec2_bench::bench_ec2_prepare` of the integration
# test binary: moto's EC2 emulator behind the recording proxy, which holds
# every new or started instance `pending` for P s and every attached volume
# `attaching` for A s (defaults 20 s and 2 s: public figures for small Linux
# instances), and a loopback sshd standing in for the instance that answers
# when its pending hold ends. Each row: a setup job without holds (a resume
# row makes and suspends its environment), then RUNS measured jobs through
# the built binary as GitLab Runner runs them. Prints a table: the holds the
# row must sit through, prepare's wall time (median), the difference
# (dormant's own time), and the EC2 calls prepare made (counted by the
# proxy). Rows are listed in tests/integration/ec2_bench.rs (`Case`); a new
# row is a new case there and its id here.
#
# Usage: scripts/bench-ec2.sh [--rows ID,ID,...] [--pending S] [--attaching S] [--runs N]
#        rows: new-machine, new-volume, resume-machine, resume-volume, new-machine-warm,
#              resume-volume-warm, new-volume-warm (a warm instance, `[ec2] warm = 1`, ready
#              before the job) (default: all)
# Env:   DORMANT_TEST_MOTO_SERVER, DORMANT_TEST_SSHD as for scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
ROWS= PENDING=20 ATTACHING=2 RUNS=1
while [ $# -gt 0 ]; do
  case "$1" in
    --rows) ROWS=$2; shift 2 ;;
    --pending) PENDING=$2; shift 2 ;;
    --attaching) ATTACHING=$2; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    *) echo "bench-ec2: unknown argument $1 (see the usage at the top of $0)" >&2; exit 2 ;;
  esac
done
export DORMANT_TEST_MOTO_SERVER=${DORMANT_TEST_MOTO_SERVER:-$PWD/.venv/bin/moto_server}
export DORMANT_TEST_SSHD=${DORMANT_TEST_SSHD:-/usr/sbin/sshd}
if [ ! -x "$DORMANT_TEST_MOTO_SERVER" ] || [ ! -x "$DORMANT_TEST_SSHD" ]; then
  echo "bench-ec2: needs moto and sshd: run scripts/install-test-deps.sh" >&2
  exit 1
fi
echo "command: scripts/bench-ec2.sh${ROWS:+ --rows $ROWS} --pending $PENDING --attaching $ATTACHING --runs $RUNS ($(nproc) cores, load $(cut -d' ' -f1 /proc/loadavg))"
DORMANT_BENCH_ROWS=$ROWS DORMANT_BENCH_PENDING=$PENDING DORMANT_BENCH_ATTACHING=$ATTACHING \
DORMANT_BENCH_RUNS=$RUNS cargo test --quiet --all-features --test integration -- \
  --ignored --exact ec2_bench::bench_ec2_prepare --nocapture --test-threads 1
