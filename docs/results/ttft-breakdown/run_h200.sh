#!/usr/bin/env bash
# Where the first token's time goes on two H200s (32 cores): the goodput sweep's app
# (docs/results/goodput/serve_config.h200.yaml, one pool per GPU) under the SLO policy at 0.5x,
# 1x, 1.5x and 2x the capacity probed before (130.4 req/s, docs/results/goodput.md), every
# request's Server-Timing recorded. MULTIPLES, POLICIES and REPEATS_AT (multiples run 3 times)
# change the sweep. Needs the offline vLLM + Ray install named by $SERVE_APP_SITE
# (default /tmp/site, with its env.sh). Writes h200.json/.md/.png and the logs to $OUT.
#   OUT=/some/dir bash docs/results/ttft-breakdown/run_h200.sh
set -euo pipefail
SITE=${SERVE_APP_SITE:-/tmp/site}
OUT=${OUT:?}
URL=http://127.0.0.1:8000
source "$SITE/env.sh"
export PYTHONPATH=$PWD:$SITE
python3 -m serve_app run docs/results/goodput/serve_config.h200.yaml --port 8000 > "$OUT/app.log" 2>&1 &
APP=$!
trap 'kill -INT $APP 2>/dev/null; wait $APP 2>/dev/null || true' EXIT
for _ in $(seq 1 300); do curl -sf $URL/ready >/dev/null && break; sleep 1; done
curl -si -X POST $URL/v1/completions -H 'content-type: application/json' -H 'x-slo-class: interactive' \
  -d '{"prompt": "Where does the time go?", "max_tokens": 16}' > "$OUT/one-request.txt"
python3 -m serve_app.bench.goodput --url $URL --workload workloads/slo-mix-gpu.yaml \
  --capacity 130.4 --multiples "${MULTIPLES:-0.5,1,1.5,2}" --policies "${POLICIES:-slo}" \
  --repeats-at "${REPEATS_AT:-}" --extra-repeats 2 \
  --window-s 30 --drain-s 10 --machine "two H200s, 32 cores" --out "$OUT" --name h200 \
  > "$OUT/bench.log" 2>&1
curl -s $URL/pools > "$OUT/pools-end.json"
