#!/usr/bin/env bash
# Issue 29's batch-128 MFU: the fused Triton kernels (moe_engine/kernels.py) and the batch read
# ahead (workers/loop.py), A/B on one H200 against the code before them, unpacked by
#   mkdir -p .ab/old && git archive <commit> moe_engine lm workers tools moe_sim app tune_spaces | tar -x -C .ab/old
# Run with the `device` tool carrying .devwheels and .ab:
#   bash tools/h200-fused.sh kernels      # the kernels' GPU tests and the engine's (~1 min)
#   bash tools/h200-fused.sh ab           # tools/profile_step.py, gpt-xl 4 layers, batch 128 and 8,
#                                         # old / new / old / new (~5 min; AB_BATCHES="8" for batch 8 only)
# Writes under $OUT (default ./out): profile-b{128,8}-{old,new}-{1,2}.json, one log per run.
set -u
[ $# -gt 0 ] || { echo "give stages: kernels ab"; exit 2; }
source "$(dirname "$0")/device-setup.sh"
here=$PWD
profile() {  # profile NAME CODE_DIR BATCH
  step "$1" 150 env PYTHONPATH="$here/.site:$2" python3 "$2/tools/profile_step.py" --preset gpt-xl --num-layers 4 \
    --batch-size "$3" --optimizer-impl fused --out "$OUT/$1.json"
}
for stage in "$@"; do case $stage in
kernels)
  step kernels 200 python3 -m pytest -q -rs -p no:cacheprovider -m gpu tests/moe_engine/test_kernels.py \
    tests/moe_engine/test_gpu.py ;;
ab)
  [ -d .ab/old ] || { echo "no .ab/old: unpack the code to compare against (see the top of this file)"; exit 2; }
  for batch in ${AB_BATCHES:-128 8}; do for round in 1 2; do
    profile "profile-b$batch-old-$round" "$here/.ab/old" "$batch"
    profile "profile-b$batch-new-$round" "$here" "$batch"
  done; done
  python3 - "$OUT" <<'PY' | tee "$OUT/ab-summary.txt"
import glob, json, os, sys
for path in sorted(glob.glob(f"{sys.argv[1]}/profile-b*.json")):  # the records of this call
    d = json.load(open(path))
    kinds = " ".join(f"{k} {v * 1e3:.1f}" for k, v in sorted(d["kernel_s_by_kind"].items()))
    print(f"{os.path.basename(path)}: step {d['step_s'] * 1e3:.1f} ms (profiled {d['profiled_step_s'] * 1e3:.1f}), "
          f"MFU {d['mfu']:.3f}, idle {d['gpu_idle_s'] * 1e3:.1f} ms; {kinds}")
PY
  ;;
*) echo "unknown stage $stage"; exit 2 ;;
esac; done
