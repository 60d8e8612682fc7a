# Stops every stage of environment $1 left on this machine and removes what
# was kept of them; with $2 = check, also makes sure output can be kept here.
# A paused stage (its script waits in dormant-ask: `.paused`, its wrapper
# holding the output, or its script ended while paused: `.exit`) is spared, unless $3 = all (the environment's release);
# with $3 = look, it is spared and `paused:<n>` says how many are (cleanup of
# a resumed job: does a script still wait for its answer?).
# Run by prepare (in its one probe command) and by cleanup when a stage did
# not end cleanly. Prints `keep:ok`, or `keep:no <why>` when stages here
# cannot keep their output (then they run without re-attaching).
umask 077
if [ "${TMPDIR#/}" != "${TMPDIR-}" ]; then t=$TMPDIR; elif [ "$UID" -lt 1000 ] && [ -d /dev/shm ]; then t=/dev/shm; else t=/tmp; fi
t=$t/dormant-$UID
if [ -d "$t" ] && [ -O "$t" ] && [ ! -L "$t" ]; then
  holds() { local d; for d in /proc/$1/fd/*; do [ "$d" -ef "$o.out" ] && return; done; return 1; }
  # Whether a process of group $1 is still alive (a zombie has ended). The
  # wrapper lets go of the output (fd 3) right after it sent the group
  # SIGKILL, before the group's members have run to their end: the caller
  # suspends or runs the next job's stages only once they have.
  lives() {
    local s st g=$1
    for s in /proc/[1-9]*/stat; do
      { read -r st < "$s"; } 2>/dev/null || continue
      set -- ${st##*) }
      [ "$3" = "$g" ] && [ "$1" != Z ] && [ "$1" != X ] && return 0
    done
    return 1
  }
  # The stages to wait for, as wrapper:group:owner:stage.
  g= k=
  for s in "$t/$1".*.out; do
    [ -e "$s" ] || continue
    o=${s%.out} w= f= m= p=
    { read -r w f < "$o.own"; } 2>/dev/null
    { read -r m p < "$o.pid"; } 2>/dev/null
    # (A paused script that ended on its own is spared too: its tail and
    # exit code are the next dormant-continue's.)
    if [ "$3" != all ] && [ -e "$o.paused" ] && { { [ -n "$m" ] && [ "/proc/$m/fd/3" -ef "$s" ]; } || { [ -e "$o.exit" ] && [ ! -e "$o.relay" ]; }; }; then
      k="$k $o"; continue
    fi
    { holds "$w" && kill -s TERM "$w" 2>/dev/null; } || w=
    holds "$f" && kill -s KILL "$f" 2>/dev/null
    # The wrapper that ran the script holds fd 3 while the script's group may
    # live: only then is the group the stage's (not a reused id). The group
    # may be gone already and the wrapper still to record the stage's end
    # here, and the owner to mark the bound: both are waited for, or what
    # they write would stay behind the files' removal.
    # (A group frozen by `dormant pause` takes the TERM once woken: CONT.)
    if [ "/proc/$m/fd/3" -ef "$o.out" ]; then kill -s TERM -- "-$p" 2>/dev/null; kill -s CONT -- "-$p" 2>/dev/null; else m= p=; fi
    [ -z "$m$w" ] || g="$g $m:$p:$w:$o"
  done
  i=0
  while [ -n "$g" ] && [ $((i += 1)) -le 60 ]; do
    l=
    for x in $g; do
      m=${x%%:*} o=${x#*:} p=${o%%:*} o=${o#*:} w=${o%%:*} o=${o#*:}
      if [ -n "$m" ] && { [ "/proc/$m/fd/3" -ef "$o.out" ] || lives "$p"; }; then
        [ "$i" -eq 50 ] && kill -s KILL -- "-$p" 2>/dev/null
      elif holds "$w"; then
        [ "$i" -eq 50 ] && kill -s KILL "$w" 2>/dev/null
      else
        continue
      fi
      l="$l $x"
    done
    g=$l
    [ -z "$g" ] || sleep 0.1
  done
  for s in "$t/$1".*; do
    case " $k " in *" ${s%.*} "*) continue;; esac
    rm -f -- "$s"
  done
fi
[ "$3" = look ] && { set -- "$@" $k; echo "paused:$(( $# - 3 ))"; }
if [ "$2" = check ]; then
  mkdir -p -- "$t" 2>/dev/null
  if [ ! -d "$t" ] || [ ! -O "$t" ] || [ -L "$t" ]; then echo "keep:no $t is not a directory of $USER's own"
  elif [ ! -r /proc/self/fdinfo/0 ]; then echo "keep:no /proc/<pid>/fdinfo is not readable"
  elif ! command -v tail >/dev/null; then echo "keep:no tail is not installed"
  elif ! tail --pid=$$ -s 0.2 -c +1 /dev/null >/dev/null 2>&1; then echo "keep:no tail does not take --pid and -s (GNU coreutils' tail does)"
  elif ! dd bs=65536 count=1 status=none </dev/null >/dev/null 2>&1; then echo "keep:no dd does not take status=none (GNU coreutils' dd does)"
  elif ! { : > "$t/.punch.$1" && fallocate -p -o 0 -l 1 -- "$t/.punch.$1"; } 2>/dev/null; then echo "keep:no fallocate -p (util-linux) does not work in $t"
  else echo keep:ok
  fi
  rm -f -- "$t/.punch.$1"
fi
