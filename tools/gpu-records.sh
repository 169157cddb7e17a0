#!/usr/bin/env bash
# The GPU records under results/, made again on one GPU machine (an H100 or an H200: every
# record's name carries the card that ran it, h100 or h200). Run from the repository root
# after `bash tools/stamp-commit.sh`, carrying `.git-commit`, `.devwheels` (Ray, for the
# training stages) and `.whl` (torchtitan 0.3.0 and its imports, for the peer stages):
#   bash tools/gpu-records.sh STAGE...      # e.g. gpu-tests bench bench-lean
# Each stage writes under $OUT (default ./out) its records and <name>.log, and prints the
# log's tail; results/README.md names the stage that made each committed record.
# Time limits (seconds) a stage's step may take: STEP_LIMIT, LAYER_LIMIT, GPU_TESTS_LIMIT.
set -u
stages="gpu-tests kernel-tests parts bench bench-lean bench-peers bench-probe dry-run-routing stacked:MODEL:TOKENS
        layer-xl layer-small layer-a100 layer-memory layer-split trace-xl32k
        step-xl step-small routing-run step-routing step-ep step-ep-xl expert-loop
        train-auto train-n4-s3 capacity mixed-gpt-s mixed-gpt-xl mixed-capacity-gpt-s mixed-capacity-gpt-xl
        curve-mixed curve-pure adamw-profile val-curve mfu fused-ab"
[ $# -gt 0 ] || { echo "give stages:" $stages; exit 2; }
source "$(dirname "$0")/device-setup.sh"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
CARD=$(grep -q H100 "$OUT/gpu.txt" 2>/dev/null && echo h100 || echo h200)
here=$PWD
# the layer bench's grid on the emulated 8x8 cluster: n x {none, S3, S4}, uniform and hot-expert routing
LAYER="--emulate 8x8 --experts 64 --routing uniform,hot-expert --partitions 1,2,4,8 --strategies none,S3,S4
       --rounds 2 --repeats 2 --tracking-uri none"
STEP="--step --emulate 8x8 --experts 64 --network dgx-h200 --routing uniform --strategies none --tracking-uri none"
GELU_GRID="--model gpt-s,gpt-xl --tokens 4096,8192,16384,32768 --partitions 1,2,4,8 --tracking-uri none"
# training through Ray Train, one worker; no checkpoints (one of gpt-s with AdamW state is several GiB)
train=(python3 -m app.cli train --use-gpu --num-workers 1 --tracking-uri none --lr 3e-4 --checkpoint-every 0
       --storage-path /tmp/mpipemoe-runs)
mixed_capacity=(python3 -m app.cli capacity --engines mpipemoe,fastmoe --use-gpu --tracking-uri none
                --memory-cap-gib 100 --start-batch 8 --max-batch 128)
XL4=(--preset gpt-xl --num-layers 4)
rm -rf ~/ray_results /tmp/mpipemoe-runs ray_results
profile_step() {  # profile_step NAME CODE_DIR BATCH: tools/profile_step.py of the code in CODE_DIR
  step "$1" 150 env PYTHONPATH="$here/.site:$2" python3 "$2/tools/profile_step.py" "${XL4[@]}" \
    --batch-size "$3" --optimizer-impl fused --out "$OUT/$1.json"
}
for stage in "$@"; do case $stage in
# --- tests ---
gpu-tests)  # every GPU test: gpu-tests-<commit>.log (results/logs-*/gpu-tests-*.log)
  step gpu-tests-$(head -1 .git-commit 2>/dev/null | cut -c1-7 | grep . || echo tree) ${GPU_TESTS_LIMIT:-280} \
      python3 -m pytest -q -rs -p no:cacheprovider -m gpu ;;
kernel-tests)  # the fused Triton kernels' and the engine's GPU tests: kernels.log (results/training-h200-fused/)
  step kernels 200 python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests/moe_engine/test_kernels.py \
      tests/moe_engine/test_gpu.py ;;
# --- one GPU, measured ---
parts)  # the simulator's GPU parts: sim-parts-<card>.json (results/sim-parts-h200.json)
  step parts 240 python3 -m app.cli simulate --measure-parts "$OUT/sim-parts-$CARD.json" --tracking-uri none ;;
bench)  # the layer bench's GELU grid, every engine and the dense floor: bench-<card>.json (results/bench-h200.json)
  step bench 300 python3 -m app.cli bench $GELU_GRID --out "$OUT/bench-$CARD.json" ;;
bench-probe)  # the same grid twice, its run-to-run spread: bench-<card>-probe{,-rerun}.json (results/)
  step bench-probe 300 python3 -m app.cli bench $GELU_GRID --out "$OUT/bench-$CARD-probe.json"
  step bench-probe-rerun 300 python3 -m app.cli bench $GELU_GRID --out "$OUT/bench-$CARD-probe-rerun.json" ;;
bench-lean)  # SwiGLU, no bias, beside torchtitan's MoE layer (carry .whl): bench-<card>-lean.json (results/)
  step bench-lean 280 python3 -m app.cli bench --model gpt-s,gpt-xl --tokens 4096,16384,32768 --activation swiglu \
      --no-bias --peers torchtitan --partitions 1,2,4,8 --tracking-uri none --out "$OUT/bench-$CARD-lean.json" ;;
bench-peers)  # n = 1 and 4 beside torchtitan (carry .whl): bench-<card>-peers.json (results/bench-h200-peers.json)
  step bench-peers 200 python3 -m app.cli bench --model gpt-s,gpt-xl --tokens 4096,16384,32768 --activation swiglu \
      --no-bias --peers torchtitan --partitions 1,4 --strategies none,S4 --tracking-uri none \
      --out "$OUT/bench-$CARD-peers.json" ;;
dry-run-routing)  # gpt-s at 4k and 16k on every GPU of the machine: bench-<card>-dry-run-routing.json (results/)
  step dry-run-routing 300 python3 -m app.cli bench --model gpt-s --tokens 4096,16384 --routing uniform,hot-expert \
      --partitions 1,2,4 --strategies none,S3 --world-size "$(nvidia-smi -L | wc -l)" --tracking-uri none \
      --out "$OUT/bench-$CARD-dry-run-routing.json" ;;
stacked:*)  # 8 residual SwiGLU layers beside torchtitan, +/- checkpointing (carry .whl): stacked-MODEL-TOKENS.json (results/stacked-h200/)
  point=${stage#stacked:} model=${point%:*} tokens=${point#*:}
  step "stacked-$model-$tokens" 540 python3 -m app.cli bench --layers 8 --peers torchtitan --model "$model" \
      --tokens "$tokens" --activation swiglu --no-bias --dtype bf16 --partitions 1,4,8 --strategies none,S4 \
      --warmup 2 --repeats 5 --rounds 1 --tracking-uri none --out "$OUT/stacked-$model-$tokens.json" ;;
# --- the layer as rank 0 of an emulated 8x8 cluster ---
layer-xl)  # gpt-xl 32k-8k, dgx-h200: bench-<card>-emulated-8x8-dgx-h200.json (results/)
  step layer-xl ${LAYER_LIMIT:-330} python3 -m app.cli bench $LAYER --network dgx-h200 --model gpt-xl \
      --tokens 32768,16384,8192 --out "$OUT/bench-$CARD-emulated-8x8-dgx-h200.json" ;;
layer-small)  # bert-l and gpt-s at 32k, dgx-h200: bench-<card>-emulated-8x8-dgx-h200-32k.json (results/)
  step layer-small ${LAYER_LIMIT:-160} python3 -m app.cli bench $LAYER --network dgx-h200 --model bert-l,gpt-s \
      --tokens 32768 --out "$OUT/bench-$CARD-emulated-8x8-dgx-h200-32k.json" ;;
layer-a100)  # gpt-xl 32k-8k, dgx-a100: bench-<card>-emulated-8x8-dgx-a100.json (results/)
  step layer-a100 ${LAYER_LIMIT:-330} python3 -m app.cli bench $LAYER --network dgx-a100 --model gpt-xl \
      --tokens 32768,16384,8192 --out "$OUT/bench-$CARD-emulated-8x8-dgx-a100.json" ;;
layer-memory)  # the memory model against every setting's peak, one timing round: bench-<card>-emulated-memory.json (results/)
  step layer-memory 200 python3 -m app.cli bench --emulate 8x8 --network dgx-h200 --experts 64 --model gpt-xl \
      --tokens 32768,16384,8192 --routing uniform,hot-expert --partitions 1,2,4,8 --strategies none,S3,S4 \
      --rounds 1 --repeats 1 --tracking-uri none --out "$OUT/bench-$CARD-emulated-memory.json" ;;
layer-split)  # gpt-xl 16k and 8k split by tokens and by peers, n = 1-16: bench-<card>-emulated-8x8-dgx-h200-split.json (docs/emulation.md)
  step layer-split ${LAYER_LIMIT:-330} python3 -m app.cli bench --emulate 8x8 --experts 64 --network dgx-h200 \
      --routing uniform,hot-expert --model gpt-xl --tokens 16384,8192 --partitions 1,2,4,8,16 --strategies none,S4 \
      --splits tokens,peers --rounds 2 --repeats 2 --tracking-uri none \
      --out "$OUT/bench-$CARD-emulated-8x8-dgx-h200-split.json" ;;
trace-xl32k)  # gpt-xl 32k and 16k with a timeline each: bench-xl32k-trace.json and traces (results/traces/)
  step trace-xl32k 300 python3 -m app.cli bench --emulate 8x8 --network dgx-h200 --experts 64 --model gpt-xl \
      --tokens 32768,16384 --partitions 1,2,4,8 --strategies none,S3,S4 --rounds 2 --repeats 2 --tracking-uri none \
      --trace /tmp/traces --out "$OUT/bench-xl32k-trace.json"
  for f in /tmp/traces/*16384*fastmoe* /tmp/traces/*16384*grid-4_none.*; do [ -f "$f" ] && cp "$f" "$OUT/"; done ;;
# --- the training step as rank 0 of an emulated 8x8 cluster ---
step-xl)  # gpt-xl (4 layers) at 32k, K = 1 and 2, both schedules, traced: step-<card>-emulated-8x8-dgx-h200-gpt-xl.json (results/, traces/)
  step step-xl ${STEP_LIMIT:-540} python3 -m app.cli bench $STEP --model gpt-xl --layers 4 --tokens 32768 \
      --partitions ${XL_PARTITIONS:-1,2,4} --rounds ${XL_ROUNDS:-3} --micro-batches 1,2 --schedule sequential,overlapped \
      --trace /tmp/step-xl-traces --out "$OUT/step-$CARD-emulated-8x8-dgx-h200-gpt-xl.json"
  for k in k1 k2; do  # FasterMoE's 16-partition traces are too large to bring back
    (cd /tmp && tar -czf "$OUT/step-xl-traces-$k.tgz" $(ls step-xl-traces/*-$k-* 2>/dev/null | grep -v fastermoe))
  done ;;
step-small)  # gpt-s (4 layers) at 32k, K = 1 and 2, both schedules: step-<card>-emulated-8x8-dgx-h200-gpt-s.json (results/)
  step step-small ${STEP_LIMIT:-300} python3 -m app.cli bench $STEP --model gpt-s --layers 4 --tokens 32768 \
      --partitions 1,2 --rounds 2 --micro-batches 1,2 --schedule sequential,overlapped \
      --out "$OUT/step-$CARD-emulated-8x8-dgx-h200-gpt-s.json" ;;
routing-run)  # a real routing early and late, gpt-s trained on .routing-data: routing-gpt-s-{20,300}.json (results/routing/)
  step routing-run 150 python3 tools/routing_from_training.py --data .routing-data --preset gpt-s \
      --layers 4 --experts 64 --steps 300 --at 20,300 --out-dir "$OUT" ;;
step-routing)  # gpt-xl (4 layers), K = 1 under ROUTINGS at TOKENS: step-<card>-emulated-8x8-<network>-routing.json (results/, and -replay)
  for net in ${NETWORKS:-dgx-h200 dgx-a100}; do
    step step-routing-$net ${STEP_LIMIT:-280} python3 -m app.cli bench --step --emulate 8x8 --experts 64 --network $net \
        --model gpt-xl --layers 4 --tokens ${TOKENS:-16384,32768} --micro-batches 1 --routing ${ROUTINGS:-uniform,zipf:1.2,replay:early,replay:late,hot-expert} \
        --partitions 1,2,4 --strategies none --no-grid --tracking-uri none \
        --out "$OUT/step-$CARD-emulated-8x8-$net-routing.json"
  done ;;
step-ep|step-ep-xl)  # gpt-s / gpt-xl (4 layers) at 8k, expert groups of 8 and 64: step-<card>-emulated-8x8-<network>-<model>-e{8,64}.json (results/)
  model=gpt-s; [ "$stage" = step-ep-xl ] && model=gpt-xl
  for net in dgx-h200 dgx-a100; do for e in 8 64; do
    step $stage$e-$net ${STEP_LIMIT:-150} python3 -m app.cli bench --step --emulate 8x8 --experts 64 --network $net \
        --model $model --layers 4 --tokens 8192 --micro-batches 1 --partitions 1,2 --strategies none --no-grid \
        --expert-parallel $e --tracking-uri none --out "$OUT/step-$CARD-emulated-8x8-$net-$model-e$e.json"
  done; done ;;
expert-loop)  # the per-expert GEMM loop (fp16) against the grouped kernel (bf16), E = 8, dgx-a100: step-<card>-...-e8-{bf16,fp16}.json (results/)
  for model in gpt-s gpt-xl; do for dtype in bf16 fp16; do
    step expert-loop-$model-$dtype ${STEP_LIMIT:-150} python3 -m app.cli bench --step --emulate 8x8 --experts 64 \
        --network dgx-a100 --model $model --layers 4 --tokens 8192 --micro-batches 1 --partitions 1,2 \
        --strategies none --no-grid --expert-parallel 8 --dtype $dtype --tracking-uri none \
        --out "$OUT/step-$CARD-emulated-8x8-dgx-a100-$model-e8-$dtype.json"
  done; done ;;
# --- training through Ray Train, one worker (carry .devwheels) ---
train-auto)  # gpt-s, both engines, default settings, batch 8: train-gpt-s-<card>-auto.json (results/)
  step train-auto 280 "${train[@]}" --preset gpt-s --engines mpipemoe,fastmoe --steps 40 --log-every 10 --batch-size 8 \
      --summary-json "$OUT/train-gpt-s-$CARD-auto.json" ;;
train-n4-s3)  # gpt-s, both engines, n = 4 with S3, batch 16: train-gpt-s-<card>-n4-s3.json (results/)
  step train-n4-s3 200 "${train[@]}" --preset gpt-s --engines mpipemoe,fastmoe --steps 40 --log-every 10 --batch-size 16 \
      --partitions 4 --strategy S3 --summary-json "$OUT/train-gpt-s-$CARD-n4-s3.json" ;;
capacity)  # gpt-s's largest batch under a 32 GiB cap, n = 4 with S3: capacity-gpt-s-<card>.json (results/)
  step capacity 240 python3 -m app.cli capacity --preset gpt-s --engines mpipemoe,fastmoe --use-gpu \
      --memory-cap-gib 32 --partitions 4 --strategy S3 --start-batch 8 --max-batch 64 --tracking-uri none \
      --out "$OUT/capacity-gpt-s-$CARD.json" ;;
mixed-gpt-s|mixed-gpt-xl)  # float32 master weights, bf16 compute, batch 8: train-<model>-<card>-mixed.json (results/training-h200-mixed/)
  if [ $stage = mixed-gpt-s ]; then shape=(--preset gpt-s --steps 40) name=gpt-s; else shape=("${XL4[@]}" --steps 30) name=gpt-xl4; fi
  step $stage 280 "${train[@]}" "${shape[@]}" --engines mpipemoe,fastmoe --log-every 20 --batch-size 8 \
      --summary-json "$OUT/train-$name-$CARD-mixed.json" ;;
mixed-capacity-gpt-s|mixed-capacity-gpt-xl)  # the largest batch under 100 GiB: capacity-<model>-<card>-mixed.json (results/training-h200-mixed/)
  if [ $stage = mixed-capacity-gpt-s ]; then shape=(--preset gpt-s) name=gpt-s; else shape=("${XL4[@]}") name=gpt-xl4; fi
  step $stage 290 "${mixed_capacity[@]}" "${shape[@]}" --out "$OUT/capacity-$name-$CARD-mixed.json" ;;
curve-mixed|curve-pure)  # 300 steps of gpt-s, master weights or pure bf16: curve-gpt-s-<card>-{mixed,pure-bf16}.json (results/training-h200-mixed/)
  if [ $stage = curve-mixed ]; then extra=() name=mixed; else extra=(--param-dtype bfloat16) name=pure-bf16; fi
  step $stage 280 "${train[@]}" --preset gpt-s --engine mpipemoe --steps 300 --log-every 20 --batch-size 8 \
      "${extra[@]}" --summary-json "$OUT/curve-gpt-s-$CARD-$name.json" ;;
adamw-profile)  # gpt-xl (4 layers) kernels by kind, batch 8 and 128, foreach and fused AdamW (results/training-h200-adamw/)
  for batch in 8 128; do for impl in foreach fused; do
    step "profile-b$batch-$impl" 280 python3 tools/profile_step.py "${XL4[@]}" --batch-size "$batch" \
        --optimizer-impl "$impl" --out "$OUT/profile-step-gpt-xl4-b$batch-$impl.json"
  done; done ;;
val-curve)  # docs/training.md §4a's BPE recipe at gpt-s, 300 steps: train-gpt-s-bpe-<card>-300.json (results/training-h200-val/)
  step prepare-bpe 280 python3 -m app.cli data prepare --tokenizer bpe:8192 --out /tmp/mpipemoe-bpe
  step val-curve 500 "${train[@]}" --preset gpt-s --data-dir /tmp/mpipemoe-bpe --steps 300 --batch-size 8 \
      --lr-schedule cosine --warmup-steps 30 --min-lr 3e-5 --eval-every 25 --log-every 25 \
      --summary-json "$OUT/train-gpt-s-bpe-$CARD-300.json" ;;
mfu)  # gpt-xl (4 layers), fused AdamW, batch 8 and 128: profile and 15 Ray Train steps, mfu-compare.txt (results/training-h200-mfu*/)
  python3 -c "from moe_engine.experts import _grouped_kernel_widens as w; print('grouped kernel widens:', w('cuda'))" \
    | tee "$OUT/mfu-widens.txt"
  for batch in 8 128; do
    step "mfu-profile-b$batch" 150 python3 tools/profile_step.py "${XL4[@]}" --batch-size "$batch" \
        --optimizer-impl fused --out "$OUT/profile-step-gpt-xl4-b$batch-mfu.json"
  done
  for batch in 8 128; do
    step "mfu-train-b$batch" 200 "${train[@]}" "${XL4[@]}" --engine mpipemoe --steps 15 --log-every 10 --eval-every 0 \
        --batch-size "$batch" --optimizer-impl fused --summary-json "$OUT/train-gpt-xl4-b$batch-mfu.json"
  done
  python3 - "$OUT" <<'PY' | tee "$OUT/mfu-compare.txt"
import json, sys
for batch in (8, 128):  # against the fused AdamW profiles of results/training-h200-adamw/
    try:
        before = json.load(open(f"results/training-h200-adamw/profile-step-gpt-xl4-b{batch}-fused.json"))
        after = json.load(open(f"{sys.argv[1]}/profile-step-gpt-xl4-b{batch}-mfu.json"))
    except OSError as error:
        print(f"batch {batch}: {error}"); continue
    profiled = after.get("profiled_step_s", after["step_s"])
    print(f"batch {batch}: profiled step {before['step_s'] * 1e3:.1f} -> {profiled * 1e3:.1f} ms "
          f"(unprofiled {after['step_s'] * 1e3:.1f} ms, MFU {before['mfu']:.1%} -> {after['mfu']:.1%}), "
          f"kernels {before['kernel_s'] * 1e3:.1f} -> {after['kernel_s'] * 1e3:.1f} ms, clocks {after.get('gpu_clocks')}")
    for kind in sorted(set(before["kernel_s_by_kind"]) | set(after["kernel_s_by_kind"])):
        b, a = (d["kernel_s_by_kind"].get(kind, 0.0) * 1e3 for d in (before, after))
        print(f"  {kind:<12} {b:8.1f} -> {a:8.1f} ms")
PY
  ;;
fused-ab)  # profile_step of the code in .ab/old and of this tree in turn, twice, batch 128 and 8 (AB_BATCHES):
  # profile-b<batch>-{old,new}-{1,2}.json, ab-summary.txt (results/training-h200-fused/); unpack the old code with
  #   mkdir -p .ab/old && git archive COMMIT moe_engine lm workers tools moe_sim app tune_spaces | tar -x -C .ab/old
  [ -d .ab/old ] || { echo "no .ab/old: unpack the code to compare against (see this stage's comment)"; exit 2; }
  for batch in ${AB_BATCHES:-128 8}; do for round in 1 2; do
    profile_step "profile-b$batch-old-$round" "$here/.ab/old" "$batch"
    profile_step "profile-b$batch-new-$round" "$here" "$batch"
  done; done
  python3 - "$OUT" <<'PY' | tee "$OUT/ab-summary.txt"
import glob, json, os, sys
for path in sorted(glob.glob(f"{sys.argv[1]}/profile-b*.json")):
    d = json.load(open(path))
    kinds = " ".join(f"{k} {v * 1e3:.1f}" for k, v in sorted(d["kernel_s_by_kind"].items()))
    print(f"{os.path.basename(path)}: step {d['step_s'] * 1e3:.1f} ms (profiled {d['profiled_step_s'] * 1e3:.1f}), "
          f"MFU {d['mfu']:.3f}, idle {d['gpu_idle_s'] * 1e3:.1f} ms; {kinds}")
PY
  ;;
*) echo "unknown stage $stage: give" $stages; exit 2 ;;
esac; done
