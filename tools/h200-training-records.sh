#!/usr/bin/env bash
# The GPU records of issue 5 (training on one H200 through Ray Train), run with the
# `device` tool (each call under its 10-minute limit), carrying `.devwheels`, e.g.:
#   bash tools/h200-training-records.sh train-auto
#   bash tools/h200-training-records.sh train-n4-s3 capacity gpu-tests
# Writes under $OUT (default ./out): train-*.json, capacity-*.json, gpu.txt and logs.
set -u
[ $# -gt 0 ] || { echo "give stages: train-auto train-n4-s3 capacity gpu-tests"; exit 2; }
source "$(dirname "$0")/device-setup.sh"
# No checkpoints: one of gpt-s with its AdamW state is several GiB and the disk is 64 GiB.
train=(python3 -m app.cli train --preset gpt-s --engines mpipemoe,fastmoe --use-gpu --num-workers 1
       --tracking-uri none --steps 40 --lr 3e-4 --log-every 10 --checkpoint-every 0 --storage-path /tmp/mpipemoe-runs)
rm -rf ~/ray_results /tmp/mpipemoe-runs ray_results; df -h . /tmp | tail -2
for stage in "$@"; do case $stage in
train-auto)  # 1. the default engine settings (n and strategy chosen online), 8 x 1024 tokens, bf16
  step train-auto 280 "${train[@]}" --batch-size 8 --summary-json "$OUT/train-gpt-s-h200-auto.json" ;;
train-n4-s3)  # 2. fixed n=4 with S3 (the capacity search's setting), 16 x 1024 tokens
  step train-n4-s3 200 "${train[@]}" --batch-size 16 --partitions 4 --strategy S3 \
    --summary-json "$OUT/train-gpt-s-h200-n4-s3.json" ;;
capacity)  # 3. the largest batch each engine trains with under a 32 GiB cap
  step capacity 240 python3 -m app.cli capacity --preset gpt-s --engines mpipemoe,fastmoe --use-gpu \
    --memory-cap-gib 32 --partitions 4 --strategy S3 --start-batch 8 --max-batch 64 --tracking-uri none \
    --out "$OUT/capacity-gpt-s-h200.json" ;;
gpu-tests)  # 4. the GPU tests (engines on CUDA streams, memory model, capacity OOM search, host fallback)
  step gpu-tests 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/moe_engine/test_gpu.py tests/app/test_capacity.py ;;
*) echo "unknown stage $stage: give train-auto, train-n4-s3, capacity or gpu-tests"; exit 2 ;;
esac; done
