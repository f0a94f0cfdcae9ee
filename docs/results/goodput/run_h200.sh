#!/usr/bin/env bash
# Goodput on two H200s (32 cores): the app with its two shipped pools, one GPU each, and
# routing policies compared on the same replicas (x-route-policy) at 0.5x, 1x, 1.5x, 2x the
# fleet's probed capacity, 3 repeats at 1x and 2x. GPUS=1: both pools share one H200 (half a GPU
# per replica). Needs the offline vLLM + Ray install named by $SERVE_APP_SITE (default /tmp/site,
# with its env.sh). Runs in the background (setsid) and writes as it goes:
#   bash docs/results/goodput/run_h200.sh start    # start the app and the sweep, return at once
#   bash docs/results/goodput/run_h200.sh collect  # copy what is there so far to $OUT
# POLICIES names the policies (x-route-policy values), NAME the output stem; MULTIPLES,
# REPEATS_AT, EXTRA (repeats added there, 2) and CAPACITY (req/s: no probe) narrow the sweep;
# CONFIG names another app config.
# The app is stopped when the sweep ends, so another can start after it (`done` in $WORK).
set -euo pipefail
SITE=${SERVE_APP_SITE:-/tmp/site}
WORK=${GOODPUT_WORK:-/tmp/goodput}
GPUS=${GPUS:-2}
NAME=${NAME:-$(cat "$WORK/name" 2>/dev/null || echo h200)}  # collect: the stem start was given
POLICIES=${POLICIES:-slo,round-robin,least-load,single=throughput}
MULTIPLES=${MULTIPLES:-0.5,1,1.5,2}
REPEATS_AT=${REPEATS_AT-1,2}
PROBE=${CAPACITY:+--capacity $CAPACITY}
CONFIG=${CONFIG:-docs/results/goodput/serve_config.h200.yaml}
# the hardware, as the records name it (MACHINE overrides): "one NVIDIA H200, 16 cores"
gpus() { nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | sed 's/ [0-9]*GB.*//'; }
count() { case $1 in 1) echo one;; 2) echo two;; *) echo "$1";; esac; }
MACHINE=${MACHINE:-"$(count "$GPUS") $(gpus | head -1)$([ "$GPUS" = 1 ] || echo s), $(nproc) cores"}
URL=http://127.0.0.1:8000
case "${1:-}" in
start)
  mkdir -p "$WORK"
  echo "$NAME" > "$WORK/name"
  if [ "$GPUS" = 1 ]; then
    source "$SITE/env.sh"
    PYTHONPATH=$SITE python3 -c "import sys, yaml; c = yaml.safe_load(open(sys.argv[1])); \
c['applications'][0]['args']['num_gpus_per_replica'] = 0.5; yaml.safe_dump(c, open(sys.argv[2], 'w'))" \
      "$CONFIG" "$WORK/serve_config.yaml"
    CONFIG=$WORK/serve_config.yaml
  fi
  cat > "$WORK/sweep.sh" <<SH
source $SITE/env.sh
export PYTHONPATH=$PWD:$SITE
cd $PWD
python3 -m serve_app run $CONFIG --port 8000 > $WORK/app.log 2>&1 &
APP=\$!
for i in \$(seq 1 300); do curl -sf $URL/ready >/dev/null && break; sleep 1; done
curl -s $URL/pools > $WORK/pools-start.json
nvidia-smi --query-gpu=index,name,memory.used --format=csv > $WORK/gpus.txt
python3 -m serve_app.bench.goodput --url $URL --workload workloads/slo-mix-gpu.yaml \
  --policies "$POLICIES" --probe-concurrency 256 --probe-s 15 $PROBE --multiples $MULTIPLES \
  --repeats-at "$REPEATS_AT" --extra-repeats ${EXTRA:-2} --window-s 30 --drain-s 10 --machine "$MACHINE" \
  --out $WORK --name $NAME --samples \
  > $WORK/bench.log 2>&1
curl -s $URL/pools > $WORK/pools-end.json
kill \$APP; wait \$APP
touch $WORK/done
SH
  setsid bash "$WORK/sweep.sh" > "$WORK/sweep.log" 2>&1 < /dev/null &
  echo "started";;
collect)
  OUT=${OUT:?}
  tail -c 3000 "$WORK/app.log" > "$WORK/app-tail.log" 2>/dev/null || true
  # one archive: a call brings back at most 8 files
  (cd "$WORK" && tar czf "$OUT/$NAME.tar.gz" --ignore-failed-read $NAME.json $NAME.md $NAME.png \
    $NAME.samples.jsonl bench.log gpus.txt pools-start.json pools-end.json app-tail.log 2>/dev/null) || true
  tail -5 "$WORK/bench.log" 2>/dev/null || true
  [ -f "$WORK/done" ] && echo "== sweep done" || echo "== sweep running";;
*) echo "usage: $0 start|collect"; exit 2;;
esac
