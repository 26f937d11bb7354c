#!/usr/bin/env bash
# The similarity bench's peers for an offline GPU machine that has CUDA 13 only: two archives
# of unpacked wheels (each under 32 MiB, so that each fits a 64 MiB transfer beside .whl), and
# a libcublas.so.12 that forwards the cuBLAS calls FAISS imports to CUDA 13's cuBLAS.
# Run from the repository root: bash tools/peers/build.sh  ->  .peersA/a.tar.xz, .peersB/b.tar.xz
# On the GPU machine, after `source .whl/prelude.sh`:
#   mkdir -p /tmp/peers && tar -xJf .peersA/a.tar.xz -C /tmp/peers   (then b.tar.xz the same way)
#   export PYTHONPATH="$PYTHONPATH:/tmp/peers" _FAISS_WHEEL_DISABLE_CUDA_PRELOAD=1
#   export CUBLAS13_PATH=<the machine's libcublas.so.13>
#   export LD_LIBRARY_PATH="/tmp/peers/nvidia/cuda_runtime/lib:$(dirname "$CUBLAS13_PATH")"
#   python -m dask_gpuchunk bench similarity --device-budget 8GiB --peer-rows 131072
set -euo pipefail
work=$(mktemp -d)
site=$work/site
mkdir -p "$site"
plat="--platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64
      --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
# nvMolKit 0.7.0 links RDKit 2026.03.6's libraries by their hashed names: that RDKit, no other.
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  $plat -d "$work/wheels" rdkit==2026.3.6 nvmolkit==0.7.0 nvidia-cuda-runtime-cu12==12.9.79 \
  fpsim2==0.7.4 tables==3.11.1 numexpr blosc2 ndindex py-cpuinfo pydantic pydantic-core \
  annotated-types typing-inspection faiss-gpu-cu12==1.14.1.post1
for w in "$work"/wheels/*.whl; do unzip -q -o "$w" -d "$site"; done
# nvMolKit's similarity call and what it links; the rest of it (conformers, force fields) is 200 MB.
keep="__init__.py _DataStructs.so _arrayHelpers.so libSimilarity.so libsimilarity_kernels.so
      libexceptions.so libdevice.so libopenmp_helpers.so"
mkdir "$work/nvmolkit" && for f in $keep; do cp "$site/nvmolkit/$f" "$work/nvmolkit/"; done
rm -rf "$site/nvmolkit" "$site/rdkit-stubs" "$site"/nvidia/cuda_runtime/lib/*.a && mv "$work/nvmolkit" "$site/"
here=$(cd "$(dirname "$0")" && pwd)
echo 'libcublas.so.12 { global: cublas*; local: *; };' > "$work/v.map"
gcc -O2 -shared -fPIC -Wl,--version-script="$work/v.map" -Wl,-soname,libcublas.so.12 \
  -o "$site/faiss_gpu_cu12.libs/libcublas.so.12" "$here/cublas12_shim.c" -ldl
echo 'libcublasLt.so.12 { local: *; };' > "$work/lt.map" && echo 'int cublaslt12_unused;' > "$work/lt.c"
gcc -shared -fPIC -Wl,--version-script="$work/lt.map" -Wl,-soname,libcublasLt.so.12 \
  -o "$site/faiss_gpu_cu12.libs/libcublasLt.so.12" "$work/lt.c"
cd "$site"
a="rdkit rdkit.libs nvmolkit nvmolkit.libs nvidia FPSim2 numexpr ndindex cpuinfo"
a="$a $(ls -d rdkit-*.dist-info nvmolkit-*.dist-info nvidia_cuda_runtime*.dist-info fpsim2-*.dist-info \
        numexpr-*.dist-info ndindex-*.dist-info py_cpuinfo-*.dist-info)"
b=$(ls | grep -vxF "$(echo $a | tr ' ' '\n')")
root=$(cd "$here/../.." && pwd)
mkdir -p "$root/.peersA" "$root/.peersB"
tar -cf - $a | xz -T2 -6 > "$root/.peersA/a.tar.xz"
tar -cf - $b | xz -T2 -6 > "$root/.peersB/b.tar.xz"
du -sh "$root/.peersA/a.tar.xz" "$root/.peersB/b.tar.xz"
rm -rf "$work"
