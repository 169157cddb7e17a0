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
OUT=${OUT:-out}; mkdir -p "$OUT"
G=$(nvidia-smi -L | wc -l)
if [ -d .devwheels ]; then
  mkdir -p .site && tar -xJf .devwheels/ray-cp312.tar.xz -C .site \
    && python3 -m pip install -q --no-index --no-deps --no-compile --target .site .devwheels/*.whl 2>/dev/null \
    && chmod -R +x .site/ray/core
fi
export PYTHONPATH=$PWD/.site:$PWD RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S=60
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader | tee "$OUT/gpu.txt"
nvidia-smi topo -m > "$OUT/topology.txt" 2>&1
step() { local name=$1 limit=$2; shift 2; echo "== $name: $*"; timeout "$limit" "$@" > "$OUT/$name.log" 2>&1;
         echo "   rc=$? after ${SECONDS}s"; tail -12 "$OUT/$name.log"; }
# Runs 1-3: every engine, the n x strategy grid, uniform and skewed routing, 4k-32k tokens per GPU.
bench=(python3 -m app.cli bench --tokens 4096,8192,16384,32768 --routing uniform,skewed --partitions 1,2,4,8,16
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
  step dry-run 300 python3 -m app.cli bench --model gpt-s --tokens 4096,16384 --routing uniform,skewed \
    --partitions 1,2,4 --strategies none,S3 --world-size "$G" --tracking-uri none --out "$OUT/bench-dry-run-x$G.json" ;;
*) echo "unknown stage $stage"; exit 2 ;;
esac; done
