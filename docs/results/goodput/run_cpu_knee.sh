#!/usr/bin/env bash
# The knee again on the CPU machine: the app of run_cpu.sh, the SLO policy (best fit) and
# least-load (POLICIES: others too) in turn at 1x a given capacity (CAPACITY, req/s, e.g. the
# one run_cpu.sh probed), 3 repeats (MULTIPLES: other multiples too), each run offering exactly
# its rate for 30 s. REPEATS (3) runs at every multiple; REPEATS_AT names multiples that get 2
# more (then set REPEATS=1 for single runs elsewhere). From the repository root:
#   SERVE_APP_CPU_ENGINE_NICENESS=19 CAPACITY=6.06 NAME=cpu-window-knee bash docs/results/goodput/run_cpu_knee.sh
set -euo pipefail
PY=${PY:-.venv/bin/python}
OUT=${OUT:-docs/results/goodput}
NAME=${NAME:-cpu-knee}
MULTIPLES=${MULTIPLES:-1}   # e.g. 1,2: the knee and twice the capacity
REPEATS=${REPEATS:-3}
REPEATS_AT=${REPEATS_AT:-}   # e.g. 1,2 with REPEATS=1: 3 runs there, 1 elsewhere
POLICIES=${POLICIES:-slo:best-fit,least-load}   # e.g. slo:best-fit,least-load,round-robin
MACHINE=${MACHINE:-"CPU (AMD EPYC), 2 cores, 24 GiB"}
CONFIG=${CONFIG:-docs/results/goodput/serve_config.cpu.yaml}   # the app's config
URL=http://127.0.0.1:8000
: "${CAPACITY:?names the capacity of the fleet, req/s}"
# In this script's session, as run_cpu.sh (its note on the kernel's autogroups says why).
$PY -m serve_app run "$CONFIG" --port 8000 > /tmp/goodput-knee-app.log 2>&1 &
APP=$!
trap 'kill -INT $APP; wait $APP || true' EXIT
for i in $(seq 1 300); do curl -sf $URL/ready >/dev/null && break; sleep 1; done
$PY -m serve_app.bench.goodput --url $URL --workload workloads/slo-mix.yaml --capacity "$CAPACITY" \
  --policies "$POLICIES" --multiples "$MULTIPLES" --repeats "$REPEATS" --repeats-at "$REPEATS_AT" \
  --window-s 30 --drain-s 20 --machine "$MACHINE" --out "$OUT" --name "$NAME" --samples
