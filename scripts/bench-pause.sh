#!/usr/bin/env bash
# Benchmark of pausing a job on qemu in hibernate mode (a script, not a test;
# issue 31's "Measured"). Prints two tables:
#
#  1. the machine alone, a 1 GiB TCG guest whose RAM holds 768 MiB of random
#     data, no guest OS (scripts/bench-hibernate-methods.py A C): hibernation
#     (save) and restore until the guest runs, the old way (A: the whole
#     memory copied into and out of an image) against the one dormant uses
#     for hibernate-mode VMs (C: RAM in a file, x-ignore-shared), same run;
#     cold rows (page cache dropped) only as root.
#  2. dormant on a real VM (the test image, TCG, 1 GiB), through the built
#     binary driven like GitLab Runner (the ignored test
#     `qemu_pause::bench_pause_and_continue`): one boot, then RUNS rounds of
#     a resumed job answering a paused script with `dormant-continue`, the
#     script asking again at once. Per round: from the resuming job's first
#     prepare call to the continued script's first output byte after the
#     answer (goal: 3 s), the machine restore dormant logs, the resume's
#     prepare, the suspend of the paused job (its cleanup: a hibernation)
#     and the hibernation dormant logs. It takes the machine-wide VM lock.
#
# Usage: scripts/bench-pause.sh [RUNS]   (default 3; debug build)
# Env:   DORMANT_TEST_QEMU_IMAGE as for scripts/test.sh (else the image is built).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-3}
echo "command: scripts/bench-pause.sh $RUNS ($(nproc) cores, load $(cut -d' ' -f1 /proc/loadavg))"
scripts/bench-hibernate-methods.py A C
export DORMANT_TEST_QEMU_IMAGE=${DORMANT_TEST_QEMU_IMAGE:-$(scripts/build-test-image.sh | tail -1)}
DORMANT_BENCH_RUNS=$RUNS cargo test --quiet --all-features --test integration -- \
  --ignored --exact qemu_pause::bench_pause_and_continue --nocapture --test-threads 1
