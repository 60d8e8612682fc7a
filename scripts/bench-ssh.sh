#!/usr/bin/env bash
# Benchmark of the SSH transport on loopback (a script, not a test).
#
# Starts a private sshd on 127.0.0.1 (own host key, own config), then drives
# the dormant binary through one job exactly as GitLab Runner would — config,
# prepare, N run stages (each a new process), cleanup — with provider = "ssh",
# and compares per-stage costs:
#   - dormant run: a whole `dormant run` process re-attaching the job's master;
#   - bare `ssh -S <socket> none true` over that same master;
#   - a fresh `ssh` connection per stage (what most custom executors do).
#
# Usage: scripts/bench-ssh.sh [--release] [STAGES]   (default 10 stages, debug build)
# Env:   DORMANT_BIN (use this binary), DORMANT_TEST_SSHD (default /usr/sbin/sshd),
#        DORMANT_BIN_BASE (another build, e.g. before a change: its `run` is
#        interleaved with the others on the same job, one more row, so both are
#        measured under the same load).
set -euo pipefail
cd "$(dirname "$0")/.."

profile=debug
if [ "${1:-}" = "--release" ]; then profile=release; shift; fi
STAGES=${1:-10}
SSHD=${DORMANT_TEST_SSHD:-/usr/sbin/sshd}
if [ ! -x "$SSHD" ]; then
  echo "bench-ssh: no sshd at $SSHD: run scripts/install-test-deps.sh" >&2
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

# Short paths: the control socket lives under the state dir.
work=$(mktemp -d /tmp/dbench.XXXXXX)
sshd_pid=
cleanup() {
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

# The runner's environment for one call.
job_id=$((RANDOM + 1000))
tmp="$work/custom-executor"
mkdir -m 700 "$tmp"
printf '{"id":%s,"token":"x","job_info":{"project_id":1,"project_full_path":"g/p"},"variables":[{"key":"CI_RUNNER_ID","value":"1"}]}\n' \
  "$job_id" > "$tmp/response.json"
# A subshell that empties its environment with builtins and execs dormant: one
# fork and one exec, like the runner's own spawn (and like the bare ssh below;
# `env -i` would add an exec to dormant's side only).
call() {
  (
    b=${CALL_BIN:-$BIN} p=$PATH h=$HOME
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
now() { date +%s%N; }
ms() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", (b - a) / 1e6 }'; }
# stats FILE -> "median mean min max" in ms
stats() { sort -n "$1" | awk '{ v[NR] = $1; s += $1 } END { m = (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2; printf "%.1f %.1f %.1f %.1f\n", m, s / NR, v[1], v[NR] }'; }

# For the fresh connections below (before counting: it connects once per key type).
ssh-keyscan -p "$port" 127.0.0.1 2>/dev/null > "$work/known_hosts"
builds=
conns_before=$(grep -c "Connection from" "$work/sshd.log" || true)
builds=$(call config | python3 -c 'import json,sys; print(json.load(sys.stdin)["builds_dir"])')
t0=$(now); call prepare > "$work/prepare.log" 2>&1; t1=$(now)
prepare_ms=$(ms "$t0" "$t1")

printf '#!/usr/bin/env bash\ntrap '"'"'exit 1'"'"' TERM\nset -eo pipefail\ntrue\nexit 0\n' > "$tmp/script"
# One warm-up stage (page cache, the master's first session), not counted.
call run "$tmp/script" step_0 >> "$work/run.log" 2>&1
socket=$(ls -d "$work"/state/ctl/*/.ssh-connection*/master | head -1)
# The three kinds interleaved, stage by stage, so a change in the machine's
# load hits them alike (this machine is shared).
: > "$work/run.ms"; : > "$work/bare.ms"; : > "$work/fresh.ms"; : > "$work/base.ms"
for i in $(seq "$STAGES"); do
  t0=$(now); call run "$tmp/script" "step_$i" >> "$work/run.log" 2>&1; t1=$(now)
  ms "$t0" "$t1" >> "$work/run.ms"; echo >> "$work/run.ms"
  if [ -n "${DORMANT_BIN_BASE:-}" ]; then
    t0=$(now); CALL_BIN=$DORMANT_BIN_BASE call run "$tmp/script" "base_$i" >> "$work/run.log" 2>&1; t1=$(now)
    ms "$t0" "$t1" >> "$work/base.ms"; echo >> "$work/base.ms"
  fi
  # Bare ssh over dormant's own master.
  t0=$(now); ssh -S "$socket" -o BatchMode=yes -p 9 none true; t1=$(now)
  ms "$t0" "$t1" >> "$work/bare.ms"; echo >> "$work/bare.ms"
  # A fresh connection per stage, host key already known (the best case for it).
  t0=$(now)
  ssh -F /dev/null -i "$work/client_key" -p "$port" -o BatchMode=yes -o IdentitiesOnly=yes \
    -o UserKnownHostsFile="$work/known_hosts" root@127.0.0.1 true
  t1=$(now)
  ms "$t0" "$t1" >> "$work/fresh.ms"; echo >> "$work/fresh.ms"
done
# Less the fresh connections: what dormant itself opened.
conns_job=$(( $(grep -c "Connection from" "$work/sshd.log") - conns_before - STAGES ))

# Time to the first byte of a stage's output, from the call: a stage shaped
# like the runner's (its exports, mkdir and cd into the project, then the
# command's echo), and one whose very first command prints; each against the
# same script over a bare `ssh -S`. Clock: bash's $EPOCHREALTIME (no exec).
{
  printf '#!/usr/bin/env bash\ntrap '"'"'exit 1'"'"' TERM\nset -eo pipefail\n'
  for n in $(seq 80); do printf "export CI_BENCH_VAR_%s='value number %s of the job'\n" "$n" "$n"; done
  printf 'mkdir -p project\ncd project\necho "$ make"\nexit 0\n'
} > "$tmp/runner_script"
printf '#!/usr/bin/env bash\necho first\nexit 0\n' > "$tmp/echo_script"
first_byte() {
  local t0=$EPOCHREALTIME t1
  { IFS= read -r -n 1 _; t1=$EPOCHREALTIME; cat >/dev/null; } < <("$@" 2>/dev/null)
  awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f\n", (b - a) * 1000 }'
}
: > "$work/ttfb_run.ms"; : > "$work/ttfb_bare.ms"; : > "$work/ttfb_echo_run.ms"; : > "$work/ttfb_echo_bare.ms"
for i in $(seq "$STAGES"); do
  first_byte call run "$tmp/runner_script" "first_$i" >> "$work/ttfb_run.ms"
  first_byte ssh -S "$socket" -o BatchMode=yes -p 9 none bash -s < "$tmp/runner_script" >> "$work/ttfb_bare.ms"
  first_byte call run "$tmp/echo_script" "echo_$i" >> "$work/ttfb_echo_run.ms"
  first_byte ssh -S "$socket" -o BatchMode=yes -p 9 none bash -s < "$tmp/echo_script" >> "$work/ttfb_echo_bare.ms"
  if [ -n "${DORMANT_BIN_BASE:-}" ]; then
    CALL_BIN=$DORMANT_BIN_BASE first_byte call run "$tmp/runner_script" "bfirst_$i" >> "$work/ttfb_base.ms"
    CALL_BIN=$DORMANT_BIN_BASE first_byte call run "$tmp/echo_script" "becho_$i" >> "$work/ttfb_echo_base.ms"
  fi
done

status=success
t0=$(now); call cleanup > "$work/cleanup.log" 2>&1; t1=$(now)
cleanup_ms=$(ms "$t0" "$t1")

read -r run_med run_mean run_min run_max < <(stats "$work/run.ms")
read -r bare_med bare_mean bare_min bare_max < <(stats "$work/bare.ms")
read -r fresh_med fresh_mean fresh_min fresh_max < <(stats "$work/fresh.ms")
read -r tr_med tr_mean tr_min tr_max < <(stats "$work/ttfb_run.ms")
read -r tb_med tb_mean tb_min tb_max < <(stats "$work/ttfb_bare.ms")
read -r er_med er_mean er_min er_max < <(stats "$work/ttfb_echo_run.ms")
read -r eb_med eb_mean eb_min eb_max < <(stats "$work/ttfb_echo_bare.ms")
overhead=$(awk -v a="$run_med" -v b="$bare_med" 'BEGIN { printf "%.1f", a - b }')
ratio=$(awk -v a="$run_med" -v b="$bare_med" 'BEGIN { printf "%.2f", a / b }')
ratio_mean=$(awk -v a="$run_mean" -v b="$bare_mean" 'BEGIN { printf "%.2f", a / b }')
total() { awk -v m="$1" -v n="$STAGES" 'BEGIN { printf "%.0f", m * n }'; }

echo
echo "dormant SSH benchmark: $STAGES run stages on loopback ($profile, $(ssh -V 2>&1 | cut -d, -f1), $(nproc) cores)"
echo
echo "| per stage                                   | median ms | mean ms | min ms | max ms | $STAGES stages ms |"
echo "|---------------------------------------------|----------:|--------:|-------:|-------:|------------:|"
printf '| `dormant run` over the reused master        | %9s | %7s | %6s | %6s | %11s |\n' "$run_med" "$run_mean" "$run_min" "$run_max" "$(total "$run_mean")"
printf '| bare `ssh -S <socket> none true`            | %9s | %7s | %6s | %6s | %11s |\n' "$bare_med" "$bare_mean" "$bare_min" "$bare_max" "$(total "$bare_mean")"
printf '| fresh `ssh host true` per stage             | %9s | %7s | %6s | %6s | %11s |\n' "$fresh_med" "$fresh_mean" "$fresh_min" "$fresh_max" "$(total "$fresh_mean")"
if [ -n "${DORMANT_BIN_BASE:-}" ]; then
  read -r b_med b_mean b_min b_max < <(stats "$work/base.ms")
  printf '| `dormant run`, base build                   | %9s | %7s | %6s | %6s | %11s |\n' "$b_med" "$b_mean" "$b_min" "$b_max" "$(total "$b_mean")"
fi
echo
echo "| first output byte                           | median ms | mean ms | min ms | max ms |"
echo "|---------------------------------------------|----------:|--------:|-------:|-------:|"
printf '| runner-shaped stage: `dormant run`          | %9s | %7s | %6s | %6s |\n' "$tr_med" "$tr_mean" "$tr_min" "$tr_max"
printf '| runner-shaped stage: bare `ssh -S … bash -s`| %9s | %7s | %6s | %6s |\n' "$tb_med" "$tb_mean" "$tb_min" "$tb_max"
printf '| `echo` first: `dormant run`                 | %9s | %7s | %6s | %6s |\n' "$er_med" "$er_mean" "$er_min" "$er_max"
printf '| `echo` first: bare `ssh -S … bash -s`       | %9s | %7s | %6s | %6s |\n' "$eb_med" "$eb_mean" "$eb_min" "$eb_max"
if [ -n "${DORMANT_BIN_BASE:-}" ]; then
  read -r x_med x_mean x_min x_max < <(stats "$work/ttfb_base.ms")
  printf '| runner-shaped stage: base build             | %9s | %7s | %6s | %6s |\n' "$x_med" "$x_mean" "$x_min" "$x_max"
  read -r x_med x_mean x_min x_max < <(stats "$work/ttfb_echo_base.ms")
  printf '| `echo` first: base build                    | %9s | %7s | %6s | %6s |\n' "$x_med" "$x_mean" "$x_min" "$x_max"
fi
echo
echo "dormant's own overhead per stage over the bare multiplexed channel (medians): $overhead ms"
echo "dormant run / bare ssh -S: ${ratio}x (medians), ${ratio_mean}x (means); load average at the end: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "prepare (workspace, first handshake, host key pinned, probes): $prepare_ms ms; cleanup (release, close): $cleanup_ms ms"
echo "SSH connections dormant opened for the whole job (prepare + $((STAGES + 1)) stages): $conns_job; reconnects: $(grep -c reconnecting "$work/run.log" || true)"
