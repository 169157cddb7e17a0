#!/usr/bin/env bash
# Regenerates every simulator record docs/simulate.md quotes, from the committed parts
# (results/sim-parts-h200.json) and the committed one-GPU benchmarks, on any machine
# (the simulator needs no GPU). Run from the repository root after new parts or records:
#   bash tools/simulate-answers.sh
set -eu
sim=(.venv/bin/mpipemoe simulate --tracking-uri none)
[ -x .venv/bin/mpipemoe ] || sim=(python3 -m app.cli simulate --tracking-uri none)
tokens=1024,1408,2048,2880,4096,5760,8192,11584,16384,23168,32768,46336,65536,92672,131072
"${sim[@]}" --validate results/bench-h200.json --validate results/bench-h200-lean.json \
    --out results/simulate-validation.json
"${sim[@]}" --validate results/bench-h200-emulated-8x8-dgx-h200.json \
    --validate results/bench-h200-emulated-8x8-dgx-h200-32k.json \
    --validate results/bench-h200-emulated-8x8-dgx-a100.json --out results/simulate-validation-emulated.json
"${sim[@]}" --validate results/step-h200-emulated-8x8-dgx-h200-gpt-xl.json \
    --validate results/step-h200-emulated-8x8-dgx-h200-gpt-s.json \
    --validate results/step-h200-emulated-8x8-dgx-h200-routing.json \
    --validate results/step-h200-emulated-8x8-dgx-h200-replay.json --out results/simulate-validation-step.json
"${sim[@]}" --nodes 8 --gpus-per-node 8 --model gpt-xl --tokens 4096,8192,16384,32768 --step \
    --out results/simulate-8x8-gpt-xl.json
"${sim[@]}" --model gpt-xl --sweep-nodes 1,8,32 --tokens $tokens --out results/simulate-best-n-gpt-xl.json
"${sim[@]}" --model gpt-xl --sweep-nodes 1,8,32 --tokens $tokens --routing hot:0.3 \
    --out results/simulate-best-n-gpt-xl-hot.json
"${sim[@]}" --model gpt-xl --tokens 4096,16384 --sweep-nodes 1,2,4,8,16,32,64 --out results/simulate-sweep-gpt-xl.json
"${sim[@]}" --model gpt-xl --tokens 4096,16384 --sweep-nodes 1,2,4,8,16,32,64 --hierarchical \
    --out results/simulate-sweep-gpt-xl-hierarchical.json
# The expert-parallel degree on 8 DGX nodes: one node's group (E = 8) against the whole world
# (E = 64), with as many experts as GPUs and with the presets' 8 (docs/cluster.md).
"${sim[@]}" --model gpt-s --nodes 8 --tokens 8192 --experts 64 --expert-parallel 8,64 --network dgx-h200 \
    --out results/simulate-expert-parallel-gpt-s-dgx-h200.json
"${sim[@]}" --model gpt-s --nodes 8 --tokens 8192 --experts 64 --expert-parallel 8,64 --network dgx-a100 \
    --out results/simulate-expert-parallel-gpt-s-dgx-a100.json
"${sim[@]}" --model gpt-s --nodes 8 --tokens 8192 --experts 8 --expert-parallel 8,64 --network dgx-h200 \
    --out results/simulate-expert-parallel-gpt-s-8-experts.json
"${sim[@]}" --model gpt-xl --nodes 8 --tokens 8192 --experts 64 --expert-parallel 8,64 --network dgx-h200 \
    --out results/simulate-expert-parallel-gpt-xl-dgx-h200.json
"${sim[@]}" --model gpt-xl --nodes 8 --tokens 8192 --experts 64 --expert-parallel 8,64 --network dgx-a100 \
    --out results/simulate-expert-parallel-gpt-xl-dgx-a100.json
"${sim[@]}" --model gpt-xl --nodes 8 --tokens 8192 --experts 8 --expert-parallel 8,64 --network dgx-h200 \
    --out results/simulate-expert-parallel-gpt-xl-8-experts.json
