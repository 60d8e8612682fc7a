#!/bin/bash
# dormant-ask QUESTION...: asks the question and waits, with the script's
# processes alive, for a later job's `dormant-continue` to answer; prints the
# answer on stdout byte for byte and exits 0. Written by kept.sh onto the
# PATH of every stage script (docs/pause.md has the protocol).
# Exit 125 (as dormant-continue's own failures) with one `dormant-ask: ...`
# line: this environment cannot keep a paused process (the setting is
# named), a question empty or over the bound, or the question could not be
# recorded, another script of the environment already waits; nothing was
# asked (under the runner's `set -e` the script then stops, unless the line
# says what to do instead: `dormant-ask ... || ...`).
umask 077
LC_ALL=C
ask_max=4096
# bash's own words about a child a signal ended (`Terminated`, when the
# script's `timeout` stops this command while it runs a tool) are not the
# script's output: stderr is /dev/null from here, this command's own lines
# go to fd 9. (Soak seed 3546260562590775887: `Terminated` in the job log.)
exec 9>&2 2>/dev/null
if [ -n "${DORMANT_PAUSE-}" ] && [ "$DORMANT_PAUSE" != ok ]; then
  echo "dormant-ask: cannot pause here: $DORMANT_PAUSE" >&9; exit 125
fi
o=${DORMANT_STAGE-}
if [ -z "$o" ] || [ ! -e "$o.out" ]; then
  echo "dormant-ask: cannot pause here: this stage's output is not kept on the machine (ssh.reconnect_timeout = \"0s\", or the host cannot keep it)" >&9; exit 125
fi
q="$*"
if [ "${#q}" -gt "$ask_max" ]; then
  echo "dormant-ask: the question is ${#q} bytes; at most $ask_max are kept" >&9; exit 125
fi
if [ -z "$q" ]; then echo "dormant-ask: usage: dormant-ask QUESTION..." >&9; exit 125; fi
# One paused script per environment: another stage's script waits for its
# answer (this job resumed the environment and did not continue it).
d=${o%/*} b=${o##*/}
for x in "$d/${b%%.*}".*.paused; do
  [ -e "$x" ] && [ "${x%.paused}" != "$o" ] || continue
  m=; { read -r m _ < "${x%.paused}.pid"; } 2>/dev/null
  if { [ -n "$m" ] && [ "/proc/$m/fd/3" -ef "${x%.paused}.out" ]; } || { [ -e "${x%.paused}.exit" ] && [ ! -e "${x%.paused}.relay" ]; }; then
    echo "dormant-ask: another script of this environment already waits for its answer: continue it first (dormant-continue ANSWER); nothing was asked" >&9; exit 125
  fi
done
rm -f -- "$o.fifo"
mkfifo -m 600 -- "$o.fifo" || { echo "dormant-ask: could not make $o.fifo" >&9; exit 125; }
# Intent: the question, whole, under its final name in one link, which fails
# when `dormant pause` asked first (this process was frozen meanwhile): that
# round ends with a dormant-continue, which removes its `.ask`; then this
# question is asked in the next round. `.asker` names this process, so that
# a question whose asker is gone (killed: `timeout 5 dormant-ask ...`) is
# known for stale and taken away by whoever finds it.
asker() { local a x y; { read -r a < "$o.asker"; } 2>/dev/null || return 1; { { IFS= read -r -d '' x; IFS= read -r -d '' y; } < "/proc/$a/cmdline"; } 2>/dev/null; case $y in */dormant-ask) return 0;; esac; return 1; }
i=0
while :; do
  n=0
  { read -r n _ < "$o.paused"; } 2>/dev/null
  [ -n "$n" ] || n=0
  n=$((n + 1))
  printf '%s\n%s' "$n" "$q" > "$o.ask.a" || { rm -f -- "$o.ask.a" "$o.fifo"; echo "dormant-ask: could not record the question in $o.ask" >&9; exit 125; }
  ln -- "$o.ask.a" "$o.ask" 2>/dev/null && break
  if [ -e "$o.ask" ]; then
    # A host pause's round (no asker): it lasts until it is continued.
    # A stale question (its asker gone): taken away.
    i=0
    [ -e "$o.asker" ] && ! asker && rm -f -- "$o.ask" "$o.asker"
  else
    [ $((i += 1)) -le 50 ] || { rm -f -- "$o.ask.a" "$o.fifo"; echo "dormant-ask: could not record the question in $o.ask (ln failed)" >&9; exit 125; }
  fi
  sleep 0.1
done
echo $$ > "$o.asker"
trap 'rm -f -- "$o.ask" "$o.fifo" "$o.asker"; exit 143' TERM
trap 'rm -f -- "$o.ask" "$o.fifo" "$o.asker"; exit 129' HUP
trap 'rm -f -- "$o.ask" "$o.fifo" "$o.asker"; exit 130' INT
rm -f -- "$o.ask.a"
# One frame per writer: "<round> <length>", then the answer in base64 on one
# line of that length (any bytes, NUL too, held in memory only). A short frame
# (its writer was killed) or another round's is dropped and the wait goes on.
while :; do
  exec 7<"$o.fifo" || exit 125
  a= ok=
  if IFS=' ' read -r r len <&7 && [ "$r" = "$n" ] && [ "$len" -ge 0 ] 2>/dev/null; then
    IFS= read -r a <&7
    [ "${#a}" -eq "$len" ] && ok=1
  fi
  exec 7<&-
  [ -n "$ok" ] && break
done
# The answer came whole: it is not asked again (a retried continue only streams).
trap - TERM HUP INT
rm -f -- "$o.ask" "$o.fifo" "$o.asker"
printf '%s' "$a" | base64 -d
