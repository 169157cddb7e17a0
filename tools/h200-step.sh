#!/usr/bin/env bash
# Issues 36-39: the training step on the emulated 8x8 cluster, the layer targets with
# yardsticks that are floors, and the GPU tests at the landing code. Run with the `device`
# tool after `bash tools/stamp-commit.sh`, carrying `.git-commit` (and `.whl` for torchtitan):
#   bash tools/h200-step.sh gpu-tests step-xl
#   bash tools/h200-step.sh layer-xl layer-small
# Writes under $OUT (default ./out): step-*.json/.md, bench-*.json/.md, <stage>.log.
set -u
[ $# -gt 0 ] || { echo "give stages: gpu-tests step-xl step-small step-rest routing-run step-routing step-split step-ep step-ep-xl expert-loop layer-split layer-xl layer-small"; exit 2; }
source "$(dirname "$0")/device-setup.sh"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
# The records name the card that ran them (the device tool may lend an H100 for an H200).
CARD=$(grep -q H100 "$OUT/gpu.txt" 2>/dev/null && echo h100 || echo h200)
LAYER="--emulate 8x8 --experts 64 --network dgx-h200 --routing uniform,hot-expert --partitions 1,2,4,8
       --strategies none,S3,S4 --rounds 2 --repeats 2 --tracking-uri none"
STEP="--step --emulate 8x8 --experts 64 --network dgx-h200 --routing uniform --partitions 1,2,4
      --strategies none,S4 --tracking-uri none"
for stage in "$@"; do case $stage in
gpu-tests)  # every GPU test
  step gpu-tests-$(head -1 .git-commit 2>/dev/null | cut -c1-7 | grep . || echo tree) ${GPU_TESTS_LIMIT:-280} \
      python3 -m pytest -q -rs -p no:cacheprovider -m gpu ;;
step-xl)  # gpt-xl (4 layers) at 32k tokens per GPU, one and two micro-batches, both schedules, every
  # step traced (issue 37: the timeline of both micro-batches); the traces come back as one archive
  # (FasterMoE's 16-partition traces stay behind: the device returns at most 16 MiB a file)
  step step-xl ${STEP_LIMIT:-540} python3 -m app.cli bench $STEP --strategies none --model gpt-xl --layers 4 \
      --tokens ${XL_TOKENS:-32768} --partitions ${XL_PARTITIONS:-1,2,4} --rounds ${XL_ROUNDS:-3} --micro-batches 1,2 --schedule sequential,overlapped --trace /tmp/step-xl-traces \
      --out "$OUT/step-$CARD-emulated-8x8-dgx-h200-gpt-xl.json"
  for k in k1 k2; do
    (cd /tmp && tar -czf "$OUT/step-xl-traces-$k.tgz" $(ls step-xl-traces/*-$k-* 2>/dev/null | grep -v fastermoe))
  done ;;
step-small)  # gpt-s (4 layers) at 32k tokens per GPU, both schedules (issue 37's smaller points)
  step step-small ${STEP_LIMIT:-300} python3 -m app.cli bench $STEP --strategies none --model gpt-s --layers 4 \
      --tokens 32768 --micro-batches 1,2 --schedule sequential,overlapped \
      --out "$OUT/step-$CARD-emulated-8x8-dgx-h200-gpt-s.json" ;;
step-rest)  # issue 37's other points: gpt-xl at 16k and bert-l at 32k tokens per GPU, both schedules
  for point in gpt-xl:16384 bert-l:32768; do
    step step-rest-${point%%:*} ${STEP_LIMIT:-200} python3 -m app.cli bench --step --emulate 8x8 --experts 64 \
        --network dgx-h200 --routing uniform --partitions 1,2 --strategies none --rounds 2 --tracking-uri none \
        --model ${point%%:*} --layers 4 --tokens ${point##*:} --micro-batches 1,2 --schedule sequential,overlapped \
        --out "$OUT/step-$CARD-emulated-8x8-dgx-h200-${point%%:*}-${point##*:}.json"
  done ;;
routing-run)  # issue 36: a real routing, early and late: gpt-s (4 layers, 64 experts) trained on the BPE
  # data carried in .routing-data (`mpipemoe data prepare --tokenizer bpe:8192 --out .routing-data`)
  step routing-run ${ROUTING_LIMIT:-150} python3 tools/routing_from_training.py --data .routing-data --preset gpt-s \
      --layers 4 --experts 64 --steps 300 --at 20,300 --out-dir "$OUT" ;;
step-routing)  # issue 36: the step under uniform, hot-expert (and replayed: ROUTINGS) routing, FastMoE, FasterMoE and auto, K = 1
  for net in ${NETWORKS:-dgx-h200 dgx-a100}; do
    step step-routing-$net ${STEP_LIMIT:-280} python3 -m app.cli bench --step --emulate 8x8 --experts 64 --network $net \
        --model ${MODELS:-gpt-xl} --layers 4 --tokens ${TOKENS:-16384,32768} --micro-batches 1 \
        --routing ${ROUTINGS:-uniform,zipf:1.2,replay:early,replay:late,hot-expert} \
        --partitions 1,2,4 --strategies none --no-grid --tracking-uri none \
        --out "$OUT/step-$CARD-emulated-8x8-$net-routing.json"
  done ;;
step-ep)  # issue 38: gpt-s (4 layers, 64 experts) at 8k tokens per GPU, expert groups of 8 (a node) and of 64
  for net in dgx-h200 dgx-a100; do for e in 8 64; do
    step step-ep$e-$net ${STEP_LIMIT:-100} python3 -m app.cli bench --step --emulate 8x8 --experts 64 --network $net \
        --model gpt-s --layers 4 --tokens 8192 --micro-batches 1 --partitions 1,2 --strategies none --no-grid \
        --expert-parallel $e --tracking-uri none --out "$OUT/step-$CARD-emulated-8x8-$net-gpt-s-e$e.json"
  done; done ;;
step-ep-xl)  # issue 38: the same for gpt-xl (4 layers, 64 experts) at 8k tokens per GPU
  for net in dgx-h200 dgx-a100; do for e in 8 64; do
    step step-ep-xl$e-$net ${STEP_LIMIT:-150} python3 -m app.cli bench --step --emulate 8x8 --experts 64 --network $net \
        --model gpt-xl --layers 4 --tokens 8192 --micro-batches 1 --partitions 1,2 --strategies none --no-grid \
        --expert-parallel $e --tracking-uri none --out "$OUT/step-$CARD-emulated-8x8-$net-gpt-xl-e$e.json"
  done; done ;;
expert-loop)  # issue 38: the A100 path's per-expert GEMM loop against the grouped kernel, side by side:
  # E = 8 (8 experts per GPU), dgx-a100; fp16 takes the loop (no grouped kernel for fp16, as
  # none for any dtype on sm80), bf16 the grouped kernel; the same GEMM rate on this GPU
  for model in gpt-s gpt-xl; do for dtype in bf16 fp16; do
    step expert-loop-$model-$dtype ${STEP_LIMIT:-150} python3 -m app.cli bench --step --emulate 8x8 --experts 64 \
        --network dgx-a100 --model $model --layers 4 --tokens 8192 --micro-batches 1 --partitions 1,2 \
        --strategies none --no-grid --expert-parallel 8 --dtype $dtype --tracking-uri none \
        --out "$OUT/step-$CARD-emulated-8x8-dgx-a100-$model-e8-$dtype.json"
  done; done ;;
layer-split)  # issue 36 (auto vs FasterMoE under skew): gpt-xl 16k and 8k, uniform and hot-expert, the grid split
  # by tokens and by peers at n = 2..16 (16 split by peers with strategy none is FasterMoE's schedule)
  step layer-split ${LAYER_LIMIT:-330} python3 -m app.cli bench --emulate 8x8 --experts 64 --network ${NETWORK:-dgx-h200} \
      --routing uniform,hot-expert --model gpt-xl --tokens ${SPLIT_TOKENS:-16384,8192} --partitions 1,2,4,8,16 \
      --strategies none,S4 --splits tokens,peers --rounds 2 --repeats 2 --tracking-uri none \
      --out "$OUT/bench-$CARD-emulated-8x8-${NETWORK:-dgx-h200}-split.json" ;;
step-split)  # the same on the step: gpt-xl (4 layers) 16k under hot-expert and replayed routing (ROUTINGS)
  step step-split ${STEP_LIMIT:-400} python3 -m app.cli bench --step --emulate 8x8 --experts 64 --network dgx-h200 \
      --model gpt-xl --layers 4 --tokens 16384 --micro-batches 1 --routing ${ROUTINGS:-uniform,zipf:1.2,replay:early,replay:late,hot-expert} \
      --partitions 4,8,16 --strategies none --splits tokens,peers --rounds 2 --tracking-uri none \
      --out "$OUT/step-$CARD-emulated-8x8-dgx-h200-split.json" ;;
layer-xl)  # the layer targets: gpt-xl 32k-8k, every setting beside FastMoE, FasterMoE and auto
  step layer-xl ${LAYER_LIMIT:-330} python3 -m app.cli bench $LAYER --model gpt-xl --tokens 32768,16384,8192 \
      --out "$OUT/bench-$CARD-emulated-8x8-dgx-h200.json" ;;
layer-small)
  step layer-small ${LAYER_LIMIT:-160} python3 -m app.cli bench $LAYER --model bert-l,gpt-s --tokens 32768 \
      --out "$OUT/bench-$CARD-emulated-8x8-dgx-h200-32k.json" ;;
*) echo "unknown stage $stage"; exit 2 ;;
esac; done
