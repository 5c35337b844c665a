#!/bin/bash
# A/B of the generative benchmark's throughput line: base (622f30d) vs head, alternating.
out=/tmp/gen_ab2.txt

for round in 3; do
  for side in base main; do
    dir=/tmp/hp-base; [ $side = main ] && dir=/work/main
    cd $dir
    HF_HUB_OFFLINE=1 timeout 900 .venv/bin/python -m bench.generative --prompts 32 --concurrency 16 --repeats 1 --out /tmp/gen-ab-$side > /tmp/gen-ab-$side.log 2>&1 &
    pid=$!
    while kill -0 $pid 2>/dev/null && ! grep -q "repeat 0 c=16" /tmp/gen-ab-$side.log; do sleep 2; done
    pkill -P $pid; kill $pid 2>/dev/null; sleep 1; pkill -f "redbatch-gen-bench" ; pkill -f "worker run --redis-url" ; sleep 2
    echo "round $round $side: $(grep 'repeat 0 c=16' /tmp/gen-ab-$side.log)" >> $out
  done
done
echo done >> $out
