#!/bin/sh
# The bridge's shared library exports its API and nothing else: every symbol
# it defines (weak ones aside: inline and template code LibTorch's headers
# instantiate) is in namespace tshare::torch, and each function the headers
# (torch.h, torch_set.h) mark TSHARE_TORCH_API is there.
#   exported_symbols_torch.sh LIB HEADER...
set -eu
lib=$1
shift
command -v nm >/dev/null 2>&1 || { echo "SKIP: nm (binutils) is not installed"; exit 77; }
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
nm -D --defined-only -C "$lib" >"$tmp/all"
awk '$2 !~ /^[WVwvu]$/ { $1 = ""; $2 = ""; sub(/^  /, ""); print }' "$tmp/all" | grep -v '^_' | sort -u >"$tmp/exported"
echo "$(wc -l <"$tmp/exported") strong symbols exported"
status=0
if grep -vE '^((typeinfo|typeinfo name|vtable) for )?tshare::torch::' "$tmp/exported"; then
  echo "FAILED: exported, but not the bridge's API (above)"
  status=1
fi
# Every marked function by name (overloads and signatures aside).
for fn in $(cat "$@" | grep -v '^#' | grep -o 'TSHARE_TORCH_API [^(]*(' | sed 's/ *($//; s/.*[ *&:]//'); do
  grep -q "tshare::torch::$fn(" "$tmp/exported" || { echo "FAILED: tshare::torch::$fn is marked but not exported"; status=1; }
done
grep -q "typeinfo for tshare::torch::Error" "$tmp/all" ||
  { echo "FAILED: tshare::torch::Error's typeinfo is not exported (catching it across the library would fail)"; status=1; }
exit $status
