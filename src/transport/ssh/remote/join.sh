# dormant's wrapper of a shell joined beside a running job (`dormant shell`
# on an active environment; see ../remote.rs). $1 = the environment, $2 =
# the join's nonce, $3 = the job's project directory, $4 = a command line
# ('' = a login shell). It registers its session as
# <dir>/dormant-<uid>/<env>.join.<nonce>, creating that file and holding it
# open as fd 9 in one step (so from the moment it exists a live wrapper holds
# it: that is how the job's cleanup, join_end.sh, tells a join from a file a
# killed wrapper left), runs the shell as its child, and removes the file
# when the shell ends. If the file is there already, the job's cleanup made
# it (it saw this join's mark before the join got here): the job has ended,
# nothing runs.
umask 077
if [ "${TMPDIR#/}" != "${TMPDIR-}" ]; then t=$TMPDIR; elif [ "$UID" -lt 1000 ] && [ -d /dev/shm ]; then t=/dev/shm; else t=/tmp; fi
t=$t/dormant-$UID
mkdir -p -- "$t" 2>/dev/null
if [ ! -d "$t" ] || [ ! -O "$t" ] || [ -L "$t" ]; then echo "dormant: $t is not a directory of $USER's own: not joining" >&2; exit 97; fi
j=$t/$1.join.$2
if ! { set -C; exec 9>"$j"; } 2>/dev/null; then
  # (A file of the cleanup's, or one it is still writing: either way ours to
  # remove, and the join's answer.)
  if [ -e "$j" ] && [ ! -s "$j" -o "$(cat -- "$j" 2>/dev/null)" = ended ]; then
    rm -f -- "$j"
    echo "dormant: the job ended before this shell could join it: nothing was run" >&2
    exit 97
  fi
  echo "dormant: could not register the shell in $j" >&2; exit 97
fi
set +C
echo "$$" >&9
trap 'rm -f -- "$j"' EXIT
c=
trap 'if [ -n "$c" ]; then kill -s HUP "$c" 2>/dev/null; fi' HUP TERM
if ! cd -- "$3" 2>/dev/null; then
  if [ -n "$4" ]; then echo "dormant: $3 does not exist" >&2; exit 1; fi
  echo "dormant: $3 does not exist, starting in $HOME" >&2
fi
if [ -n "$4" ]; then set -- -c "$4"; else set -- -l; fi
# In the background, so that the traps above run while it does. But bash
# without job control gives a background command /dev/null for stdin and
# makes it ignore SIGINT and SIGQUIT: give back both, the person's terminal
# (or stdin) and Ctrl-C for the programs run in the shell.
{ trap - INT QUIT; exec "${SHELL:-/bin/sh}" "$@"; } 0<&0 9<&- & c=$!
# (A trapped signal ends `wait` early: wait again until the shell is gone.)
while :; do wait "$c"; r=$?; kill -0 "$c" 2>/dev/null || break; done
exit "$r"
