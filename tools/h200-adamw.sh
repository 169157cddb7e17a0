#!/usr/bin/env bash
# Issue 29: AdamW's kernels on one H200 (gpt-xl, 4 of its 24 layers, bf16 compute over float32
# master weights, mpipemoe n=1): step time and MFU at batch 8 and at the largest batch (128:
# results/training-h200-mixed/capacity-gpt-xl4-h200-mixed.json), foreach (what torch chose
# before: 24.4 ms of a 79.7 ms step at batch 8) against fused (--optimizer-impl auto on CUDA).
# Run with the `device` tool carrying .devwheels, as the other tools/h200-*.sh:
#   bash tools/h200-adamw.sh profile      # tools/profile_step.py: kernel time by kind, 4 runs, ~5 min
#   bash tools/h200-adamw.sh train        # mpipemoe train through Ray Train, 30 steps each, ~8 min
#   bash tools/h200-adamw.sh val-curve    # issue 29's GPU target: gpt-s on BPE text, 300 steps, validation loss
#   bash tools/h200-adamw.sh mfu          # issue 29's MFU target after the copy/cast fixes (branch mfu): profile and
#                                         # 15 Ray Train steps at batch 8 and 128, fused AdamW, ~5 min; prints the
#                                         # profile against results/training-h200-adamw/*-fused.json (before)
# Writes under $OUT (default ./out): profile-step-gpt-xl4-b{8,128}-{foreach,fused}.json and
# train-gpt-xl4-b{8,128}-{foreach,fused}.json (the summary's mfu, step_time_s), one log per run.
set -u
[ $# -gt 0 ] || { echo "give stages: profile train val-curve mfu"; exit 2; }
source "$(dirname "$0")/device-setup.sh"
train=(python3 -m app.cli train --use-gpu --num-workers 1 --tracking-uri none --checkpoint-every 0
       --storage-path /tmp/mpipemoe-runs --preset gpt-xl --num-layers 4 --engine mpipemoe --steps 30
       --lr 3e-4 --log-every 10 --eval-every 0)
rm -rf /tmp/mpipemoe-runs
for stage in "$@"; do case $stage in
profile)
  for batch in 8 128; do for impl in foreach fused; do
    step "profile-b$batch-$impl" 280 python3 tools/profile_step.py --preset gpt-xl --num-layers 4 \
      --batch-size "$batch" --optimizer-impl "$impl" --out "$OUT/profile-step-gpt-xl4-b$batch-$impl.json"
  done; done ;;
train)
  for batch in 8 128; do for impl in foreach fused; do
    step "train-b$batch-$impl" 280 "${train[@]}" --batch-size "$batch" --optimizer-impl "$impl" \
      --summary-json "$OUT/train-gpt-xl4-b$batch-$impl.json"
  done; done ;;
val-curve)  # the docs' recipe (docs/training.md §4a) at gpt-s: the validation loss every 25 steps
  step prepare-bpe 280 python3 -m app.cli data prepare --tokenizer bpe:8192 --out /tmp/mpipemoe-bpe
  step val-curve 500 python3 -m app.cli train --use-gpu --num-workers 1 --tracking-uri none --checkpoint-every 0 \
    --storage-path /tmp/mpipemoe-runs --preset gpt-s --data-dir /tmp/mpipemoe-bpe --steps 300 --batch-size 8 \
    --lr 3e-4 --lr-schedule cosine --warmup-steps 30 --min-lr 3e-5 --eval-every 25 --log-every 25 \
    --summary-json "$OUT/train-gpt-s-bpe-h200-300.json" ;;
mfu)  # writes profile-step-gpt-xl4-b{8,128}-mfu.json and train-gpt-xl4-b{8,128}-mfu.json
  # whether this torch's grouped GEMM writes float32 (False: the expert weight gradients run per
  # expert with host counts, and the bias gradients take the one-hot GEMM of experts.grouped_bias_grad)
  python3 -c "from moe_engine.experts import _grouped_kernel_widens as w; print('grouped kernel widens:', w('cuda'))" \
    | tee "$OUT/mfu-widens.txt"
  for batch in 8 128; do
    step "mfu-profile-b$batch" 150 python3 tools/profile_step.py --preset gpt-xl --num-layers 4 \
      --batch-size "$batch" --optimizer-impl fused --out "$OUT/profile-step-gpt-xl4-b$batch-mfu.json"
  done
  for batch in 8 128; do
    step "mfu-train-b$batch" 200 "${train[@]}" --steps 15 --batch-size "$batch" --optimizer-impl fused \
      --summary-json "$OUT/train-gpt-xl4-b$batch-mfu.json"
  done
  python3 - "$OUT" <<'PY' | tee "$OUT/mfu-compare.txt"
import json, sys
for batch in (8, 128):
    try:
        before = json.load(open(f"results/training-h200-adamw/profile-step-gpt-xl4-b{batch}-fused.json"))
        after = json.load(open(f"{sys.argv[1]}/profile-step-gpt-xl4-b{batch}-mfu.json"))
    except OSError as error:
        print(f"batch {batch}: {error}"); continue
    # (records before the unprofiled timing have only the profiled step time, as step_s)
    profiled = after.get("profiled_step_s", after["step_s"])
    print(f"batch {batch}: profiled step {before['step_s'] * 1e3:.1f} -> {profiled * 1e3:.1f} ms "
          f"(unprofiled {after['step_s'] * 1e3:.1f} ms, MFU {before['mfu']:.1%} -> {after['mfu']:.1%}), "
          f"kernels {before['kernel_s'] * 1e3:.1f} -> {after['kernel_s'] * 1e3:.1f} ms, clocks {after.get('gpu_clocks')}")
    for kind in sorted(set(before["kernel_s_by_kind"]) | set(after["kernel_s_by_kind"])):
        b, a = (d["kernel_s_by_kind"].get(kind, 0.0) * 1e3 for d in (before, after))
        print(f"  {kind:<12} {b:8.1f} -> {a:8.1f} ms")
PY
  ;;
*) echo "unknown stage $stage"; exit 2 ;;
esac; done
