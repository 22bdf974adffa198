#!/bin/sh
# Run `tshare-launch demo ARGS`; with --device cuda on a machine without a
# usable GPU, skip (77) with the launcher's reason instead of failing.
launch=$1
shift
out=$("$launch" demo "$@" 2>&1)
rc=$?
printf '%s\n' "$out"
if [ $rc -ne 0 ] && printf '%s' "$out" | grep -q "tshare-launch: --device cuda:"; then
  echo "SKIP: no usable CUDA device"
  exit 77
fi
exit $rc
