#!/bin/sh
# run_interop.sh PYTHON DEVICE LAUNCHER ARGS...: tshare-launch ARGS with the
# interop roles, skipped (77) when DEVICE is cuda and torch sees no GPU.
py=$1 device=$2
shift 2
if ! "$py" -c "import torch" >/dev/null 2>&1; then
  echo "SKIP: $py has no torch (Debian: apt-get install python3-torch)"
  exit 77
fi
if [ "$device" = cuda ] && ! "$py" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  echo "SKIP: torch sees no CUDA device here"
  exit 77
fi
exec "$@"
