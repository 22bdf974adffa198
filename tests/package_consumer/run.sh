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
pcdir=$(ls -d "$work"/prefix/lib*/pkgconfig | head -n 1)
version=$(sed -n 's/^Version: \([0-9]*\.[0-9]*\).*/\1/p' "$pcdir/tshare.pc") # MAJOR.MINOR

# The installed targets are relocatable: no path of the build tree, and
# LibTorch reached through Torch's own package targets, never a library path
# of this machine (such as /usr/lib/x86_64-linux-gnu/libc10.so).
if grep -nE 'INTERFACE_|IMPORTED_' "$work"/prefix/lib*/cmake/tshare/*Targets*.cmake | grep -E '("|;)/' ||
  grep -nF "$build_dir" "$work"/prefix/lib*/cmake/tshare/*Targets*.cmake; then
  echo "the installed targets (above) name absolute paths of the build machine"
  exit 1
fi

# A project asking only for tshare::core never looks for LibTorch: nothing
# of LibTorch (or Caffe2, its CMake package) in its configure output.
cmake -S "$src_dir" -B "$work/cmake-build" -DCMAKE_PREFIX_PATH="$work/prefix" -DTSHARE_WANTED_VERSION="$version" \
  -DCMAKE_C_FLAGS="$extra_cflags" -DCMAKE_EXE_LINKER_FLAGS="$extra_cflags" >"$work/cmake-configure.log" 2>&1 ||
  { echo "configuring the consumer failed:"; cat "$work/cmake-configure.log"; exit 1; }
if grep -E 'Torch|Caffe2|c10' "$work/cmake-configure.log"; then
  echo "configuring a project that asks only for tshare::core printed LibTorch's output (above)"
  exit 1
fi
cmake --build "$work/cmake-build" >/dev/null
"$work/cmake-build/uses_tshare"
"$work/cmake-build/uses_tshare_shared"
# It loads the installed libtshare.so by its versioned SONAME.
ldd "$work/cmake-build/uses_tshare_shared" | grep -q "libtshare.so.$version => $work/prefix/" ||
  { echo "uses_tshare_shared does not load the installed libtshare.so:"; ldd "$work/cmake-build/uses_tshare_shared"; exit 1; }
if command -v pkg-config >/dev/null 2>&1; then
  # A static link through pkg-config adds what the CMake package adds.
  pc_static=$(PKG_CONFIG_PATH=$pcdir pkg-config --static --libs tshare | tr ' ' '\n' |
    grep -v -e '^-L' -e '^-ltshare$' -e '^$' | sort -u | tr '\n' ' ' || true)
  cmake_static=$(tr ';' '\n' <"$work/cmake-build/static_link_flags.txt" | grep -v '^$' | sort -u | tr '\n' ' ' || true)
  [ "$pc_static" = "$cmake_static" ] ||
    { echo "pkg-config --static --libs adds '$pc_static', the CMake package's tshare::core '$cmake_static'"; exit 1; }
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
    -DTSHARE_WANTED_VERSION="$version" \
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
