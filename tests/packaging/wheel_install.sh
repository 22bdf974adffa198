#!/bin/sh
# wheel_install.sh PYTHON SOURCE_DIR VERSION TEST_WRAPPER: the Python package
# as a user gets it, offline, with the distribution's setuptools, pip and
# wheel. From a copy of the sources (the checkout is left alone): an sdist
# (so MANIFEST.in carries everything the build needs), a wheel built from
# it, installed into a scratch venv that sees the system's torch. The
# installed package states VERSION through importlib.metadata and
# tshare.__version__, its extension needs only libc and exports only its
# init function, a Python test passes against it through TEST_WRAPPER (the
# Python tests' interpreter, with TSHARE_TEST_PYTHON), and pip uninstall
# leaves nothing behind.
set -u
py=$1 src=$2 version=$3 wrapper=$4
fail() { echo "FAILED: $*"; exit 1; }

for module in venv pip setuptools wheel torch; do
  "$py" -c "import $module" 2>/dev/null ||
    { echo "SKIP: $py cannot import $module (Debian: apt-get install python3-venv python3-pip python3-wheel python3-torch)"; exit 77; }
done
command -v readelf >/dev/null || { echo "SKIP: readelf is not installed (binutils)"; exit 77; }

scratch=$(mktemp -d) || exit 1
trap 'rm -rf "$scratch"' EXIT
mkdir "$scratch/src" "$scratch/dist"
(cd "$src" && cp -R setup.py pyproject.toml MANIFEST.in README.md LICENSE CHANGELOG.md cmake core python "$scratch/src/") ||
  fail "cannot copy the sources from $src"
rm -rf "$scratch/src/build"

step() { # step WHAT COMMAND...: runs COMMAND quietly, shows its output when it fails
  what=$1
  shift
  "$@" >"$scratch/log" 2>&1 || { cat "$scratch/log"; fail "$what: $*"; }
}
step "sdist" sh -c "cd '$scratch/src' && '$py' setup.py -q sdist -d '$scratch/dist'"
sdist=$scratch/dist/tshare-$version.tar.gz
[ -f "$sdist" ] || fail "no $sdist (version.h says $version): $(ls "$scratch/dist")"
step "wheel from the sdist" "$py" -m pip wheel --no-build-isolation --no-deps --no-index -w "$scratch/dist" "$sdist"
wheel=$(ls "$scratch"/dist/tshare-"$version"-*.whl 2>/dev/null) || fail "no wheel of $version in $scratch/dist"
echo "built $(basename "$sdist") and $(basename "$wheel")"

venv=$scratch/venv
step "venv" "$py" -m venv --system-site-packages "$venv"
# An interpreter that is itself a venv lends the new one its base's
# site-packages, not its own: point the new venv at where its torch lives.
if ! "$venv/bin/python" -c "import torch" 2>/dev/null; then
  torch_site=$("$py" -c "import os, torch; print(os.path.dirname(os.path.dirname(torch.__file__)))") ||
    fail "$py imports torch, but its location could not be read"
  echo "$torch_site" >"$(echo "$venv"/lib/python3*/site-packages)/_test-torch-site.pth"
fi
step "install" "$venv/bin/pip" install --no-deps --no-index "$wheel"
cd "$scratch" || exit 1

"$venv/bin/python" - "$venv" "$version" <<'EOF' || fail "the installed package"
import importlib.metadata, os, sys
venv, version = sys.argv[1], sys.argv[2]
import tshare
assert tshare.__file__.startswith(venv), "imported %s, not the venv's" % tshare.__file__
assert importlib.metadata.version("tshare") == version, importlib.metadata.version("tshare")
assert tshare.__version__ == version, tshare.__version__
print("installed:", tshare.__file__, "version", version)
EOF

so=$(ls "$venv"/lib/python3*/site-packages/tshare/_tshare*.so) || fail "no extension installed"
needed=$(readelf -d "$so" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p' | sort | tr '\n' ' ')
case "$needed" in
"ld-linux-x86-64.so.2 libc.so.6 " | "libc.so.6 " | "ld-linux-aarch64.so.1 libc.so.6 ") ;;
*) fail "$so needs more than libc: $needed" ;;
esac
exported=$(readelf --dyn-syms -W "$so" | awk '$5 != "LOCAL" && $7 != "UND" && $4 == "FUNC" {print $8}' | tr '\n' ' ')
[ "$exported" = "PyInit__tshare " ] || fail "$so exports more than PyInit__tshare: $exported"
echo "extension needs $needed; exports $exported"

# tshare._torch_native: built where the building interpreter has torch (and
# it compiles); where it was, the installed package must use it.
if ls "$venv"/lib/python3*/site-packages/tshare/_torch_native*.so >/dev/null 2>&1; then
  "$venv/bin/python" -c "from tshare import _sets; assert _sets._native is not None, 'installed but not used'" ||
    fail "tshare._torch_native was installed, and the package does not use it"
  echo "tshare._torch_native installed and used"
else
  echo "tshare._torch_native not built (setup.py says why in its output)"
fi

TSHARE_TEST_PYTHON=$venv/bin/python "$wrapper" "$src/tests/python/test_api.py" release_once ||
  fail "test_api.py release_once against the installed package"
TSHARE_TEST_PYTHON=$venv/bin/python "$wrapper" -c "import tshare; assert tshare.__file__.startswith('$venv'), tshare.__file__" ||
  fail "the tests' interpreter with TSHARE_TEST_PYTHON did not import the installed package"

step "uninstall" "$venv/bin/pip" uninstall -y tshare
left=$(ls -d "$venv"/lib/python3*/site-packages/tshare* 2>/dev/null)
[ -z "$left" ] || fail "pip uninstall left $left"
"$venv/bin/python" -c "import tshare" 2>/dev/null && fail "tshare still imports after pip uninstall"
echo "pip uninstall removed it"
