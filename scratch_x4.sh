source .whl/prelude.sh
export CUPY_GPU_MEMORY_LIMIT=8589934592
M=$OUT/m; mkdir -p $M
{ nvidia-smi; nproc; lscpu | head -20; free -g; } > $M/machine.txt 2>&1
nvidia-smi dmon -s pc -d 1 > $M/dmon-gram.txt 2>&1 & D=$!
(cd tools && timeout 300 python gram_scaling.py --gpus 1,2,4 --methods auto,popcount --variants host --out $M/gram-scaling.json > $M/gram-scaling.txt 2>&1; echo rc $? >> $M/gram-scaling.txt)
kill $D
nvidia-smi dmon -s pc -d 1 > $M/dmon-sim.txt 2>&1 & D=$!
(cd tools && timeout 240 python similarity_scaling.py --gpus 1,2,4 --ops top-k,threshold,multiply --out $M/similarity.json > $M/similarity.txt 2>&1; echo rc $? >> $M/similarity.txt)
(cd tools && DASK_GPUCHUNK__LISTED_GRAPHS=False timeout 100 python similarity_scaling.py --gpus 1,4 --ops threshold --repeats 2 --out $M/similarity-threshold-blockwise.json > $M/similarity-threshold-blockwise.txt 2>&1; echo rc $? >> $M/similarity-threshold-blockwise.txt)
kill $D
tail -3 $M/*.txt | grep -v "^$" | tail -40
