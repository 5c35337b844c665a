#!/bin/bash
OUT=$1
: > $OUT
for i in 1 2 3; do
  for side in base new new-gpu; do
    dir=/tmp/embed-base; flag=""
    [ $side != base ] && dir=/work/wt-embed
    [ $side = new-gpu ] && flag="--gpu-batching"
    echo "=== $side run $i" >> $OUT
    (cd $dir && HF_HUB_OFFLINE=1 PYTHONPATH=$dir .venv/bin/python -m bench.throughput.host_path $flag >> $OUT 2>&1)
  done
done
