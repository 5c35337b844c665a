#!/usr/bin/env bash
# The whole GPU check as one device call: a lease is short and a machine is bare, so every
# stage runs under its own time limit, and a stage that fails or hangs leaves the rest to run.
# First copy bundle.sh's parts into /tmp/gpu-parts (one call each), then, carrying the last part
# and .gpu/install.sh:   bash bench/gpu_session.sh   (under 9.7 minutes: give the call 590 s)
# Logs and reports go to $OUT (the device tool's folder that comes back), else ./gpu-out.
set -uo pipefail
OUT=${OUT:-$PWD/gpu-out}
mkdir -p "$OUT"
LOG=$OUT/gpu.log
bash .gpu/install.sh >/dev/null || { echo "install failed"; exit 1; }
export PYTHONPATH=/tmp/gpu-site:$PWD HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1

stage() {  # stage SECONDS COMMAND...: run it, its output into the log and on the screen
  local limit=$1 begun=$SECONDS
  shift
  echo "=== $* (limit ${limit} s)" | tee -a "$LOG"
  timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
  echo "=== rc=${PIPESTATUS[0]} after $((SECONDS - begun)) s" | tee -a "$LOG"
}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1 | tee -a "$LOG"
python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers',
transformers.__version__)" 2>&1 | tee -a "$LOG"
stage 200 python3 -m bench.gpu_check --checks vs-sentence-transformers overlap governor \
  oom-split throughput
stage 160 python3 -m bench.gpu_check --checks generative --out "$OUT"
stage 90 python3 -m bench.gpu_check --checks generative-16 --out "$OUT"
for log in /tmp/redbatch-gen-bench-*/*.log; do  # left behind only if the stage was cut short
  [ -f "$log" ] && { echo "--- $log"; tail -40 "$log"; } | tee -a "$LOG"
done
stage 40 python3 -m bench.generative.host_path --device cuda --rounds 2
stage 40 python3 -m pytest -q -p no:cacheprovider --timeout 30 -k "cuda or precision or gpu_shaped" \
  tests/unit/execution/test_devices.py tests/unit/execution/test_sampling_batch.py \
  tests/models/test_engine_step.py tests/models/test_gpu_shaped_steps.py \
  tests/models/test_overlapped_steps.py \
  tests/redis/single/test_cuda_graphs.py \
  tests/redis/single/test_precision.py
stage 50 python3 -m bench.gpu_check --checks exactness --out "$OUT"
# structured outputs (issue 44): needs llguidance in the bundle; the masks on CUDA, then the
# constrained mix (half the requests under a JSON schema) against unconstrained; last, so
# that past the call's 590 s only these are cut
stage 20 python3 -m pytest -q -p no:cacheprovider -k cuda tests/unit/execution/test_grammar_mask.py
stage 60 python3 -m bench.generative.constrained --device cuda --prompts 64 --concurrency 16 64
