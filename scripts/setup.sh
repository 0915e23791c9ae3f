#!/usr/bin/env bash
# Installs the Debian packages moetron needs to build and test (DESIGN §8). Idempotent; run as root
# (or with sudo available). Skips apt entirely when every package is already installed.
set -euo pipefail

packages=(
  g++ cmake ninja-build pkg-config make git
  libopenblas-dev libopenblas0-openmp
  nlohmann-json3-dev libyaml-cpp-dev libcli11-dev libfmt-dev libcpp-httplib-dev
  libsentencepiece-dev sentencepiece
  libopenmpi-dev openmpi-bin
  libgtest-dev libgmock-dev libbenchmark-dev
  clang libclang-rt-14-dev libomp-14-dev
  patchelf libblas3
)

missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "setup: all ${#packages[@]} packages present"
else
  SUDO=""
  if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  echo "setup: installing ${missing[*]}"
  $SUDO apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
# The CUDA backend's build-time headers (the cuDNN frontend), when there is a CUDA compiler.
if command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ]; then
  bash "$(dirname "$0")/fetch-gpu-headers.sh"
fi
