#!/bin/sh
# Install what building and testing tshare needs, where it is missing.
# Debian/Ubuntu: apt-get (as root, or through sudo). Elsewhere: says what to install.
# Required: cmake >= 3.25, make, a C compiler. Optional: pkg-config (the
# package test's pkg-config half), python3 (the bench's check and its
# torch.multiprocessing peer), clang (the libFuzzer target), valgrind
# (make valgrind), a C++
# compiler and LibTorch for the torch bridge: Debian's libtorch-dev (CPU-only)
# where no LibTorch is found (Torch_DIR, python3's torch, the system), and
# for the Python package an interpreter with torch and its C headers
# (Debian's python3-torch and python3-dev, for /usr/bin/python3).
# TSHARE_WITH_TORCH=OFF / TSHARE_WITH_PYTHON=OFF in the environment skip them.
set -eu

need=""
command -v make >/dev/null 2>&1 || need="$need make"
command -v cc >/dev/null 2>&1 || need="$need gcc libc6-dev"
if command -v cmake >/dev/null 2>&1; then
  v=$(cmake --version | sed -n 's/^cmake version \([0-9]*\)\.\([0-9]*\).*/\1 \2/p')
  set -- $v
  if [ "${1:-0}" -lt 3 ] || { [ "${1:-0}" -eq 3 ] && [ "${2:-0}" -lt 25 ]; }; then need="$need cmake"; fi
else
  need="$need cmake"
fi
optional=""
command -v pkg-config >/dev/null 2>&1 || optional="$optional pkg-config"
command -v python3 >/dev/null 2>&1 || optional="$optional python3"
command -v clang >/dev/null 2>&1 || optional="$optional clang"
command -v valgrind >/dev/null 2>&1 || optional="$optional valgrind"

have_torch() {
  [ -n "${Torch_DIR:-}" ] && return 0
  for f in /usr/lib/*/cmake/Torch/TorchConfig.cmake /usr/lib/cmake/Torch/TorchConfig.cmake \
    /usr/local/share/cmake/Torch/TorchConfig.cmake; do
    [ -f "$f" ] && return 0
  done
  command -v python3 >/dev/null 2>&1 && python3 -c "import torch.utils" >/dev/null 2>&1 && return 0
  return 1
}
if [ "${TSHARE_WITH_TORCH:-AUTO}" != "OFF" ]; then
  command -v c++ >/dev/null 2>&1 || optional="$optional g++"
  have_torch || optional="$optional libtorch-dev"
fi

# The Python package: an interpreter that imports torch, with its C headers.
# Debian's python3-torch installs into /usr/bin/python3, which need not be the
# python3 first on PATH; the build looks at both (cmake/TsharePython.cmake).
python_ready() {
  for py in "${TSHARE_PYTHON:-}" "$(command -v python3 2>/dev/null)" /usr/bin/python3; do
    [ -n "$py" ] && [ -x "$py" ] || continue
    "$py" -c "import torch, sysconfig, os, sys; sys.exit(0 if os.path.exists(os.path.join(sysconfig.get_paths()['include'], 'Python.h')) else 1)" \
      >/dev/null 2>&1 && return 0
  done
  return 1
}
if [ "${TSHARE_WITH_PYTHON:-AUTO}" != "OFF" ] && ! python_ready; then
  optional="$optional python3-dev python3-torch"
fi

[ -z "$need$optional" ] && exit 0

sudo=""
if ! command -v apt-get >/dev/null 2>&1 || { [ "$(id -u)" -ne 0 ] && ! command -v sudo >/dev/null 2>&1; }; then
  if [ -n "$need" ]; then
    echo "tshare: please install:$need (cmake >= 3.25, make, a C11 compiler)" >&2
    exit 1
  fi
  exit 0 # only optional tools are missing
fi
[ "$(id -u)" -ne 0 ] && sudo="sudo"

echo "tshare: installing:$need$optional"
if ! $sudo apt-get update -qq; then
  [ -n "$need" ] && { echo "tshare: apt-get update failed; cannot install:$need" >&2; exit 1; }
  exit 0
fi
if [ -n "$need" ]; then
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends $need >/dev/null
fi
if [ -n "$optional" ]; then
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends $optional >/dev/null ||
    echo "tshare: optional$optional not installed; continuing without" >&2
fi
exit 0
