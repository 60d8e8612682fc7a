# dormant's stage wrapper without kept output (ssh.reconnect_timeout = "0s", or a
# host that cannot keep it): see ../remote.rs. $1 = the script's length,
# $2 = the work directory, $3 = the file to watch.
r() { local LC_ALL=C; IFS= read -r -N "$1" s && [ "${#s}" -eq "$1" ]; }
if ! r "$1"; then echo "dormant-error the stage script arrived incomplete: not run" >&2; exit 97; fi
unset -f r
if [ -n "$2" ] && ! cd -- "$2" 2>/dev/null; then echo "dormant-error the work directory $2 does not exist on the host" >&2; exit 97; fi
# `$$` in the script is this wrapper: what the script sends it is passed on
# to the script. Set before the script starts (a subshell starts with them
# reset), so a signal sent at once is kept until the script's pid is known.
# INT goes to the whole group, as a Ctrl-C would: bash ignores an INT that
# arrives while it waits for a command the INT did not reach. A QUIT sent to
# `$$` is ignored unless the script traps it, as by a bash of its own; the
# `:` trap (not `trap ''`, which its commands would inherit) leaves the
# commands the script runs with QUIT at its default.
p= q=
for g in TERM HUP QUIT USR1 USR2; do
  trap "x=1; if [ -n \"\$p\" ]; then kill -s $g \$p; else q=$g; fi 2>/dev/null" "$g"
done
trap "x=1; if [ -n \"\$p\" ]; then kill -s INT -- -\$p; else q=INT; fi 2>/dev/null" INT
# Job control only to start the script in a group of its own; its messages
# ("[1]+ Exit 3 ...", when the script ends at once) must not reach stderr.
# A stage run direct cannot pause (docs/pause.md): dormant-ask and
# dormant-continue are functions (exported: a bash the script starts has
# them too) that say why at once, instead of a missing command.
dormant-ask() { local m=${DORMANT_PAUSE-ok}; [ "$m" != ok ] || m="this stage runs direct: the host cannot keep its output (keep:no)"; echo "dormant-ask: cannot pause here: $m" >&2; return 125; }
dormant-continue() { local m=${DORMANT_PAUSE-ok}; [ "$m" != ok ] || m="this stage runs direct: the host cannot keep its output (keep:no)"; echo "dormant-continue: nothing can be paused here: $m; so nothing waits to be continued" >&2; return 125; }
export -f dormant-ask dormant-continue
{ set -m; ( set +m; trap : QUIT; unset w p q g x r; set --; eval "$s" ) </dev/null 2>&1 & p=$!; set +m; } 2>/dev/null
unset s
# A signal that came before the script's pid was known (the script may run
# first after the fork): passed on now as its trap would have, INT too.
case $q in "") ;; INT) kill -s INT -- "-$p";; *) kill -s "$q" "$p";; esac 2>/dev/null
# Only now (the script must keep the default): a lost connection must not
# kill the wrapper before it has reported and cleaned up.
trap '' PIPE
echo "dormant-pgid $p" >&2
( while IFS= read -r c; do case $c in TERM|KILL) kill -s "$c" -- "-$p";; esac; done
  kill -s TERM -- "-$p"; sleep 5; kill -s KILL -- "-$p" ) <&0 >/dev/null 2>&1 &
w=$!
disown "$w"
# A trapped signal (its trap sets x) ends `wait` early with 128+n, the
# script's end still to be collected, even when the script has already
# ended by then: wait again. A wait with nothing left to collect (127)
# means the one before had the end (the signal came just after it).
x=; wait "$p"; rc=$?
while [ -n "$x" ]; do x=; wait "$p"; r=$?; [ $r -eq 127 ] && [ -z "$x" ] && break; rc=$r; done
kill -s KILL -- "-$p" "$w" 2>/dev/null
if [ -n "$3" ]; then
  if [ -e "$3" ] || [ -L "$3" ]; then echo "dormant-watched present" >&2; else echo "dormant-watched absent" >&2; fi
fi
echo "dormant-exit $rc" >&2
exit "$rc"
