#!/usr/bin/env bash
# The host's ceiling for the Gram's scaling, with no cluster between the GPUs: the one-GPU run
# of tools/gram_scaling.py alone on GPU 0, then the same run on every GPU at once (a process and
# a one-GPU local cluster each, CUDA_VISIBLE_DEVICES=i, the same .npy in the page cache). Were
# the GPUs independent, each concurrent run would take as long as the one alone; the ratio
# alone / concurrent, times the GPUs, bounds what a cluster of them can reach on this host.
# Then the cluster itself (--gpus 1,N) in the same call, for comparison.
#
#   bash tools/gram_weak_scaling.sh OUT_DIR [gram_scaling.py options...]
#
# Run from the repository's root on the GPU machine (after `source .whl/prelude.sh`).
set -u
out=${1:?an output folder}
shift
mkdir -p "$out"
gpus=$(nvidia-smi -L | wc -l)
cd tools || exit 1
common=(--methods auto,popcount --variants host --keep --repeats 4 "$@")
CUDA_VISIBLE_DEVICES=0 python3 gram_scaling.py --gpus 1 "${common[@]}" \
  --out "$out/alone.json" > "$out/alone.txt" 2>&1
for ((i = 0; i < gpus; i++)); do
  CUDA_VISIBLE_DEVICES=$i python3 gram_scaling.py --gpus 1 "${common[@]}" \
    --out "$out/concurrent-$i.json" > "$out/concurrent-$i.txt" 2>&1 &
done
wait
python3 gram_scaling.py --gpus "1,$gpus" "${common[@]}" --out "$out/cluster.json" \
  > "$out/cluster.txt" 2>&1
python3 - "$out" "$gpus" <<'PY'
import json, statistics, sys
from pathlib import Path
out, gpus = Path(sys.argv[1]), int(sys.argv[2])
def runs(name):
    return json.loads((out / name).read_text())["runs"]
alone = runs("alone.json")["1"]
for method in ("auto host", "popcount host"):
    a = statistics.median(alone[method]["seconds"][1:])
    c = [statistics.median(runs(f"concurrent-{i}.json")["1"][method]["seconds"][1:])
         for i in range(gpus)]
    cl = runs("cluster.json")
    print(json.dumps({"run": method, "alone_median": round(a, 3),
                      "concurrent_medians": [round(x, 3) for x in c],
                      "ceiling_on_all": round(gpus * a / max(c), 2),
                      "cluster_best": {k: v[method]["best"] for k, v in cl.items()}}))
PY
