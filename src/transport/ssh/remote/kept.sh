# dormant's stage wrapper with kept output: see ../remote.rs for the protocol.
# $1 = the script's length (0 when following), $2 = the work directory,
# $3 = the file to watch, $4 = the environment, $5 = the stage's id,
# $6 = start | retry | follow, $7 = the offset to follow from,
# $8 = how long a stage nobody follows is kept, $9 = the output bound,
# ${10} = the owner's functions (kept_owner.sh): defined only where they run,
# in the owner and in a re-attach, so a stage's own path does not parse them;
# ${11} = the name of the directory of dormant-ask and dormant-continue in
# $t (versioned), ${12} = a command that writes them there (docs/pause.md).
umask 077
K=$9 L=$8
# Where the output is kept: $TMPDIR, else /dev/shm (a tmpfs) for users below
# 1000, whom logind's RemoveIPC spares when their last session ends, else /tmp.
if [ "${TMPDIR#/}" != "${TMPDIR-}" ]; then t=$TMPDIR; elif [ "$UID" -lt 1000 ] && [ -d /dev/shm ]; then t=/dev/shm; else t=/tmp; fi
t=$t/dormant-$UID o=$t/$4.$5
if [ ! -d "$t" ]; then
  [ "$6" = start ] || { echo "dormant-error gone: $t is not on the machine any more (it restarted?)" >&2; exit 97; }
  mkdir -p -- "$t" 2>/dev/null
fi
if [ ! -O "$t" ] || [ -L "$t" ]; then echo "dormant-error $t is not a directory of $USER's own: not keeping the stage's output there" >&2; exit 97; fi
# The claim: the first session to create the output file runs the script.
# A new stage claims at once. (A session re-sent after a connection lost
# before dormant heard of the start claims once it has the script, and
# follows the stage if one did before.)
f= c=
claim() {
  set -C
  if { exec 3>"$o.out"; } 2>/dev/null; then
    c=1
  fi
  set +C
}
[ "$6" = start ] && claim
# Not run after all: the claim goes.
unclaim() { rm -f -- "$o.out"; }
r() { local LC_ALL=C; IFS= read -r -N "$1" s && [ "${#s}" -eq "$1" ]; }
if ! r "$1"; then
  [ -n "$c" ] && unclaim
  echo "dormant-error the stage script arrived incomplete: not run" >&2; exit 97
fi
unset -f r
if [ "$6" != follow ] && [ -n "$2" ] && ! cd -- "$2" 2>/dev/null; then
  [ -n "$c" ] && unclaim
  echo "dormant-error the work directory $2 does not exist on the host" >&2; exit 97
fi
m= p=
[ "$6" = retry ] && claim
unset -f claim unclaim
if [ -z "$c" ] && [ "$6" = start ]; then echo "dormant-error could not create $o.out to keep the stage's output" >&2; exit 97; fi
if [ -n "$c" ]; then
  m=$$ rep=
  # dormant-ask and dormant-continue, on the script's PATH: written once per
  # boot (tmpfs) and version, made whole before their directory's rename.
  [ -z "${11}" ] || [ -d "$t/${11}" ] || eval "${12}"
  # The owner, forked beside the script's start. It first starts the
  # follower that copies the output into this session as it is written (the
  # one program a stage starts), then defines its functions; the session's
  # output is left to the follower alone. (In the C locale: it counts bytes,
  # and loading the host's UTF-8 locale would add 0.1-0.2 ms to its start.)
  # The follower ends within 0.2 s of its owner (--pid): an owner killed
  # before it could record the follower's pid leaves no `tail` behind.
  ( u=$BASHPID; LC_ALL=C tail --pid=$u -s 0.2 -c +1 -f -- "$o.out" </dev/null 2>/dev/null 3>&- & f=$!
    disown "$f"; exec >/dev/null; eval "${10}"; own start ) <&0 & w=$!
  exec 0</dev/null >/dev/null
  # `$$` in the script is this wrapper: what the script sends it is passed on
  # to the script, as in the direct wrapper (direct.sh says why).
  q=
  for g in TERM HUP QUIT USR1 USR2; do
    trap "x=1; if [ -n \"\$p\" ]; then kill -s $g \$p; else q=$g; fi 2>/dev/null" "$g"
  done
  trap "x=1; if [ -n \"\$p\" ]; then kill -s INT -- -\$p; else q=INT; fi 2>/dev/null" INT
  # The script writes into a pipe, never into the file nor the connection:
  # it runs on whatever happens to the connection, and whatever it does with
  # its descriptors (`>/dev/stderr` reopens the pipe, which has no length to
  # truncate). The pump at the pipe's other end is the one writer of the file
  # (it shares fd 3's file description: the wrapper's fd 3 position is the
  # output's length) and keeps it within its bound: past it, it reads no more
  # and the script waits on a full pipe until dormant has taken its output
  # (`.kept`). It ends at the pipe's end of file: when the script's group,
  # background writers included, has let go of it.
  #
  #
  # In a stage that may relay a paused script (another stage of this
  # environment is paused: the script may `dormant-continue` it; `.relays`
  # says so), the pump also writes that script's output into the file
  # (`.splice`, the continue's request: where to start, how far, the paused
  # stage P): a piece at a time, after what the script wrote before, each
  # piece's place in both files noted in `.map` and how far it got in
  # `.spliced`. Its one writer knows where every byte went, so this stage's
  # owner can say exactly how far the job's log has P (`P.kept`), a killed
  # `dormant-continue` leaves nothing half-copied (the pump finishes its
  # request) and nothing of this stage's own output is taken for P's
  # (docs/pause.md, "The relay"). There it never waits in a read it cannot
  # leave: it looks whether the pipe has bytes (bash's `read -t 0`, which
  # takes none) and takes them without waiting (`dd iflag=nonblock`, which
  # stops where the pipe is empty). (Bash's timed read cannot wait for
  # them: it drops a byte it read as its time ran out.) Elsewhere it waits
  # in `dd`, which costs nothing while the script is quiet and starts one
  # program per bound's worth of output.
  rl=; g=${o##*/}
  for g in "${o%/*}/${g%%.*}".*.paused; do [ -e "$g" ] && { rl=1; break; }; done
  pump() {
    local l z y k x c r sp sf st sd= sv= sx= n w q=2
    exec 2>/dev/null
    export LC_ALL=C
    # (A sleep that starts no program.)
    nap() { [ -n "$n" ] || { exec 8< <(:); exec 8<>/dev/fd/8; n=1; }; read -r -t "$1" -u 8 _; }
    # The file's length (fd 1's position) -> z.
    len() { z=; while read -r l; do case $l in pos:*) z=${l//[!0-9]/};; esac; done < "/proc/$BASHPID/fdinfo/1"; }
    if [ -z "$rl" ]; then
      while :; do
        k=0; { read -r k < "$o.kept"; } 2>/dev/null
        len
        x=$((K - z + ${k:-0}))
        if [ "$x" -gt 0 ]; then
          # (Reads of at most 64 KiB, as many as fit; less room: one read. In
          # the C locale, like the follower: loading the host's locale only
          # slows its start, and it prints nothing a locale changes.)
          if [ "$x" -ge 65536 ]; then dd bs=65536 count=$((x >> 16)) status=none; else dd bs="$x" count=1 status=none; fi || exit
          y=$z
          len
          # (dd stops short of its count only at the end of the pipe.)
          [ "$z" = "$y" ] && exit
        else
          # (The stage is over, its end recorded or its files gone, while
          # nobody took what the bound holds: nothing more is its output.)
          { [ -e "$o.exit" ] || [ ! -e "$o.out" ]; } && exit
          nap 0.05
        fi
      done
    fi
    # What the pipe holds now, at most $1 bytes (room in the bound), into the
    # file. 1: the pipe's end (no byte and no error). dd's errors are kept in
    # `.dd`: the pipe found empty is the usual one; one writing the file
    # (e.g. the file system is full) ends the pump, so the script's writes
    # fail rather than its bytes vanish.
    drain() {
      local e=0 y=$z
      if [ "$1" -ge 65536 ]; then dd iflag=nonblock bs=65536 count=$(($1 >> 16)) status=none 2>"$o.dd"; else dd iflag=nonblock bs="$1" count=1 status=none 2>"$o.dd"; fi || e=1
      if [ "$e" = 1 ]; then { read -r l < "$o.dd"; } 2>/dev/null; case $l in *'error writing'*) exit;; esac; fi
      len
      [ "$e" = 1 ] || [ "$z" != "$y" ] || [ "$1" -le 0 ]
    }
    while :; do
      k=0; { read -r k < "$o.kept"; } 2>/dev/null
      len
      x=$((K - z + ${k:-0}))
      if [ "$x" -le 0 ]; then
        { [ -e "$o.exit" ] || [ ! -e "$o.out" ]; } && exit
        nap 0.05; continue
      fi
      if [ -e "$o.splice" ] && { read -r sf st sp < "$o.splice"; } 2>/dev/null && [ -n "$sp" ] && [ "$sp $st" != "$sx" ]; then
        # (A second request for the same script, after a `dormant-continue`
        # killed mid-request, goes on from what this pump copied.)
        [ "$sp" = "$sv" ] || sv=$sp sd=$sf
        if [ "$st" -gt "$sd" ] 2>/dev/null; then
          # What the script wrote before comes first; then a piece, even
          # when the script writes on: the two take turns, each with at most
          # half the room, so a writer that never stops (and would fill the
          # bound every time dormant frees it) does not hold the relay back.
          if read -t 0; then
            drain $((x > 1 ? x / 2 : x)) || exit
            x=$((K - z + ${k:-0}))
            [ "$x" -gt 0 ] || continue
          fi
          c=$((st - sd))
          [ "$c" -le "$x" ] || c=$x
          [ "$c" -le 1048576 ] || c=1048576
          # The piece is noted first, where it goes and how long it is to be:
          # this pump is the file's one writer, so the output past `y` is
          # that piece's until it notes more, and a pump killed mid-piece
          # leaves the owner a map that is right for every byte written (a
          # byte the log has is never taken for one it has not). A piece cut
          # short is noted again at its real end. (One read, one write: bs
          # is the piece.)
          y=$z r=0
          printf '%21s %20s %20s\n' "$y" "$sd" "$((sd + c))" >> "$o.map"
          : failpoint pump:piece
          dd if="$sp.out" iflag=skip_bytes,count_bytes,fullblock skip="$sd" count="$c" bs="$c" status=none 2>"$o.dd" || r=1
          len
          w=$((z - y))
          [ "$w" = "$c" ] || printf '%21s %20s %20s\n' "$z" "$((sd + w))" "$((sd + w))" >> "$o.map"
          : failpoint pump:pieced
          if [ "$w" -gt 0 ]; then
            sd=$((sd + w))
            printf '%20s\n' "$sd" 1<>"$o.spliced"
          fi
          if [ "$r" = 1 ]; then { read -r l < "$o.dd"; } 2>/dev/null; case $l in *'error writing'*) exit;; esac; fi
          if [ "$w" -le 0 ]; then
            # P's file is not there any more (or shorter than asked): this
            # request is given up, not tried again at each turn (a program
            # start each). (The next request for P starts where it says:
            # where the job's log has P, never past a byte not copied.)
            sx="$sp $st" sv=
          fi
          continue
        fi
      fi
      # The script's bytes, once there are some (or the pipe's end): looked
      # for every 2 ms after some came, backing off to every 10 ms while the
      # script is quiet (a request is taken within that: the first byte of a
      # continued script waits for it).
      if read -t 0; then
        drain "$x" || exit
        q=2
      else
        if [ "$q" -lt 10 ]; then nap "0.00$q"; q=$((q * 2)); else nap 0.010; fi
      fi
    done
  }
  # (A coprocess: its stdout, which it keeps as fd 9 and never writes, is
  # how the wrapper hears it end — an end of file, no polling.)
  # (Test point, a no-op here: src/failpoint.rs `in_script`. Held there by
  # DORMANT_FAILPOINT_NAP, a relaying stage's pump is slow to start: the
  # script's `dormant-continue` must wait for it, not give up.)
  coproc PUMP {
    if [ -n "$rl" ]; then
      : failpoint pump:starting
    fi
    pump 9>&1 >&3 3>&-; }
  u=$PUMP_PID
  # (The pump's pid, for a `dormant-continue` waiting on it: a pump that is
  # gone copies nothing more.)
  [ -z "$rl" ] || echo "$u" > "$o.relays"
  exec 4>&"${PUMP[1]}" 5<&"${PUMP[0]}"
  eval "exec ${PUMP[1]}>&- ${PUMP[0]}<&-"
  { set -m; ( set +m; trap : QUIT; [ -z "${11}" ] || export DORMANT_STAGE=$o PATH=$t/${11}:$PATH; unset w p q g x r o f t m c K L rep u rl PUMP PUMP_PID; unset -f pump; set --; eval "$s" ) </dev/null >&4 2>&4 3>&- 4>&- 5<&- & p=$!; set +m; } 2>/dev/null
  exec 4>&-
  unset s
  # The session's stderr carries the reports only, on fd 6 from here: what
  # bash itself says about its jobs (`line N: <pid> Killed ( set +m; ...`,
  # when the script's group was killed while the wrapper was not in `wait`)
  # would reach the job log through dormant.
  exec 6>&2 2>/dev/null
  # A signal that came before the script's pid was known (the script may run
  # first after the fork): passed on now as its trap would have, INT too.
  case $q in "") ;; INT) kill -s INT -- "-$p";; *) kill -s "$q" "$p";; esac 2>/dev/null
  trap '' PIPE
  echo "$m $p" > "$o.pid"
  # (Claimed and started: one report, one write.)
  printf 'dormant-kept\ndormant-pgid %s\n' "$p" >&6
  # A trapped signal (its trap sets x) ends `wait` early with 128+n, the
  # script's end still to be collected, even when the script has already
  # ended by then: wait again. A wait with nothing left to collect (127)
  # means the one before had the end (the signal came just after it).
  x=; wait "$p"; rc=$?
  while [ -n "$x" ]; do x=; wait "$p"; r=$?; [ $r -eq 127 ] && [ -z "$x" ] && break; rc=$r; done
  kill -s KILL -- "-$p" 2>/dev/null
  # The pump has the group's last bytes once the pipe's writers are gone; one
  # that a process outside the group keeps open is not waited for past 2 s
  # (what it writes after the script's end is not the stage's).
  read -r -t 2 -u 5 _
  exec 5<&-
  # The output's length: fd 3's position (the owner's `pos`, which is not
  # defined here; this wrapper's own fd cannot go away under the read).
  z=; while read -r l; do case $l in pos:*) z=${l//[!0-9]/};; esac; done < "/proc/$$/fdinfo/3"
  if [ -n "$3" ]; then
    if [ -e "$3" ] || [ -L "$3" ]; then echo "dormant-watched present" >&6; else echo "dormant-watched absent" >&6; fi
  fi
  # (Test point, a no-op here: src/failpoint.rs `in_script`. Held there by
  # DORMANT_FAILPOINT_NAP, the script has ended and `.exit` is not written
  # yet: a `dormant pause` now must find nothing to pause, `halt`.)
  : failpoint wrapper:ended
  # The end and the output's length: dormant is done once it has both.
  echo "$rc $z" > "$o.exit"
  # (A script that relayed a paused one, `dormant-continue`: said before
  # the end, so that dormant says `DONE` and waits for the owner; with the
  # exit code the continue gave (`.gave`), which dormant notes on the runner
  # host before its `DONE` lets the paused script's files go.)
  { if [ -e "$o.relay" ]; then
      rv=; [ -e "$o.gave" ] && { read -r rl < "$o.relay" && read -r rv _ < "$rl.exit"; } 2>/dev/null
      echo "dormant-relay $rv"
    fi; echo "dormant-exit $rc $z"; } >&6
  # fd 3 open in this wrapper means "the script's group may live".
  exec 3>&-
  # sshd stops passing the session's input on once this process exits, and
  # the owner still has to see how it ends: wait for it.
  wait "$w"
  exit "$rc"
fi
# Re-attach: become the stage's owner and follow its output from offset $7.
eval "${10}"
[ -e "$o.out" ] || { echo "dormant-error gone: the stage's output is not kept on the machine any more (it was left $L s without dormant, or the machine restarted)" >&2; exit 97; }
i=0
until { read -r m p < "$o.pid"; } 2>/dev/null && [ -n "$p" ]; do
  [ $((i += 1)) -le 40 ] || { echo "dormant-error the stage on the machine never started" >&2; exit 97; }
  nap 0.05
done
# The owner records itself as it starts; one killed before it could never
# will: after 2 s the stage is taken over as one with no owner.
i=0
until { read -r w f < "$o.own"; } 2>/dev/null && [ -n "$w" ]; do
  [ $((i += 1)) -le 40 ] || { w= f=; break; }
  nap 0.05
done
echo "$$ -" > "$o.own"
i=0
while holds "$w"; do [ $((i += 1)) -le 40 ] || kill -s KILL "$w" 2>/dev/null; nap 0.05; done
holds "$f" && kill -s KILL "$f" 2>/dev/null
# (Gone since the look above: the stage's files went meanwhile.)
{ exec 3<"$o.out"; } 2>/dev/null || { echo "dormant-error gone: the stage's output is not kept on the machine any more (its files were removed as dormant came back)" >&2; exit 97; }
a=$7 k=0
[ -r "$o.kept" ] && { read -r k < "$o.kept"; } 2>/dev/null
[ "$a" -ge "$k" ] || a=$k
LC_ALL=C tail --pid=$$ -s 0.2 -c +$((a + 1)) -f -- "$o.out" </dev/null 2>/dev/null 3<&- 8<&- & f=$!
disown "$f"
exec >/dev/null
echo "$$ $f" > "$o.own"
echo "dormant-at $a" >&2
rep=1
own
