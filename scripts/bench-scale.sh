#!/usr/bin/env bash
# Benchmark (not a test): what the operator commands and a job's cleanup cost
# with 100, 1,000 and 10,000 suspended environments in the registry (local
# provider). The environments are copies of one real suspended environment's
# record (fresh ids); every command runs on the same state dir. Prints a
# Markdown table of medians. Usage:
#   scripts/bench-scale.sh [SIZES...]            # default: 100 1000 10000
#   DORMANT_BIN=target/release/dormant scripts/bench-scale.sh
#   OLD_BIN=/path/to/an/older/dormant scripts/bench-scale.sh   # adds its cleanup column
# cleanup: a job's prepare (a new environment), then its cleanup timed alone
# (the release of its own environment and the end-of-job sweep); RUNS times.
set -euo pipefail
cd "$(dirname "$0")/.."
BIN=${DORMANT_BIN:-target/debug/dormant}
[ -x "$BIN" ] || cargo build --quiet
OLD_BIN=${OLD_BIN:-}
RUNS=${RUNS:-5}
SIZES=("$@")
[ ${#SIZES[@]} -gt 0 ] || SIZES=(100 1000 10000)
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
export JOB_RESPONSE_FILE=$tmp/response.json DORMANT_CONFIG=$tmp/settings.toml
printf 'system_id = "s_bench"\nrunner_system_id_file = "/nonexistent"\n' >"$DORMANT_CONFIG"

payload() { # job-id [suspend]
  local opts=''
  [ "${2:-}" = suspend ] && opts=', "suspend_options": {"suspend_on_success": true}'
  echo "{\"id\": $1, \"job_info\": {\"project_id\": 2}, \"variables\": [{\"key\": \"CI_RUNNER_ID\", \"value\": \"1\"}]$opts}" >"$JOB_RESPONSE_FILE"
}

ms() { # command...: wall time in ms (3 decimals)
  local s e
  s=$(date +%s%N)
  "$@" >/dev/null 2>&1
  e=$(date +%s%N)
  echo "$(((e - s) / 1000))" | awk '{printf "%.1f", $1 / 1000}'
}

median() { sort -n | awk '{a[NR]=$1} END {print a[int((NR+1)/2)]}'; }

# state dir, N: N suspended environments, copies of one made by a real job.
populate() {
  local state=$1 n=$2
  DORMANT_STATE_DIR=$state payload 1 suspend
  DORMANT_STATE_DIR=$state "$BIN" prepare >/dev/null 2>&1
  CUSTOM_ENV_CI_JOB_STATUS=success DORMANT_STATE_DIR=$state "$BIN" cleanup >/dev/null 2>&1
  python3 - "$state" "$n" <<'EOF'
import os, sys, uuid
state, n = sys.argv[1], int(sys.argv[2])
envs = os.path.join(state, "environments")
(template_id,) = [d for d in os.listdir(envs) if not d.startswith(".")]
text = open(os.path.join(envs, template_id, "record.json")).read()
for _ in range(n - 1):
    new = str(uuid.uuid4())
    d = os.path.join(envs, new)
    os.mkdir(d, 0o700)
    with open(os.path.join(d, "record.json"), "w") as f:
        f.write(text.replace(template_id, new))
    os.chmod(os.path.join(d, "record.json"), 0o600)
EOF
}

# bin, state: median ms of RUNS cleanups (each after its own prepare).
cleanups() {
  local bin=$1 state=$2 job
  for i in $(seq "$RUNS"); do
    job=$((1000 + RANDOM * 10 + i))
    payload "$job"
    DORMANT_STATE_DIR=$state "$bin" prepare >/dev/null 2>&1
    CUSTOM_ENV_CI_JOB_STATUS=success DORMANT_STATE_DIR=$state ms "$bin" cleanup
    echo
  done | median
}

op() { # state, args...: median ms of RUNS runs
  local state=$1
  shift
  for _ in $(seq "$RUNS"); do
    DORMANT_STATE_DIR=$state ms "$BIN" "$@"
    echo
  done | median
}

echo "binary: $BIN ($(du -h "$BIN" | cut -f1)), $(nproc) cores, median of $RUNS runs, ms"
if [ -n "$OLD_BIN" ]; then
  echo "| suspended environments | cleanup | cleanup, $OLD_BIN | list | metrics | sweep |"
  echo "|---:|---:|---:|---:|---:|---:|"
else
  echo "| suspended environments | cleanup | list | metrics | sweep |"
  echo "|---:|---:|---:|---:|---:|"
fi
for n in "${SIZES[@]}"; do
  state=$tmp/state-$n
  populate "$state" "$n"
  count=$(find "$state/environments" -mindepth 1 -maxdepth 1 -type d ! -name '.*' | wc -l)
  [ "$count" -eq "$n" ] || { echo "bench-scale: $count environments, not $n" >&2; exit 1; }
  c=$(cleanups "$BIN" "$state")
  old=''
  [ -z "$OLD_BIN" ] || old=" $(cleanups "$OLD_BIN" "$state") |"
  # The first metrics run counts the whole event log; later runs only what is new.
  DORMANT_STATE_DIR=$state "$BIN" metrics >/dev/null
  l=$(op "$state" list)
  m=$(op "$state" metrics)
  s=$(op "$state" sweep)
  left=$(find "$state/environments" -mindepth 1 -maxdepth 1 -type d ! -name '.*' | wc -l)
  [ "$left" -eq "$n" ] || { echo "bench-scale: the runs lost environments ($left of $n)" >&2; exit 1; }
  echo "| $n | $c |$old $l | $m | $s |"
done
