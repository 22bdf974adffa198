#!/bin/sh
# Install the build into a scratch prefix, then build and run a project
# outside the tree against it: once with find_package, once with pkg-config.
set -eu
build_dir=$(cd "$1" && pwd)
extra_cflags=${2:-} # a sanitizer build's flags: its static library needs them to link
src_dir=$(cd "$(dirname "$0")" && pwd)
work=$build_dir/package-test
rm -rf "$work"
cmake --install "$build_dir" --prefix "$work/prefix" >/dev/null
cmake -S "$src_dir" -B "$work/cmake-build" -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DCMAKE_C_FLAGS="$extra_cflags" -DCMAKE_EXE_LINKER_FLAGS="$extra_cflags" >/dev/null
cmake --build "$work/cmake-build" >/dev/null
"$work/cmake-build/uses_tshare"
"$work/cmake-build/uses_tshare_shared"
# It loads the installed libtshare.so by its versioned SONAME.
ldd "$work/cmake-build/uses_tshare_shared" | grep -q "libtshare.so.$(sed -n 's/^Version: \([0-9]*\)\.\([0-9]*\).*/\1.\2/p' "$work"/prefix/lib*/pkgconfig/tshare.pc) => $work/prefix/" ||
  { echo "uses_tshare_shared does not load the installed libtshare.so:"; ldd "$work/cmake-build/uses_tshare_shared"; exit 1; }
pcdir=$(ls -d "$work"/prefix/lib*/pkgconfig | head -n 1)
if command -v pkg-config >/dev/null 2>&1; then
  # pkg-config links the shared library; the loader finds it through the path.
  PKG_CONFIG_PATH=$pcdir cc -std=c11 $extra_cflags -o "$work/uses_tshare_pc" "$src_dir/main.c" \
    $(PKG_CONFIG_PATH=$pcdir pkg-config --cflags --libs tshare)
  LD_LIBRARY_PATH=$(dirname "$pcdir") "$work/uses_tshare_pc"
else
  echo "pkg-config not installed: skipped the pkg-config half"
fi
if [ -f "$work"/prefix/lib*/cmake/tshare/tshareTorchTargets.cmake ]; then
  # The bridge was built: a LibTorch project finds it (and LibTorch) the same way.
  cmake -S "$src_dir/../package_consumer_torch" -B "$work/torch-build" -DCMAKE_PREFIX_PATH="$work/prefix" \
    -DCMAKE_CXX_FLAGS="$extra_cflags" -DCMAKE_EXE_LINKER_FLAGS="$extra_cflags" >/dev/null
  cmake --build "$work/torch-build" >/dev/null
  "$work/torch-build/uses_tshare_torch"
  "$work/torch-build/uses_tshare_torch_shared" # the installed shared libraries, found through their RUNPATH
else
  echo "the torch bridge is not built: skipped the LibTorch project"
fi
"$work/prefix/bin/tshare-launch" --help >/dev/null
# The installed C examples, copied out and built on their own, run by the
# installed launcher.
cp -r "$work"/prefix/share/tshare/examples/c "$work/examples-c"
cmake -S "$work/examples-c" -B "$work/examples-c/build" -DCMAKE_PREFIX_PATH="$work/prefix" \
  -DCMAKE_C_FLAGS="$extra_cflags" -DCMAKE_EXE_LINKER_FLAGS="$extra_cflags" >/dev/null
cmake --build "$work/examples-c/build" >/dev/null
(cd "$work/examples-c/build" && "$work/prefix/bin/tshare-launch" --producer "./batch_producer 12" \
  --consumer ./batch_consumer --consumers 2 --timeout 60 >"$work/examples-c/run.log" 2>&1) ||
  { echo "the installed C examples failed:"; cat "$work/examples-c/run.log"; exit 1; }
tail -n 1 "$work/examples-c/run.log"
echo "installed package works"
