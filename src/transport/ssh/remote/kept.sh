# dormant's stage wrapper with kept output: see ../remote.rs for the protocol.
# $1 = the script's length (0 when following), $2 = the work directory,
# $3 = the file to watch, $4 = the environment, $5 = the stage's id,
# $6 = start | retry | follow, $7 = the offset to follow from,
# $8 = how long a stage nobody follows is kept, $9 = the output bound.
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
# A new stage claims at once, and starts the follower that copies the output
# into this session as it is written (the one program a stage starts): its
# start runs beside all that comes before the script's first output. (A
# session re-sent after a connection lost before dormant heard of the start
# claims once it has the script, and follows the stage if one did before.)
f= c=
claim() {
  set -C
  if { exec 3>"$o.out"; } 2>/dev/null; then
    c=1
    tail -c +1 -f -- "$o.out" </dev/null 2>/dev/null 3>&- & f=$!
    disown "$f"
  fi
  set +C
}
[ "$6" = start ] && claim
# Whether process $1 has the kept output open: it is this stage's, not a
# process that got a pid of the stage's back.
holds() { local d; for d in /proc/$1/fd/*; do [ "$d" -ef "$o.out" ] && return; done; return 1; }
# The position of fd $2 of process $1 in the kept output -> z.
pos() { local l; z=; [ "/proc/$1/fd/$2" -ef "$o.out" ] || return; while read -r l; do case $l in pos:*) z=${l//[!0-9]/};; esac; done < "/proc/$1/fdinfo/$2"; }
# A sleep that starts no program: a read that times out on a pipe no one writes.
nap() { [ -n "$n" ] || { exec 8< <(:); exec 8<>/dev/fd/8; n=1; }; read -r -t "$1" -u 8 _; }
n=
# Stops what is left of the stage, drops its files, and goes.
fin() {
  local i=0 x y
  if [ "/proc/$m/fd/3" -ef "$o.out" ]; then
    # (The script's group may be a moment from being recorded.)
    while [ -z "$p" ] && [ $((i += 1)) -le 20 ]; do
      { read -r x y < "$o.pid" && [ -n "$y" ] && m=$x p=$y; } 2>/dev/null || nap 0.05
    done
    kill -s TERM -- "-$p" 2>/dev/null
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
    read -r st < "/proc/$PPID/stat" 2>/dev/null
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
  local me=$BASHPID c x y k=0 fp e= keep= dl pend=
  [ "$1" = start ] && echo "$me $f" > "$o.own"
  # A lost connection must not end the owner when it says something.
  trap '' PIPE
  trap 'holds "$f" && kill -s KILL "$f" 2>/dev/null; exit 0' TERM
  [ -r "$o.kept" ] && read -r k < "$o.kept"
  while :; do
    # The script's group, once the wrapper has started it.
    [ -n "$p" ] || { read -r x y < "$o.pid" && [ -n "$y" ] && m=$x p=$y; } 2>/dev/null
    if [ -n "$pend" ] && [ -n "$p" ]; then kill -s "$pend" -- "-$p" 2>/dev/null; pend=; fi
    if IFS= read -r -t 0.05 c; then
      case $c in
        TERM|KILL) if [ -n "$p" ]; then kill -s "$c" -- "-$p" 2>/dev/null; else pend=$c; fi;;
        KEEP) keep=1;;
      esac
    elif [ $? -lt 128 ] && [ -z "$e" ]; then
      e=1 dl=$((SECONDS + L)); nap 0; exec 0<&8
      [ -z "$keep" ] && up && fin
    fi
    read -r x y < "$o.own" 2>/dev/null
    [ "$x" = "$me" ] || { holds "$f" && kill -s KILL "$f" 2>/dev/null; exit 0; }
    z=; [ -e "$o.exit" ] && read -r x z < "$o.exit"
    if [ -n "$z" ] && [ -n "$rep" ]; then echo "dormant-exit $x $z" >&2; rep=; fi
    if [ -z "$z" ]; then
      pos "$m" 3
      # The wrapper that ran the script is gone without recording its end.
      if [ -z "$z" ] && [ ! -e "$o.exit" ]; then echo "dormant-error the stage's wrapper on the machine was killed before the script's end was recorded" >&2; fin; fi
    fi
    if [ -n "$z" ] && [ $((z - k)) -gt "$K" ]; then
      # Past the bound: punch out the oldest part, keeping the newest 3/4
      # (more than any connection has in flight). Never below what the
      # follower has read, unless it lags by more than the bound: then it
      # goes, and dormant follows again from where it is, told of the gap.
      x=$((z - K * 3 / 4)) y=$z fp=
      for c in /proc/$f/fd/*; do [ "$c" -ef "$o.out" ] && { pos "$f" "${c##*/}"; fp=$z; break; }; done
      # A follower that lives but has not opened the file yet (a loaded
      # machine starts it late) will read from its start: nothing may be
      # dropped under it, or it would send the hole's zeros for output.
      if [ -z "$fp" ] && [ -n "$f" ] && { read -r c < "/proc/$f/stat"; } 2>/dev/null; then
        c=${c##*) }
        [ "${c%% *}" = Z ] || x=$k
      fi
      if [ -n "$fp" ] && [ "$fp" -lt "$x" ]; then
        if [ $((y - fp)) -gt "$K" ]; then kill -s KILL "$f" 2>/dev/null; else x=$fp; fi
      fi
      if [ "$x" -gt "$k" ]; then
        echo "$x" > "$o.kept"
        fallocate -p -o "$k" -l $((x - k)) -- "$o.out" 2>/dev/null || echo "dormant-warn could not drop the oldest output of the stage on the machine (fallocate -p failed): it is kept whole" >&2
        k=$x
      fi
    fi
    [ -n "$e" ] && [ "$SECONDS" -ge "$dl" ] && fin
  done
}
# Not run after all: the claim goes.
unclaim() { kill -s KILL "$f" 2>/dev/null; rm -f -- "$o.out"; }
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
  echo "dormant-kept" >&2
  m=$$ rep=
  # The owner, and the session's output left to the follower alone.
  own start <&0 >/dev/null & w=$!
  exec 0</dev/null >/dev/null
  # `$$` in the script is this wrapper: what the script sends it is passed on
  # to the script, as in the direct wrapper (direct.sh says why).
  q=
  for g in TERM HUP QUIT USR1 USR2; do
    trap "x=1; if [ -n \"\$p\" ]; then kill -s $g \$p; else q=$g; fi 2>/dev/null" "$g"
  done
  trap "x=1; if [ -n \"\$p\" ]; then kill -s INT -- -\$p; else q=INT; fi 2>/dev/null" INT
  # The script writes into the file, never into the connection: it runs on
  # whatever happens to the connection.
  { set -m; ( set +m; trap : QUIT; unset -f holds pos nap fin up own; unset w p q g x r o f t m n c K L rep; set --; eval "$s" ) </dev/null >&3 2>&3 & p=$!; set +m; } 2>/dev/null
  unset s
  # A signal that came before the script's pid was known (the script may run
  # first after the fork): passed on now as its trap would have, INT too.
  case $q in "") ;; INT) kill -s INT -- "-$p";; *) kill -s "$q" "$p";; esac 2>/dev/null
  trap '' PIPE
  echo "$m $p" > "$o.pid"
  echo "dormant-pgid $p" >&2
  # A trapped signal (its trap sets x) ends `wait` early with 128+n, the
  # script's end still to be collected, even when the script has already
  # ended by then: wait again. A wait with nothing left to collect (127)
  # means the one before had the end (the signal came just after it).
  x=; wait "$p"; rc=$?
  while [ -n "$x" ]; do x=; wait "$p"; r=$?; [ $r -eq 127 ] && [ -z "$x" ] && break; rc=$r; done
  kill -s KILL -- "-$p" 2>/dev/null
  pos $$ 3
  if [ -n "$3" ]; then
    if [ -e "$3" ] || [ -L "$3" ]; then echo "dormant-watched present" >&2; else echo "dormant-watched absent" >&2; fi
  fi
  # The end and the output's length: dormant is done once it has both.
  echo "$rc $z" > "$o.exit"
  echo "dormant-exit $rc $z" >&2
  # fd 3 open in this wrapper means "the script's group may live".
  exec 3>&-
  # sshd stops passing the session's input on once this process exits, and
  # the owner still has to see how it ends: wait for it.
  wait "$w"
  exit "$rc"
fi
# Re-attach: become the stage's owner and follow its output from offset $7.
[ -e "$o.out" ] || { echo "dormant-error gone: the stage's output is not kept on the machine any more (it was left $L s without dormant, or the machine restarted)" >&2; exit 97; }
i=0
until { read -r m p < "$o.pid" && read -r w f < "$o.own"; } 2>/dev/null && [ -n "$p" ] && [ -n "$w" ]; do
  [ $((i += 1)) -le 40 ] || { echo "dormant-error the stage on the machine never started" >&2; exit 97; }
  nap 0.05
done
echo "$$ -" > "$o.own"
i=0
while holds "$w"; do [ $((i += 1)) -le 40 ] || kill -s KILL "$w" 2>/dev/null; nap 0.05; done
holds "$f" && kill -s KILL "$f" 2>/dev/null
exec 3<"$o.out"
a=$7 k=0
[ -r "$o.kept" ] && read -r k < "$o.kept"
[ "$a" -ge "$k" ] || a=$k
tail -c +$((a + 1)) -f -- "$o.out" </dev/null 2>/dev/null 3<&- 8<&- & f=$!
disown "$f"
exec >/dev/null
echo "$$ $f" > "$o.own"
echo "dormant-at $a" >&2
rep=1
own
