#!/usr/bin/env bash
# A/B of moe_engine/experts.py (this commit's against out/ab/experts_before.py) on the gpt-s step
# at 16k tokens, K = 1: after, before, after again; records under $1.
set -u
o=$1; mkdir -p "$o"
ab() { timeout 150 python3 -m app.cli bench --step --emulate 8x8 --experts 64 --network dgx-h200 --model gpt-s \
  --layers 4 --tokens 16384 --micro-batches 1 --partitions 1,2 --strategies none --no-grid --tracking-uri none \
  --out "$o/ab-$1.json" > "$o/ab-$1.log" 2>&1; echo "ab-$1 rc=$?"; grep "| gpt-s" "$o/ab-$1.log"; }
cp moe_engine/experts.py /tmp/experts_after.py
ab after1
cp out/ab/experts_before.py moe_engine/experts.py
ab before
cp /tmp/experts_after.py moe_engine/experts.py
ab after2
