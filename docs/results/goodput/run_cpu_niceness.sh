#!/usr/bin/env bash
# The serving path's CPU priority on the CPU machine: the same sweep cell (the SLO policy and
# round-robin at 2x the capacity given) with Ray's workers at Ray's default niceness (15: the
# ingress and pool replicas, Serve's controller and the HAProxy its proxy actor starts) and at 0,
# the engines at nice 19 in both. One app per setting, started in turn. From the repository
# root, with the venv of `make run`:
#   CAPACITY=2.59 bash docs/results/goodput/run_cpu_niceness.sh
set -euo pipefail
PY=${PY:-.venv/bin/python}
OUT=${OUT:-docs/results/goodput}
CAPACITY=${CAPACITY:?the capacity probed by run_cpu.sh, req/s}
REPEATS=${REPEATS:-3}
POLICIES=${POLICIES:-slo:best-fit,round-robin}
MACHINE=${MACHINE:-"CPU (AMD EPYC), 2 cores, 24 GiB"}
URL=http://127.0.0.1:8000
export SERVE_APP_CPU_ENGINE_NICENESS=19
for workers in 15 0; do
  RAY_worker_niceness=$workers $PY -m serve_app run docs/results/goodput/serve_config.cpu.yaml \
    --port 8000 > /tmp/goodput-cpu-niceness-$workers.log 2>&1 &
  APP=$!
  trap 'kill -INT $APP; wait $APP || true' EXIT
  for i in $(seq 1 300); do curl -sf $URL/ready >/dev/null && break; sleep 1; done
  $PY -m serve_app.bench.goodput --url $URL --workload workloads/slo-mix.yaml --capacity "$CAPACITY" \
    --policies "$POLICIES" --multiples 2 --repeats "$REPEATS" --repeats-at "" \
    --window-s 30 --drain-s 20 --machine "$MACHINE, Ray workers at nice $workers" \
    --out "$OUT" --name "cpu-ray-workers-nice$workers"
  kill -INT $APP; wait $APP || true
  trap - EXIT
done
