#!/bin/sh
# install_check.sh PYTHON BUILD_DIR SITE: the python component installed
# under a scratch DESTDIR imports and works from there, outside the tree.
py=$1 build=$2 site=$3
"$py" -c "import torch" >/dev/null 2>&1 || { echo "SKIP: $py has no torch"; exit 77; }
dest=$(mktemp -d) || exit 1
trap 'rm -rf "$dest"' EXIT
DESTDIR="$dest" cmake --install "$build" --component python >/dev/null || exit 1
cd "$dest" || exit 1
PYTHONPATH="$dest$site" "$py" -c "
import tshare, torch
assert tshare.__file__.startswith('$dest'), tshare.__file__
t = tshare.empty_shared(4, dtype=torch.int32)
assert tshare.is_shared(t) and t.tolist() == [0, 0, 0, 0]
print('installed package works:', tshare.__file__, tshare.__version__)
"
