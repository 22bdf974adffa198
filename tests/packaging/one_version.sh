#!/bin/sh
# one_version.sh VERSION SOURCE_DIR [PYTHON]: every artefact states the
# version CMake read from core/include/tshare/version.h, its one source:
# setup.py (the Python package's metadata) and the man pages.
version=$1 src=$2 py=${3:-$(command -v python3)}
status=0
fail() { echo "FAILED: $*"; status=1; }

for page in "$src"/docs/man/*.1; do
  th=$(grep -m1 '^\.TH ' "$page")
  case "$th" in
  *"\"tshare $version\""*) ;;
  *) fail "$page says '$th', not \"tshare $version\" (version.h says $version)" ;;
  esac
done

if [ -n "$py" ] && "$py" -c "import setuptools" 2>/dev/null; then
  # From a scratch directory: setup.py finds its files from its own path.
  from_setup=$(cd /tmp && "$py" "$src/setup.py" --version 2>/dev/null | tail -n 1)
  [ "$from_setup" = "$version" ] || fail "setup.py --version says '$from_setup', version.h says $version"
else
  echo "note: no python3 with setuptools; setup.py's version not checked"
fi
[ $status -ne 0 ] || echo "version $version everywhere: CMake, setup.py, $(ls "$src"/docs/man/*.1 | wc -l) man pages"
exit $status
