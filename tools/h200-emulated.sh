#!/usr/bin/env bash
# Issue 16: the real engine on one H200 as rank 0 of an emulated 8x8 cluster (docs/emulation.md),
# on the DGX-A100 network and on the H200-class one; every model, 4k-32k tokens per GPU, uniform and
# skewed routing, the baselines, auto and the full n x strategy grid. Run with the `device` tool:
#   bash tools/h200-emulated.sh gpu-tests a100 h200
# Writes under $OUT (default ./out): bench-h200-emulated-8x8-<network>.json/.md, logs.
set -u
[ $# -gt 0 ] || { echo "give stages: gpu-tests a100 h200"; exit 2; }
source "$(dirname "$0")/device-setup.sh"
GRID="--emulate 8x8 --experts 64 --model gpt-s,bert-l,gpt-xl --tokens 4096,8192,16384,32768
      --routing uniform,skewed --rounds 3 --repeats 2 --tracking-uri none"
for stage in "$@"; do case $stage in
gpu-tests)  # the GPU tests of the emulated All-to-All and the NCCL path
  step gpu-tests 120 python3 -m pytest -q -p no:cacheprovider -m gpu -k "emulated or nccl" ;;
a100) step a100 560 python3 -m app.cli bench $GRID --network dgx-a100 --out "$OUT/bench-h200-emulated-8x8-dgx-a100.json" ;;
h200) step h200 560 python3 -m app.cli bench $GRID --network dgx-h200 --out "$OUT/bench-h200-emulated-8x8-dgx-h200.json" ;;
*) echo "unknown stage $stage: give gpu-tests, a100 or h200"; exit 2 ;;
esac; done
