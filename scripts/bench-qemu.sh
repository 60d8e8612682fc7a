#!/usr/bin/env bash
# Benchmarks the qemu provider against the bare machine, on the test image
# (scripts/build-test-image.sh), and prints a table:
#
#   new environment     machine: QEMU start to the guest's SSH banner
#                       dormant: prepare (overlay, seed, boot, SSH login, probes)
#   resume (shutdown)   machine: boot of the same disk again to the banner
#                       dormant: prepare of the resuming job
#   resume (hibernate)  machine: restore of the saved memory to the banner
#                       dormant: prepare of the resuming job (restore, clock, login)
#   suspend             machine: ACPI power-off to QEMU's exit / stop+save+quit
#                       dormant: cleanup of the suspending job
#   new environment,    dormant: prepare of a new job that takes a warm VM
#   warm (warm = 1)     (`dormant warm` booted it before the job; not timed)
#   volume-mode resume, dormant: prepare of a resuming job that takes a warm VM
#   warm (warm = 1)     (job 1 took one too; its refill booted the next before job 2)
#   a warm VM held      what one idle warm VM holds, printed below the table: its
#   (ROWS=all|held)     QEMU's resident memory (`ps -o rss`) and its directory's
#                       allocated bytes on disk (overlay, seed, key), HELD_IDLE s
#                       (default 240) after `dormant warm` booted it
#   volume mode         resume  machine: a new overlay, boot to the banner, the data disk hot-plugged
#   (storage="volume")          dormant: prepare of the resuming job (new VM, attach, mount)
#                       suspend machine: QMP quit to QEMU's exit, the overlay deleted
#                               dormant: cleanup (guest sync+unmount, quit, VM deleted)
#
# The machine rows run QEMU by hand with the command line dormant uses; the
# dormant rows run `dormant try` (two whole jobs per mode). Everything stays on
# 127.0.0.1 (the guest's own network is restricted). Under TCG the absolute
# numbers are slow; dormant's added time is the figure that counts.
#
# Usage: [ROWS=new|warm|volume|held] [HELD_IDLE=S] scripts/bench-qemu.sh [runs]   (DORMANT_BIN=target/release/dormant for a release build;
#        QEMU_ACCEL=kvm where KVM works)
set -euo pipefail
cd "$(dirname "$0")/.."
RUNS=${1:-1}
# ROWS=new: only the new-environment rows (cold and warm; a shorter run).
# ROWS=warm: the rows a warm pool changes: new environment and volume-mode
# resume, each cold and warm. ROWS=volume: the volume-mode resume rows only.
# ROWS=held: only what an idle warm VM holds (no table rows).
ROWS=${ROWS:-all}
case $ROWS in all|new|warm|volume|held) ;; *) echo "bench-qemu: ROWS is all, new, warm, volume or held, not '$ROWS'" >&2; exit 2 ;; esac
HELD_IDLE=${HELD_IDLE:-240}
ACCEL=${QEMU_ACCEL:-tcg}
BIN=${DORMANT_BIN:-target/debug/dormant}
[ -x "$BIN" ] || cargo build --quiet
IMG=$(scripts/build-test-image.sh | tail -1)
# One VM at a time on the machine: the same lock file the VM tests take
# (tests/integration/qemu.rs, one_vm), so a suite running beside the
# benchmark waits instead of halving both VMs' CPU.
exec 9>"${TMPDIR:-/tmp}/dormant-tests-one-vm.lock"
flock 9
# Short: a VM's QMP socket path (<state dir>/environments/<id>/vm/qmp.sock)
# must fit in 107 bytes.
work=$(mktemp -d /tmp/dbq.XXXXXX)
cleanup() { # the bench's own QEMU, by its pidfile, if it still runs
  local pid; pid=$(cat "$work/qemu.pid" 2>/dev/null || true)
  if [ -n "$pid" ] && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q "dormant-bench-$$"; then
    kill -KILL "$pid" || true
  fi
  rm -rf "$work"
}
trap cleanup EXIT
now() { date +%s.%N; }
secs() { python3 -c "print(f'{$2 - $1:.1f}')"; }

# --- the bare machine -------------------------------------------------------
qmp() { # qmp SOCKET COMMAND [ARGS-JSON]: runs one QMP command, prints its return value
  python3 - "$@" <<'EOF'
import json, socket, sys
s = socket.socket(socket.AF_UNIX); s.connect(sys.argv[1]); f = s.makefile("rw")
f.readline()
def run(cmd, args=None):
    msg = {"execute": cmd}
    if args: msg["arguments"] = json.loads(args)
    f.write(json.dumps(msg) + "\n"); f.flush()
    while True:
        line = f.readline()
        if not line: return None
        r = json.loads(line)
        if "event" in r: continue
        return r
run("qmp_capabilities")
print(json.dumps(run(sys.argv[2], sys.argv[3] if len(sys.argv) > 3 else None)))
EOF
}
wait_banner() { # wait_banner PORT: polls until the guest's sshd sends its banner
  while :; do
    b=$(timeout 3 bash -c "exec 3<>/dev/tcp/127.0.0.1/$1; head -c 4 <&3" 2>/dev/null || true)
    [ "$b" = "SSH-" ] && return 0
    sleep 0.2
  done
}
wait_exit() { while kill -0 "$1" 2>/dev/null; do sleep 0.05; done; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }

cpu=qemu64; accel="tcg,thread=multi"
[ "$ACCEL" = kvm ] && { cpu=host; accel=kvm; }
start_vm() { # start_vm PORT [EXTRA...]: the command line the qemu provider builds (src/provider/qemu/vm.rs)
  local port=$1; shift
  qemu-system-x86_64 -name "dormant-bench-$$" -machine q35 -accel "$accel" -cpu "$cpu" -smp 2 -m 1024 \
    -nodefaults -display none -chardev "file,id=console,path=$work/console.log,append=on" \
    -serial chardev:console -qmp "unix:$work/qmp.sock,server=on,wait=off" -pidfile "$work/qemu.pid" \
    -daemonize -kernel "$IMG/vmlinuz" -initrd "$IMG/initrd.img" -append "root=/dev/vda rw console=ttyS0 quiet" \
    -drive "file=$work/overlay.qcow2,if=virtio,format=qcow2" \
    -netdev "user,id=net0,restrict=on,hostfwd=tcp:127.0.0.1:$port-:22" -device virtio-net-pci,netdev=net0 \
    -drive "file=$work/seed.iso,if=virtio,format=raw,readonly=on" \
    -device pcie-root-port,id=dormant-data-port,chassis=1,slot=1,bus=pcie.0,addr=0x10 "$@"
}
# Volume mode's data disk, hot-plugged into the root port as
# src/provider/qemu/hotplug.rs does it.
plug_data_disk() {
  local r cmd args
  for cmd in blockdev-add device_add; do
    case $cmd in
      blockdev-add) args="{\"driver\": \"qcow2\", \"node-name\": \"dormant-data\", \"file\": {\"driver\": \"file\", \"filename\": \"$work/data.qcow2\"}}" ;;
      device_add) args='{"driver": "virtio-blk-pci", "id": "dormant-data-disk", "drive": "dormant-data", "serial": "dormant-data", "bus": "dormant-data-port"}' ;;
    esac
    r=$(qmp "$work/qmp.sock" "$cmd" "$args")
    [ "$r" = '{"return": {}}' ] || { echo "bench-qemu: QMP $cmd answered $r" >&2; exit 1; }
  done
}

declare -A M D
# expect_taken STATE CONFIG N OUTPUT: the try's jobs took N warm VMs (the
# pool's `warm taken` events), else the row would time a cold boot.
expect_taken() {
  local n
  n=$(DORMANT_STATE_DIR=$1 "$BIN" --config "$2" events --json |
    python3 -c 'import json,sys; print(sum(1 for l in sys.stdin if l.strip() and (e:=json.loads(l))["event"]=="warm" and e["cause"]=="taken"))')
  [ "$n" = "$3" ] || { echo "$4" >&2; echo "bench-qemu: the jobs took $n warm VM(s), not $3" >&2; exit 1; }
}
# empty_pool STATE CONFIG: lets a detached refill finish, then retires every
# warm VM (warm = 0, sweep) and deletes the state dir.
empty_pool() {
  local i
  for i in $(seq 900); do flock -n "$1/warm/refill.lock" true 2>/dev/null && break; sleep 1; done
  [ "$i" -lt 900 ] || { echo "bench-qemu: the refill in $1 still runs after 15 min" >&2; exit 1; }
  sed -i 's/^warm = 1/warm = 0/' "$2"
  DORMANT_STATE_DIR=$1 "$BIN" --config "$2" sweep >/dev/null 2>&1
  rm -rf "$1"
}
# held STATE: after HELD_IDLE s idle, the resident KiB of the pool's one
# warm VM's QEMU (its pidfile in the pool) and its entry's allocated bytes.
declare -a HELD_RSS HELD_DISK
held() {
  local pidfile
  sleep "$HELD_IDLE"
  pidfile=$(ls "$1"/warm/*/vm/qemu.pid)
  [ "$(echo "$pidfile" | wc -l)" = 1 ] || { echo "bench-qemu: not one warm VM in $1/warm: $pidfile" >&2; exit 1; }
  HELD_RSS+=("$(ps -o rss= -p "$(cat "$pidfile")" | tr -d ' ')")
  HELD_DISK+=("$(du -s --block-size=1 "$(dirname "$(dirname "$pidfile")")" | cut -f1)")
}
for run in $(seq 1 "$RUNS"); do
  if [ "$ROWS" = held ]; then
    # The dormant rows' settings, with one warm VM.
    cat >"$work/held.toml" <<EOF
provider = "qemu"
system_id = "s_bench"
runner_system_id_file = "/nonexistent"
[qemu]
accel = "$ACCEL"
cpus = 2
memory_mib = 1024
restrict_network = true
boot_timeout = "10m"
max_environments = 2
warm = 1
image = { disk = "$IMG/base.qcow2", kernel = "$IMG/vmlinuz", initrd = "$IMG/initrd.img" }
EOF
    st="$work/h$run"
    DORMANT_STATE_DIR=$st "$BIN" --config "$work/held.toml" warm >/dev/null 2>&1 || {
      echo "bench-qemu: dormant warm failed (held)" >&2; exit 1; }
    held "$st"
    empty_pool "$st" "$work/held.toml"
    continue
  fi
  rm -f "$work"/overlay.qcow2 "$work"/state
  ssh-keygen -q -t ed25519 -N "" -f "$work/key" <<<y >/dev/null
  printf '#cloud-config\nssh_authorized_keys:\n  - %s\n' "$(cat "$work/key.pub")" >"$work/user-data"
  printf 'instance-id: bench-%s\n' "$run" >"$work/meta-data"
  genisoimage -quiet -output "$work/seed.iso" -volid cidata -joliet -rock "$work/user-data" "$work/meta-data"
  qemu-img create -q -f qcow2 -b "$IMG/base.qcow2" -F qcow2 "$work/overlay.qcow2"
  port=$(free_port)
  t0=$(now); start_vm "$port"; wait_banner "$port"; t1=$(now)
  M[new]+="$(secs "$t0" "$t1") "
  pid=$(cat "$work/qemu.pid")
  if [ "$ROWS" != all ]; then
    qmp "$work/qmp.sock" quit >/dev/null || true; wait_exit "$pid"
  fi
  if [ "$ROWS" = all ]; then
  t0=$(now); qmp "$work/qmp.sock" system_powerdown >/dev/null; wait_exit "$pid"; t1=$(now)
  M[shutdown]+="$(secs "$t0" "$t1") "
  t0=$(now); start_vm "$port"; wait_banner "$port"; t1=$(now)
  M[boot]+="$(secs "$t0" "$t1") "
  pid=$(cat "$work/qemu.pid")
  t0=$(now)
  qmp "$work/qmp.sock" stop >/dev/null
  qmp "$work/qmp.sock" migrate "{\"uri\": \"file:$work/state\"}" >/dev/null
  until qmp "$work/qmp.sock" query-migrate | grep -q '"completed"'; do sleep 0.05; done
  qmp "$work/qmp.sock" quit >/dev/null || true; wait_exit "$pid"; t1=$(now)
  M[hibernate]+="$(secs "$t0" "$t1") "
  t0=$(now); start_vm "$port" -incoming "file:$work/state"
  # The saved VM was paused: it loads paused and needs `cont`.
  until qmp "$work/qmp.sock" query-status | grep -q '"status": "paused"\|"status": "running"'; do sleep 0.05; done
  qmp "$work/qmp.sock" cont >/dev/null; wait_banner "$port"; t1=$(now)
  M[restore]+="$(secs "$t0" "$t1") "
  pid=$(cat "$work/qemu.pid"); qmp "$work/qmp.sock" quit >/dev/null || true; wait_exit "$pid"
  fi
  if [ "$ROWS" != new ]; then

  # Volume mode by hand: a resume is a new overlay booted to the banner, then
  # the data disk hot-plugged (the guest's mount is dormant's side).
  rm -f "$work/data.qcow2" "$work/overlay.qcow2"
  qemu-img create -q -f qcow2 "$work/data.qcow2" 1G
  t0=$(now); qemu-img create -q -f qcow2 -b "$IMG/base.qcow2" -F qcow2 "$work/overlay.qcow2"
  start_vm "$port"; wait_banner "$port"; plug_data_disk; t1=$(now)
  M[resume-volume]+="$(secs "$t0" "$t1") "
  pid=$(cat "$work/qemu.pid")
  t0=$(now); qmp "$work/qmp.sock" quit >/dev/null || true; wait_exit "$pid"; rm -f "$work/overlay.qcow2"; t1=$(now)
  M[suspend-volume]+="$(secs "$t0" "$t1") "
  rm -f "$work/data.qcow2"
  fi

  # --- dormant, in the same run (so both sides see the same machine load) ----
  modes="shutdown hibernate volume"
  [ "$ROWS" = new ] && modes=shutdown
  [ "$ROWS" = warm ] && modes="shutdown volume"
  [ "$ROWS" = volume ] && modes=volume
  for mode in $modes; do
    storage=machine suspend_mode=$mode
    [ "$mode" = volume ] && { storage=volume; suspend_mode=shutdown; }
    cat >"$work/dormant.toml" <<EOF
provider = "qemu"
system_id = "s_bench"
runner_system_id_file = "/nonexistent"
prepare_timeout = "15m"
[qemu]
accel = "$ACCEL"
cpus = 2
memory_mib = 1024
restrict_network = true
boot_timeout = "10m"
suspend_mode = "$suspend_mode"
storage = "$storage"
volume_size = "1G"
image = { disk = "$IMG/base.qcow2", kernel = "$IMG/vmlinuz", initrd = "$IMG/initrd.img" }
EOF
    out=$(DORMANT_STATE_DIR="$work/${mode:0:1}$run" "$BIN" --config "$work/dormant.toml" try 2>&1) || {
      echo "$out" >&2; echo "bench-qemu: dormant try failed ($mode)" >&2; exit 1; }
    # "  prepare#1   exit   0    45.123 s" — job 1's prepare and cleanup, then job 2's prepare.
    p1=$(echo "$out" | awk '/^  prepare#/ {print $4; exit}')
    c1=$(echo "$out" | awk '/^job 2/ {exit} /^  cleanup#/ {v=$4} END {print v}')
    p2=$(echo "$out" | awk '/^job 2/ {j=1} j && /^  prepare#/ {print $4; exit}')
    [ "$mode" = shutdown ] && D[new]+="$p1 "
    D["resume-$mode"]+="$p2 "
    D["suspend-$mode"]+="$c1 "
    rm -rf "${work:?}/${mode:0:1}$run"
  done

  # A new environment on a warm VM: `dormant warm` boots it first (not
  # timed); job 1's prepare takes it. Its detached refill boots the next one
  # while the job runs; the pool is emptied (warm = 0, sweep) before the next run.
  sed -e 's/^storage = .*/storage = "machine"/' -e 's/^suspend_mode = .*/suspend_mode = "shutdown"/' \
    "$work/dormant.toml" >"$work/warm.toml"
  printf 'max_environments = 2\nwarm = 1\n' >>"$work/warm.toml"
  if [ "$ROWS" != volume ]; then
  st="$work/w$run"
  DORMANT_STATE_DIR=$st "$BIN" --config "$work/warm.toml" warm >/dev/null 2>&1 || {
    echo "bench-qemu: dormant warm failed" >&2; exit 1; }
  if [ "$ROWS" = all ]; then held "$st"; fi
  out=$(DORMANT_STATE_DIR=$st "$BIN" --config "$work/warm.toml" try 2>&1) || {
    echo "$out" >&2; echo "bench-qemu: dormant try failed (warm)" >&2; exit 1; }
  expect_taken "$st" "$work/warm.toml" 1 "$out"
  D[new-warm]+="$(echo "$out" | awk '/^  prepare#/ {print $4; exit}') "
  empty_pool "$st" "$work/warm.toml"
  fi

  # A volume-mode resume on a warm VM: job 1 (a new volume-mode environment)
  # takes the first; `try` starts job 2 once the refill job 1 started has
  # booted the next, and job 2's resume takes that one.
  [ "$ROWS" = new ] && continue
  st="$work/v$run"
  sed -e 's/^max_environments = 2/max_environments = 3/' -e 's/^warm = 0/warm = 1/' -e 's/^storage = .*/storage = "volume"/' \
    "$work/warm.toml" >"$work/warmv.toml"
  DORMANT_STATE_DIR=$st "$BIN" --config "$work/warmv.toml" warm >/dev/null 2>&1 || {
    echo "bench-qemu: dormant warm failed (volume)" >&2; exit 1; }
  out=$(DORMANT_STATE_DIR=$st "$BIN" --config "$work/warmv.toml" try 2>&1) || {
    echo "$out" >&2; echo "bench-qemu: dormant try failed (warm, volume)" >&2; exit 1; }
  expect_taken "$st" "$work/warmv.toml" 2 "$out"
  D[resume-volume-warm]+="$(echo "$out" | awk '/^job 2/ {j=1} j && /^  prepare#/ {print $4; exit}') "
  empty_pool "$st" "$work/warmv.toml"
  # Each run's figures as they are (a failure later loses no run).
  echo "bench-qemu: after run $run: $(declare -p M D | tr '\n' ' ')" >&2
done

med() { tr ' ' '\n' | { grep -v '^$' || true; } | sort -n | awk '{a[NR]=$1} END {if (NR==0) print "-"; else if (NR%2) print a[(NR+1)/2]; else printf "%.1f\n", (a[NR/2]+a[NR/2+1])/2}'; }
row() { # row LABEL MACHINE DORMANT (a row ROWS did not run is left out)
  [ -n "$2$3" ] || return 0
  local m d; m=$(echo "$2" | med); d=$(echo "$3" | med)
  local added=-
  [ "$m" = - ] || [ "$d" = - ] || added=$(python3 -c "print(f'{$d - $m:+.1f}')")
  printf '| %-28s | %10s | %10s | %10s |\n' "$1" "$m" "$d" "$added"
}
echo
echo "qemu provider, accel $ACCEL, 2 vCPUs, 1 GiB, $RUNS run(s) each (median seconds); binary $BIN"
printf '| %-28s | %10s | %10s | %10s |\n' "" "machine s" "dormant s" "added s"
echo "|------------------------------|-----------:|-----------:|-----------:|"
row "new environment (to SSH)" "${M[new]:-}" "${D[new]:-}"
row "new environment, warm VM" "${M[new]:-}" "${D[new-warm]:-}"
row "resume after shutdown" "${M[boot]:-}" "${D[resume-shutdown]:-}"
row "resume after hibernate" "${M[restore]:-}" "${D[resume-hibernate]:-}"
row "suspend: shutdown" "${M[shutdown]:-}" "${D[suspend-shutdown]:-}"
row "suspend: hibernate" "${M[hibernate]:-}" "${D[suspend-hibernate]:-}"
row "resume, volume mode" "${M[resume-volume]:-}" "${D[resume-volume]:-}"
row "resume, volume mode, warm VM" "${M[resume-volume]:-}" "${D[resume-volume-warm]:-}"
row "suspend, volume mode" "${M[suspend-volume]:-}" "${D[suspend-volume]:-}"
if [ "${#HELD_RSS[@]}" -gt 0 ]; then
  echo
  echo "an idle warm VM, $HELD_IDLE s after its boot (median of ${#HELD_RSS[@]}): QEMU resident" \
    "$(printf '%s\n' "${HELD_RSS[@]}" | med | awk '{printf "%.0f", $1/1024}') MiB (ps -o rss)," \
    "its pool entry $(printf '%s\n' "${HELD_DISK[@]}" | med | awk '{printf "%.0f", $1/1048576}') MiB allocated on disk (du)"
fi
