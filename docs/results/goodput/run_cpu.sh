#!/usr/bin/env bash
# Goodput on the CPU machine (2 cores, 24 GiB): the app with its two pools on the builtin tiny
# model, routing policies compared on the same replicas at 0.5x-2x the probed capacity (3 repeats
# at 1x and 2x), then the three SLO placements side by side at 1x and 1.5x (3 repeats). From the
# repository root, with the venv of `make run`:
#   bash docs/results/goodput/run_cpu.sh             # both
#   bash docs/results/goodput/run_cpu.sh placement   # the placements alone, at the probed capacity
#   bash docs/results/goodput/run_cpu.sh sweep       # the policies alone
# POLICIES names the policies of the sweep (x-route-policy values, `slo:<placement>` included).
set -euo pipefail
PY=${PY:-.venv/bin/python}
OUT=${OUT:-docs/results/goodput}
POLICIES=${POLICIES:-slo,round-robin,least-load,single=throughput}
NAME=${NAME:-cpu}   # output stem; e.g. NAME=cpu-nice with SERVE_APP_CPU_ENGINE_NICENESS=19
MACHINE=${MACHINE:-"CPU (AMD EPYC), 2 cores, 24 GiB"}
URL=http://127.0.0.1:8000
# In this script's session, not a new one (setsid): with the kernel's autogroups (Linux's
# sched_autogroup_enabled) each session shares the cores as one group, niceness counts only
# inside it, and a benchmark client in a session of its own waited up to 1.5-3.4 s for a core
# while the engines were busy, a stall it then measured as TTFT (goodput.md).
$PY -m serve_app run docs/results/goodput/serve_config.cpu.yaml --port 8000 > /tmp/goodput-cpu-app.log 2>&1 &
APP=$!
trap 'kill -INT $APP; wait $APP || true' EXIT
for i in $(seq 1 300); do curl -sf $URL/ready >/dev/null && break; sleep 1; done
[ "${1:-}" = placement ] || $PY -m serve_app.bench.goodput --url $URL --workload workloads/slo-mix.yaml \
  --policies "$POLICIES" --probe-concurrency 16 --probe-s 20 --multiples 0.5,1,1.5,2 --repeats-at 1,2 --extra-repeats 2 \
  --window-s 30 --drain-s 20 --machine "$MACHINE" --out "$OUT" --name "$NAME"
[ "${1:-}" = sweep ] && exit 0
CAPACITY=$($PY -c "import json; print(json.load(open('$OUT/$NAME.json'))['probe']['capacity_req_s'])")
$PY -m serve_app.bench.goodput --url $URL --workload workloads/slo-mix.yaml --capacity "$CAPACITY" \
  --policies slo:headroom,slo:best-fit,slo:least-load --multiples 1,1.5 --repeats 3 --repeats-at "" \
  --window-s 30 --drain-s 20 --machine "$MACHINE" --out "$OUT" --name "$NAME-placement"
