#!/usr/bin/env bash
# Builds DeepGEMM's deep_gemm._C (torch.utils.cpp_extension, ninja) and installs the package into PREFIX,
# with CUTLASS's cute/ and cutlass/ copied into deep_gemm/include, where its runtime kernel JIT looks.
# Usage: bash scripts/build_deepgemm.sh SRC PREFIX   (SRC: DeepGEMM tree with third-party/fmt filled in,
# e.g. `git clone --recursive https://github.com/deepseek-ai/DeepGEMM` at v2.6.1, commit 54e2261, the one
# ds_comet.bench.library_fp8 --deepgemm calls; its own CUTLASS submodule is not used)
# Needs: CUDA torch, nvcc and ninja on PATH, CUTLASS headers in $CUTLASS_INCLUDE (default below).
set -euo pipefail

die() { echo "build_deepgemm: error: $*" >&2; exit 1; }

[ $# -eq 2 ] || die "usage: bash scripts/build_deepgemm.sh SRC PREFIX"
[ -d "$1" ] || die "SRC $1 is not a directory"
SRC=$(realpath "$1")
PREFIX=$(realpath -m "$2")
PY=${PYTHON:-python3}
CUTLASS_INCLUDE=${CUTLASS_INCLUDE:-/tmp/site/cutlass_library/source/include}

[ -f "$SRC/csrc/python_api.cpp" ] || die "$SRC/csrc/python_api.cpp not found (SRC must be a DeepGEMM tree)"
[ -f "$SRC/third-party/fmt/include/fmt/format.h" ] || die "fmt headers missing: $SRC/third-party/fmt/include"
for d in cute cutlass; do
  [ -d "$CUTLASS_INCLUDE/$d" ] || die "CUTLASS headers missing: $CUTLASS_INCLUDE/$d (set CUTLASS_INCLUDE)"
done
command -v nvcc >/dev/null || die "nvcc not on PATH"
command -v ninja >/dev/null || die "ninja not on PATH"
"$PY" -c 'import torch.utils.cpp_extension' || die "$PY cannot import torch.utils.cpp_extension"
TORCH_LIB=$("$PY" -c 'import os, torch; print(os.path.join(os.path.dirname(torch.__file__), "lib"))')
[ -f "$TORCH_LIB/libtorch_cuda.so" ] || die "torch is not a CUDA build ($TORCH_LIB/libtorch_cuda.so missing)"

# nvcc on PATH may be a wrapper script, so ask nvcc itself for its toolkit root.
if [ -z "${CUDA_HOME:-}" ]; then
  top=$(cd /tmp && nvcc --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n1) || true
  CUDA_HOME=$(realpath "${top:-$(dirname "$(command -v nvcc)")/..}")
fi
[ -x "$CUDA_HOME/bin/nvcc" ] || die "no nvcc at CUDA_HOME/bin ($CUDA_HOME)"
export CUDA_HOME

# cuBLAS(Lt), cuSPARSE, cuSOLVER (pulled in by ATen/cuda/CUDAContext.h) and NVRTC may be missing from
# the toolkit; torch's pip nvidia-* packages carry them (nvidia/cu13/... or nvidia/<name>/...).
mapfile -t NV_DIRS < <("$PY" -c 'import glob, os, sys
dirs = {d for p in sys.path for d in glob.glob(os.path.join(p or ".", "nvidia", "*")) if os.path.isdir(d)}
sys.stdout.write("".join(d + "\n" for d in sorted(dirs)))')
SEARCH=("$CUDA_HOME" "$CUDA_HOME"/targets/*-linux "${NV_DIRS[@]}")

INCS=()
for h in cuda.h cuda_runtime.h nvrtc.h cublasLt.h cusparse.h cusolverDn.h; do
  found=
  for d in "${SEARCH[@]}"; do
    [ -f "$d/include/$h" ] && { found=$d/include; break; }
  done
  [ -n "$found" ] || die "header $h not found in $CUDA_HOME or in pip nvidia packages (${NV_DIRS[*]:-none})"
  [[ " ${INCS[*]} " == *" $found "* ]] || INCS+=("$found")
done
[ -d "$CUDA_HOME/include/cccl" ] && INCS+=("$CUDA_HOME/include/cccl")

LDFLAGS=("-L$TORCH_LIB" -lc10_cuda -ltorch_cuda)
for l in cudart nvrtc cublas cublasLt; do
  found=
  for d in "${SEARCH[@]}"; do
    for f in "$d"/lib64/lib$l.so "$d"/lib/lib$l.so "$d"/lib64/lib$l.so.[0-9]* "$d"/lib/lib$l.so.[0-9]*; do
      [ -f "$f" ] && { found=$f; break 2; }
    done
  done
  [ -n "$found" ] || die "lib$l.so not found in $CUDA_HOME or in pip nvidia packages"
  # Link by full path: the pip wheels ship only versioned names (libnvrtc.so.13). DeepGEMM links only
  # cudart and nvrtc and gets cuBLAS(Lt) through torch_cuda; naming them too costs nothing.
  LDFLAGS+=("$found" "-Wl,-rpath,$(dirname "$found")")
done

echo "build_deepgemm: CUDA_HOME=$CUDA_HOME CUTLASS_INCLUDE=$CUTLASS_INCLUDE"
BUILD=$PREFIX/.deep_gemm_build
mkdir -p "$BUILD"
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
DG_INCS=$(printf '%s\n' "$SRC/deep_gemm/include" "$CUTLASS_INCLUDE" "$SRC/third-party/fmt/include" "${INCS[@]}") \
DG_LDFLAGS=$(printf '%s\n' "${LDFLAGS[@]}") \
"$PY" - "$SRC/csrc/python_api.cpp" "$BUILD" <<'EOF'
import os, sys, torch
from torch.utils.cpp_extension import load

src, build = sys.argv[1:]
# Same host flags as DeepGEMM's setup.py; its C++17 overrides torch's default (c++20 builds too).
cflags = ['-std=' + os.environ.get('DG_HOST_STD', 'c++17'), '-O3', '-fPIC', '-Wno-psabi',
          '-Wno-deprecated-declarations', f'-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}']
if os.environ.get('DG_JIT_USE_RUNTIME_API', '0') == '1':
    cflags.append('-DDG_JIT_USE_RUNTIME_API')
# with_cuda=False: the CUDA include dirs and libraries found above are passed explicitly instead.
load(name='_C', sources=[src], extra_cflags=cflags,
     extra_include_paths=os.environ['DG_INCS'].split('\n'),
     extra_ldflags=os.environ['DG_LDFLAGS'].split('\n'),
     build_directory=build, with_cuda=False, verbose=True)
EOF

PKG=$PREFIX/deep_gemm
rm -rf "$PKG"
cp -r "$SRC/deep_gemm" "$PKG"
# The kernel JIT compiles with -I deep_gemm/include only, so CUTLASS has to be inside the package.
cp -rL "$CUTLASS_INCLUDE/cute" "$CUTLASS_INCLUDE/cutlass" "$PKG/include/"
cp "$BUILD/_C.so" "$PKG/_C$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')"

# deep_gemm/__init__.py applies envs.py's persistent_envs where unset. Pin CUDA_HOME: its own guess
# (parent of `which nvcc`) is not the toolkit when nvcc is a wrapper script outside it.
{
  echo "persistent_envs = dict()"
  echo "persistent_envs['CUDA_HOME'] = '$CUDA_HOME'"
  for v in DG_JIT_CACHE_DIR DG_JIT_PRINT_COMPILER_COMMAND DG_JIT_CPP_STANDARD; do
    [ -z "${!v:-}" ] || echo "persistent_envs['$v'] = '${!v}'"
  done
} > "$PKG/envs.py"

# Import from / so a deep_gemm/ folder in the current directory cannot shadow the installed one.
(cd / && PYTHONPATH="$PREFIX${PYTHONPATH:+:$PYTHONPATH}" "$PY" -c \
  'import deep_gemm; print("deep_gemm", deep_gemm.__version__, "at", deep_gemm.__file__)') \
  || die "import deep_gemm from $PREFIX failed"
