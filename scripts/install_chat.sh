#!/usr/bin/env bash
# Create .venv-chat for the chat page: Chainlit and the OpenAI client (serve_app/chat/
# requirements.txt), apart from .venv, whose web stack Ray Serve pins. Idempotent: a stamp keyed
# by the requirements' hash skips the work when nothing changed.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV=${VENV_CHAT:-.venv-chat}
REQS=serve_app/chat/requirements.txt
stamp="$VENV/.installed-$(sha256sum "$REQS" | cut -c1-12)"
[ -f "$stamp" ] && exit 0
echo "== installing the chat page's environment into $VENV"
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
quiet() { grep -v -E "is ignored: it is neither a file nor a directory|^WARNING: pip index" || true; }
"$VENV/bin/python" -m pip install -q --upgrade pip 2>&1 | quiet
"$VENV/bin/python" -m pip install -q -r "$REQS" 2>&1 | quiet
"$VENV/bin/python" -c "import chainlit, openai" >/dev/null
rm -f "$VENV"/.installed-*
touch "$stamp"
echo "== $VENV ready"
