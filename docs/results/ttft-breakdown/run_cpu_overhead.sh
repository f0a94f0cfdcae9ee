#!/usr/bin/env bash
# What the TTFT breakdown costs: the streaming comparison (app vs `vllm serve`, same engine
# arguments, `vllm bench serve` as the client) with the breakdown on, then off
# (--no-server-timing), 3 repeats each; the app / vllm serve throughput ratio of the two runs
# compared. On the CPU machine (2 cores, builtin tiny model, profile low-latency).
#   bash docs/results/ttft-breakdown/run_cpu_overhead.sh
set -euo pipefail
OUT=docs/results/ttft-breakdown
PY=${PYTHON:-.venv/bin/python}
for mode in on off; do
  flag=$([ $mode = off ] && echo --no-server-timing || true)
  $PY -m serve_app.bench.streaming --concurrency 4,32 --num-prompts 96 --output-len 64 \
    --repeats 3 $flag --out $OUT/cpu-overhead-$mode
done
