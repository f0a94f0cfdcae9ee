#!/usr/bin/env bash
# On two H200s (32 cores; or one, ONE_GPU=1), after the offline vLLM + Ray install (/tmp/site): `vllm serve` on GPU 0 and the app on
# GPU 1, same engine arguments (profiles/h200-stream.yaml), `vllm bench serve` against both,
# alternating. MODE=before runs the app from ./before-app (the session-1 serving path:
# `git archive d34ce1e serve_app | tar -x -C before-app`, its cli.py finding `serve` on PATH);
# any other MODE (after, harness) runs this checkout, MODE naming the output folder.
set -euo pipefail
source /tmp/site/env.sh
export PYTHONPATH=$PWD:/tmp/site SERVE_APP_PROFILES_DIR=$PWD/docs/results/streaming/profiles
MODE=${MODE:-after}
OUT=${OUT:-/tmp/out}
CONC=${CONC-1,4,64,256}   # empty: no `vllm bench serve` runs (e.g. HARNESS alone)
PROMPTS=${PROMPTS:-48}
EXTRA=()
[ "$MODE" = before ] && EXTRA+=(--app-pythonpath before-app)
# API_SERVERS=4: vLLM's server with four API-server processes in front of its engine (the
# GPU README's best `vllm serve` configuration).
[ -n "${API_SERVERS:-}" ] && EXTRA+=(--vllm-arg=--api-server-count=$API_SERVERS)
# HAPROXY=1: the app behind HAProxy (`serve-app run --haproxy`); Serve's proxy (HAProxy's
# fallback) is measured too, as "app serve-proxy".
[ -n "${HAPROXY:-}" ] && EXTRA+=(--haproxy)
# DIRECT=1: also the app's ingress replica on its own port (Serve's direct ingress, no proxy hop).
[ -n "${DIRECT:-}" ] && EXTRA+=(--direct-ingress)
# HARNESS=<workload>: then serve_app.bench's own client against the bare engine (in the bench
# process, on GPU 0 beside `vllm serve`, hence 0.4 of its memory), `vllm serve` and the app.
[ -n "${HARNESS:-}" ] && EXTRA+=(--harness "$HARNESS" --harness-gpu-memory-utilization 0.4)
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv
  python3 -c "import vllm, torch, ray; print('vllm', vllm.__version__, 'torch', torch.__version__, 'ray', ray.__version__)"
  nproc; } > "$OUT/device.txt" 2>&1
# ONE_GPU=1: both servers on GPU 0 (profile h200-stream-1gpu: 0.42 of its memory each); the
# bench alternates them, so one serves at a time.
PROFILE=h200-stream APP_GPU=1
[ -n "${ONE_GPU:-}" ] && PROFILE=h200-stream-1gpu APP_GPU=0
CUDA_VISIBLE_DEVICES=0 python3 -m serve_app.bench.streaming --profile $PROFILE --concurrency "$CONC" \
  --num-prompts "$PROMPTS" --output-len 256 --repeats "${REPEATS:-2}" \
  --vllm-env CUDA_VISIBLE_DEVICES=0 --app-env CUDA_VISIBLE_DEVICES=$APP_GPU "${EXTRA[@]}" \
  --out "$OUT/$MODE" > "$OUT/bench-$MODE.txt" 2>&1 || true
grep -E "^c=|^\||conc=" "$OUT/bench-$MODE.txt" || tail -20 "$OUT/bench-$MODE.txt"
cp "$OUT/$MODE/logs/app.log" "$OUT/app-$MODE.log" 2>/dev/null || true
tail -c 20000 "$OUT/$MODE/logs/vllm-serve.log" > "$OUT/vllm-serve-$MODE.log" 2>/dev/null || true
grep -v "it/s]" "$OUT/$MODE/logs/vllm-bench.log" | grep -v "^Namespace" > "$OUT/vllm-bench-$MODE.log" || true
rm -rf "$OUT/$MODE/logs"
