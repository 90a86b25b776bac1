#!/usr/bin/env bash
# A job longer than one 10-minute GPU call, spread over back-to-back calls on the same warm machine.
#
# The device tool kills what a call leaves running when it returns, except processes in a new session (setsid), which
# live until the machine goes back; a machine goes back ~30 s after a call ends, so the next call must follow at once,
# and it is held at most 30 minutes in all.
#
#   bash benchmarks/gpu/detached.sh start NAME CMD...   # CMD in its own session, output to /tmp/detached/NAME/log;
#                                                       # returns at once (CMD inherits the environment and cwd)
#   bash benchmarks/gpu/detached.sh wait NAME SECONDS   # until CMD ends or SECONDS pass; copies the log (last 15 MB)
#                                                       # and every file under /tmp/detached/NAME/out to $OUT
#                                                       # (out/32b/r.json arrives as 32b--r.json: two runs that name
#                                                       # their results alike no longer overwrite each other)
#
# `wait` exits with CMD's exit status once it ended, 75 while it still runs (call `wait` again in the next call), 3
# when NAME was never started on this machine (a fresh machine: start it again). Have CMD write its results to
# /tmp/detached/NAME/out or a folder under it (e.g. grpo_step.py --out), since $OUT is emptied before each call.
set -u
root=/tmp/detached
verb=${1:-}; name=${2:-}
[ -n "$verb" ] && [ -n "$name" ] || { echo "usage: $0 start NAME CMD... | wait NAME SECONDS" >&2; exit 2; }
shift 2
dir=$root/$name
case $verb in
start)
  [ $# -gt 0 ] || { echo "$0 start $name: no command" >&2; exit 2; }
  if [ -f "$dir/pid" ] && [ ! -f "$dir/rc" ] && kill -0 "$(cat "$dir/pid")" 2>/dev/null; then
    echo "[detached] $name is already running (pid $(cat "$dir/pid"))" >&2; exit 2
  fi
  rm -rf "$dir"; mkdir -p "$dir/out"
  setsid nohup bash -c '"$@" > "$0/log" 2>&1; echo $? > "$0/rc"' "$dir" "$@" < /dev/null > /dev/null 2>&1 &
  echo $! > "$dir/pid"
  echo "[detached] $name started (pid $(cat "$dir/pid")), log $dir/log: $*"
  ;;
wait)
  limit=${1:?wait needs SECONDS}
  [ -f "$dir/pid" ] || { echo "[detached] $name was never started here (fresh machine?)" >&2; exit 3; }
  t0=$SECONDS
  while [ ! -f "$dir/rc" ] && [ $((SECONDS - t0)) -lt "$limit" ]; do sleep 2; done
  if [ -n "${OUT:-}" ]; then
    tail -c 15000000 "$dir/log" > "$OUT/$name.log" 2>/dev/null
    (cd "$dir/out" && find . -type f | sort | while read -r f; do
      rel=${f#./}; cp "$f" "$OUT/${rel//\//--}"
    done)
  fi
  tail -c 6000 "$dir/log"
  if [ -f "$dir/rc" ]; then echo "[detached] $name ended, rc $(cat "$dir/rc")"; exit "$(cat "$dir/rc")"; fi
  echo "[detached] $name still running after ${limit} s: call wait again"; exit 75
  ;;
*) echo "$0: unknown verb $verb (start | wait)" >&2; exit 2 ;;
esac
