#!/usr/bin/env bash
# Soak of the signal and wrapper tests (a script, not a test): runs them RUNS
# times in a row (default 50) the way a CI agent or a runner started under
# `nohup` runs them — each run under `nohup` as a background job of this
# non-interactive script, so it starts with SIGHUP, SIGINT and SIGQUIT
# ignored, stdin from /dev/null and no terminal — with two busy loops
# (`yes > /dev/null`) beside it on the machine's 2 cores. One line per run,
# then a summary; exit 1 if any run failed (its log is kept and named).
#
# What runs, each time:
#   - lib tests `transport::`: the wrappers (kill $$, traps, QUIT, a signal
#     racing the script's end), the kept output's protocol, the signal reset,
#     the job log's stream, the local transport;
#   - integration tests `signals::`, `hygiene::` and the ssh ones of
#     `reattach::` against the test sshd (not the qemu VM test: one boot per
#     run is the VM suite's job; nor the one that waits out cleanup's minute
#     for an unreachable host, which tests no signal or wrapper).
#
# Usage: scripts/soak-signals.sh [RUNS]
# Env:   DORMANT_TEST_SSHD (default /usr/sbin/sshd).
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-50}
export DORMANT_TEST_SSHD=${DORMANT_TEST_SSHD:-/usr/sbin/sshd}
if [ ! -x "$DORMANT_TEST_SSHD" ]; then
  echo "soak-signals: no sshd at $DORMANT_TEST_SSHD: run scripts/install-test-deps.sh" >&2
  exit 1
fi
# Built once, before the load starts.
cargo test --all-features --no-run --quiet

logs=$(mktemp -d /tmp/soak-signals.XXXXXX)
busy=()
stop() {
  [ ${#busy[@]} -eq 0 ] || kill "${busy[@]}" 2>/dev/null || true
}
trap stop EXIT
for _ in 1 2; do
  yes > /dev/null &
  busy+=($!)
done

failed=0
start=$SECONDS
for i in $(seq 1 "$RUNS"); do
  log=$logs/run-$i.log
  t=$SECONDS
  # `&` in a script without job control: SIGINT and SIGQUIT ignored; nohup
  # adds SIGHUP. The tests must not care.
  nohup bash -c '
    grep -E "^Sig(Ign|Blk)" /proc/self/status
    cargo test --all-features --lib -- transport:: &&
    cargo test --all-features --test integration -- signals:: hygiene:: reattach:: \
      --skip qemu_ --skip a_stage_cleanup_could_not_stop
  ' < /dev/null > "$log" 2>&1 &
  if wait $!; then
    # What the runs start with (SigIgn 0x7: HUP, INT, QUIT ignored).
    [ "$i" -gt 1 ] || grep -E "^Sig(Ign|Blk)" "$log" | sed 's/^/  each run starts with /'
    rm -f "$log"
    result=ok
  else
    failed=$((failed + 1))
    result="FAILED (log: $log)"
  fi
  printf 'run %3d of %d: %4d s  %s\n' "$i" "$RUNS" $((SECONDS - t)) "$result"
done
echo "soak-signals: $((RUNS - failed)) of $RUNS runs passed in $((SECONDS - start)) s, under nohup, beside 2 busy loops"
[ "$failed" -eq 0 ] && rmdir "$logs"
[ "$failed" -eq 0 ]
