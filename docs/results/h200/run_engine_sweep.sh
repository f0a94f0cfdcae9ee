#!/usr/bin/env bash
# On an H200 (after the offline vLLM + Ray install in /tmp/site): the bare engine (vLLM AsyncLLM in
# the bench process, profile seed-gpu: block 16, len 4096) at concurrency 1, 4, 16, 64 and 256 on
# the seed's request shapes (prompts 30-300 tokens, 256 output tokens), with enough requests per
# run to keep every user busy (at least 4 x concurrency, about 20 s each). One repeat per
# invocation (REPEAT names it), so a cut-off call keeps the repeats it finished:
#   REPEAT=0 OUT=/tmp/out bash docs/results/h200/run_engine_sweep.sh
set -euo pipefail
source /tmp/site/env.sh
export PYTHONPATH=$PWD:/tmp/site SERVE_APP_PROFILES_DIR=$PWD/docs/results/h200/profiles
OUT=${OUT:-/tmp/out}
REPEAT=${REPEAT:-0}
python3 -m serve_app.bench run --workload workloads/seed-table.yaml --concurrency 1,4,16,64,256 \
  --requests 1=45,4=160,16=480,64=1280,256=2560 --target engine:seed-gpu \
  --out "$OUT/engine-sweep" --name "engine-sweep-r$REPEAT" 2>&1 | grep -E "^ *engine|^\|" | tail -14
