#!/usr/bin/env bash
# Compile-check the C++ torch extension (python/stitch_alloc/csrc/stitch_torch.cpp), and
# scripts/torch-alloc-pair.cpp, against torch 2.11's headers on a machine with no GPU and
# no torch installed: downloads the torch wheel (no dependencies, about 530 MB) and the
# CUDA runtime and crt header wheels, unpacks
# only their headers, compiles the extension to an object file, then links it as a shared
# library against the wheel's libc10/libtorch (only undefined Python and CUDA runtime symbols
# are allowed: those come from the interpreter and libcudart at run time), which proves
# every torch symbol it uses exists in that torch.
#
#   bash scripts/check-torch-ext.sh             # downloads into a temporary folder
#   TORCH_EXT_WHEELS=dir bash scripts/check-torch-ext.sh   # reuse (or keep) the wheels there
#
# Needs python3 with pip, and g++. Called by .ci/run; about a minute on 2 cores.
set -euo pipefail
cd "$(dirname "$0")/.."
TORCH_VERSION=${TORCH_VERSION:-2.11.0}
CUDA_TOOLKIT=${CUDA_TOOLKIT:-13.0.2}
wheels=${TORCH_EXT_WHEELS:-$(mktemp -d)}
mkdir -p "$wheels"
work=$(mktemp -d)
trap 'rm -rf "$work"; [ -n "${TORCH_EXT_WHEELS:-}" ] || rm -rf "$wheels"' EXIT
t0=$(date +%s)

# The wheels for this machine and Python (the headers are the same for every Python).
if ! ls "$wheels"/torch-"$TORCH_VERSION"-*.whl >/dev/null 2>&1; then
    python3 -m pip download -q "torch==$TORCH_VERSION" --no-deps --only-binary=:all: -d "$wheels"
fi
if ! ls "$wheels"/nvidia_cuda_crt-*.whl >/dev/null 2>&1; then
    # cuda_runtime_api.h (cudart) and crt/host_config.h (crt), which it includes.
    python3 -m pip download -q "cuda-toolkit[cudart,crt]==$CUDA_TOOLKIT" --only-binary=:all: \
        -d "$wheels"
fi
t1=$(date +%s)

# Only the headers and the libraries linked against (python's zipfile: no unzip needed).
extract() { # wheel, destination, fnmatch patterns...
    python3 - "$@" <<'PY'
import fnmatch, sys, zipfile
whl, dest, pats = sys.argv[1], sys.argv[2], sys.argv[3:]
with zipfile.ZipFile(whl) as z:
    z.extractall(dest, [n for n in z.namelist() if any(fnmatch.fnmatch(n, p) for p in pats)])
PY
}
extract "$(ls "$wheels"/torch-"$TORCH_VERSION"-*.whl | head -1)" "$work" 'torch/include/*' \
    torch/lib/libc10.so torch/lib/libc10_cuda.so torch/lib/libtorch_cpu.so \
    torch/lib/libtorch_cuda.so torch/lib/libtorch_python.so
for w in "$wheels"/nvidia_cuda_runtime-*.whl "$wheels"/nvidia_cuda_crt-*.whl; do
    extract "$w" "$work" '*/include/*'
done
cuda_inc=$(dirname "$(find "$work" -path '*nvidia*' -name cuda_runtime_api.h | head -1)")
crt_inc=$(dirname "$(dirname "$(find "$work" -path '*nvidia*/crt/host_config.h' | head -1)")")
py_inc=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["include"])')
T="$work/torch"
t2=$(date +%s)

g++ -std=c++17 -fPIC -D_GLIBCXX_USE_CXX11_ABI=1 -DTORCH_EXTENSION_NAME=stitch_alloc_torch \
    -O0 -Wall -Wextra -Wno-unused-parameter -Werror \
    -I include -I "$T/include" -I "$T/include/torch/csrc/api/include" \
    -I "$cuda_inc" -I "$crt_inc" -I "$py_inc" \
    -c python/stitch_alloc/csrc/stitch_torch.cpp -o "$work/stitch_torch.o"
# scripts/torch-alloc-pair.cpp (torch-alloc-pair.py builds it on the GPU machine) compiles
# against the same headers.
g++ -std=c++17 -fPIC -D_GLIBCXX_USE_CXX11_ABI=1 -DTORCH_EXTENSION_NAME=stitch_alloc_pair \
    -O0 -Wall -Wextra -Wno-unused-parameter -Werror \
    -I "$T/include" -I "$T/include/torch/csrc/api/include" \
    -I "$cuda_inc" -I "$crt_inc" -I "$py_inc" \
    -c scripts/torch-alloc-pair.cpp -o "$work/torch_alloc_pair.o"
# Every undefined symbol must be a torch one the wheel's libraries define, or a Python /
# CUDA runtime one (resolved at run time).
undefined=$(g++ -shared -o "$work/stitch_torch.so" "$work/stitch_torch.o" -L "$T/lib" \
    -lc10 -lc10_cuda -ltorch_cpu -ltorch_cuda -ltorch_python -Wl,--no-undefined \
    -Wl,--unresolved-symbols=ignore-in-shared-libs 2>&1 |
    sed -n 's/.*undefined reference to `\([^'"'"']*\).*/\1/p' | sort -u |
    grep -Ev '^_?Py|^cuda' || true)
if [ -n "$undefined" ]; then
    echo "check-torch-ext: symbols torch $TORCH_VERSION does not define:"
    echo "$undefined" | c++filt
    exit 1
fi
t3=$(date +%s)
echo "check-torch-ext: the extension compiles and links against torch $TORCH_VERSION" \
    "(download $((t1 - t0)) s, unpack $((t2 - t1)) s, compile and link $((t3 - t2)) s)"
