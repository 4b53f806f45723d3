#!/usr/bin/env bash
# Seconds per training step of `train-mtp`: one process with 2 threads against 2 processes
# (torchrun) with 1 thread each, from the difference of a 5-step and a 45-step run (loading
# and data checks cancel out). Builds a small data cache first (96 self-instruct prompts,
# 96 new tokens, the default model in bfloat16) unless it is there.
#
#     bash scripts/data_parallel_timing.sh [OUT_DIR]   # default bench-out/dp
set -euo pipefail
cd "$(dirname "$0")/.."
export HF_HUB_OFFLINE=1
OUT=${1:-bench-out/dp}
HEADS="--kind sequential --num-heads 3 --draft-vocab 8192 --seq-len 256 --batch-size 8"
DATA=../shared/train_prompts/self_instruct_en
if [ ! -f "$OUT/build/data/manifest.json" ]; then
  .venv/bin/specmtp train-mtp --dtype bfloat16 --mixed-precision bf16 --data $DATA \
    --limit-per-source 96 --max-new-tokens 96 --out "$OUT/build" --steps 1 --threads 1 $HEADS
fi
COMMON="train-mtp --dtype bfloat16 --mixed-precision bf16 --cache $OUT/build/data --data $DATA
  $HEADS --checkpoint-every 1000 --eval-every 1000"
for rep in 1 2; do
  for steps in 5 45; do
    rm -rf "$OUT/one" "$OUT/two"
    s=$(date +%s.%N)
    .venv/bin/specmtp $COMMON --out "$OUT/one" --steps $steps --threads 2 > /dev/null 2>&1
    e=$(date +%s.%N)
    echo "one process, 2 threads, steps=$steps: $(echo "$e - $s" | bc) s"
    s=$(date +%s.%N)
    OMP_NUM_THREADS=1 .venv/bin/python -m torch.distributed.run --nproc_per_node 2 \
      -m specmtp $COMMON --out "$OUT/two" --steps $steps --threads 1 > /dev/null 2>&1
    e=$(date +%s.%N)
    echo "two processes, 1 thread each, steps=$steps: $(echo "$e - $s" | bc) s"
  done
done
