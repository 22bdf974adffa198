#!/usr/bin/env bash
# On a GPU machine: build with the LibTorch of python3's torch and run the
# GPU, LibTorch, Python and zeroing suites under PyTorch's default allocator
# and again with expandable segments. LABELS (a ctest -L regex) or REGEX (a
# ctest -R regex) choose other tests, MODES ("default expandable") the
# allocator modes; logs go to $OUT (default build-gpu/logs).
set -u
cd "$(dirname "$0")/.."
out=${OUT:-build-gpu/logs}
mkdir -p "$out"
nvidia-smi -L | tee "$out/gpu.txt"
prefix=$(python3 -c 'import torch; print(torch.utils.cmake_prefix_path)') || { echo "python3 cannot import torch"; exit 1; }
generator=$(command -v ninja >/dev/null && echo Ninja || echo "Unix Makefiles")
cmake -S . -B build-gpu -G "$generator" -DCMAKE_BUILD_TYPE=Release -DCMAKE_PREFIX_PATH="$prefix" \
  -DTSHARE_PYTHON="$(command -v python3)" >"$out/configure.log" 2>&1 || { tail -30 "$out/configure.log"; exit 1; }
cmake --build build-gpu -j "$(nproc)" >"$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
if [ -n "${REGEX:-}" ]; then select=(-R "$REGEX"); else select=(-L "${LABELS:-gpu|torch|python|zeroing}"); fi
rc=0
for mode in ${MODES:-default expandable}; do
  if [ $mode = expandable ]; then export PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True; else unset PYTORCH_CUDA_ALLOC_CONF; fi
  ctest --test-dir build-gpu --output-on-failure -j 4 "${select[@]}" --timeout 300 >"$out/ctest-$mode.log" 2>&1 || rc=1
  echo "== $mode:"
  grep -E "tests passed|\(Failed\)|\(Timeout\)|\(SEGFAULT\)|\(Skipped\)" "$out/ctest-$mode.log"
done
exit $rc
