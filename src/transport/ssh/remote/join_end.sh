# Ends every shell joined beside the job of environment $1 on this machine
# (join.sh registered them), telling each first ($2, on its terminal or
# stderr): SIGHUP to its whole session 1 s later, SIGKILL to what is left
# 4 s after that. Run by the job's cleanup.
if [ "${TMPDIR#/}" != "${TMPDIR-}" ]; then t=$TMPDIR; elif [ "$UID" -lt 1000 ] && [ -d /dev/shm ]; then t=/dev/shm; else t=/tmp; fi
t=$t/dormant-$UID
[ -d "$t" ] && [ -O "$t" ] && [ ! -L "$t" ] || exit 0
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
l=
for j in "$t/$1".join.*; do
  [ -e "$j" ] || continue
  s=; read -r s < "$j" 2>/dev/null
  # Only a wrapper that still holds its file is this join's session leader.
  if [ -n "$s" ] && [ "/proc/$s/fd/9" -ef "$j" ]; then
    printf "\r\n%s\r\n" "$2" 2>/dev/null >> "/proc/$s/fd/2"
    l="$l $s"
  else
    rm -f -- "$j"
  fi
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
rm -f -- "$t/$1".join.*
exit 0
