#!/bin/sh
# scripts/install-deps.sh in the machines a new user meets, simulated: PATH
# holds only basic tools and fakes (apt-get, sudo, id, cmake, python3, ...)
# whose behaviour each case sets. A case checks the exit status and the
# message, and where apt ran, what apt was asked.
#   tests/install_deps/run.sh SCRIPT CASE
set -u
script=$(cd "$(dirname "$1")" && pwd)/$(basename "$1")
case_name=$2
here=$(cd "$(dirname "$0")" && pwd)
work=$(mktemp -d "${TMPDIR:-/tmp}/tshare-deps-test.XXXXXX")
trap 'rm -rf "$work"' EXIT
fakes=$work/bin
mkdir -p "$fakes"
export FAKE_DIR=$work FAKE_BIN=$fakes

# The basic tools the script uses, and nothing that it looks for.
# (The programs, not the shell's builtins of the same name.)
for tool in sh env true sed grep head tail tr cat stat date sleep mktemp rm mv mkdir dirname touch cut wc chmod; do
  for dir in /usr/bin /bin; do
    [ -x "$dir/$tool" ] && ln -s "$dir/$tool" "$fakes/$tool" && break
  done
done
. "$here/fakes.sh"

fail() {
  echo "FAIL: $case_name: $*"
  echo "--- output (status $status) ---"
  cat "$work/out"
  echo "--- apt-get calls ---"
  cat "$work/apt-calls" 2>/dev/null
  exit 1
}

# Runs the script (extra arguments passed on) with the fakes only, giving up
# after 60 s: a script that waits for a password or a lock forever fails.
timeout=$(command -v timeout)
run_script() {
  PATH=$fakes HOME=$work TMPDIR=$work TSHARE_PYTHON="" TSHARE_DEPS_ROOT=$work/root \
    "$timeout" 60 "$fakes/sh" "$script" "$@" >"$work/out" 2>&1
  status=$?
}

expect_status() { [ "$status" -eq "$1" ] || fail "exit status $status, expected $1"; }
expect_output() { grep -q -- "$1" "$work/out" || fail "no line matching '$1'"; }
expect_apt_call() { grep -q -- "$1" "$work/apt-calls" 2>/dev/null || fail "apt-get was never called with '$1'"; }

# A machine with every required and optional tool but the ones a case removes.
complete_machine() {
  fake_tool make
  fake_tool cc
  fake_tool c++
  fake_tool pkg-config
  fake_tool clang
  fake_tool valgrind
  fake_cmake 3.28.3
  fake_python3 torch
  fake_ucx
}

case "$case_name" in
  held_apt_lock_is_waited_for)
    # A fresh VM: unattended-upgrades holds the lock for two more attempts.
    complete_machine
    rm "$fakes/cmake"
    fake_root
    export FAKE_APT_LOCKED_CALLS=2 TSHARE_APT_LOCK_TIMEOUT=60
    run_script
    expect_status 0
    expect_output "waiting up to 60 s for the apt lock: held by process 4242 (unattended-upgr)"
    expect_apt_call "DPkg::Lock::Timeout=60 install .*cmake"
    [ -x "$fakes/cmake" ] || fail "cmake was not installed"
    ;;
  apt_lock_never_released)
    complete_machine
    rm "$fakes/cmake"
    fake_root
    export FAKE_APT_LOCKED_CALLS=1000 TSHARE_APT_LOCK_TIMEOUT=3
    run_script
    expect_status 1
    expect_output "cannot build: missing cmake"
    expect_output "why: the apt lock was still held after 3 s: held by process 4242 (unattended-upgr)"
    expect_output "fix: wait until that run ends, then make again (TSHARE_APT_LOCK_TIMEOUT=SECONDS waits longer)"
    ;;
  no_root_no_sudo_optional_missing)
    complete_machine
    rm "$fakes/pkg-config"
    fake_user
    run_script
    expect_status 0
    expect_output "left out: the package test's pkg-config half (missing: pkg-config)"
    expect_output "why: not root, and sudo is not installed"
    expect_output "fix: as root, apt-get install pkg-config"
    ;;
  no_root_no_sudo_cmake_missing)
    complete_machine
    rm "$fakes/cmake"
    fake_user
    run_script
    expect_status 1
    expect_output "cannot build: missing cmake"
    expect_output "why: not root, and sudo is not installed"
    expect_output "fix: as root, apt-get install cmake"
    ;;
  sudo_needs_a_password)
    complete_machine
    rm "$fakes/cmake" "$fakes/clang"
    fake_user
    fake_sudo password
    run_script
    expect_status 1
    expect_output "cannot build: missing cmake"
    expect_output "why: not root, and sudo needs a password (make does not ask for one)"
    expect_output "fix: as root, apt-get install cmake clang (e.g. sudo scripts/install-deps.sh once)"
    [ ! -f "$work/apt-calls" ] || fail "apt-get ran without a usable sudo"
    ;;
  sudo_without_password_installs)
    complete_machine
    rm "$fakes/cmake"
    fake_user
    fake_sudo nopassword
    run_script
    expect_status 0
    expect_output "installing: cmake"
    grep -q "^sudo -n env LC_ALL=C DEBIAN_FRONTEND=noninteractive apt-get" "$work/sudo-calls" ||
      fail "apt-get did not run through sudo -n with DEBIAN_FRONTEND kept and apt's messages in English (LC_ALL=C)"
    ;;
  cmake_too_old_after_install)
    # Ubuntu 22.04: cmake 3.22 on the machine, and apt's is no newer.
    complete_machine
    fake_cmake 3.22.1
    fake_root
    export FAKE_APT_CMAKE_VERSION=3.22.1
    run_script
    expect_status 1
    expect_apt_call "install .*cmake"
    expect_output "cmake 3.22.1 is too old: tshare needs 3.25 or newer, and apt's cmake here is that one"
    expect_output "fix: python3 -m pip install --user 'cmake>=3.25'"
    ;;
  unknown_optional_package_is_named_then_remembered)
    # An apt without libtorch-dev: the rest is installed, the bridge is named
    # as left out, and the next build neither retries nor stays silent.
    complete_machine
    rm "$fakes/pkg-config"
    fake_python3 none
    fake_root
    export FAKE_APT_UNKNOWN=libtorch-dev FAKE_APT_TORCH=none
    run_script --cache "$work/cache"
    expect_status 0
    expect_output "left out: the LibTorch bridge, its examples and tests (missing: libtorch-dev; apt knows no package libtorch-dev)"
    [ -x "$fakes/pkg-config" ] || fail "pkg-config was not installed beside the unknown package"
    : >"$work/apt-calls"
    run_script --cache "$work/cache"
    expect_status 0
    expect_output "left out: the LibTorch bridge, its examples and tests (missing: libtorch-dev; last try: apt knows no package libtorch-dev)"
    expect_output "fix: make deps tries again"
    grep -q "install" "$work/apt-calls" && fail "apt-get install ran again for a package it could not install"
    run_script --retry --cache "$work/cache"
    expect_apt_call "install .*libtorch-dev"
    ;;
  nothing_missing_costs_no_probe)
    # The answer about torch is kept while the interpreter and its directories
    # are unchanged; a package added to its site directory asks again.
    complete_machine
    fake_root
    run_script --cache "$work/cache"
    expect_status 0
    [ ! -s "$work/out" ] || fail "output where nothing is missing"
    probes=$(wc -l <"$work/python-calls")
    [ "$probes" -ge 1 ] || fail "python3 was never asked"
    run_script --cache "$work/cache"
    expect_status 0
    [ "$(wc -l <"$work/python-calls")" -eq "$probes" ] || fail "python3 was asked again with nothing changed"
    sleep 1.1 # a new mtime second
    mkdir "$work/site/newpackage"
    run_script --cache "$work/cache"
    [ "$(wc -l <"$work/python-calls")" -gt "$probes" ] || fail "a changed site directory was not looked at again"
    [ ! -f "$work/apt-calls" ] || fail "apt-get ran where nothing is missing"
    ;;
  ucx_missing_is_installed)
    complete_machine
    rm -r "$work/root/usr/include/ucp" "$fakes/ucx_info"
    fake_root
    run_script
    expect_status 0
    expect_apt_call "install .*libucx-dev"
    expect_apt_call "install .*ucx-utils"
    [ -f "$work/root/usr/include/ucp/api/ucp.h" ] || fail "libucx-dev was not installed"
    ;;
  ucx_missing_without_root_is_named)
    complete_machine
    rm -r "$work/root/usr/include/ucp"
    fake_user
    run_script
    expect_status 0
    expect_output "left out: channels across hosts (ucx:// addresses) and their tests, which skip (missing: libucx-dev)"
    expect_output "fix: as root, apt-get install libucx-dev"
    ;;
  ucx_off_is_not_asked_for)
    complete_machine
    rm -r "$work/root/usr/include/ucp" "$fakes/ucx_info"
    fake_root
    export TSHARE_WITH_UCX=OFF
    run_script
    expect_status 0
    [ ! -f "$work/apt-calls" ] || fail "apt-get ran for UCX under TSHARE_WITH_UCX=OFF"
    ;;
  *)
    echo "unknown case: $case_name"
    exit 2
    ;;
esac
echo "PASS: $case_name"
