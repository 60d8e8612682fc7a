#!/usr/bin/env bash
# The whole test suite, as CI runs it: installs what the tests need, checks
# formatting and lints, then runs every test with every feature on.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-test-deps.sh
export DORMANT_TEST_MOTO_SERVER="$PWD/.venv/bin/moto_server"
export DORMANT_TEST_SSHD=/usr/sbin/sshd
cargo fmt --all -- --check
cargo clippy --all-targets --all-features -- -D warnings
cargo test --all-features
# Builds the .deb from the binary the tests just built and checks it (see the script).
scripts/package.sh --check
