#!/usr/bin/env bash
# Cross-check: vLLM's own client (`vllm bench serve`) and our harness against the same app
# endpoint, alternating twice. Run from the repo root with the app serving on :8000.
set -euo pipefail
URL=${URL:-http://127.0.0.1:8000}
OUT=${OUT:-docs/results/bench/crosscheck}
mkdir -p "$OUT"
TOK=$(.venv/bin/python -c "from serve_app.engine.builtin_model import ensure_builtin; print(ensure_builtin('ernie-4.5-tiny'))")
for i in 1 2 3; do
  .venv/bin/python -m serve_app.bench run --workload workloads/crosscheck.yaml \
    --target "app:$URL" --out "$OUT" --name "harness-$i"
  .venv/bin/python -m serve_app.bench.vllm_cli bench serve --backend openai --base-url "$URL" \
    --endpoint /v1/completions --model ernie-4.5-tiny --tokenizer "$TOK" --dataset-name random \
    --random-input-len 165 --random-output-len 64 --random-range-ratio 0 --num-prompts 100 \
    --max-concurrency 4 --ignore-eos --temperature 0 --save-result --result-dir "$OUT" \
    --result-filename "vllm-bench-$i.json" 2>&1 | grep -E "Median TTFT|Output token throughput"
done
.venv/bin/python - "$OUT" <<'PY'
import json, sys
from pathlib import Path
out = Path(sys.argv[1])
rows = ["| run | client | TTFT p50 (ms) | output tok/s |", "|---|---|---|---|"]
for i in (1, 2, 3):
    ours = json.loads((out / f"harness-{i}.json").read_text())[0]
    theirs = json.loads((out / f"vllm-bench-{i}.json").read_text())
    rows.append(f"| {i} | serve_app.bench | {ours['ttft_ms']['p50']:.1f} | {ours['output_tok_s']:.1f} |")
    rows.append(f"| {i} | vllm bench serve | {theirs['median_ttft_ms']:.1f} | {theirs['output_throughput']:.1f} |")
    rows.append(
        f"| {i} | ratio ours/vLLM | {ours['ttft_ms']['p50'] / theirs['median_ttft_ms']:.3f} "
        f"| {ours['output_tok_s'] / theirs['output_throughput']:.3f} |"
    )
(out / "crosscheck.md").write_text("\n".join(rows) + "\n")
print("\n".join(rows))
PY
