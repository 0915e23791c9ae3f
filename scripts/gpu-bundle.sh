#!/usr/bin/env bash
# Makes the GPU check's bundle: the binaries scripts/gpu-check.sh runs, built HERE (nvcc is installed
# on this machine; the GPU machine has no compiler toolchain for us and no time to build), stripped,
# with the shared libraries a GPU image lacks, in one folder that git ignores:
#   .gpu-bundle/bin/   moetron and the CUDA test executables, RUNPATH $ORIGIN/../lib
#   .gpu-bundle/lib/   yaml-cpp, fmt, sentencepiece, libgomp (OpenMP), and libblas.so.3 (the reference
#                      CBLAS, 0.5 MB: the CPU side of the check's comparisons is small; OpenBLAS
#                      would be 36 MB), RUNPATH $ORIGIN
# Not bundled: the C/C++ runtime (libc, libm, libdl, libpthread, librt, libstdc++, libgcc_s) and what
# is loaded at run time from the image: the CUDA driver, cuBLASLt, cuDNN, NCCL (gpu-check.sh puts
# the image's site-packages/nvidia/*/lib on the search path), libmpi (none on the image: the 2-rank
# stage is skipped there).
#   bash scripts/gpu-bundle.sh             # builds BUILD_DIR (build) with CUDA, then bundles
# Environment: BUILD_DIR (build), BUNDLE_DIR (.gpu-bundle), MOETRON_BUNDLE_NO_BUILD=1 (bundle what
# BUILD_DIR holds: the test that checks the bundle).  Prints the bundle's size; fails over 50 MiB.
set -euo pipefail
cd "$(dirname "$0")/.."
BUILD_DIR=${BUILD_DIR:-build}
BUNDLE_DIR=${BUNDLE_DIR:-.gpu-bundle}
BINARIES=(moetron test_cuda_ops test_cuda_model test_backend_ops test_model_infer test_infer_cli)
# The runtime libraries a GPU image is assumed to have (and the kernel's vDSO).
ALLOWED='^(linux-vdso|ld-linux-x86-64|libc|libm|libdl|libpthread|librt|libstdc\+\+|libgcc_s)\.so'
MAX_BYTES=$((50 * 1024 * 1024))

for tool in patchelf strip readelf; do
  command -v "$tool" >/dev/null || { echo "gpu-bundle: $tool is missing (bash scripts/setup.sh installs it)" >&2; exit 1; }
done
if [[ ${MOETRON_BUNDLE_NO_BUILD:-0} != 1 ]]; then
  bash scripts/setup.sh
  BUILD_TARGETS="${BINARIES[*]}" BUILD_DIR=$BUILD_DIR bash scripts/build.sh -DMOETRON_CUDA=ON
fi
[[ -f $BUILD_DIR/libmoetron_cuda.a ]] ||
  { echo "gpu-bundle: $BUILD_DIR was configured without the CUDA backend (nvcc not found?)" >&2; exit 1; }

rm -rf "$BUNDLE_DIR"
mkdir -p "$BUNDLE_DIR/bin" "$BUNDLE_DIR/lib"
for b in "${BINARIES[@]}"; do
  [[ -x $BUILD_DIR/$b ]] || { echo "gpu-bundle: $BUILD_DIR/$b was not built" >&2; exit 1; }
  cp "$BUILD_DIR/$b" "$BUNDLE_DIR/bin/$b"
done

# Copies the library a NEEDED soname resolves to (by this machine's loader) unless it is allowed.
copy_needed() {
  local file=$1 soname path
  for soname in $(readelf -d "$file" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p'); do
    [[ $soname =~ $ALLOWED ]] && continue
    [[ -e $BUNDLE_DIR/lib/$soname ]] && continue
    # (awk reads to the end: an early exit would kill ldconfig with SIGPIPE under pipefail)
    path=$(ldconfig -p | awk -v s="$soname" '$1 == s && /x86-64/ && !p {p = $NF} END {print p}')
    [[ -n $path ]] || { echo "gpu-bundle: $file needs $soname, which this machine cannot find" >&2; exit 1; }
    cp -L "$path" "$BUNDLE_DIR/lib/$soname"
    copy_needed "$BUNDLE_DIR/lib/$soname"
  done
}
for b in "$BUNDLE_DIR"/bin/*; do copy_needed "$b"; done
# Loaded with dlopen, not NEEDED: a CBLAS for the CPU backend (src/ops/blas.cpp tries libblas.so.3
# after OpenBLAS).
# Debian's reference BLAS (libblas3), not whatever the libblas.so.3 alternative points to (OpenBLAS).
blas=/usr/lib/x86_64-linux-gnu/blas/libblas.so.3
[[ -e $blas ]] || { echo "gpu-bundle: no $blas on this machine (apt-get install libblas3)" >&2; exit 1; }
cp -L "$blas" "$BUNDLE_DIR/lib/libblas.so.3"
copy_needed "$BUNDLE_DIR/lib/libblas.so.3"

strip --strip-unneeded "$BUNDLE_DIR"/bin/* "$BUNDLE_DIR"/lib/*
for b in "$BUNDLE_DIR"/bin/*; do patchelf --set-rpath '$ORIGIN/../lib' "$b"; done
for l in "$BUNDLE_DIR"/lib/*; do patchelf --set-rpath '$ORIGIN' "$l"; done

bytes=$(du -sb "$BUNDLE_DIR" | cut -f1)
echo "gpu-bundle: $BUNDLE_DIR: $(ls "$BUNDLE_DIR/bin" | wc -l) binaries, $(ls "$BUNDLE_DIR/lib" | wc -l) libraries" \
  "($(ls "$BUNDLE_DIR/lib" | tr '\n' ' ')), $((bytes / 1024)) KiB"
if ((bytes > MAX_BYTES)); then
  echo "gpu-bundle: the bundle is $bytes bytes, over the 50 MiB the GPU machine is sent with the tree" >&2
  exit 1
fi
