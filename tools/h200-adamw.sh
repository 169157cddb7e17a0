#!/usr/bin/env bash
# Issue 29: AdamW's kernels on one H200 (gpt-xl, 4 of its 24 layers, bf16 compute over float32
# master weights, mpipemoe n=1): step time and MFU at batch 8 and at the largest batch (128:
# results/training-h200-mixed/capacity-gpt-xl4-h200-mixed.json), foreach (what torch chose
# before: 24.4 ms of a 79.7 ms step at batch 8) against fused (--optimizer-impl auto on CUDA).
# Run with the `device` tool carrying .devwheels, as the other tools/h200-*.sh:
#   bash tools/h200-adamw.sh profile      # tools/profile_step.py: kernel time by kind, 4 runs, ~5 min
#   bash tools/h200-adamw.sh train        # mpipemoe train through Ray Train, 30 steps each, ~8 min
#   bash tools/h200-adamw.sh val-curve    # issue 29's GPU target: gpt-s on BPE text, 300 steps, validation loss
# Writes under $OUT (default ./out): profile-step-gpt-xl4-b{8,128}-{foreach,fused}.json and
# train-gpt-xl4-b{8,128}-{foreach,fused}.json (the summary's mfu, step_time_s), one log per run.
set -u
[ $# -gt 0 ] || { echo "give stages: profile train val-curve"; exit 2; }
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
*) echo "unknown stage $stage"; exit 2 ;;
esac; done
