#!/usr/bin/env bash
# Issue 26: the overlap on the emulated 8x8 cluster, with timelines. Run with the `device` tool:
#   bash tools/h200-overlap.sh wait-tests trace-xl32k
# Writes under $OUT (default ./out): the bench JSON/Markdown, the traces of chosen settings, logs.
set -u
[ $# -gt 0 ] || { echo "give stages: wait-tests trace-xl32k"; exit 2; }
source "$(dirname "$0")/device-setup.sh"
export PYTHONUNBUFFERED=1
for stage in "$@"; do case $stage in
wait-tests)  # the emulated link's wall-clock wait and the emulated All-to-All on the GPU
  step wait-tests 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/moe_engine/test_gpu.py -k "emulated" ;;
trace-xl32k)  # gpt-xl 32k on the H200-class network: baselines, auto, n x {none, S3}, a timeline each
  step trace-xl32k 300 python3 -m app.cli bench --emulate 8x8 --network dgx-h200 --experts 64 --model gpt-xl \
      --tokens 32768,16384 --partitions 1,2,4,8 --strategies none,S3,S4 --rounds 2 --repeats 2 --tracking-uri none \
      --trace /tmp/traces --out "$OUT/bench-xl32k-trace.json"
  for f in /tmp/traces/*fastmoe* /tmp/traces/*grid-4_none* /tmp/traces/*grid-2_none* /tmp/traces/*grid-8_none* \
           /tmp/traces/*auto*; do [ -f "$f" ] && cp "$f" "$OUT/"; done ;;
*) echo "unknown stage $stage"; exit 2 ;;
esac; done
