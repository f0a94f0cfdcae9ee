#!/usr/bin/env bash
# Holding on and off on the CPU machine: the app of run_cpu.sh started twice, with
# routing.max_held 0 (a request refused `protects-running` gets 429 at once) and then 64 (it
# waits while its TTFT target allows), the SLO policy (best fit) at 1x and 2x the capacity
# run_cpu.sh probed (CAPACITY, req/s), 3 repeats each. From the repository root:
#   CAPACITY=5.28 bash docs/results/goodput/run_cpu_hold_ab.sh
set -euo pipefail
PY=${PY:-.venv/bin/python}
OUT=${OUT:-docs/results/goodput}
CAPACITY=${CAPACITY:?the capacity run_cpu.sh probed, req/s}
MACHINE=${MACHINE:-"CPU (AMD EPYC), 2 cores, 24 GiB"}
URL=http://127.0.0.1:8000
CONFIG=$(mktemp --suffix=.yaml)
for HELD in 0 64; do
  sed "s/max_held: 64/max_held: $HELD/" docs/results/goodput/serve_config.cpu.yaml > "$CONFIG"
  grep -q "max_held: $HELD" "$CONFIG"
  $PY -m serve_app run "$CONFIG" --port 8000 > "/tmp/goodput-hold-$HELD.log" 2>&1 &
  APP=$!
  trap 'kill -INT $APP; wait $APP || true' EXIT
  for i in $(seq 1 300); do curl -sf $URL/ready >/dev/null && break; sleep 1; done
  $PY -m serve_app.bench.goodput --url $URL --workload workloads/slo-mix.yaml \
    --capacity "$CAPACITY" --policies slo:best-fit --multiples 1,2 --repeats 3 --repeats-at "" \
    --window-s 30 --drain-s 20 --machine "$MACHINE" --out "$OUT" --name "cpu-held-$HELD"
  kill -INT $APP; wait $APP || true
  trap - EXIT
done
