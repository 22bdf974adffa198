# Fakes for tests/install_deps/run.sh, written into $FAKE_BIN. Each logs its
# calls under $FAKE_DIR; their behaviour comes from FAKE_* variables.

fake_script() { # NAME BODY
  printf '#!%s\n%s\n' "$(command -v sh)" "$2" >"$FAKE_BIN/$1"
  chmod +x "$FAKE_BIN/$1"
}

fake_tool() { fake_script "$1" 'exit 0'; }

fake_cmake() { fake_script cmake "echo 'cmake version $1'"; }

fake_root() { export FAKE_UID=0; }

fake_user() { export FAKE_UID=1000; }

# torch: the interpreter imports torch (and has its C headers); none: neither.
# It answers install-deps' probe as a real one would, naming a site directory
# whose change must make the script ask again.
fake_python3() {
  mkdir -p "$FAKE_DIR/site"
  : >"$FAKE_DIR/Python.h"
  if [ "$1" = torch ]; then : >"$FAKE_DIR/python-torch"; else rm -f "$FAKE_DIR/python-torch"; fi
  fake_script python3 'echo "$*" >>"$FAKE_DIR/python-calls"
if [ -f "$FAKE_DIR/python-torch" ]; then
  echo "1 1 $FAKE_BIN/python3 $FAKE_DIR/Python.h $FAKE_DIR/site"
else
  echo "0 0 $FAKE_BIN/python3 $FAKE_DIR/Python.h $FAKE_DIR/site"
fi'
}

# password: sudo asks for one (-n refuses at once, as the real one does);
# nopassword: it runs the command.
fake_sudo() {
  fake_script sudo "echo \"sudo \$*\" >>\"\$FAKE_DIR/sudo-calls\"
if [ '$1' = password ]; then
  if [ \"\$1\" = -n ]; then echo 'sudo: a password is required' >&2; else echo 'sudo: a terminal is required to read the password' >&2; fi
  exit 1
fi
[ \"\$1\" = -n ] && shift
exec \"\$@\""
}

fake_script id '[ "$1" = -u ] && echo "${FAKE_UID:-0}"'

# apt-get: the first FAKE_APT_LOCKED_CALLS calls find the lock held (as
# unattended-upgrades holds it); packages named in FAKE_APT_UNKNOWN are not
# known; the others install fakes (cmake of FAKE_APT_CMAKE_VERSION; a torch
# for python3 unless FAKE_APT_TORCH=none).
fake_script apt-get 'echo "$*" >>"$FAKE_DIR/apt-calls"
n=$(cat "$FAKE_DIR/apt-locked" 2>/dev/null || echo 0)
if [ "$n" -lt "${FAKE_APT_LOCKED_CALLS:-0}" ]; then
  echo $((n + 1)) >"$FAKE_DIR/apt-locked"
  echo "E: Could not get lock /var/lib/dpkg/lock-frontend. It is held by process 4242 (unattended-upgr)" >&2
  exit 100
fi
while [ "$1" = -o ]; do shift 2; done
command=$1
shift
[ "$command" = install ] || exit 0
for p in "$@"; do
  case " ${FAKE_APT_UNKNOWN:-} " in *" $p "*) echo "E: Unable to locate package $p" >&2; exit 100 ;; esac
done
tool() { printf "#!%s\nexit 0\n" "$(command -v sh)" >"$FAKE_BIN/$1"; chmod +x "$FAKE_BIN/$1"; }
for p in "$@"; do
  case "$p" in
    -*) ;;
    cmake) printf "#!%s\necho \"cmake version %s\"\n" "$(command -v sh)" "${FAKE_APT_CMAKE_VERSION:-3.28.3}" >"$FAKE_BIN/cmake"; chmod +x "$FAKE_BIN/cmake" ;;
    gcc) tool cc ;;
    g++) tool c++ ;;
    python3-torch) [ "${FAKE_APT_TORCH:-}" = none ] || : >"$FAKE_DIR/python-torch" ;;
    libc6-dev | python3-dev | libtorch-dev) ;;
    libucx-dev) mkdir -p "$FAKE_DIR/root/usr/include/ucp/api" && : >"$FAKE_DIR/root/usr/include/ucp/api/ucp.h" ;;
    ucx-utils) tool ucx_info ;;
    *) tool "$p" ;;
  esac
done'

# UCX as Debian's libucx-dev and ucx-utils install it, under the script's root.
fake_ucx() {
  mkdir -p "$FAKE_DIR/root/usr/include/ucp/api"
  : >"$FAKE_DIR/root/usr/include/ucp/api/ucp.h"
  fake_tool ucx_info
}
