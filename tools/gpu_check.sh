#!/usr/bin/env bash
# One device call's whole check, logs and figures under $OUT/check (run on the GPU machine, in
# the repository's root, after `source .whl/prelude.sh`; carry .whl, and .rdk for RDKit):
#
#   bash tools/gpu_check.sh                  # everything below
#   bash tools/gpu_check.sh tests loop       # some of it: tests similarity loop gram wgmma
#
# tests:      `pytest -m gpu`, the suite split in two processes on the one GPU (about half the
#             time of one), under the 8 GiB cap unless CUPY_GPU_MEMORY_LIMIT is set.
# similarity: the similarity command as a user types it on 10^6 fingerprints, on a new CuPy
#             kernel cache (a first run compiles) and again; then `bench similarity`.
# loop:       `bench elementwise --loop-sizes` at 4096², 10^7 and 16384² (seed 002's loop; the
#             other tables at a token size), uncapped as the issue measures it.
# gram:       `bench gram` at 16384 x 131072 bits, 4096- and 16384-row chunks.
# wgmma:      the Hopper kernel alone: tools/wgmma_check.py (exact, and its rates beside
#             bmma's), tools/wgmma_probe.py (its parts apart) and tools/gram_path_profile.py
#             (dg.gram beside it); only with `wgmma` named (not in the default list).
set -u
out=${OUT:?run on the device machine, where OUT is set}/check
mkdir -p "$out"
export CUPY_GPU_MEMORY_LIMIT=${CUPY_GPU_MEMORY_LIMIT:-8589934592}
nvidia-smi -L > "$out/gpu.txt"
python3 -m dask_gpuchunk info > "$out/info.txt" 2>&1
if [ -d .rdk ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .rdk/*.whl
fi

timed() {  # timed LABEL LOG COMMAND...: run, log, and print the seconds it took
  local label=$1 log=$2 t0 t1
  shift 2
  t0=$(date +%s.%N)
  "$@" > "$log" 2>&1
  local rc=$?
  t1=$(date +%s.%N)
  echo "$label: rc $rc, $(python3 -c "print(round($t1 - $t0, 2))") s" | tee -a "$out/summary.txt"
}

tests() {
  local files
  mapfile -t files < <(ls tests/test_*.py tests/_kernels/test_*.py tests/bench/test_*.py)
  local odd=() even=() i
  for i in "${!files[@]}"; do  # every other file: halves of about equal time
    if (( i % 2 )); then odd+=("${files[$i]}"); else even+=("${files[$i]}"); fi
  done
  timed "pytest -m gpu, first half" "$out/pytest-gpu-1.txt" \
    timeout 560 python3 -m pytest -q -m gpu "${even[@]}" &
  timed "pytest -m gpu, second half" "$out/pytest-gpu-2.txt" \
    timeout 560 python3 -m pytest -q -m gpu "${odd[@]}" &
  wait
  tail -n 2 "$out"/pytest-gpu-*.txt >> "$out/summary.txt"
}

similarity() {
  python3 -c "
import numpy as np
from dask_gpuchunk.bench.similarity import make_fingerprints
np.save('/tmp/check-fps.npy', make_fingerprints(1_000_000, 2048, 0.075, on_gpu=True))"
  local sim=(-m dask_gpuchunk similarity /tmp/check-fps.npy --packed -o /tmp/check-nn.npz
             --json --overwrite)
  CUPY_CACHE_DIR=/tmp/check-cupy-cache timed "similarity top-10, new kernel cache" \
    "$out/similarity-cold.txt" python3 "${sim[@]}" --top-k 10
  CUPY_CACHE_DIR=/tmp/check-cupy-cache timed "similarity top-10, again" \
    "$out/similarity-warm.txt" python3 "${sim[@]}" --top-k 10
  CUPY_CACHE_DIR=/tmp/check-cupy-cache timed "similarity threshold 0.7" \
    "$out/similarity-threshold.txt" python3 "${sim[@]}" --threshold 0.7
  timed "bench similarity" "$out/bench-similarity.log" \
    timeout 500 python3 -m dask_gpuchunk bench similarity --out-dir "$out"
}

loop() {
  ( unset CUPY_GPU_MEMORY_LIMIT
    timed "bench elementwise, seed 002 loop" "$out/bench-loop.log" \
      timeout 400 python3 -m dask_gpuchunk bench elementwise --rows 10000 --rk4-rows 10000 \
      --loop-sizes 16777216,10000000,268435456 --out-dir "$out" )
}

gram() {
  timed "bench gram" "$out/bench-gram.log" timeout 500 python3 -m dask_gpuchunk bench gram \
    --chunk-rows 4096 --chunk-rows 16384 --out-dir "$out"
}

wgmma() {
  ( unset CUPY_GPU_MEMORY_LIMIT  # the kernel alone, C of 16384² and 65536² on the device
    timed "wgmma kernel check" "$out/wgmma-check.log" timeout 240 python3 tools/wgmma_check.py
    timed "wgmma kernel probe" "$out/wgmma-probe.log" timeout 120 python3 tools/wgmma_probe.py
    timed "dg.gram path profile" "$out/gram-path.log" timeout 120 \
      python3 tools/gram_path_profile.py )
}

for part in "${@:-tests similarity loop gram}"; do
  for each in $part; do "$each"; done
done
cat "$out/summary.txt"
