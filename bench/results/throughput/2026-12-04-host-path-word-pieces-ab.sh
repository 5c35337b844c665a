#!/bin/bash
OUT=$1
: > $OUT
for i in 1 2; do
  for side in base new base-gpu new-gpu; do
    dir=/tmp/hp-base; flag=""
    case $side in new*) dir=/work/main;; esac
    case $side in *gpu) flag="--gpu-batching";; esac
    echo "=== $side run $i" >> $OUT
    (cd $dir && HF_HUB_OFFLINE=1 PYTHONPATH=$dir .venv/bin/python -m bench.throughput.host_path $flag >> $OUT 2>&1)
  done
done
