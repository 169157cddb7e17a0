#!/usr/bin/env bash
# Issue 15: our engines beside torchtitan's MoE layer and the dense-GEMM floor, on the same
# shapes, inputs and weights, timed in the same interleaved rounds on one H200. Run with the
# `device` tool, carrying `.whl` (torchtitan and its pure-Python imports, fetched here with
# the `pip download` line in the issue; the GPU machine has no internet), e.g.:
#   bash tools/h200-lean-engine.sh gpu-tests peer bench
# Writes under $OUT (default ./out): bench-h200-lean.json/.md, bench-h200.json/.md, gpu.txt, logs.
set -u
[ $# -gt 0 ] || { echo "give stages: gpu-tests peer bench"; exit 2; }
source "$(dirname "$0")/device-setup.sh"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
# torchtitan's MoE imports triton; the CUDA torch wheels bring it. Say here whether the chain loads.
python3 -c "import triton, torchtitan.models.common.moe; print('torchtitan MoE imports; triton', triton.__version__)" \
  2>&1 | tail -1 | tee "$OUT/peer-import.txt"
# Expected on an H200, scaled from the timed steps of results/bench-h200-probe.json (134 s for its
# 8 GELU points): peer ~150 s (6 points; SwiGLU is 1.5x the FFN work; 25 layers a point), bench ~140 s.
for stage in "$@"; do case $stage in
gpu-tests)  # 1. every GPU test, torchtitan's layer against FastMoE in bf16 among them
  step gpu-tests 240 python3 -m pytest -q -p no:cacheprovider -m gpu ;;
peer)  # 2. MPipeMoE, FastMoE, FasterMoE, torchtitan and the dense floor (SwiGLU, no biases)
  step peer 280 python3 -m app.cli bench --model gpt-s,gpt-xl --tokens 4096,16384,32768 --activation swiglu \
    --no-bias --peers torchtitan --partitions 1,2,4,8 --tracking-uri none \
    --out "$OUT/bench-h200-lean.json" ;;
bench)  # 3. the default GELU grid (the committed one), now with the dense floor
  step bench 280 python3 -m app.cli bench --model gpt-s,gpt-xl --tokens 4096,8192,16384,32768 \
    --partitions 1,2,4,8 --tracking-uri none --out "$OUT/bench-h200.json" ;;
*) echo "unknown stage $stage: give gpu-tests, peer or bench"; exit 2 ;;
esac; done
