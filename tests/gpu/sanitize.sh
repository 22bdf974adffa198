#!/bin/sh
# compute-sanitizer memcheck over a GPU test, both processes included.
# Usage: sanitize.sh COMPUTE_SANITIZER TEST_BINARY TEST_NAME
sanitizer=$1 bin=$2 name=$3
"$bin" has_device >/dev/null 2>&1 || { echo "SKIP: no CUDA device"; exit 77; }
[ -x "$sanitizer" ] || { echo "SKIP: compute-sanitizer not found"; exit 77; }
exec "$sanitizer" --tool memcheck --target-processes all --error-exitcode 1 "$bin" "$name"
