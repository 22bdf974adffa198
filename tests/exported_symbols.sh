#!/bin/sh
# The shared library exports exactly the public API: every function the
# public headers mark TSHARE_API, and nothing else (no internal ts_* helper).
set -eu
lib=$1
include_dir=$2
command -v nm >/dev/null 2>&1 || { echo "SKIP: nm (binutils) is not installed"; exit 77; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
nm -D --defined-only "$lib" | awk '{print $NF}' | grep -v '^_' | sort -u >"$tmp/exported"
# The headers through the preprocessor (comments gone, TSHARE_API kept as a
# marker): a declaration's name is the last word before its '('.
${CC:-cc} -E -P -DTSHARE_API=@TSHARE_API@ -I"$include_dir/.." "$include_dir/tshare.h" | tr '\n' ' ' |
  grep -o '@TSHARE_API@[^(;]*(' | sed 's/ *($//; s/.*[ *]//' | sort -u >"$tmp/declared"
echo "$(wc -l <"$tmp/exported") symbols exported, $(wc -l <"$tmp/declared") functions declared TSHARE_API"
status=0
if comm -13 "$tmp/declared" "$tmp/exported" | grep .; then
  echo "FAILED: exported, but not declared TSHARE_API in a public header (above)"
  status=1
fi
if comm -23 "$tmp/declared" "$tmp/exported" | grep .; then
  echo "FAILED: declared TSHARE_API, but not exported (above)"
  status=1
fi
# A public function declared without the mark would be hidden and missed above.
if grep -nE '^(const |unsigned |struct )?[a-z_0-9]+ \**tshare_[a-z0-9_]+ ?\(' "$include_dir"/*.h; then
  echo "FAILED: public functions declared without TSHARE_API (above)"
  status=1
fi
exit $status
