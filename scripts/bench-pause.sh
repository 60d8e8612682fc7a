#!/usr/bin/env bash
# Pause benchmark (a script, not a test): what pausing a job costs. Prints a
# table per provider family; the numbers never become assertions in tests.
#
# ssh, ec2: the ignored test `pause_bench::bench_pause` of the integration
# test binary, on the `ssh` provider (a loopback sshd) and on EC2 in
# `hibernate` mode (moto behind the test proxy, the loopback sshd standing in
# for the instance). Per row and run: job A pauses (its script runs
# `dormant-ask`, or `dormant pause` freezes it from the host; a `not paused`
# row suspends by trigger, as the baseline), then job B resumes it by its key
# and runs `dormant-continue`; on EC2 the proxy holds B's StartInstances
# `pending` for P s (default 20 s: the public figure for resuming a
# hibernated small Linux instance) and the "instance" answers SSH only after
# it. Columns: the pause, the paused job's suspension (its cleanup), the
# resume's hold and prepare, and from B's first prepare call to the first
# byte the continued script prints after the answer (and that minus the
# hold: dormant's part); explained in tests/integration/pause_bench.rs.
# ec2-hot: the same on EC2 with a hot window (suspend.hot_for = "10m"): job
# A's cleanup leaves the instance running, B takes it (no StartInstances,
# no hold, the loopback sshd up as a running instance's); the hot row and the
# ec2 (hibernated) row of one run are the issue's "hot vs hibernated".
#
# qemu (hibernate mode), two tables:
#  1. the machine alone, a 1 GiB TCG guest whose RAM holds 768 MiB of random
#     data, no guest OS (scripts/bench-hibernate-methods.py A C): hibernation
#     (save) and restore until the guest runs, the old way (A: the whole
#     memory copied into and out of an image) against the one dormant uses
#     for hibernate-mode VMs (C: RAM in a file, x-ignore-shared), same run;
#     cold rows (page cache dropped) only as root.
#  2. dormant on a real VM (the test image, TCG, 1 GiB), through the built
#     binary driven like GitLab Runner (the ignored test
#     `qemu_pause::bench_pause_and_continue`): one boot, then RUNS rounds of
#     a resumed job answering a paused script with `dormant-continue` from
#     the hibernated VM, the script asking again at once, then RUNS rounds
#     answering it hot (suspend.hot_for = "10m": the VM kept running): the
#     hot and hibernated rows of one run. Per round: from the resuming job's
#     first prepare call to the continued script's first output byte after
#     the answer (goals: hibernated 3 s, hot 1.0 s), the machine restore
#     dormant logs, the resume's prepare, the suspend of the paused job (its
#     cleanup: a hibernation, or none when hot) and the hibernation dormant
#     logs; the first round of each kind also prints where its time went.
#     It takes the machine-wide VM lock.
#
# Usage: scripts/bench-pause.sh [--providers ssh,ec2,ec2-hot,qemu] [--pending S] [--runs N]
#        (default: ssh,ec2,ec2-hot, 20 s, 3 runs; debug build)
# Env:   DORMANT_TEST_MOTO_SERVER, DORMANT_TEST_SSHD, DORMANT_TEST_QEMU_IMAGE
#        as for scripts/test.sh (the qemu image is built if unset).
set -euo pipefail
cd "$(dirname "$0")/.."
PROVIDERS=ssh,ec2,ec2-hot PENDING=20 RUNS=3
while [ $# -gt 0 ]; do
  case "$1" in
    --providers) PROVIDERS=$2; shift 2 ;;
    --pending) PENDING=$2; shift 2 ;;
    --runs) RUNS=$2; shift 2 ;;
    *) echo "bench-pause: unknown argument $1 (see the usage at the top of $0)" >&2; exit 2 ;;
  esac
done
echo "command: scripts/bench-pause.sh --providers $PROVIDERS --pending $PENDING --runs $RUNS ($(nproc) cores, load $(cut -d' ' -f1 /proc/loadavg))"
hosts=$(tr , '\n' <<<"$PROVIDERS" | grep -v '^qemu$' | paste -sd, || true)
if [ -n "$hosts" ]; then
  export DORMANT_TEST_MOTO_SERVER=${DORMANT_TEST_MOTO_SERVER:-$PWD/.venv/bin/moto_server}
  export DORMANT_TEST_SSHD=${DORMANT_TEST_SSHD:-/usr/sbin/sshd}
  if [ ! -x "$DORMANT_TEST_SSHD" ] || { [[ $hosts == *ec2* ]] && [ ! -x "$DORMANT_TEST_MOTO_SERVER" ]; }; then
    echo "bench-pause: needs sshd (and moto for ec2): run scripts/install-test-deps.sh" >&2
    exit 1
  fi
  DORMANT_BENCH_PROVIDERS=$hosts DORMANT_BENCH_PENDING=$PENDING DORMANT_BENCH_RUNS=$RUNS \
    cargo test --quiet --all-features --test integration -- \
    --ignored --exact pause_bench::bench_pause --nocapture --test-threads 1
fi
if [[ ,$PROVIDERS, == *,qemu,* ]]; then
  scripts/bench-hibernate-methods.py A C
  export DORMANT_TEST_QEMU_IMAGE=${DORMANT_TEST_QEMU_IMAGE:-$(scripts/build-test-image.sh | tail -1)}
  DORMANT_BENCH_RUNS=$RUNS cargo test --quiet --all-features --test integration -- \
    --ignored --exact qemu_pause::bench_pause_and_continue --nocapture --test-threads 1
fi
