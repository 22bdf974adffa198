#!/bin/sh
# Install what building and testing tshare needs, where it is missing, and
# say what is left out, why, and how to fix it: nothing is skipped silently.
#   scripts/install-deps.sh [--cache FILE]
# Debian/Ubuntu: apt-get, as root or through `sudo -n` (make never waits for a
# password). Elsewhere, or without either: says what to install.
# Required: cmake >= 3.25, make, a C compiler; without them it exits 1.
# Optional (it exits 0 without them, naming each): pkg-config (the package
# test's pkg-config half), python3 (the bench's Python peers), clang (the
# libFuzzer target), valgrind (make valgrind), a C++ compiler and LibTorch for
# the torch bridge (Debian's libtorch-dev, CPU-only, where no LibTorch is found
# through Torch_DIR, python3's torch or the system), and for the Python package
# an interpreter with torch and its C headers (Debian's python3-torch and
# python3-dev, for /usr/bin/python3; pybind11-dev for tshare._torch_native,
# which makes received sets in C++), and UCX for channels across hosts
# (Debian's libucx-dev, which brings libucp.so.0, opened at run time, and
# ucx-utils, whose ucx_info says what UCX can reach).
# Environment: TSHARE_WITH_TORCH=OFF / TSHARE_WITH_PYTHON=OFF /
# TSHARE_WITH_UCX=OFF skip those parts;
# TSHARE_APT_LOCK_TIMEOUT (seconds, default 600) is how long to wait for an
# apt or dpkg run that holds the lock (a fresh cloud machine runs
# unattended-upgrades for minutes after its first boot).
# --cache FILE (make's builds pass one): remembers the slow answer (which
# interpreter imports torch, keyed by the times of the files that answer rests
# on) and the optional packages apt could not install, so a make with nothing
# missing costs no probe and one that cannot install them does not retry every
# time. --retry (make deps) tries those packages again.
set -eu

cache=""
retry=""
while [ $# -gt 0 ]; do
  case "$1" in
    --cache) cache=${2:?"--cache needs a file"} && shift 2 ;;
    --retry) retry=1 && shift ;;
    *) echo "usage: scripts/install-deps.sh [--retry] [--cache FILE]" >&2 && exit 2 ;;
  esac
done
lock_timeout=${TSHARE_APT_LOCK_TIMEOUT:-600}
# Where the system's own LibTorch and python3 are looked for: its tests point
# this at an empty tree, so the machine running them does not leak in.
root=${TSHARE_DEPS_ROOT:-}
work=$(mktemp -d "${TMPDIR:-/tmp}/tshare-deps.XXXXXX")
trap 'rm -rf "$work"' EXIT
apt_log=$work/apt.log

say() { echo "tshare: $*" >&2; }

# --- the cache: "KEY VALUE..." lines ---------------------------------------

cache_get() {
  [ -n "$cache" ] && [ -f "$cache" ] || return 1
  sed -n "s|^$1 ||p" "$cache" | head -n 1 | grep . # fails where KEY is absent
}

cache_put() {
  [ -n "$cache" ] || return 0
  mkdir -p "$(dirname "$cache")"
  { [ -f "$cache" ] && grep -v "^$1 " "$cache"; echo "$1 $2"; } >"$work/cache" || true
  mv "$work/cache" "$cache"
}

cache_drop() {
  [ -n "$cache" ] && [ -f "$cache" ] || return 0
  grep -v "^$1 " "$cache" >"$work/cache" || true
  mv "$work/cache" "$cache"
}

# "PATH:MTIME ..." of files and directories (one stat for all: a build with
# nothing missing forks little); an answer stays true while every one of them
# is unchanged, and a file gone drops out of the list.
fingerprint() { stat -Lc '%n:%Y' "$@" 2>/dev/null | tr '\n' ' '; }

fingerprint_fresh() {
  paths=""
  for file_time in $1; do paths="$paths ${file_time%:*}"; done
  [ "$(fingerprint $paths)" = "$1" ]
}

# --- what is missing ----------------------------------------------------------

cmake_version() { cmake --version 2>/dev/null | sed -n 's/^cmake version \([0-9][0-9.]*\).*/\1/p'; }

cmake_new_enough() {
  v=$(cmake_version)
  major=${v%%.*}
  minor=${v#*.}
  minor=${minor%%.*}
  case "$major$minor" in '' | *[!0-9]*) return 1 ;; esac
  [ "$major" -gt 3 ] || { [ "$major" -eq 3 ] && [ "$minor" -ge 25 ]; }
}

required_missing() {
  m=""
  command -v make >/dev/null 2>&1 || m="$m make"
  command -v cc >/dev/null 2>&1 || m="$m gcc libc6-dev"
  cmake_new_enough || m="$m cmake"
  echo "$m"
}

# Prints "TORCH HEADER FILE..." for interpreter $1: TORCH 1 where it imports
# torch, HEADER 1 where its C headers are there, and the files and directories
# the answer rests on (the interpreter, every directory on its path, torch's
# own and Python.h): a package installed or removed changes one of them.
probe_python() {
  "$1" -c "import os, sys, sysconfig
try:
    import torch
    where = [os.path.dirname(torch.__file__)]
except Exception:
    where = []
h = os.path.join(sysconfig.get_paths()['include'], 'Python.h')
dirs = [p for p in sys.path if p and os.path.isdir(p)]
print(len(where), int(os.path.exists(h)), os.path.realpath(sys.executable), h, *dirs, *where)" 2>/dev/null
}

# "TORCH HEADER" for interpreter $1 (see probe_python): from the cache while
# none of the files its answer rests on changed.
python_facts() {
  interpreter=$1
  key="python:$interpreter:$(echo "${PYTHONPATH:-}" | tr ' ' _)"
  if facts=$(cache_get "$key") && fingerprint_fresh "${facts#* * }"; then
    echo "${facts%"${facts#* * }"}" | sed 's/ $//'
    return 0
  fi
  facts=$(probe_python "$interpreter") || return 1
  set -- $facts
  torch=$1 header=$2
  shift 2
  cache_put "$key" "$torch $header $(fingerprint "$@")"
  echo "$torch $header"
}

have_libtorch() {
  [ -n "${Torch_DIR:-}" ] && return 0
  for f in "$root"/usr/lib/*/cmake/Torch/TorchConfig.cmake "$root"/usr/lib/cmake/Torch/TorchConfig.cmake \
    "$root"/usr/local/share/cmake/Torch/TorchConfig.cmake; do
    [ -f "$f" ] && return 0
  done
  py=$(command -v python3 2>/dev/null) && case "$(python_facts "$py")" in 1*) true ;; *) false ;; esac
}

# UCX's development package: its headers, beside the libucp.so.0 that
# channels across hosts open at run time.
have_ucx() {
  for f in "$root"/usr/include/ucp/api/ucp.h "$root"/usr/include/*/ucp/api/ucp.h; do
    [ -f "$f" ] && return 0
  done
  return 1
}

# The Python package: an interpreter that imports torch, with its C headers.
# Debian's python3-torch installs into /usr/bin/python3, which need not be the
# python3 first on PATH; the build looks at both (cmake/TsharePython.cmake).
python_ready() {
  for py in "${TSHARE_PYTHON:-}" "$(command -v python3 2>/dev/null)" "$root/usr/bin/python3"; do
    [ -n "$py" ] && [ -x "$py" ] || continue
    [ "$(python_facts "$py")" = "1 1" ] && return 0
  done
  return 1
}

optional_missing() {
  m=""
  command -v pkg-config >/dev/null 2>&1 || m="$m pkg-config"
  command -v python3 >/dev/null 2>&1 || m="$m python3"
  command -v clang >/dev/null 2>&1 || m="$m clang"
  command -v valgrind >/dev/null 2>&1 || m="$m valgrind"
  if [ "${TSHARE_WITH_TORCH:-AUTO}" != "OFF" ]; then
    command -v c++ >/dev/null 2>&1 || m="$m g++"
    have_libtorch || m="$m libtorch-dev"
  fi
  if [ "${TSHARE_WITH_PYTHON:-AUTO}" != "OFF" ] && ! python_ready; then
    m="$m python3-dev python3-torch"
  fi
  if [ "${TSHARE_WITH_PYTHON:-AUTO}" != "OFF" ] && [ "${TSHARE_WITH_TORCH:-AUTO}" != "OFF" ] &&
    [ ! -e /usr/include/pybind11/pybind11.h ]; then
    m="$m pybind11-dev"
  fi
  if [ "${TSHARE_WITH_UCX:-AUTO}" != "OFF" ]; then
    have_ucx || m="$m libucx-dev"
    command -v ucx_info >/dev/null 2>&1 || m="$m ucx-utils"
  fi
  echo "$m"
}

# What a missing optional package leaves out.
left_out_by() {
  case "$1" in
    pkg-config) echo "the package test's pkg-config half" ;;
    python3) echo "the bench's Python peers (torch.multiprocessing)" ;;
    clang) echo "the libFuzzer target (make fuzz)" ;;
    valgrind) echo "make valgrind" ;;
    g++) echo "the LibTorch bridge (no C++ compiler)" ;;
    libtorch-dev) echo "the LibTorch bridge, its examples and tests" ;;
    python3-dev | python3-torch) echo "the Python package's build or tests" ;;
    pybind11-dev) echo "tshare._torch_native (received sets made in C++; Python makes them without it)" ;;
    libucx-dev) echo "channels across hosts (ucx:// addresses) and their tests, which skip" ;;
    ucx-utils) echo "ucx_info and ucx_perftest, which say what UCX reaches and how fast" ;;
    *) echo "a part of the build" ;;
  esac
}

# --- how to install -----------------------------------------------------------

# Sets $sudo (empty as root) where apt-get can be run without a question;
# otherwise sets $why and fails.
choose_installer() {
  sudo=""
  if ! command -v apt-get >/dev/null 2>&1; then
    why="no apt-get here (not Debian or Ubuntu)"
    return 1
  fi
  [ "$(id -u)" -eq 0 ] && return 0
  if ! command -v sudo >/dev/null 2>&1; then
    why="not root, and sudo is not installed"
    return 1
  fi
  # -n: make runs unattended, so a password prompt would hang it or fail unseen.
  if ! sudo -n true >/dev/null 2>&1; then
    why="not root, and sudo needs a password (make does not ask for one)"
    return 1
  fi
  sudo="sudo -n"
}

how_to_install() {
  if command -v apt-get >/dev/null 2>&1; then
    echo "as root, apt-get install$1 (e.g. sudo scripts/install-deps.sh once), then make again"
  else
    echo "install$1 with this system's package manager, then make again"
  fi
}

lock_held() { grep -q "Could not get lock\|Unable to acquire the dpkg frontend lock\|Unable to lock" "$apt_log"; }

# apt-get ARGS as root, waiting for the lock up to $lock_timeout seconds: dpkg
# waits on its own lock (DPkg::Lock::Timeout), and `apt-get update` fails at
# once on the lists lock, so a held lock is retried here until the deadline.
# LC_ALL=C: the messages grepped below (lock held, unknown package) are apt's
# English ones, whatever the user's locale.
apt_run() {
  deadline=$(($(date +%s) + lock_timeout))
  told=""
  while :; do
    $sudo env LC_ALL=C DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout="$lock_timeout" "$@" >"$apt_log" 2>&1 &&
      return 0
    lock_held && [ "$(date +%s)" -lt "$deadline" ] || return 1
    if [ -z "$told" ]; then
      say "waiting up to ${lock_timeout} s for the apt lock: $(holder)"
      told=1
    fi
    sleep 2
  done
}

holder() {
  h=$(grep -o "held by process.*" "$apt_log" | head -n 1)
  echo "${h:-another apt or dpkg run holds it} (a fresh machine's unattended-upgrades, or another apt-get)"
}

# Why the last apt_run failed, in one line.
apt_failure() {
  if lock_held; then
    echo "the apt lock was still held after ${lock_timeout} s: $(holder)"
  elif grep -q "Unable to locate package" "$apt_log"; then
    echo "apt knows no package $(sed -n 's/.*Unable to locate package \(.*\)/\1/p' "$apt_log" | head -n 1)"
  else
    echo "apt-get failed: $(grep -v '^\s*$' "$apt_log" | tail -n 1)"
  fi
}

apt_fix() {
  if lock_held; then
    echo "wait until that run ends, then make again (TSHARE_APT_LOCK_TIMEOUT=SECONDS waits longer)"
  else
    how_to_install "$1"
  fi
}

# --- reports ------------------------------------------------------------------

cannot_build() { # MISSING WHY FIX
  say "cannot build: missing$1 (cmake 3.25 or newer, make, a C11 compiler)"
  say "  why: $2"
  say "  fix: $3"
  exit 1
}

report_left_out() { # PACKAGES WHY FIX
  for p in $1; do say "left out: $(left_out_by "$p") (missing: $p)"; done
  say "  why: $2"
  say "  fix: $3"
  say "  the build goes on without them; cmake's summary lists every part left out"
}

cmake_too_old() {
  say "cmake $(cmake_version) is too old: tshare needs 3.25 or newer, and apt's cmake here is that one"
  say "  fix: python3 -m pip install --user 'cmake>=3.25' (puts cmake in ~/.local/bin: put it first on PATH),"
  say "       or Kitware's apt repository (https://apt.kitware.com), or snap install cmake --classic; then make again"
  exit 1
}

# --- the run ------------------------------------------------------------------

install_required() {
  [ -n "$need" ] || return 0
  apt_run install -y -qq --no-install-recommends $need || cannot_build "$need" "$(apt_failure)" "$(apt_fix "$need")"
  # apt's cmake may still be older than 3.25 (Ubuntu 22.04's is 3.22).
  still=$(required_missing)
  case "$still" in *cmake*) cmake_new_enough || ! command -v cmake >/dev/null 2>&1 || cmake_too_old ;; esac
  [ -z "$still" ] || cannot_build "$still" "apt-get installed$need, yet these are still missing" "$(how_to_install "$still")"
}

# One apt-get for all; where it fails (one unknown package fails them all),
# each alone, so what apt has is still installed.
install_optional() {
  [ -n "$optional" ] || return 0
  apt_run install -y -qq --no-install-recommends $optional && return 0
  for p in $optional; do
    apt_run install -y -qq --no-install-recommends "$p" || remember_failure "$p" "$(apt_failure)"
  done
}

remember_failure() { cache_put "failed:$1" "$2"; say "left out: $(left_out_by "$1") (missing: $1; $2)"; }

forget_failures() {
  [ -n "$cache" ] && [ -f "$cache" ] || return 0
  grep -v "^failed:" "$cache" >"$work/cache" || true
  mv "$work/cache" "$cache"
}

# Packages that could not be installed last time are not tried on every
# build: they are named, with the way to try again.
skip_known_failures() {
  kept=""
  for p in $optional; do
    if reason=$(cache_get "failed:$p"); then
      say "left out: $(left_out_by "$p") (missing: $p; last try: $reason)"
      say "  fix: make deps tries again; $(how_to_install " $p")"
    else
      kept="$kept $p"
    fi
  done
  optional=$kept
}

[ -z "$retry" ] || forget_failures
need=$(required_missing)
optional=$(optional_missing)
skip_known_failures
[ -z "$need$optional" ] && exit 0

if ! choose_installer; then
  [ -n "$need" ] && cannot_build "$need" "$why" "$(how_to_install "$need$optional")"
  report_left_out "$optional" "$why" "$(how_to_install "$optional")"
  exit 0
fi

echo "tshare: installing:$need$optional"
apt_run update -qq || {
  [ -n "$need" ] && cannot_build "$need" "$(apt_failure)" "$(apt_fix "$need")"
  report_left_out "$optional" "$(apt_failure)" "$(apt_fix "$optional")"
  exit 0
}
install_required
install_optional
# Say what is still missing after installing: an installed package need not
# bring what the build looks for (e.g. a torch for another interpreter).
cache_put installed "$(date +%s)" # a changed cache file makes make run cmake again
for p in $(optional_missing); do
  cache_get "failed:$p" >/dev/null || remember_failure "$p" "apt-get installed it, yet the build still misses it"
done
exit 0
