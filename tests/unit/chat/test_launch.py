"""`serve-app chat`'s command line: Chainlit from its own environment, on loopback."""

import argparse
from pathlib import Path

import pytest

from serve_app.chat import launch


def args(**overrides: object) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    launch.add_parser(parser.add_subparsers(dest="command"))
    ns = parser.parse_args(["chat"])
    for key, value in overrides.items():
        setattr(ns, key, value)
    return ns


def test_defaults_listen_on_loopback_and_talk_to_make_run() -> None:
    ns = args()
    assert (ns.host, ns.port, ns.app_url) == ("127.0.0.1", 8001, "http://127.0.0.1:8000")


def test_command_runs_the_page_with_chainlit_of_the_chat_venv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    chainlit = tmp_path / "bin" / "chainlit"
    chainlit.parent.mkdir()
    chainlit.write_text("#!/bin/sh\n")
    monkeypatch.setenv(launch.VENV_ENV, str(tmp_path))
    argv, env = launch.command(args(port=9001, max_tokens=48))
    assert argv[:3] == [str(chainlit), "run", str(launch.CHAT_DIR / "page.py")]
    assert argv[argv.index("--host") + 1] == "127.0.0.1" and "--headless" in argv
    assert env["SERVE_APP_URL"] == "http://127.0.0.1:8000"
    assert env["SERVE_APP_CHAT_MAX_TOKENS"] == "48"
    assert str(launch.ROOT) in env["PYTHONPATH"].split(":")


def test_no_chat_environment_says_how_to_make_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(launch.VENV_ENV, str(tmp_path / "missing"))
    assert launch.run(args()) == 1
    assert "make chat" in capsys.readouterr().err
