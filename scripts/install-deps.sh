#!/bin/sh
# Install what building and testing tshare needs, where it is missing.
# Debian/Ubuntu: apt-get (as root, or through sudo). Elsewhere: says what to install.
set -eu

need=""
command -v cmake >/dev/null 2>&1 || need="$need cmake"
command -v make >/dev/null 2>&1 || need="$need make"
command -v cc >/dev/null 2>&1 || need="$need gcc libc6-dev"
command -v pkg-config >/dev/null 2>&1 || need="$need pkg-config"
# cmake >= 3.25 is required; older ones are replaced where apt has newer.
if command -v cmake >/dev/null 2>&1; then
  v=$(cmake --version | sed -n 's/^cmake version \([0-9]*\)\.\([0-9]*\).*/\1 \2/p')
  set -- $v
  if [ "${1:-0}" -lt 3 ] || { [ "${1:-0}" -eq 3 ] && [ "${2:-0}" -lt 25 ]; }; then need="$need cmake"; fi
fi
# Optional extras: clang builds the libFuzzer target (skipped without it).
want_optional="${TSHARE_OPTIONAL_DEPS:-}"

[ -z "$need$want_optional" ] && exit 0

if command -v apt-get >/dev/null 2>&1; then
  if [ "$(id -u)" -eq 0 ]; then sudo=""; elif command -v sudo >/dev/null 2>&1; then sudo="sudo"; else
    echo "tshare: missing:$need$want_optional; run as root or install them" >&2
    exit 1
  fi
  echo "tshare: installing:$need $want_optional"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends $need $want_optional >/dev/null
  exit 0
fi
echo "tshare: please install:$need $want_optional (cmake >= 3.25, a C11 compiler, make, pkg-config)" >&2
exit 1
