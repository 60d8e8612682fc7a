#!/bin/bash
# dormant-continue [ANSWER...]: in a job that resumed the environment, hands
# the answer (the arguments joined by spaces; with none, stdin) to the
# script paused in `dormant-ask`, has that script's output from the byte
# where the earlier job's log stopped written into this stage's output (by
# its pump, kept.sh: not through this command's stdout), and exits with its
# exit code. If it
# asks again, this stage ends paused with the new question (docs/pause.md).
# Exit 125 (as env, timeout, chroot: the tool itself failed, not the script)
# whenever it cannot continue, with one `dormant-continue: ...` line naming
# the cause: nothing can be paused here, nothing is paused, the paused script
# is gone (lost with its machine's memory: DORMANT_PAUSE_LOST, set by
# `dormant run`), or an answer over the bound. Any other code is the
# continued script's.
umask 077
LC_ALL=C
max=65536
if [ -n "${DORMANT_PAUSE-}" ] && [ "$DORMANT_PAUSE" != ok ]; then
  echo "dormant-continue: nothing can be paused here: $DORMANT_PAUSE; so nothing waits to be continued" >&2; exit 125
fi
# The machine's memory was lost with the paused script (a hibernation that
# fell back to a power-off): said at once, whatever is found below.
if [ -n "${DORMANT_PAUSE_LOST-}" ]; then
  echo "dormant-continue: $DORMANT_PAUSE_LOST" >&2; exit 125
fi
T=${DORMANT_STAGE-}
if [ -z "$T" ] || [ ! -e "$T.out" ]; then
  echo "dormant-continue: this stage's output is not kept on the machine (ssh.reconnect_timeout = \"0s\", or the host cannot keep it): nothing can be continued here" >&2; exit 125
fi
d=${T%/*} b=${T##*/}; e=${b%%.*}
# The position of the paused script's output (its wrapper's fd 3) -> z.
pos() { local l; z=; [ "/proc/$m/fd/3" -ef "$P.out" ] || return; { while read -r l; do case $l in pos:*) z=${l//[!0-9]/};; esac; done < "/proc/$m/fdinfo/3"; } 2>/dev/null; }
P= gone=
for x in "$d/$e".*.paused; do
  [ -e "$x" ] || continue
  c=${x%.paused}
  [ "$c" = "$T" ] && continue
  m=; { read -r m _ < "$c.pid"; } 2>/dev/null
  if [ -n "$m" ] && [ "/proc/$m/fd/3" -ef "$c.out" ]; then P=$c; break; fi
  # Ended on its own while paused (its dormant-ask was killed, it timed out):
  # its output and exit code are kept; it is continued to its end. (Not a
  # relay, `.relay`: a stage that relayed a paused script ends killed by
  # its dormant-continue once its job has the question.)
  if [ -e "$c.exit" ] && [ ! -e "$c.relay" ]; then P=$c; break; fi
  gone=1
done
if [ -z "$P" ]; then
  # The script ended, a job's log has all its output, and that job was
  # killed before it gave the exit code (DORMANT_PAUSE_ENDED, set by
  # `dormant run` from the record): given now, with nothing more to show.
  case ${DORMANT_PAUSE_ENDED-} in ''|*[!0-9]*) ;; *) exit "$DORMANT_PAUSE_ENDED";; esac
  if [ -n "$gone" ]; then echo "dormant-continue: the paused script is gone (it was stopped, or the machine restarted or lost its memory): nothing to continue; run its work again from the start" >&2
  else echo "dormant-continue: nothing is paused in this environment (no dormant-ask waits here: was this job resumed with the key the paused job printed?)" >&2; fi
  exit 125
fi
# (Gone meanwhile: another dormant-continue ended the round and P's files.)
pr= at=; { read -r pr at < "$P.paused"; } 2>/dev/null
if [ -z "$pr" ]; then
  echo "dormant-continue: nothing is paused in this environment any more (another dormant-continue took the question just now)" >&2; exit 125
fi
# (This stage's pump relays only where a script was paused before the stage
# began, kept.sh `.relays`: always so, when P was paused in an earlier job or
# stage.)
u=; { read -r u < "$T.relays"; } 2>/dev/null
if [ -z "$u" ]; then
  echo "dormant-continue: the paused script was paused after this stage began: continue it from a later stage or job" >&2; exit 125
fi
# Whether this stage's pump (its pid in `.relays`) still copies: it writes
# this stage's output (a pid taken by another process holds no such file),
# or it is still starting: a live child of this stage's wrapper whose
# output is not yet the file (under load the script can get here first).
tw=; { read -r tw _ < "$T.pid"; } 2>/dev/null
pumps() {
  local st
  [ "/proc/$u/fd/1" -ef "$T.out" ] && return
  { read -r st < "/proc/$u/stat"; } 2>/dev/null || return 1
  set -- ${st##*) }
  [ "$1" != Z ] && [ "$1" != X ] && [ -n "$tw" ] && [ "$2" = "$tw" ]
}
# This job's log starts where the jobs' logs have the paused script's output
# up to (`.kept`: its owner's record at the round's end, or the relaying
# stage's, kept_owner.sh `acked`, `relayed`): past the round's offset when
# a background writer went on and dormant showed it; short of it when the
# `dormant run` that was to show the round's end was killed first. (No
# `.kept`: its owner died before it wrote one; the round's offset then.)
k=; { read -r k < "$P.kept"; } 2>/dev/null
[ -n "$k" ] && at=$k
k=$at
# An earlier dormant-continue of this stage relayed P and was killed: its
# request is the pump's (kept.sh), which finished it; this one goes on from
# there (what this stage's file has of P).
x= f= s=
{ read -r f _ x < "$T.splice"; } 2>/dev/null
if [ "$x" = "$P" ] && [ -n "$f" ]; then
  s=$f; { read -r s < "$T.spliced"; } 2>/dev/null
  s=${s// /}; [ "$s" -gt "$at" ] 2>/dev/null && at=$s
fi
s0=$at
# Relaying P: a `dormant pause` of this stage pauses P (kept_owner.sh, halt).
echo "$P" > "$T.relay"
# Paused from the host (`dormant pause`, `$P.stop`): the script's group is
# frozen and asks nothing; it is woken (again, if a continue killed after
# the SIGCONT is retried: harmless), then the pause's files go. An answer
# given is not read.
if [ -e "$P.stop" ]; then
  { read -r n < "$P.ask"; } 2>/dev/null
  if [ "${n-}" = "$pr" ]; then
    { read -r _ g < "$P.pid"; } 2>/dev/null
    [ -n "${g-}" ] && kill -s CONT -- "-$g" 2>/dev/null
    # (Crash point for tests, a no-op here: src/failpoint.rs `in_script`.)
    : failpoint continue:woken
    rm -f -- "$P.ask" "$P.stop"
  fi
  set --; exec 0</dev/null
fi
if [ $# -gt 0 ]; then a=$(printf '%s' "$*" | base64 -w0); else a=$(head -c $((max + 1)) | base64 -w0); fi
pad=${a##*[!=]}; size=$(( ${#a} / 4 * 3 - ${#pad} ))
if [ "$size" -gt "$max" ]; then echo "dormant-continue: the answer is over $max bytes: not sent (the script still waits; give a shorter answer, e.g. a path to a file holding it)" >&2; exit 125; fi
# Deliver once: only to a question still asked, of the round the job log
# showed, by a script that still runs.
# A question whose asker is gone (`.asker` names a process that is no
# dormant-ask: it was killed, e.g. by `timeout`) is stale: the script went
# on without an answer; it is taken away, and the output streams.
asked_by_nobody() { local a x y; { read -r a < "$P.asker"; } 2>/dev/null || return 1; { { IFS= read -r -d '' x; IFS= read -r -d '' y; } < "/proc/$a/cmdline"; } 2>/dev/null; case $y in */dormant-ask) return 1;; esac; return 0; }
if [ -e "$P.ask" ] && asked_by_nobody; then rm -f -- "$P.ask" "$P.asker"; fi
if [ -e "$P.ask" ] && [ ! -e "$P.exit" ]; then
  n=; { read -r n < "$P.ask"; } 2>/dev/null
  if [ "$n" = "$pr" ]; then
    # (The frame in two writes only for the crash point between them, a
    # no-op here: src/failpoint.rs `in_script`.)
    if ! { printf '%s %s\n' "$n" "${#a}"
      : failpoint continue:mid-frame $$ $BASHPID
      printf '%s\n' "$a"; } | timeout 10 tee -- "$P.fifo" >/dev/null 2>&1; then
      if [ -e "$P.ask" ]; then echo "dormant-continue: the paused dormant-ask does not take the answer (its process is gone?): nothing was delivered; run the work again from the start" >&2; exit 125; fi
    fi
  fi
fi
# Has the pump (kept.sh) copy the paused script's output up to byte $1 into
# this stage, after what the script wrote before (`T.splice`: <start> <end>
# <P>, replaced whole by a rename). The pump is this stage's file's one
# writer and notes where each piece went (`T.map`), so what this job's log
# has of P is exact: this stage's owner records it (`P.kept`, kept_owner.sh
# `relayed`), and what it has is punched out of P's file every 1 MiB. A
# continue killed meanwhile leaves its request to the pump, which finishes
# it: nothing is half-copied, nothing shown twice.
copy() {
  [ "$1" -gt "$at" ] || return 0
  local c=
  echo "$s0 $1 $P" > "$T.splice.c" && mv -f -- "$T.splice.c" "$T.splice"
  at=$1
  { read -r c < "$P.kept"; } 2>/dev/null
  [ $((${c:-0} - k)) -ge 1048576 ] 2>/dev/null || return 0
  fallocate -p -o "$k" -l $((c - k)) -- "$P.out" 2>/dev/null
  k=$c
}
# Waits until the pump has copied all asked (`T.spliced`): as long as dormant
# takes this stage's output (the pump keeps its bound). 1: P's output is not
# there any more, or this stage's file cannot be written.
copied() {
  local c l
  while :; do
    c=; { read -r c < "$T.spliced"; } 2>/dev/null
    # (Nothing copied yet: the pump is where this continue started.)
    [ "${c:-$s0}" -ge "$at" ] 2>/dev/null && return 0
    [ -e "$P.out" ] && pumps || return 1
    l=; { read -r l < "$T.dd"; } 2>/dev/null
    case $l in *'error writing'*) return 1;; esac
    nap 0.05
  done
}
# The end of P's copy at byte $1: waited for (at most 60 s, while this
# stage's pump lives) until this job's log has it, before the exit code is
# given. A job killed meanwhile leaves them (P ended while paused: the next
# continue shows the rest); so does one whose log did not get there (1).
done_at() {
  local i=0 c
  while [ $((i += 1)) -le 1200 ]; do
    c=; { read -r c < "$P.kept"; } 2>/dev/null
    [ "${c:-0}" -ge "$1" ] 2>/dev/null && return 0
    if ! pumps; then c=; { read -r c < "$T.spliced"; } 2>/dev/null; [ "${c:-0}" -ge "$1" ] 2>/dev/null || return 1; fi
    nap 0.05
  done
  return 1
}
nap() { [ -n "$nn" ] || { exec 8< <(:); exec 8<>/dev/fd/8; nn=1; }; read -r -t "$1" -u 8 _; }
nn=
while :; do
  # (This stage's pump killed: nothing more reaches its output, here or in
  # the log; what it copied is noted. The next continue shows the rest.)
  pumps || { echo "dormant-continue: this stage's output can no longer be written (its pump on the machine is gone): the next dormant-continue shows the rest" >&2; exit 125; }
  pos
  if { read -r rc len < "$P.exit"; } 2>/dev/null && [ -n "$len" ]; then
    copy "$len"
    # (P's files go with this stage's, once dormant has its end:
    # kept_owner.sh `fin`.)
    if [ "$len" -gt "$s0" ] && ! done_at "$len"; then
      echo "dormant-continue: the paused script ended, but this job's log did not get all its output (this stage stopped copying it, or the job's log stalled 60 s): the next dormant-continue shows the rest and gives its exit code" >&2; exit 125
    fi
    # (The exit code given: only then may P's files go with this stage's.)
    : > "$T.gave"
    exit "$rc"
  fi
  if [ -z "$z" ]; then
    [ -e "$P.exit" ] && continue
    echo "dormant-continue: the paused script's wrapper on the machine was killed before its end was recorded: its exit code is unknown" >&2; exit 125
  fi
  if [ -e "$P.ask" ] && { read -r n < "$P.ask"; } 2>/dev/null && [ "$n" -gt "$pr" ] 2>/dev/null; then
    # Asked again: this job's log ends here, paused with the new question,
    # once this stage has P's output up to it.
    copy "$z"
    copied || { echo "dormant-continue: the paused script's output could not be copied into this job's log (its files went, or the machine's disk is full): nothing more is shown" >&2; exit 125; }
    # The question, read before the round is recorded: one withdrawn
    # meanwhile (its dormant-ask killed, e.g. by `timeout`, took `.ask`
    # away) is no round, and the output streams on. (Recorded first, the
    # round ended this job paused on an empty question, the script going on
    # unshown: soak seeds 8276378529131131809, 3741125384218328068.)
    if { echo 1; tail -n +2 -- "$P.ask"; } > "$T.ask.c" 2>/dev/null; then
      echo "$n $z" > "$P.paused.c" && mv -f -- "$P.paused.c" "$P.paused"
      mv -f -- "$T.ask.c" "$T.ask"
      i=0
      until [ -e "$T.told" ] || [ $((i += 1)) -gt 600 ]; do nap 0.05; done
      read -r _ _ _ _ g _ < /proc/$$/stat
      kill -s KILL -- "-$g"
      exit 0
    fi
    rm -f -- "$T.ask.c"
  fi
  copy "$z"
  nap 0.05
done
