#!/usr/bin/env bash
# Where one dispatch (the ingress's Serve call to a pool replica) spends its time, traced inside
# Ray Serve 2.60 and the app: patches the venv's Ray and the checkout with trace points (undone on
# exit), serves the shipped config, runs workloads/ttft-gpu.yaml at concurrency 1 against it, and
# writes trace.txt, breakdown.txt and the harness's run files here. From the repository root:
#   bash docs/results/hop/cpu-2core/serve-trace/run.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
py=.venv/bin/python
site=$($py -c "import os, ray; print(os.path.dirname(os.path.dirname(ray.__file__)))")
rm -f /tmp/hop-trace.txt
patch -d "$site" -p1 --forward < "$here/ray-trace.patch"
git apply "$here/app-trace.patch"
app=""
undo() {
  [ -n "$app" ] && kill -INT "$app" 2>/dev/null && wait "$app" || true
  patch -d "$site" -p1 -R < "$here/ray-trace.patch"
  git apply -R "$here/app-trace.patch"
}
trap undo EXIT
$py -m serve_app run serve_config.yaml --port 18000 --dashboard-port 18265 \
  --metrics-port 18080 > "$here/app.log" 2>&1 &
app=$!
for _ in $(seq 120); do
  curl -sf 127.0.0.1:18000/ready > /dev/null && break
  sleep 2
done
: > /tmp/hop-trace.txt
$py -m serve_app.bench run --workload workloads/ttft-gpu.yaml \
  --target app:http://127.0.0.1:18000 --concurrency 1 --out "$here" > "$here/bench.txt" 2>&1
cp /tmp/hop-trace.txt "$here/trace.txt"
$py "$here/analyze.py" "$here/trace.txt" | tee "$here/breakdown.txt"
