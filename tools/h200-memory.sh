#!/usr/bin/env bash
# Issue 27: memory the user can trust, on one H200. Run with the `device` tool from a checkout
# that holds .whl/ (torchtitan 0.3.0 and its pure-Python imports; /work/main/.whl), carrying it:
#   run(command="bash tools/h200-memory.sh gpu-tests", carry=[".whl"])
#   run(command="bash tools/h200-memory.sh stacked:gpt-xl:32768", carry=[".whl"])   # 22 settings, ~3 min a point
#   ... stacked:gpt-xl:16384, stacked:gpt-s:32768
# Writes under $OUT (default ./out): gpu-tests.log, stacked-<model>-<tokens>.json/.md, logs.
set -u
[ $# -gt 0 ] || { echo "give stages: gpu-tests stacked:MODEL:TOKENS"; exit 2; }
source "$(dirname "$0")/device-setup.sh"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=/tmp/site:$PYTHONPATH
fi
for stage in "$@"; do case $stage in
gpu-tests)  # 1. the GPU tests, the CUDA-graph capture of every strategy and the memory model among them
  step gpu-tests 400 python3 -m pytest -q -p no:cacheprovider -m gpu tests/moe_engine/test_gpu.py ;;
stacked:*)  # 2. 8 residual SwiGLU layers, bf16: every bench setting beside torchtitan, each +/- checkpointing,
            # and auto@budget (0.15x torchtitan's activation memory); the JSON is rewritten after each setting
  point=${stage#stacked:} model=${point%:*} tokens=${point#*:}
  step "stacked-$model-$tokens" 540 python3 -m app.cli bench --layers 8 --peers torchtitan --model "$model" \
    --tokens "$tokens" --activation swiglu --no-bias --dtype bf16 --partitions 1,4,8 --strategies none,S4 \
    --warmup 2 --repeats 5 --rounds 1 --tracking-uri none --out "$OUT/stacked-$model-$tokens.json" ;;
*) echo "unknown stage $stage: give gpu-tests or stacked:MODEL:TOKENS"; exit 2 ;;
esac; done
