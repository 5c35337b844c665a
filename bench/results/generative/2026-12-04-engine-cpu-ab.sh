#!/bin/bash
: > /tmp/eng_ab.txt
for i in 1 2 3; do for side in base new; do
  dir=/tmp/eng-base; [ $side = new ] && dir=/work/main
  (cd $dir && PYTHONPATH=$dir HF_HUB_OFFLINE=1 .venv/bin/python /tmp/eng_ab.py $side 2>/dev/null | grep engine >> /tmp/eng_ab.txt)
done; done
echo done >> /tmp/eng_ab.txt
