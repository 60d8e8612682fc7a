# The functions of a kept stage's owner: kept.sh passes them in ${10} and
# defines them (eval) in the owner it forks and in a re-attach, so the
# stage's own path never parses them (see ../remote.rs for the protocol).
# Whether process $1 has the kept output open: it is this stage's, not a
# process that got a pid of the stage's back.
holds() { local d; for d in /proc/$1/fd/*; do [ "$d" -ef "$o.out" ] && return; done; return 1; }
# The position of fd $2 of process $1 in the kept output -> z. (The process
# may close the fd between the test and the read: no message then, or bash's
# "No such file" would reach the job log through the session.)
pos() { local l; z=; [ "/proc/$1/fd/$2" -ef "$o.out" ] || return; { while read -r l; do case $l in pos:*) z=${l//[!0-9]/};; esac; done < "/proc/$1/fdinfo/$2"; } 2>/dev/null; }
# A sleep that starts no program: a read that times out on a pipe no one writes.
nap() { [ -n "$n" ] || { exec 8< <(:); exec 8<>/dev/fd/8; n=1; }; read -r -t "$1" -u 8 _; }
n=
# The script asked (dormant-ask wrote $o.ask, docs/pause.md): the output's
# length now is where this round's job log stops. Recorded in $o.paused
# before it is reported, so an owner that takes over after a lost connection
# reports the same round and offset. From then on the end of the session
# leaves the script alone (pz).
asked() {
  local n pr=0 at z q
  { read -r n < "$o.ask"; } 2>/dev/null || return
  { read -r pr at < "$o.paused"; } 2>/dev/null
  if [ "$n" != "$pr" ]; then
    # What the script wrote before it asked may still be in the pipe: the
    # offset is taken once the output stopped growing for 50 ms (at most 1 s:
    # a background writer that goes on writing continues the next round).
    pos "$m" 3
    [ -n "$z" ] || return
    q=0
    while [ $((q += 1)) -le 20 ]; do at=$z; nap 0.05; pos "$m" 3; [ -n "$z" ] || return; [ "$z" = "$at" ] && break; done
  fi
  # The question, read before the round is recorded: one withdrawn
  # meanwhile (its dormant-ask was killed, e.g. by `timeout`, and took its
  # `.ask` away) is no round; the output streams on.
  q=$( { IFS= read -r _ && head -c 4096 | base64 -w0; } 2>/dev/null < "$o.ask" ) || return
  if [ "$n" != "$pr" ]; then
    echo "$n $z" > "$o.paused.o" && mv -f -- "$o.paused.o" "$o.paused" || return
    at=$z
  fi
  echo "dormant-paused $at $q" >&2
  # Told: a dormant-continue relaying a later round (its own stage is this
  # one) may end the stage now. Ended before this line, the wrapper's
  # `dormant-exit 137` could reach dormant ahead of the pause (the two write
  # the session's stderr apart), and the job would end killed, not paused.
  : > "$o.told"
  pz=1
}
# `dormant pause` from the host (PAUSE <question in base64>, docs/pause.md):
# the script's group is frozen (SIGSTOP) and, once every process of it has
# stopped (a write under way ends first, so the output's length is final),
# the pause is asked as dormant-ask would ask it: `asked` reports it. Intent
# first: `$o.stop` says the group is (to be) frozen, so whoever meets it
# later wakes the group (dormant-continue) or stops it for good (SIGCONT
# after SIGTERM: fin, leftovers.sh).
#
# A stage whose script relays a paused script (`dormant-continue` wrote the
# paused stage's path in `$o.relay`) pauses that script instead: frozen and
# asked the same way, the relay sees a new round and ends this stage paused
# with its question, as when the script asks again.
halt() {
  local r=0 i=0 s st q=${1# } t=$o g=$p x= y b=${o##*/}
  [ -n "$p" ] && [ ! -e "$o.ask" ] && [ ! -e "$o.exit" ] || return
  # One paused script per environment: another stage's script waits for its
  # answer (a resumed job that did not continue it): not paused, said why.
  for y in "${o%/*}/${b%%.*}".*.paused; do
    [ -e "$y" ] && [ "${y%.paused}" != "$o" ] || continue
    { read -r x < "$o.relay"; } 2>/dev/null
    [ "${y%.paused}" = "$x" ] && continue
    # (Paused: its wrapper holds its output, or it ended while paused.)
    s=; { read -r s _ < "${y%.paused}.pid"; } 2>/dev/null
    { [ -n "$s" ] && [ "/proc/$s/fd/3" -ef "${y%.paused}.out" ]; } || { [ -e "${y%.paused}.exit" ] && [ ! -e "${y%.paused}.relay" ]; } || continue
    echo "dormant-warn dormant pause: not paused: another script of this environment already waits for its answer (dormant-continue it first)" >&2
    return
  done
  x= y=
  { read -r x < "$o.relay"; } 2>/dev/null
  if [ -n "$x" ]; then
    t=$x g=
    { read -r _ g < "$t.pid"; } 2>/dev/null
    # (An answer just delivered: its dormant-ask removes `.ask` at once.)
    while [ -e "$t.ask" ] && [ $((i += 1)) -le 40 ]; do nap 0.05; done
    [ -n "$g" ] && [ ! -e "$t.ask" ] && [ ! -e "$t.exit" ] || return
    i=0
  fi
  { read -r r _ < "$t.paused"; } 2>/dev/null
  r=$((${r:-0} + 1))
  echo "$r" > "$t.stop" || return
  kill -s STOP -- "-$g" 2>/dev/null
  while [ $((i += 1)) -le 100 ]; do
    st=
    for s in /proc/[1-9]*/stat; do
      { read -r st < "$s"; } 2>/dev/null || continue
      set -- ${st##*) }
      [ "$3" = "$g" ] && case $1 in T|t|Z|X) ;; *) st=run; break;; esac
      st=
    done
    [ -z "$st" ] && break
    nap 0.02
  done
  # (Crash point for tests, a no-op here: src/failpoint.rs `in_script`.)
  : failpoint owner:halted
  # The script ended before it was frozen (its shell is a zombie, or its
  # end is recorded): nothing to pause, its end is the stage's.
  st=; { read -r st < "/proc/$g/stat"; } 2>/dev/null; st=${st##*) }
  case ${st%% *} in ''|Z|X) y=1;; esac
  [ -e "$t.exit" ] && y=1
  # The question under `.ask` by a link, which fails if `dormant-ask` (frozen
  # while it asked) made one first: then its question stands, and the group
  # is woken to wait for its answer.
  if [ -z "$y" ] && { echo "$r"; printf '%s' "$q" | base64 -d; } > "$t.ask.h" 2>/dev/null && ln -- "$t.ask.h" "$t.ask" 2>/dev/null; then
    rm -f -- "$t.ask.h"
    return
  fi
  rm -f -- "$t.ask.h" "$t.stop"
  kill -s CONT -- "-$g" 2>/dev/null
}
# dormant has the output up to byte $1 in its job log (`ACK <n>`, after
# every read): once a quarter of the bound has gathered, it is dropped here
# (`fallocate -p`, offsets stay) and `.kept` says so, which lets the pump
# (kept.sh) write that much more. Nothing dormant has not taken is ever
# dropped: a reader slower than the script makes the script wait, and a
# re-attach always finds what it asks for.
ack() {
  [ "$1" -gt "$tk" ] 2>/dev/null || return
  tk=$1
  [ $((tk - k)) -ge $((K / 4)) ] || return
  acked
}
# Everything dormant acknowledged so far, dropped and recorded now: at each
# quarter of the bound, when a round ends paused (`TAKEN`) and when the
# session ends, so that `.kept` says exactly how far the jobs' logs have the
# output after a round or a killed `dormant run`: where the next
# `dormant-continue` starts. (Rewritten in place, one width: a reader never
# finds it empty.)
acked() {
  [ "$tk" -gt "$k" ] 2>/dev/null || return 0
  fallocate -p -o "$k" -l $((tk - k)) -- "$o.out" 2>/dev/null || [ -n "$wk" ] || { wk=1; echo "dormant-warn could not drop output the job log has from the stage's file on the machine (fallocate -p failed): the file keeps it, the bound counts without it" >&2; }
  k=$tk
  printf '%20s\n' "$k" 1<>"$o.kept"
}
# The acknowledgements waiting on stdin, taken and recorded (the owner's
# last act when it is stopped).
taking() {
  local c
  while read -r -t 0 && IFS= read -r c; do
    case $c in ACK\ *|TAKEN\ *) ack "${c#* }";; esac
  done
  [ -e "$o.map" ] && relayed
  acked
}
# This stage's script relays a paused script P (`dormant-continue`: `.relay`),
# whose output the pump (kept.sh) copies into this stage's file a piece at a
# time: `.map`, a line per piece in the order written, <this stage's byte>
# <P's first byte> <P's byte after it>. dormant's job log has P's output up
# to the byte matching `tk` (past a piece: its end; what lies between pieces
# is this stage's own script's): recorded in `P.kept` (its one writer while P
# is relayed), so a continue after this job was killed starts exactly there,
# and P's pump writes on. The map is read as it grows (fd 7, opened once; a
# line is 64 bytes, one write, never across a page), the one line past `tk`
# kept for the next look.
relayed() {
  local c l r
  if [ -z "$mo" ]; then
    { read -r rx < "$o.relay" && exec 7<"$o.map"; } 2>/dev/null || return
    mo=1
  fi
  while :; do
    if [ -z "$ml" ]; then
      l=; IFS= read -r -u 7 l; r=$?
      # (A line still being written: its start kept, read on next time.)
      [ "$r" -eq 0 ] || { mf=$mf$l; break; }
      ml=$mf$l mf=
    fi
    set -- $ml
    [ "$tk" -ge "$1" ] 2>/dev/null || break
    mt=$1 mp=$2 mq=$3 ml=
  done
  [ -n "$mt" ] || return 0
  c=$((mp + tk - mt))
  [ "$c" -le "$mq" ] || c=$mq
  [ "$c" = "$rc" ] && return
  printf '%20s\n' "$c" 1<>"$rx.kept" && rc=$c
}
# The paused round's job log ends at byte $1 (`TAKEN <n>`), past the offset
# the owner recorded when a background writer went on meanwhile: the next
# round starts there, so no byte is shown twice.
taken() {
  local r at
  ack "$1"
  acked
  { read -r r at < "$o.paused"; } 2>/dev/null || return
  [ "$1" -gt "$at" ] 2>/dev/null || return
  echo "$r $1" > "$o.paused.o" && mv -f -- "$o.paused.o" "$o.paused"
}
# dormant said `DONE` (its job log has the stage's end): a script this
# stage relayed that has ended, whose exit code its dormant-continue gave
# (`.gave`: after this job's log had its whole output), goes: its end was
# this job's. (Until then it is kept, so that a job killed after the relay
# still leaves the script's exit code to the next dormant-continue.)
given() {
  local x
  if [ -e "$o.gave" ] && { read -r x < "$o.relay"; } 2>/dev/null && [ -e "$x.exit" ]; then rm -f -- "$x".*; fi
}
# Stops what is left of the stage, drops its files, and goes.
fin() {
  local i=0 x y
  if [ "/proc/$m/fd/3" -ef "$o.out" ]; then
    # (The script's group may be a moment from being recorded.)
    while [ -z "$p" ] && [ $((i += 1)) -le 20 ]; do
      { read -r x y < "$o.pid" && [ -n "$y" ] && m=$x p=$y; } 2>/dev/null || nap 0.05
    done
    kill -s TERM -- "-$p" 2>/dev/null
    # (A group frozen by `dormant pause` takes the TERM once woken.)
    [ -e "$o.stop" ] && kill -s CONT -- "-$p" 2>/dev/null
    while [ "/proc/$m/fd/3" -ef "$o.out" ] && [ $((i += 1)) -le 50 ]; do nap 0.1; done
    kill -s KILL -- "-$p" 2>/dev/null
    while [ "/proc/$m/fd/3" -ef "$o.out" ] && [ $((i += 1)) -le 70 ]; do nap 0.1; done
  fi
  holds "$f" && kill -s KILL "$f" 2>/dev/null
  rm -f -- "$o".*
  exit 0
}
# Whether this session's connection lives: the sshd process the session's
# shell was started by ($PPID) is still there a moment after its input ended.
# (When the connection is lost, that process goes, closing the session.)
up() {
  local i=0 st
  while :; do
    st=
    { read -r st < "/proc/$PPID/stat"; } 2>/dev/null
    st=${st##*) }
    case ${st%% *} in ''|Z|X) return 1;; esac
    [ $((i += 1)) -le 4 ] || return 0
    nap 0.025
  done
}
# The stage's owner, one at a time (the process named first in $o.own): reads
# the control lines, keeps the output within its bound, and when its session
# ends: over a connection that lives, dormant closed it — it has the stage's
# end, or it died, and then the script goes as with the direct wrapper —
# unless dormant said KEEP (it follows again in a new session); after a lost
# connection, the script runs on and the stage is kept $L s for dormant to
# come back. A newer owner (a re-attach) takes over.
own() {
  local me=$BASHPID c x y k=0 tk=0 rc= e= keep= dl pend= pz= wk= g mo= ml= mf= mt= mp= mq= rx=
  [ "$1" = start ] && echo "$me $f" > "$o.own"
  # A lost connection must not end the owner when it says something.
  trap '' PIPE
  # Stopped (leftovers.sh, a cleanup after a killed `dormant run`): what
  # dormant acknowledged before it died, still waiting in the pipe while
  # this owner napped, is recorded first.
  trap 'taking; holds "$f" && kill -s KILL "$f" 2>/dev/null; exit 0' TERM
  [ -r "$o.kept" ] && { read -r k < "$o.kept"; } 2>/dev/null
  tk=${k:-0}
  # (The never-written pipe every nap reads, opened now: a function with a
  # local `n` of its own, `asked`, would take it for opened.)
  nap 0
  while :; do
    # The script's group, once the wrapper has started it.
    [ -n "$p" ] || { read -r x y < "$o.pid" && [ -n "$y" ] && m=$x p=$y; } 2>/dev/null
    if [ -n "$pend" ] && [ -n "$p" ]; then kill -s "$pend" -- "-$p" 2>/dev/null; pend=; fi
    # A control line, or the session's end: waited for at most 50 ms, and
    # taken at once (dormant waits for the owner at a round's end). The wait
    # is for one byte only: a line comes in one write, so the rest is there
    # whole, read with no timeout. (A timed read of a whole line that
    # expires mid-line loses what it read, and the rest no longer matches:
    # under load a TERM or a KEEP was lost that way.) Then all the lines
    # waiting, at once: an owner that took one line per turn fell behind
    # dormant's acknowledgements, and those still in the connection when
    # dormant closed the session were lost with it. The one-byte read can
    # expire too, as its byte comes: bash then reports the timeout (a status
    # over 128) and keeps the byte in `x` (its "partial input"), so a byte
    # in `x` was read, whatever the status. (Taken for no byte, `DONE`
    # became `ONE`: the relayed script's files stayed and the record kept
    # its question, soak seed local 8515663036969139051.)
    x=; IFS= read -r -t 0.05 -N 1 x; y=$?
    [ -n "$x" ] && y=0
    if [ "$y" -le 128 ]; then
      g=
      [ "$y" -eq 0 ] || g=1
      while [ -z "$g" ]; do
        c=
        [ "$x" = $'\n' ] || IFS= read -r c || { g=1; break; }
        [ "$x" = $'\n' ] || c=$x$c
        case $c in
          TERM|KILL) if [ -n "$p" ]; then kill -s "$c" -- "-$p" 2>/dev/null; else pend=$c; fi;;
          KEEP) keep=1;;
          # (What this job's log has of a relayed script is recorded first;
          # its files go before the confirmation: the job's cleanup, which
          # comes next, asks whether a script waits.)
          DONE) [ -e "$o.map" ] && relayed; given; echo "dormant-took" >&2; fin;;
          ACK\ *) ack "${c#ACK }";;
          TAKEN\ *) [ -n "$pz" ] && { taken "${c#TAKEN }"; echo "dormant-took" >&2; };;
          PAUSE*) [ -z "$pz" ] && halt "${c#PAUSE}";;
        esac
        read -r -t 0 || break
        IFS= read -r -N 1 x || g=1
      done
      if [ -n "$g" ] && [ -z "$e" ]; then
        e=1 dl=$((SECONDS + L)); nap 0; exec 0<&8
        # What dormant has, recorded before anything else (a killed
        # `dormant run`: the next job's log starts there).
        [ -e "$o.map" ] && relayed
        acked
        # Paused: dormant has this round's output; the script waits on.
        [ -n "$pz" ] && { holds "$f" && kill -s KILL "$f" 2>/dev/null; exit 0; }
        [ -z "$keep" ] && up && fin
      fi
    fi
    [ -z "$pz" ] && [ -e "$o.ask" ] && asked
    [ -e "$o.map" ] && relayed
    # Paused once its session had ended (a lost connection): the script waits
    # for its answer whether dormant comes back or not, so neither the loss
    # timeout nor a clock set forward after a restore may stop it. The owner
    # goes, as at a session's end (a re-attach reports the pause again).
    [ -n "$pz" ] && [ -n "$e" ] && { holds "$f" && kill -s KILL "$f" 2>/dev/null; exit 0; }
    { read -r x y < "$o.own"; } 2>/dev/null
    [ "$x" = "$me" ] || { holds "$f" && kill -s KILL "$f" 2>/dev/null; exit 0; }
    z=; [ -e "$o.exit" ] && { read -r x z < "$o.exit"; } 2>/dev/null
    if [ -n "$z" ] && [ -n "$rep" ]; then
      # (As the wrapper says it: kept.sh.)
      { if [ -e "$o.relay" ]; then
          y=; [ -e "$o.gave" ] && { read -r c < "$o.relay" && read -r y _ < "$c.exit"; } 2>/dev/null
          echo "dormant-relay $y"
        fi; echo "dormant-exit $x $z"; } >&2
      rep=
    fi
    if [ -z "$z" ]; then
      pos "$m" 3
      # The wrapper that ran the script is gone without recording its end.
      if [ -z "$z" ] && [ ! -e "$o.exit" ]; then echo "dormant-error the stage's wrapper on the machine was killed before the script's end was recorded" >&2; fin; fi
    fi
    [ -n "$e" ] && [ "$SECONDS" -ge "$dl" ] && fin
  done
}
