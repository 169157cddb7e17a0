#!/usr/bin/env bash
# The one-GPU records that validate the simulator (issue 9): the parts and the layer
# benchmark measured on the same machine in the same session, so the host's speed that
# day is the same in both. Run with the `device` tool, carrying `.devwheels`, e.g.:
#   bash tools/h200-simulator-records.sh parts bench bench-rerun gpu-tests
# then, here, with the records copied into results/: bash tools/simulate-answers.sh
# (it validates the simulator against results/bench-h200.json and results/bench-h200-lean.json,
# both from tools/h200-lean-engine.sh, and regenerates every prediction the docs quote).
# Writes under $OUT (default ./out), with the names of the committed records it made:
# sim-parts-h200.json, bench-h200-probe.json/.md, bench-h200-probe-rerun.json/.md, gpu.txt, logs.
set -u
[ $# -gt 0 ] || { echo "give stages: parts bench bench-rerun gpu-tests"; exit 2; }
source "$(dirname "$0")/device-setup.sh"
bench=(python3 -m app.cli bench --model gpt-s,gpt-xl --tokens 4096,8192,16384,32768 --partitions 1,2,4,8
       --tracking-uri none)
for stage in "$@"; do case $stage in
parts)  # 1. every part the simulator reads: GEMM, row kernels, shell, host copies, host issue cost
  step parts 240 python3 -m app.cli simulate --measure-parts "$OUT/sim-parts-h200.json" --tracking-uri none ;;
bench)  # 2. the layer benchmark in the same session as the parts (the committed grid)
  step bench 300 "${bench[@]}" --out "$OUT/bench-h200-probe.json" ;;
bench-rerun)  # 3. the same again: the run-to-run spread of the measurements themselves
  step bench-rerun 300 "${bench[@]}" --out "$OUT/bench-h200-probe-rerun.json" ;;
gpu-tests)  # 4. the GPU tests (engines on CUDA streams, device reads per pass, memory model)
  step gpu-tests 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/moe_engine/test_gpu.py tests/app/test_capacity.py ;;
*) echo "unknown stage $stage: give parts, bench, bench-rerun or gpu-tests"; exit 2 ;;
esac; done
