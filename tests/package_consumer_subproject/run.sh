#!/bin/sh
# Build a project that adds the tshare source tree with add_subdirectory: it
# builds with nothing of tshare's tests (no ctest entry, no test binary), and
# its program shares a buffer through tshare.
set -eu
tshare_src=$(cd "$1" && pwd)
work=$(cd "$2" && pwd)/package-subproject-test
src_dir=$(cd "$(dirname "$0")" && pwd)
rm -rf "$work"
# LibTorch and Python only cost build time here: the rule under test is the
# same with or without them.
cmake -S "$src_dir" -B "$work" -DTSHARE_SOURCE_DIR="$tshare_src" \
  -DTSHARE_WITH_TORCH=OFF -DTSHARE_WITH_PYTHON=OFF >"$work.configure.log" 2>&1 ||
  { echo "configuring the subproject consumer failed:"; cat "$work.configure.log"; exit 1; }
tests=$(ctest --test-dir "$work" -N | sed -n 's/^Total Tests: //p')
[ "$tests" = 0 ] || { echo "tshare as a subproject added $tests tests to its parent's ctest"; exit 1; }
cmake --build "$work" -j 2 >"$work.build.log" 2>&1 ||
  { echo "building the subproject consumer failed:"; tail -n 40 "$work.build.log"; exit 1; }
"$work/uses_tshare"
echo "tshare builds as a subproject, without its tests"
