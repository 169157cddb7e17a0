#!/usr/bin/env bash
# Issue 16: the real engine on one H200 as rank 0 of an emulated 8x8 cluster (docs/emulation.md),
# on the DGX-A100 network and on the H200-class one; every model, 4k-32k tokens per GPU, uniform and
# hot-expert routing, the baselines, auto and the full n x strategy grid. Run with the `device` tool:
#   bash tools/h200-emulated.sh gpu-tests a100 h200
# A100_LIMIT / H200_LIMIT: seconds for each network (defaults fit one 600 s device call).
# Writes under $OUT (default ./out): bench-h200-emulated-8x8-<network>.json/.md, logs.
set -u
[ $# -gt 0 ] || { echo "give stages: gpu-tests a100 h200 small-a100 small-h200"; exit 2; }
source "$(dirname "$0")/device-setup.sh"
# gpt-xl first: a stopped run (SIGTERM from `step`'s time limit) writes the points it finished.
GRID="--emulate 8x8 --experts 64 --model gpt-xl,bert-l,gpt-s --tokens 4096,16384,32768,8192
      --routing uniform,hot-expert --rounds 2 --repeats 2 --tracking-uri none"
# bert-l and gpt-s, uniform routing only: what a short device session can add after the above.
SMALL="--emulate 8x8 --experts 64 --model bert-l,gpt-s --tokens 4096,16384,32768,8192 --routing uniform
       --rounds 2 --repeats 2 --tracking-uri none"
for stage in "$@"; do case $stage in
gpu-tests)  # the GPU tests of the emulated All-to-All and the NCCL path
  step gpu-tests 40 python3 -m pytest -q -p no:cacheprovider -m gpu -k "emulated" ;;
a100) step a100 ${A100_LIMIT:-280} python3 -m app.cli bench $GRID --network dgx-a100 --out "$OUT/bench-h200-emulated-8x8-dgx-a100.json" ;;
h200) step h200 ${H200_LIMIT:-240} python3 -m app.cli bench $GRID --network dgx-h200 --out "$OUT/bench-h200-emulated-8x8-dgx-h200.json" ;;
small-a100) step small-a100 ${SMALL_LIMIT:-70} python3 -m app.cli bench $SMALL --network dgx-a100 \
    --out "$OUT/bench-h200-emulated-8x8-dgx-a100-small.json" ;;
small-h200) step small-h200 ${SMALL_LIMIT:-70} python3 -m app.cli bench $SMALL --network dgx-h200 \
    --out "$OUT/bench-h200-emulated-8x8-dgx-h200-small.json" ;;
*) echo "unknown stage $stage: give gpu-tests, a100, h200, small-a100 or small-h200"; exit 2 ;;
esac; done
