#!/bin/sh
# compute-sanitizer over a GPU test, every process it starts included.
# Usage: sanitize.sh COMPUTE_SANITIZER TOOL TEST_BINARY TEST_NAME
# (TOOL: memcheck, racecheck, synccheck or initcheck)
sanitizer=$1 tool=$2 bin=$3 name=$4
"$bin" has_device >/dev/null 2>&1 || { echo "SKIP: no CUDA device"; exit 77; }
[ -x "$sanitizer" ] || { echo "SKIP: compute-sanitizer not found"; exit 77; }
exec "$sanitizer" --tool "$tool" --target-processes all --error-exitcode 1 "$bin" "$name"
