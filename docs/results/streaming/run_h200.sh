#!/usr/bin/env bash
# The app against `vllm serve` on H200s, 256 output tokens, prompts 33-297 tokens:
# `vllm serve` with 1, 2, 4 and 8 API servers (--api-server-count) and the app (`serve-app run`,
# its default HTTP path and, as the shipped GPU profiles, 4 processes per engine: profile
# h200-stream-frontends4; PROFILE=h200-stream-shared for one), same engine arguments, `vllm bench serve`
# against each in turn at concurrency 64, 256 and 1, 3 repeats, each run >= 20 s and >= 4 x
# concurrency requests (MIN_CELL_S=N: >= N s).
#
#   SERVE_APP_SITE=<offline vLLM + Ray install> bash docs/results/streaming/run_h200.sh OUT_DIR
#
# With two GPUs the `vllm serve`s run on GPU 0 and the app on GPU 1; with one, all on GPU 0
# (0.15 of its memory each, a fixed 16 GiB KV cache, so they start together; one server is driven
# at a time). CONC, REPEATS, API_SERVERS and REQUESTS (requests per run, CONC=N,...: sized from
# the rates measured before, so no pilot runs) and PROFILE override. PY_SPY_S=N samples the app's
# pool and ingress replicas with py-spy for N s in its first run at each concurrency (PY_SPY_NATIVE=1:
# with C/C++ frames). HARNESS=WORKLOAD then runs that workload with serve_app.bench's own client
# against every server, REPEATS times at HARNESS_CONC (default 1): each server's TTFT as that
# client sees it, and the app's per-request Server-Timing stages (where its first tokens' time
# went), e.g. HARNESS=workloads/ttft-gpu.yaml (with CONC= empty: the harness alone). DIRECT=N
# sets SERVE_APP_DIRECT_DISPATCH for the app (direct dispatch, docs/results/hop.md: on by default
# since ef251ac; DIRECT=0 runs it by Serve's calls).
set -euo pipefail
: "${SERVE_APP_SITE:?names the offline vLLM + Ray install (the directory holding env.sh)}"
OUT=${1:?usage: run_h200.sh OUT_DIR}
source "$SERVE_APP_SITE/env.sh"
export PYTHONPATH=$PWD:$SERVE_APP_SITE SERVE_APP_PROFILES_DIR=$PWD/docs/results/streaming/profiles
mkdir -p "$OUT"
GPUS=$(nvidia-smi -L | wc -l)
APP_GPU=$(( GPUS > 1 ? 1 : 0 ))
{ nvidia-smi --query-gpu=index,name,driver_version,memory.total --format=csv
  python3 -c "import vllm, torch, ray; print('vllm', vllm.__version__, 'torch', torch.__version__, 'ray', ray.__version__)"
  echo "cores: $(nproc)"; echo "app on GPU $APP_GPU"; } > "$OUT/device.txt" 2>&1
# exec: a `timeout` or SIGTERM reaches the bench itself, which stops the servers on its way out
exec python3 -m serve_app.bench.streaming --profile "${PROFILE:-h200-stream-frontends4}" \
  --concurrency "${CONC-64,256,1}" --repeats "${REPEATS:-3}" --min-cell-s "${MIN_CELL_S:-20}" \
  --output-len 256 --vllm-api-servers "${API_SERVERS:-1,2,4,8}" \
  --requests-per-run "${REQUESTS:-64=960,256=2300,1=45}" \
  --vllm-env CUDA_VISIBLE_DEVICES=0 --app-env CUDA_VISIBLE_DEVICES=$APP_GPU \
  ${DIRECT:+--app-env SERVE_APP_DIRECT_DISPATCH=$DIRECT} \
  ${PY_SPY_S:+--py-spy "$PY_SPY_S"} ${PY_SPY_NATIVE:+--py-spy-native} \
  ${HARNESS:+--harness "$HARNESS" --harness-concurrency "${HARNESS_CONC:-1}" --no-harness-engine} \
  ${HARNESS:+--harness-repeats "${REPEATS:-3}"} --out "$OUT" > "$OUT/bench.txt" 2>&1
