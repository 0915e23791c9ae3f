#!/usr/bin/env bash
# Build-time headers of the CUDA backend, from PyPI (never a run-time dependency): the cuDNN frontend
# (header-only; cuDNN itself is loaded at run time) into .deps/cudnn-frontend/include, and CUTLASS
# (the nvidia-cutlass wheel carries its C++ headers) into .deps/cutlass/include.  Idempotent: nothing
# is fetched when the pinned versions are already there.  Called by scripts/setup.sh when nvcc is
# installed; the build compiles the cuDNN attention and the grouped GEMM when the headers are present.
set -euo pipefail
cd "$(dirname "$0")/.."
FRONTEND_VERSION=1.32.0
CUTLASS_VERSION=4.2.0.0

# fetch PACKAGE VERSION DEST PREFIX...: the wheel's files under each PREFIX, into DEST/include.
fetch() {
  local package=$1 version=$2 dest=$3
  shift 3
  if [[ -f $dest/VERSION && $(cat "$dest/VERSION") == "$version" ]]; then
    echo "fetch-gpu-headers: $package $version present"
    return 0
  fi
  local tmp
  tmp=$(mktemp -d)
  python3 -m pip download --quiet --no-deps --only-binary=:all: "$package==$version" -d "$tmp"
  rm -rf "$dest"
  mkdir -p "$dest/include"
  python3 - "$tmp" "$dest/include" "$@" <<'PY'
import glob, os, shutil, sys, zipfile
wheel = glob.glob(os.path.join(sys.argv[1], "*.whl"))[0]
dest, prefixes = sys.argv[2], sys.argv[3:]
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        for p in prefixes:
            if name.startswith(p) and not name.endswith("/"):
                out = os.path.join(dest, name[len(p):])
                os.makedirs(os.path.dirname(out), exist_ok=True)
                with z.open(name) as src, open(out, "wb") as dst:
                    shutil.copyfileobj(src, dst)
PY
  rm -rf "$tmp"
  echo "$version" >"$dest/VERSION"
  echo "fetch-gpu-headers: $package $version in $dest/include"
}

fetch nvidia-cudnn-frontend "$FRONTEND_VERSION" .deps/cudnn-frontend include/
fetch nvidia-cutlass "$CUTLASS_VERSION" .deps/cutlass cutlass_library/source/include/ \
  cutlass_library/source/tools/util/include/
