#!/usr/bin/env bash
# On an H200 (after the offline vLLM + Ray install in /tmp/site): the seed workload on the bare engine
# (block 16, len 4096) at concurrency 1, 16, 64, 256; then chunked prefill on/off x max_num_seqs
# 64/256 at the seed's concurrency 4.
set -euo pipefail
source /tmp/site/env.sh
export PYTHONPATH=$PWD:/tmp/site SERVE_APP_PROFILES_DIR=$PWD/docs/results/h200/profiles
OUT=${OUT:-/tmp/out}
python3 -m serve_app.bench run --workload workloads/seed-table.yaml --concurrency 1,16,64,256 \
  --target engine:seed-gpu --out "$OUT/concurrency" --name seed-concurrency 2>&1 \
  | grep -E "^ *engine|^\|" | tail -12
python3 -m serve_app.bench.tune --profile seed-gpu --workload workloads/seed-table.yaml \
  --chunked-prefill on,off --max-num-seqs 64,256 --out "$OUT/sched" 2>&1 | grep -E "^\||tok/s" | tail -12
