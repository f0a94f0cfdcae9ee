#!/usr/bin/env bash
# On two H200s (32 cores), after the offline vLLM + Ray install (/tmp/site): the app with its two shipped pools
# (low-latency, throughput), one engine replica per GPU; NVML shows which process holds which GPU;
# then goodput of SLO routing vs round-robin vs one pool on the mixed workload at rising rates.
set -euo pipefail
source /tmp/site/env.sh
export PYTHONPATH=$PWD:/tmp/site
OUT=${OUT:-/tmp/out}
URL=http://127.0.0.1:8000
python3 -m serve_app run docs/results/h200/serve_config.gpu.yaml --port 8000 > "$OUT/app-x2.log" 2>&1 &
APP=$!
trap 'kill -TERM $APP; wait $APP || true' EXIT
for i in $(seq 1 300); do curl -sf $URL/ready >/dev/null && break; sleep 1; done
curl -sf $URL/ready
{ echo "== /pools (placement: Ray node and GPU ids per replica)"; curl -s $URL/pools | python3 -m json.tool
  echo "== nvidia-smi: compute processes per GPU"
  nvidia-smi --query-gpu=index,uuid,memory.used --format=csv
  nvidia-smi --query-compute-apps=gpu_uuid,pid,process_name,used_memory --format=csv
  echo "== each GPU process and the Serve replica it belongs to (parent chain)"
  for pid in $(nvidia-smi --query-compute-apps=pid --format=csv,noheader); do
    chain=$(ps -o pid=,args= -p $pid | cut -c1-60); p=$pid
    while p=$(ps -o ppid= -p $p | tr -d ' ') && [ -n "$p" ] && [ "$p" != 1 ]; do
      name=$(ps -o args= -p $p | cut -c1-60); case "$name" in *ServeReplica*) chain="$chain <- $name"; break;; esac
    done; echo "$chain"
  done
} > "$OUT/placement.txt" 2>&1
cat "$OUT/placement.txt"
python3 -m serve_app.bench run --workload workloads/mixed-gpu.yaml --rate "${RATES:-20,80,320}" \
  --target app@slo:$URL --target app@round-robin:$URL --target app@single=throughput:$URL \
  --out "$OUT/goodput" --name goodput-h200 2>&1 | grep -v "it/s]" | tail -30
