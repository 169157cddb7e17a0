#!/usr/bin/env bash
# The GPU records of issue 17 (training as practitioners do: float32 master weights, bf16
# compute) on one H200 through Ray Train, run with the `device` tool carrying .devwheels:
#   bash tools/h200-mixed-precision.sh gpu-tests gpt-s gpt-xl
#   bash tools/h200-mixed-precision.sh capacity-gpt-s capacity-gpt-xl
#   bash tools/h200-mixed-precision.sh curve-mixed curve-pure
# Writes under $OUT (default ./out): *.json records and one log per stage.
# gpt-xl runs 4 of its 24 layers: all 24 with float32 master weights and AdamW state need
# 110-120 GB of training state; MFU is per token and hardly depends on depth.
set -u
[ $# -gt 0 ] || { echo "give stages: gpu-tests gpt-s gpt-xl capacity-gpt-s capacity-gpt-xl curve-mixed curve-pure"; exit 2; }
source "$(dirname "$0")/device-setup.sh"
# No checkpoints: one of gpt-s with its AdamW state is several GiB and the disk is 64 GiB.
train=(python3 -m app.cli train --use-gpu --num-workers 1 --tracking-uri none --lr 3e-4 --log-every 20
       --checkpoint-every 0 --storage-path /tmp/mpipemoe-runs)
capacity=(python3 -m app.cli capacity --engines mpipemoe,fastmoe --use-gpu --tracking-uri none
          --memory-cap-gib 100 --start-batch 8 --max-batch 128)
XL=(--preset gpt-xl --num-layers 4)
rm -rf ~/ray_results /tmp/mpipemoe-runs ray_results
for stage in "$@"; do case $stage in
gpu-tests)  # the GPU tests: engines on CUDA streams and NCCL, the Trainer's bf16 compute over float32 weights
  step gpu-tests 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/moe_engine/test_gpu.py ;;
gpt-s)  # default batch (8 x 1024 tokens), both engines, n and strategy chosen online
  step gpt-s 280 "${train[@]}" --preset gpt-s --engines mpipemoe,fastmoe --steps 40 --batch-size 8 \
    --summary-json "$OUT/train-gpt-s-h200-mixed.json" ;;
gpt-xl)
  step gpt-xl 280 "${train[@]}" "${XL[@]}" --engines mpipemoe,fastmoe --steps 30 --batch-size 8 \
    --summary-json "$OUT/train-gpt-xl4-h200-mixed.json" ;;
capacity-gpt-s)  # the largest batch under a 100 GiB cap, with tokens/s and MFU there
  step capacity-gpt-s 290 "${capacity[@]}" --preset gpt-s --out "$OUT/capacity-gpt-s-h200-mixed.json" ;;
capacity-gpt-xl)
  step capacity-gpt-xl 290 "${capacity[@]}" "${XL[@]}" --out "$OUT/capacity-gpt-xl4-h200-mixed.json" ;;
curve-mixed)  # 300 steps of gpt-s: float32 master weights, bf16 compute ...
  step curve-mixed 280 "${train[@]}" --preset gpt-s --engine mpipemoe --steps 300 --batch-size 8 \
    --summary-json "$OUT/curve-gpt-s-h200-mixed.json" ;;
curve-pure)  # ... against bf16 parameters and AdamW state (same seed, data and schedule)
  step curve-pure 280 "${train[@]}" --preset gpt-s --engine mpipemoe --steps 300 --batch-size 8 \
    --param-dtype bfloat16 --summary-json "$OUT/curve-gpt-s-h200-pure-bf16.json" ;;
*) echo "unknown stage $stage"; exit 2 ;;
esac; done
