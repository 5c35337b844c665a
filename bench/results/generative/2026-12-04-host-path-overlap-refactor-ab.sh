#!/bin/bash
OUT=$1
: > $OUT
for i in 1 2 3; do
  for side in base new; do
    dir=/tmp/hp-base; [ $side = new ] && dir=/work/main
    echo "=== $side run $i ($(cd $dir && git log --oneline -1 | cut -c1-7))" >> $OUT
    (cd $dir && HF_HUB_OFFLINE=1 PYTHONPATH=$dir .venv/bin/python -m bench.generative.host_path --rounds 4 2>&1 | grep -v "GGUF\|Loading weights" >> $OUT)
  done
done
