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
cargo test --all-features --lib --bins 2>&1 | tee "$log"
# The integration binary reports each test's time (libtest's --report-time, an
# unstable option: RUSTC_BOOTSTRAP is set for the test binary only, through the
# target runner, so nothing is rebuilt), summed per group (the test's module)
# at the end.
host=$(rustc -vV | sed -n 's/^host: //p' | tr 'a-z-' 'A-Z_')
env "CARGO_TARGET_${host}_RUNNER=env RUSTC_BOOTSTRAP=1" \
  cargo test --all-features --test integration -- -Z unstable-options --report-time 2>&1 | tee -a "$log"
cargo test --all-features --doc 2>&1 | tee -a "$log"
# Builds the .deb from the binary the tests just built and checks it (see the script).
scripts/package.sh --check
# Each integration group's time: the sum of its tests' times (they run in
# parallel, so the groups' sum exceeds the wall time), longest first.
echo "integration groups (sum of their tests' times):"
awk '/^test [^ ]+ \.\.\. .* <[0-9.]+s>$/ {
       g = $2; sub(/::.*/, "", g); t = $NF; gsub(/[<>s]/, "", t); sum[g] += t; n[g]++ }
     END { for (k in sum) printf "  %-28s %4d test(s) %9.1f s\n", k, n[k], sum[k] }' "$log" | sort -k4 -rn
# One closing line for the whole suite (cargo's last line is the doc tests').
awk '/^test result:/ { p += $4; f += $6 } END { printf "%d passed, %d failed\n", p, f }' "$log"
