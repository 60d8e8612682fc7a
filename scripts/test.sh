#!/usr/bin/env bash
# The whole test suite, as CI runs it: installs what the tests need, checks
# formatting and lints, then runs every test with every feature on (real VMs included).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-test-deps.sh
# The qemu provider's tests boot this image (built once, then reused from the cache).
DORMANT_TEST_QEMU_IMAGE="$(scripts/build-test-image.sh | tail -1)"
export DORMANT_TEST_QEMU_IMAGE
export DORMANT_TEST_MOTO_SERVER="$PWD/.venv/bin/moto_server"
export DORMANT_TEST_SSHD=/usr/sbin/sshd
cargo fmt --all -- --check
cargo clippy --all-targets --all-features -- -D warnings
log=$(mktemp)
trap 'rm -f "$log"' EXIT
cargo test --all-features 2>&1 | tee "$log"
# Builds the .deb from the binary the tests just built and checks it (see the script).
scripts/package.sh --check
# One closing line for the whole suite (cargo's last line is the doc tests').
awk '/^test result:/ { p += $4; f += $6 } END { printf "%d passed, %d failed\n", p, f }' "$log"
