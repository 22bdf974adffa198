#!/bin/sh
# make demo's Python part: a Python weights server feeding the LibTorch C++
# inference workers, then the C++ server feeding Python workers; then the
# weight-sync pattern: a Python trainer pushing weight versions to LibTorch
# C++ workers, and a C++ trainer to Python workers; each through
# tshare-launch. Skipped, saying why, where a piece is not built.
#   examples/python/run_demo.sh BUILD_DIR
here=$(cd "$(dirname "$0")" && pwd)
build=$(cd "${1:-build}" && pwd)
py=$(cat "$build/python/interpreter" 2>/dev/null)
if [ -z "$py" ]; then
  echo "demo: the Python package is not built (see cmake's output); skipping the Python examples"
  exit 0
fi
if ! "$py" -c "import torch" >/dev/null 2>&1; then
  echo "demo: $py has no torch (Debian: apt-get install python3-torch); skipping the Python examples"
  exit 0
fi
if [ ! -x "$build/examples/torch/weights_server" ]; then
  echo "demo: the LibTorch examples are not built; skipping the Python examples"
  exit 0
fi
export PYTHONPATH="$build/python${PYTHONPATH:+:$PYTHONPATH}"
launch="$build/launcher/tshare-launch"
echo "demo: a Python weights server and two LibTorch C++ workers"
"$launch" --consumers 2 --producer "$py $here/weights_server.py" --consumer "$build/examples/torch/inference_worker" || exit 1
echo "demo: a LibTorch C++ weights server and two Python workers"
"$launch" --consumers 2 --producer "$build/examples/torch/weights_server" --consumer "$py $here/inference_worker.py" || exit 1
echo "demo: weight sync: a Python trainer updates its model in place and pushes each version to two LibTorch C++ workers"
"$launch" --consumers 2 --producer "$py $here/weight_sync_trainer.py --versions 5" \
  --consumer "$build/examples/torch/weight_sync_worker" || exit 1
echo "demo: weight sync: a LibTorch C++ trainer and two Python workers"
"$launch" --consumers 2 --producer "$build/examples/torch/weight_sync_trainer --versions 5" \
  --consumer "$py $here/weight_sync_worker.py"
