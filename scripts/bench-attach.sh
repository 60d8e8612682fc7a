#!/usr/bin/env bash
# Benchmark of `dormant attach` on the ssh provider, on loopback (a script,
# not a test): how long after the script wrote a line does a watcher print
# it, against the job log itself.
#
# Starts a private sshd on 127.0.0.1, drives one job through the dormant
# binary as GitLab Runner would (config, prepare, one run stage, cleanup) with
# provider = "ssh", and starts `dormant attach <job id>` before the stage. The
# stage prints LINES lines, each carrying the time it was written (bash's
# $EPOCHREALTIME, no exec), 5 ms apart. Each side stamps every line as it
# reads it: the job log (the run stage's stdout, as the runner reads it) and
# the watcher's stdout. Prints the delay's median, p90, p99 and max per side,
# and the stage's own time without and with the watcher (the same stage run
# first alone, then watched).
#
# Usage: scripts/bench-attach.sh [--release] [LINES]   (default 1000 lines, debug build)
# Env:   DORMANT_BIN (use this binary), DORMANT_TEST_SSHD (default /usr/sbin/sshd).
set -euo pipefail
cd "$(dirname "$0")/.."

profile=debug
if [ "${1:-}" = "--release" ]; then profile=release; shift; fi
LINES_N=${1:-1000}
SSHD=${DORMANT_TEST_SSHD:-/usr/sbin/sshd}
if [ ! -x "$SSHD" ]; then
  echo "bench-attach: no sshd at $SSHD: run scripts/install-test-deps.sh" >&2
  exit 1
fi
if [ -n "${DORMANT_BIN:-}" ]; then
  BIN=$DORMANT_BIN
  profile="binary $BIN"
else
  flags=(--no-default-features --quiet)
  [ "$profile" = release ] && flags+=(--release)
  cargo build "${flags[@]}"
  BIN=target/$profile/dormant
  profile="$profile build"
fi
mkdir -p /run/sshd 2>/dev/null || true

work=$(mktemp -d /tmp/dbench.XXXXXX)
sshd_pid= attach_pid=
cleanup() {
  [ -n "$attach_pid" ] && kill "$attach_pid" 2>/dev/null || true
  [ -n "$sshd_pid" ] && kill "$sshd_pid" 2>/dev/null || true
  rm -rf "$work"
}
trap cleanup EXIT

ssh-keygen -q -t ed25519 -N '' -f "$work/host_key"
ssh-keygen -q -t ed25519 -N '' -f "$work/client_key"
cp "$work/client_key.pub" "$work/authorized_keys"
mkdir -p "$work/home" "$work/ws"
port=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
cat > "$work/sshd_config" <<EOF
Port $port
ListenAddress 127.0.0.1
HostKey $work/host_key
PidFile $work/sshd.pid
AuthorizedKeysFile $work/authorized_keys
UsePAM no
PasswordAuthentication no
KbdInteractiveAuthentication no
PermitRootLogin prohibit-password
StrictModes no
MaxSessions 50
LogLevel VERBOSE
SetEnv HOME=$work/home
EOF
"$SSHD" -D -f "$work/sshd_config" -E "$work/sshd.log" </dev/null &
sshd_pid=$!
for _ in $(seq 200); do grep -q "Server listening" "$work/sshd.log" 2>/dev/null && break; sleep 0.02; done

cat > "$work/dormant.toml" <<EOF
provider = "ssh"
runner_id = "1"
system_id = "s_bench0000000"
[ssh]
workspace_root = "$work/ws"
[[ssh.hosts]]
name = "bench"
address = "127.0.0.1"
port = $port
user = "root"
identity_file = "$work/client_key"
EOF

job_id=$((RANDOM + 1000))
tmp="$work/custom-executor"
mkdir -m 700 "$tmp"
printf '{"id":%s,"token":"x","job_info":{"project_id":1,"project_full_path":"g/p"},"variables":[{"key":"CI_RUNNER_ID","value":"1"}]}\n' \
  "$job_id" > "$tmp/response.json"
call() {
  (
    b=$BIN p=$PATH h=$HOME
    for v in $(compgen -e); do unset "$v" 2>/dev/null; done
    export PATH="$p" HOME="$h" TMPDIR="$tmp" \
      DORMANT_CONFIG="$work/dormant.toml" DORMANT_STATE_DIR="$work/state" \
      BUILD_FAILURE_EXIT_CODE=1 SYSTEM_FAILURE_EXIT_CODE=2 \
      BUILD_EXIT_CODE_FILE="$tmp/build_exit_code" JOB_RESPONSE_FILE="$tmp/response.json" \
      CUSTOM_ENV_CI_JOB_ID="$job_id" CUSTOM_ENV_CI_JOB_STATUS="${status:-running}" \
      CUSTOM_ENV_CI_BUILDS_DIR="$builds" CUSTOM_ENV_CI_PROJECT_DIR="$builds/g/p"
    exec "$b" "$@"
  )
}
# Each line read, with the time it was read appended.
stamp() { while IFS= read -r l; do printf '%s %s\n' "$l" "$EPOCHREALTIME"; done; }

builds=
builds=$(call config | python3 -c 'import json,sys; print(json.load(sys.stdin)["builds_dir"])')
call prepare > "$work/prepare.log" 2>&1
{
  printf '#!/usr/bin/env bash\nset -eo pipefail\n'
  printf 'exec 8< <(:); exec 8<>/dev/fd/8\n'
  printf 'for ((i = 1; i <= %s; i++)); do printf "line %%s %%s\\n" "$i" "$EPOCHREALTIME"; read -t 0.005 -u 8 _ || true; done\n' "$LINES_N"
  printf 'exit 0\n'
} > "$tmp/script"
# The same stage without a watcher first, then with one: the job's own time
# must not change (the issue's "timing not changed", measured, not asserted).
t0=$EPOCHREALTIME
call run "$tmp/script" build_script > /dev/null 2> "$work/run0.err"
t1=$EPOCHREALTIME
# The watcher: it waits for the next stage.
call attach "$job_id" 2> "$work/attach.err" | stamp > "$work/attach.lines" &
attach_pid=$!
for _ in $(seq 500); do grep -q "waiting for the next stage" "$work/attach.err" 2>/dev/null && break; sleep 0.01; done
t2=$EPOCHREALTIME
call run "$tmp/script" build_script 2> "$work/run.err" | stamp > "$work/joblog.lines"
t3=$EPOCHREALTIME
status=success
call cleanup > "$work/cleanup.log" 2>&1
wait "$attach_pid" || true
attach_pid=

# delays FILE -> one delay in ms per line
delays() { awk '$1 == "line" { printf "%.3f\n", ($4 - $3) * 1000 }' "$1"; }
# stats -> "n median p90 p99 max"
stats() { sort -n | awk '{ v[NR] = $1 } END { printf "%d %.1f %.1f %.1f %.1f\n", NR, v[int((NR + 1) / 2)], v[int(NR * 0.9 + 0.999)], v[int(NR * 0.99 + 0.999)], v[NR] }'; }
read -r jn jmed j90 j99 jmax < <(delays "$work/joblog.lines" | stats)
read -r an amed a90 a99 amax < <(delays "$work/attach.lines" | stats)
same=$(cut -d' ' -f1-3 "$work/joblog.lines" | cmp -s - <(cut -d' ' -f1-3 "$work/attach.lines") && echo yes || echo NO)

echo
echo "dormant attach benchmark: $LINES_N lines 5 ms apart, one stage on loopback ssh ($profile, $(nproc) cores, load $(cut -d' ' -f1 /proc/loadavg))"
echo
echo "| delay from the script's write to                | lines | median ms | p90 ms | p99 ms | max ms |"
echo "|-------------------------------------------------|------:|----------:|-------:|-------:|-------:|"
printf '| the job log (`dormant run`'"'"'s stdout)             | %5s | %9s | %6s | %6s | %6s |\n' "$jn" "$jmed" "$j90" "$j99" "$jmax"
printf '| a watcher (`dormant attach`'"'"'s stdout)            | %5s | %9s | %6s | %6s | %6s |\n' "$an" "$amed" "$a90" "$a99" "$amax"
echo
echo "the watcher saw the job log's lines, in order, all of them: $same"
awk -v a="$amed" -v b="$jmed" -v c="$a99" -v d="$j99" 'BEGIN { printf "added by attach: median %.1f ms, p99 %.1f ms (goal: at most 50 ms)\n", a - b, c - d }'
awk -v a="$t0" -v b="$t1" -v c="$t2" -v d="$t3" 'BEGIN { printf "the run stage took %.2f s alone and %.2f s with the watcher following (ratio %.3f)\n", b - a, d - c, (d - c) / (b - a) }'
