#!/usr/bin/env bash
# Build ggml's CUDA backend from the libggml-python source distribution into a prefix, then
# build and install ott-gguf against it with its CUDA path on (OTT_CUDA=ON).
#
#   bash bench/build_cuda.sh [--ggml-only] [PREFIX]      PREFIX default: build/ggml-cuda
#
# Environment:
#   CUDA_ARCHS   CUDA architectures of ggml and of our kernels (default "80;86;89;90";
#                "90" alone builds ggml in about 4 minutes on 16 cores)
#   JOBS         parallel compile jobs (default: all cores)
#   GGML_SDIST   libggml_python-0.20.2.post1.tar.gz already downloaded (default: fetched with
#                pip download --no-deps --no-binary :all: libggml-python==0.20.2.post1)
#   GGML_CMAKE_ARGS  extra arguments of ggml's cmake configure (e.g. -DCUDA_cublas_LIBRARY=...
#                when cuBLAS comes from the nvidia-cublas wheel rather than the CUDA toolkit)
#   PIP_ARGS     extra arguments of the final pip install (e.g. "--no-deps --no-index" offline)
#
# Needs nvcc (CUDA 12 or 13), cmake >= 3.21, ninja, and scikit-build-core, cffi and numpy in
# the Python environment: the package is built without build isolation so that it links the
# ggml in PREFIX (isolation would fetch the CPU-only libggml-python wheel instead).
set -euo pipefail

GGML_VERSION=0.20.2.post1
ggml_only=0
if [[ "${1:-}" == "--ggml-only" ]]; then ggml_only=1; shift; fi
REPO="$(cd "$(dirname "$0")/.." && pwd)"
PREFIX="$(mkdir -p "${1:-$REPO/build/ggml-cuda}" && cd "${1:-$REPO/build/ggml-cuda}" && pwd)"
ARCHS="${CUDA_ARCHS:-80;86;89;90}"
JOBS="${JOBS:-$(nproc)}"
WORK="$PREFIX.work"
mkdir -p "$WORK"

# 1. the source distribution
if [[ -z "${GGML_SDIST:-}" ]]; then
  python3 -m pip download --no-deps --no-binary :all: "libggml-python==$GGML_VERSION" -d "$WORK"
  GGML_SDIST="$WORK/libggml_python-$GGML_VERSION.tar.gz"
fi
rm -rf "$WORK/src" && mkdir -p "$WORK/src"
tar xzf "$GGML_SDIST" -C "$WORK/src" --strip-components=1

# 2. ggml with its CUDA backend (the CPU backend built as in the wheel: AVX2/FMA/F16C, no
#    OpenMP; CUDA graphs on, ggml's default being off outside llama.cpp), installed with the
#    CUDA libraries' folder in its run path
# shellcheck disable=SC2086
cmake -S "$WORK/src/ggml" -B "$WORK/build" -G Ninja \
  -DCMAKE_BUILD_TYPE=Release \
  -DCMAKE_INSTALL_PREFIX="$PREFIX" \
  -DCMAKE_INSTALL_RPATH='$ORIGIN' \
  -DCMAKE_INSTALL_RPATH_USE_LINK_PATH=ON \
  -DCMAKE_CUDA_ARCHITECTURES="$ARCHS" \
  -DGGML_CUDA=ON \
  -DGGML_NATIVE=OFF \
  -DGGML_OPENMP=OFF \
  -DGGML_CUDA_GRAPHS=ON \
  -DGGML_CCACHE=OFF \
  -DGGML_BUILD_TESTS=OFF \
  -DGGML_BUILD_EXAMPLES=OFF \
  ${GGML_CMAKE_ARGS:-}
cmake --build "$WORK/build" -j "$JOBS"
cmake --install "$WORK/build"
ggml_DIR="$(dirname "$(find "$PREFIX" -name ggml-config.cmake -print -quit)")"
echo "ggml with CUDA installed in $PREFIX (ggml_DIR=$ggml_DIR)"
[[ $ggml_only == 1 ]] && exit 0

# 3. ott-gguf against it
# shellcheck disable=SC2086
python3 -m pip install --no-build-isolation ${PIP_ARGS:-} "$REPO" \
  -Cbuild-dir="$REPO/build/cuda-{wheel_tag}" \
  -Ccmake.define.OTT_CUDA=ON \
  -Ccmake.define.ggml_DIR="$ggml_DIR" \
  -Ccmake.define.CMAKE_CUDA_ARCHITECTURES="$ARCHS"
