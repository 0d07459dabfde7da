#!/usr/bin/env bash
# Runs two command lines side by side, every line of their output prefixed with its lane's name
# as it comes; exits non-zero (naming the lane) when either fails, after both have finished.
#   scripts/lanes.sh NAME1 'COMMAND1' NAME2 'COMMAND2'
# `make test` runs its C++ builds in one lane and its Python suites in the other: on two cores
# each leaves the other core half idle (single-file compiles, pip unpacking, pytest), and side
# by side they finish in about two thirds of the time one after the other.
set -uo pipefail
[ $# -eq 4 ] || { echo "usage: $0 NAME1 'COMMAND1' NAME2 'COMMAND2'" >&2; exit 2; }

lane() {  # name command
  bash -c "$2" 2>&1 | sed -u "s/^/[$1] /"
  return "${PIPESTATUS[0]}"
}

start=$SECONDS
lane "$1" "$2" & first=$!
lane "$3" "$4" & second=$!
wait "$first"; rc1=$?
wait "$second"; rc2=$?
status=0
for pair in "$1:$rc1" "$3:$rc2"; do
  name=${pair%%:*} rc=${pair##*:}
  if [ "$rc" -ne 0 ]; then
    echo "lane $name FAILED (exit $rc): its last lines above are prefixed [$name]"
    status=1
  else
    echo "lane $name passed"
  fi
done
echo "both lanes done in $(( (SECONDS - start) / 60 )) min $(( (SECONDS - start) % 60 )) s"
exit "$status"
