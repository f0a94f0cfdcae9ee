#!/usr/bin/env bash
# Goodput on two H200s (32 cores): the app with its two shipped pools, one GPU each, and
# routing policies compared on the same replicas (x-route-policy) at 0.5x, 1x, 1.5x, 2x the
# fleet's probed capacity, 3 repeats at 1x and 2x. Needs the offline vLLM + Ray install named by
# $SERVE_APP_SITE (default /tmp/site, with its env.sh). Runs in the background (setsid) and
# writes as it goes:
#   bash docs/results/goodput/run_h200.sh start    # start the app and the sweep, return at once
#   bash docs/results/goodput/run_h200.sh collect  # copy what is there so far to $OUT
set -euo pipefail
SITE=${SERVE_APP_SITE:-/tmp/site}
WORK=${GOODPUT_WORK:-/tmp/goodput}
URL=http://127.0.0.1:8000
case "${1:-}" in
start)
  mkdir -p "$WORK"
  cat > "$WORK/sweep.sh" <<SH
source $SITE/env.sh
export PYTHONPATH=$PWD:$SITE
cd $PWD
python3 -m serve_app run docs/results/goodput/serve_config.h200.yaml --port 8000 > $WORK/app.log 2>&1 &
for i in \$(seq 1 300); do curl -sf $URL/ready >/dev/null && break; sleep 1; done
curl -s $URL/pools > $WORK/pools-start.json
nvidia-smi --query-gpu=index,name,memory.used --format=csv > $WORK/gpus.txt
python3 -m serve_app.bench.goodput --url $URL --workload workloads/slo-mix-gpu.yaml \
  --probe-concurrency 256 --probe-s 15 --multiples 0.5,1,1.5,2 --repeats-at 1,2 --extra-repeats 2 \
  --window-s 30 --drain-s 10 --machine "two H200s, 32 cores" --out $WORK --name h200 \
  > $WORK/bench.log 2>&1
curl -s $URL/pools > $WORK/pools-end.json
touch $WORK/done
SH
  setsid bash "$WORK/sweep.sh" > "$WORK/sweep.log" 2>&1 < /dev/null &
  echo "started";;
collect)
  OUT=${OUT:?}
  for f in h200.json h200.md h200.png bench.log gpus.txt pools-start.json pools-end.json; do
    [ -f "$WORK/$f" ] && cp "$WORK/$f" "$OUT/" || true
  done
  tail -c 3000 "$WORK/app.log" > "$OUT/app-tail.log" 2>/dev/null || true
  tail -5 "$WORK/bench.log" 2>/dev/null || true
  [ -f "$WORK/done" ] && echo "== sweep done" || echo "== sweep running";;
*) echo "usage: $0 start|collect"; exit 2;;
esac
