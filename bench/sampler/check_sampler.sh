#!/usr/bin/env bash
# The sampler's test: sampler_check run under it on the CPU clock, then on
# the wall clock; what report.py names must be where the program spent its
# time (parent_spins, child_spins in the forked child's own file; the sleep
# only on the wall clock). Usage: check_sampler.sh SAMPLER_SO CHECK_PROGRAM
set -u
so=$1 prog=$2
here=$(cd "$(dirname "$0")" && pwd)
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
command -v addr2line >/dev/null || { echo "SKIP: addr2line (binutils) is not installed"; exit 77; }
fail() { echo "FAIL: $*"; cat "$dir/report.txt"; exit 1; }
share() { # the inclusive share (an integer percent) of function $1 in process section $2 of the report
  awk -v fn="$1" -v want="$2" '/^== process/{n++; s=0} n==want && /-- inclusive/{s=1; next} /-- paths/{s=0}
    s && $2==fn {sub("%","",$1); printf "%d", $1; found=1} END{if(!found) printf "0"}' "$dir/report.txt"
}
run() { # clock: cpu or wall
  rm -f "$dir"/[sm].* "$dir/report.txt"
  if [ "$1" = wall ]; then export SAMPLE_WALL=1; else unset SAMPLE_WALL; fi
  SAMPLE_DIR="$dir" SAMPLE_US=1000 LD_PRELOAD="$so" "$prog" || fail "the program failed under the sampler"
  [ "$(ls "$dir"/s.* 2>/dev/null | wc -l)" -eq 2 ] || fail "expected a sample file for the parent and one for its child"
  python3 "$here/report.py" "$dir" --top 40 > "$dir/report.txt" || fail "report.py failed"
  # Sections come in file-name order, not parent first: find each by its function.
  local p c
  p=$(grep -n "parent_spins" "$dir/report.txt" | head -1 | cut -d: -f1)
  c=$(grep -n "child_spins" "$dir/report.txt" | head -1 | cut -d: -f1)
  [ -n "$p" ] && [ -n "$c" ] || fail "$1 clock: parent_spins or child_spins not named"
  local ps=1 cs=2
  [ "$p" -gt "$c" ] && ps=2 cs=1
  local spins=$(share parent_spins $ps) sleeps=$(share parent_sleeps $ps) child=$(share child_spins $cs)
  echo "$1 clock: parent_spins ${spins}%, parent_sleeps ${sleeps}% of the parent's samples; child_spins ${child}% of the child's"
  [ "$child" -ge 80 ] || fail "$1 clock: the child's samples are not in child_spins"
  if [ "$1" = wall ]; then
    [ "$spins" -ge 20 ] || fail "wall clock: parent_spins should be a good part (half on an idle machine)"
    [ "$sleeps" -ge 10 ] || fail "wall clock: parent_sleeps should be a good part (half on an idle machine)"
  else
    [ "$spins" -ge 80 ] || fail "cpu clock: parent_spins should be nearly all"
    [ "$sleeps" -le 5 ] || fail "cpu clock: a sleep takes no CPU time"
    # --under: inside parent_spins, the time is spin_for's.
    python3 "$here/report.py" "$dir" --top 40 --under parent_spins > "$dir/report.txt" || fail "report.py --under failed"
    local inside=$(awk '/^== process/{n++; s=0} /-- under parent_spins/{s=1; next} /-- /{s=0}
      s && $2=="spin_for" {sub("%","",$1); printf "%d", $1; found=1} END{if(!found) printf "0"}' "$dir/report.txt")
    echo "cpu clock: spin_for ${inside}% of the samples under parent_spins"
    [ "$inside" -ge 80 ] || fail "cpu clock: --under parent_spins should find spin_for below it"
  fi
}
run cpu
run wall
echo "sampler: ok"
