#!/usr/bin/env bash
# Issue 26: the overlap on the emulated 8x8 cluster, with timelines, and what validates it.
# Run with the `device` tool, carrying `.devwheels` (Ray) and `.whl` (torchtitan, as for
# tools/h200-lean-engine.sh), e.g.:
#   bash tools/h200-overlap.sh gpu-tests parts grid-h200 traces
#   bash tools/h200-overlap.sh grid-a100 peers
# Writes under $OUT (default ./out): bench-h200-emulated-8x8-<network>.json/.md, sim-parts-h200.json,
# bench-h200-overlap-traces.json/.md and two of its timelines, bench-h200-peers.json/.md, logs.
set -u
[ $# -gt 0 ] || { echo "give stages: wait-tests gpu-tests parts grid-h200 grid-a100 targets-h200 targets-a100 memory traces trace-xl32k peers"; exit 2; }
source "$(dirname "$0")/device-setup.sh"
export PYTHONUNBUFFERED=1
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
    && export PYTHONPATH=$PYTHONPATH:/tmp/site
fi
# Every model at 4k-32k tokens per GPU, uniform and hot-expert; n x {none, S3, S4} (S1 and S2 move
# A over PCIe and are 2.5-3x slower: left out to fit a device call); gpt-xl and 32k first.
GRID="--emulate 8x8 --experts 64 --tokens 32768,16384,8192,4096 --routing uniform,hot-expert --partitions 1,2,4,8
      --strategies none,S3,S4 --rounds 2 --repeats 2 --tracking-uri none"
GRID_AT="--emulate 8x8 --experts 64 --routing uniform,hot-expert --partitions 1,2,4,8 --strategies none,S3,S4
         --rounds 2 --repeats 2 --tracking-uri none"
for stage in "$@"; do case $stage in
wait-tests)  # the emulated link's wall-clock wait and the emulated All-to-All on the GPU
  step wait-tests 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/moe_engine/test_gpu.py -k "emulated" ;;
gpu-tests)  # every GPU test
  step gpu-tests 240 python3 -m pytest -q -rs -p no:cacheprovider -m gpu ;;
parts)  # the simulator's parts, in the same session as the grids it is validated against
  step parts 120 python3 -m app.cli simulate --measure-parts "$OUT/sim-parts-h200.json" --tracking-uri none ;;
grid-h200)
  step grid-h200 ${H200_LIMIT:-330} python3 -m app.cli bench $GRID --model gpt-xl,bert-l,gpt-s --network dgx-h200 \
      --out "$OUT/bench-h200-emulated-8x8-dgx-h200.json" ;;
grid-a100)
  step grid-a100 ${A100_LIMIT:-300} python3 -m app.cli bench $GRID --model gpt-xl,bert-l,gpt-s --network dgx-a100 \
      --out "$OUT/bench-h200-emulated-8x8-dgx-a100.json" ;;
targets-h200)  # the issue's target points first (a device call holds ~9 min): gpt-xl 32k-8k, bert-l and gpt-s 32k
  step targets-h200-xl 330 python3 -m app.cli bench $GRID_AT --model gpt-xl --tokens 32768,16384,8192 \
      --network dgx-h200 --out "$OUT/bench-h200-emulated-8x8-dgx-h200.json"
  step targets-h200-small 160 python3 -m app.cli bench $GRID_AT --model bert-l,gpt-s --tokens 32768 \
      --network dgx-h200 --out "$OUT/bench-h200-emulated-8x8-dgx-h200-32k.json" ;;
targets-a100)  # gpt-xl at 8k-32k on the DGX-A100 network (its target: auto near the bound from 8k up)
  step targets-a100 330 python3 -m app.cli bench $GRID_AT --model gpt-xl --tokens 32768,16384,8192 \
      --network dgx-a100 --out "$OUT/bench-h200-emulated-8x8-dgx-a100.json" ;;
memory)  # the memory model against every setting's peak, uniform and hot-expert (one timing round: memory is the point)
  step memory 200 python3 -m app.cli bench --emulate 8x8 --network dgx-h200 --experts 64 --model gpt-xl \
      --tokens 32768,16384,8192 --routing uniform,hot-expert --partitions 1,2,4,8 --strategies none,S3,S4 \
      --rounds 1 --repeats 1 --tracking-uri none --out "$OUT/bench-h200-emulated-memory.json" ;;
traces)  # two representative points' timelines: gpt-xl 16k FastMoE and 4/none on the H200-class network
  step traces 120 python3 -m app.cli bench --emulate 8x8 --network dgx-h200 --experts 64 --model gpt-xl \
      --tokens 16384 --partitions 4 --strategies none --rounds 2 --repeats 2 --tracking-uri none \
      --trace /tmp/traces --out "$OUT/bench-h200-overlap-traces.json"
  for f in /tmp/traces/*fastmoe* /tmp/traces/*grid-4_none*; do [ -f "$f" ] && cp "$f" "$OUT/"; done ;;
trace-xl32k)  # gpt-xl 32k and 16k, baselines, auto, n x {none, S3, S4}, a timeline each
  step trace-xl32k 300 python3 -m app.cli bench --emulate 8x8 --network dgx-h200 --experts 64 --model gpt-xl \
      --tokens 32768,16384 --partitions 1,2,4,8 --strategies none,S3,S4 --rounds 2 --repeats 2 --tracking-uri none \
      --trace /tmp/traces --out "$OUT/bench-xl32k-trace.json" ;;
peers)  # one GPU: n = 1 beside torchtitan's layer (nothing slower on one GPU)
  step peers 200 python3 -m app.cli bench --model gpt-s,gpt-xl --tokens 4096,16384,32768 --activation swiglu \
      --no-bias --peers torchtitan --partitions 1,4 --strategies none,S4 --tracking-uri none \
      --out "$OUT/bench-h200-peers.json" ;;
*) echo "unknown stage $stage"; exit 2 ;;
esac; done
