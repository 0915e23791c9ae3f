#!/usr/bin/env bash
# Build-time headers of the CUDA backend, from PyPI (never a run-time dependency): the cuDNN frontend
# (header-only; cuDNN itself is loaded at run time) into .deps/cudnn-frontend/include.  Idempotent:
# nothing is fetched when the pinned version is already there.  Called by scripts/setup.sh when nvcc
# is installed; the build compiles the cuDNN attention path when the headers are present.
set -euo pipefail
cd "$(dirname "$0")/.."
FRONTEND_VERSION=1.32.0
dest=.deps/cudnn-frontend
if [[ -f $dest/VERSION && $(cat "$dest/VERSION") == "$FRONTEND_VERSION" && -f $dest/include/cudnn_frontend.h ]]; then
  echo "fetch-gpu-headers: cudnn-frontend $FRONTEND_VERSION present"
  exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
python3 -m pip download --quiet --no-deps --only-binary=:all: "nvidia-cudnn-frontend==$FRONTEND_VERSION" -d "$tmp"
rm -rf "$dest"
mkdir -p "$dest"
python3 - "$tmp" "$dest" <<'PY'
import glob, os, sys, zipfile
wheel = glob.glob(os.path.join(sys.argv[1], "*.whl"))[0]
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        if name.startswith("include/") and not name.endswith("/"):
            z.extract(name, sys.argv[2])
PY
echo "$FRONTEND_VERSION" >"$dest/VERSION"
echo "fetch-gpu-headers: cudnn-frontend $FRONTEND_VERSION in $dest/include"
