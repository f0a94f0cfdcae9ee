#!/usr/bin/env bash
# On an H200 (after the offline vLLM + Ray install in /tmp/site): the seed table's workload (100
# requests, prompts 30-300 tokens, 256 output tokens, concurrency 4) on the bare engine, sweeping
# block size x max_model_len (block 8 is expected to be refused), then fp8 KV at block 16 / 4096.
set -euo pipefail
source /tmp/site/env.sh
export PYTHONPATH=$PWD:/tmp/site SERVE_APP_PROFILES_DIR=$PWD/docs/results/h200/profiles
OUT=${OUT:-/tmp/out}
{ nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
  python3 -c "import vllm, torch, ray, transformers; print('vllm', vllm.__version__, 'torch', torch.__version__, 'ray', ray.__version__, 'transformers', transformers.__version__)"
} > "$OUT/device.txt" 2>&1
python3 -m serve_app.bench.tune --profile seed-gpu --workload workloads/seed-table.yaml \
  --block-size 8,16,32 --max-model-len 2048,4096 --out "$OUT/sweep" 2>&1 | grep -v "it/s]" | tail -40
python3 -m serve_app.bench.tune --profile seed-gpu --workload workloads/seed-table.yaml \
  --kv-cache-dtype fp8 --out "$OUT/fp8" 2>&1 | grep -v "it/s]" | tail -20
