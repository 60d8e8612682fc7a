#!/usr/bin/env bash
# Benchmark of resume and suspend latency (a script, not a test).
#
# Runs the ignored test `ec2_resume::bench_resume_and_suspend` of the
# integration test binary: moto's EC2 emulator behind the recording proxy,
# which holds every StartInstances `pending` for H s (every StopInstances
# `stopping` for 5 s), and a loopback sshd standing in for the instance that
# comes up D s after StartInstances. Each row resumes the same suspended
# environment RUNS times through the built binary, as GitLab Runner would,
# and prints the limit (when SSH could first log in), when prepare finished,
# and the difference (median and max). CI does not run it (it is #[ignore]d).
#
# Usage: scripts/bench-resume.sh [RUNS]   (default 5; debug build of the binary)
# Env:   DORMANT_TEST_MOTO_SERVER, DORMANT_TEST_SSHD as for scripts/test.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-5}
export DORMANT_TEST_MOTO_SERVER=${DORMANT_TEST_MOTO_SERVER:-$PWD/.venv/bin/moto_server}
export DORMANT_TEST_SSHD=${DORMANT_TEST_SSHD:-/usr/sbin/sshd}
if [ ! -x "$DORMANT_TEST_MOTO_SERVER" ] || [ ! -x "$DORMANT_TEST_SSHD" ]; then
  echo "bench-resume: needs moto and sshd: run scripts/install-test-deps.sh" >&2
  exit 1
fi
echo "command: scripts/bench-resume.sh $RUNS ($(nproc) cores, load $(cut -d' ' -f1 /proc/loadavg))"
DORMANT_BENCH_RUNS=$RUNS cargo test --quiet --all-features --test integration -- \
  --ignored --exact ec2_resume::bench_resume_and_suspend --nocapture --test-threads 1
