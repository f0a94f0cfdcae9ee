"""`serve-app chat`: start the Chainlit page (serve_app/chat/page.py) against a running app.

Chainlit lives in its own environment, .venv-chat beside this checkout (`make chat` creates it
with scripts/install_chat.sh), or the one $SERVE_APP_CHAT_VENV names: its web stack is pinned
apart from Ray Serve's. The page listens on 127.0.0.1 unless told otherwise.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

CHAT_DIR = Path(__file__).resolve().parent
ROOT = CHAT_DIR.parents[1]
VENV_ENV = "SERVE_APP_CHAT_VENV"


def chainlit_executable(environ: dict[str, str] | os._Environ[str] = os.environ) -> Path:
    venv = Path(environ.get(VENV_ENV) or ROOT / ".venv-chat")
    chainlit = venv / "bin" / "chainlit"
    if not chainlit.exists():
        raise FileNotFoundError(
            f"no Chainlit at {chainlit}: run `make chat` (or scripts/install_chat.sh), or set "
            f"${VENV_ENV} to a virtualenv with serve_app/chat/requirements.txt installed"
        )
    return chainlit


def command(args: argparse.Namespace) -> tuple[list[str], dict[str, str]]:
    """The chainlit command line and its environment."""
    argv = [
        str(chainlit_executable()), "run", str(CHAT_DIR / "page.py"),
        "--host", args.host, "--port", str(args.port), "--headless",
    ]  # fmt: skip
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "CHAINLIT_APP_ROOT": str(CHAT_DIR),  # its .chainlit/config.toml and chainlit.md
        "SERVE_APP_URL": args.app_url,
        "SERVE_APP_CHAT_MAX_TOKENS": str(args.max_tokens),
    }
    return argv, env


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    chat = sub.add_parser("chat", help="a chat page (Chainlit) in front of the running app")
    chat.add_argument("--app-url", default="http://127.0.0.1:8000", help="the app's base URL")
    chat.add_argument("--host", default="127.0.0.1", help="where the page listens")
    chat.add_argument("--port", type=int, default=8001)
    chat.add_argument("--max-tokens", type=int, default=256, help="the settings panel's start")


def run(args: argparse.Namespace) -> int:
    try:
        argv, env = command(args)
    except FileNotFoundError as e:
        print(f"serve-app chat: {e}", file=sys.stderr)
        return 1
    print(f"chat page: http://{args.host}:{args.port}  (talking to {args.app_url})", flush=True)
    try:
        return subprocess.call(argv, env=env, cwd=CHAT_DIR)  # Chainlit writes beside its config
    except KeyboardInterrupt:
        return 0
