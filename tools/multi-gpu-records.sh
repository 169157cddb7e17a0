#!/usr/bin/env bash
# The several-GPU records of issue 8, on one host with G GPUs (all of them used), run with
# the `device` tool carrying `.devwheels` (Ray is needed by the `train` stage only):
#   bash tools/multi-gpu-records.sh bench-gpt-s      # runs 1-3 for one model (one call each,
#   bash tools/multi-gpu-records.sh bench-gpt-xl     #   to stay under the 10-minute limit)
#   bash tools/multi-gpu-records.sh bench-bert-l
#   bash tools/multi-gpu-records.sh train            # run 4: Ray Train, one worker per GPU
#   bash tools/multi-gpu-records.sh dry-run          # a small bench on whatever GPUs there are
# Writes under $OUT (default ./out): bench-h200-x<G>-<model>.json/.md, train-gpt-s-h200-x<G>.json, logs.
set -u
[ $# -gt 0 ] || { echo "give stages: bench-gpt-s bench-gpt-xl bench-bert-l train dry-run"; exit 2; }
source "$(dirname "$0")/device-setup.sh"
G=$(nvidia-smi -L | wc -l)
nvidia-smi topo -m > "$OUT/topology.txt" 2>&1
# Runs 1-3: every engine, the n x strategy grid, uniform and hot-expert routing, 4k-32k tokens per GPU.
bench=(python3 -m app.cli bench --tokens 4096,8192,16384,32768 --routing uniform,hot-expert --partitions 1,2,4,8,16
       --world-size "$G" --tracking-uri none)
for stage in "$@"; do case $stage in
bench-gpt-s|bench-gpt-xl|bench-bert-l)
  model=${stage#bench-}
  step "$stage" 560 "${bench[@]}" --model "$model" --out "$OUT/bench-h200-x$G-$model.json" ;;
train)
  step train 560 python3 -m app.cli train --preset gpt-s --engines mpipemoe,fastmoe,fastermoe --use-gpu \
    --num-workers "$G" --tracking-uri none --steps 40 --batch-size 8 --lr 3e-4 --log-every 10 \
    --checkpoint-every 0 --storage-path /tmp/mpipemoe-runs --summary-json "$OUT/train-gpt-s-h200-x$G.json" ;;
dry-run)
  step dry-run 300 python3 -m app.cli bench --model gpt-s --tokens 4096,16384 --routing uniform,hot-expert \
    --partitions 1,2,4 --strategies none,S3 --world-size "$G" --tracking-uri none --out "$OUT/bench-dry-run-x$G.json" ;;
*) echo "unknown stage $stage"; exit 2 ;;
esac; done
