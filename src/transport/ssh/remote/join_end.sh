# Ends every shell joined beside the job of environment $1 on this machine
# (join.sh registered them), telling each first ($2, on its terminal or
# stderr): SIGHUP to its whole session 1 s later, SIGKILL to what is left
# 4 s after that. Run by the job's cleanup. $3... = the nonces of the joins
# the cleanup found marked: one not registered yet is on its way (marked,
# not yet connected); its file is made here, saying `ended`, so that the
# wrapper arriving late finds it, runs nothing and removes it.
if [ "${TMPDIR#/}" != "${TMPDIR-}" ]; then t=$TMPDIR; elif [ "$UID" -lt 1000 ] && [ -d /dev/shm ]; then t=/dev/shm; else t=/tmp; fi
t=$t/dormant-$UID
umask 077
mkdir -p -- "$t" 2>/dev/null
[ -d "$t" ] && [ -O "$t" ] && [ ! -L "$t" ] || exit 0
e=$1 m=$2
shift 2
# Closed first, for each join on its way: whichever of this and join.sh
# creates the file first wins, the other sees it (both create exclusively).
for n in "$@"; do
  case $n in *[!0-9a-f]*|'') continue;; esac
  ( set -C; echo ended > "$t/$e.join.$n" ) 2>/dev/null
done
# The processes of session $1 still alive (a zombie has ended).
members() {
  local s st r= g=$1
  for s in /proc/[1-9]*/stat; do
    { read -r st < "$s"; } 2>/dev/null || continue
    set -- ${st##*) }
    [ "$4" = "$g" ] && [ "$1" != Z ] && [ "$1" != X ] && r="$r ${s//[!0-9]/}"
  done
  echo $r
}
# The sessions of the processes holding file $1 open: join.sh creates its
# file open, so a registered join is held from the moment its file exists
# (even before its pid is written in it), until the wrapper ends.
holders() {
  local f p st r=
  for f in /proc/[1-9]*/fd/*; do
    [ "$f" -ef "$1" ] 2>/dev/null || continue
    p=${f#/proc/}; p=${p%%/*}
    { read -r st < "/proc/$p/stat"; } 2>/dev/null || continue
    set -- ${st##*) }
    r="$r $4"
  done
  echo $r
}
l= k=()
for j in "$t/$e".join.*; do
  [ -e "$j" ] || continue
  s=; { read -r s < "$j"; } 2>/dev/null
  if [ "$s" = ended ]; then
    # Word for a join on its way: its wrapper removes it. One that never
    # came (its dormant shell was killed, or refused on the runner host
    # after the cleanup saw its mark) is removed by a later cleanup
    # of the environment, after an hour: far longer than a join takes to connect.
    [ -n "$(find "$j" -mmin +60 2>/dev/null)" ] && rm -f -- "$j"
    continue
  fi
  h=$(holders "$j")
  if [ -z "$h" ]; then
    # Nothing holds it: its wrapper is gone (killed before its EXIT trap).
    rm -f -- "$j"
    continue
  fi
  k+=("$j")
  for s in $h; do
    case " $l " in *" $s "*) ;; *)
      printf "\r\n%s\r\n" "$m" 2>/dev/null >> "/proc/$s/fd/2"
      l="$l $s";;
    esac
  done
done
[ -n "$l" ] || exit 0
# Bounded by the clock, not by rounds: a loaded machine scans /proc slowly.
SECONDS=0
sleep 1
for s in $l; do for p in $(members "$s"); do kill -s HUP "$p" 2>/dev/null; done; done
while [ "$SECONDS" -lt 5 ]; do
  x=
  for s in $l; do [ -n "$(members "$s")" ] && x=1; done
  [ -n "$x" ] || break
  sleep 0.2
done
for s in $l; do for p in $(members "$s"); do kill -s KILL "$p" 2>/dev/null; done; done
# Each wrapper removes its file as it ends; one killed removes none. Only
# the files of the joins ended here (not a blanket join.*: a join on its
# way may have registered since, and is the next cleanup's).
for j in "${k[@]}"; do rm -f -- "$j"; done
exit 0
