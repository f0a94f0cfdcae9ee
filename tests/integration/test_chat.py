"""The chat page in a real browser: `serve-app chat` (Chainlit) in front of the shared app, driven
by headless Chromium (Debian's package) through Playwright."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.integration.conftest import ROOT, AppServer, free_ports

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ANSWER = '[data-step-type="assistant_message"]'
FOOTER = re.compile(r"pool (\S+) · route (\S+) · TTFT (\d+) ms")
# where to keep the page's picture (docs/chat.png is made this way: README "Chat front end")
SCREENSHOT_ENV = "SERVE_APP_CHAT_SCREENSHOT"


def chromium() -> str:
    """Debian's chromium binary (/usr/bin/chromium is a shell wrapper around it)."""
    for path in ("/usr/lib/chromium/chromium", shutil.which("chromium") or ""):
        if path and os.access(path, os.X_OK):
            return path
    pytest.fail("chromium is missing: `make test` installs Debian's package")


@contextlib.contextmanager
def chat_page(app_url: str, tmp_path: Path) -> Iterator[str]:
    (port,) = free_ports(1)
    log = (tmp_path / f"chat-{port}.log").open("w")
    cmd = [
        sys.executable, "-m", "serve_app", "chat", "--app-url", app_url, "--port", str(port),
        "--max-tokens", "48",  # short answers: the whole conversation fits in one picture
    ]  # fmt: skip
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(url, timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        assert proc.poll() is None, (tmp_path / f"chat-{port}.log").read_text()[-2000:]
        yield url
    finally:
        os.killpg(proc.pid, 15)  # its own session: the chainlit process and what it started
        proc.wait(30)
        log.close()


def send(page, text: str) -> None:  # type: ignore[no-untyped-def]
    page.locator("#chat-input").fill(text)
    page.keyboard.press("Enter")


# Records, in the page, every length the newest answer's text takes as the DOM changes: a
# streamed answer grows through many; one delivered whole appears at once.
WATCH_GROWTH = """() => {
  window.__lengths = [];
  if (window.__observer) return;
  window.__observer = new MutationObserver(() => {
    const answers = document.querySelectorAll('ANSWER');
    if (!answers.length) return;
    const n = answers[answers.length - 1].innerText.length, seen = window.__lengths;
    if (!seen.length || seen[seen.length - 1] !== n) seen.push(n);
  });
  window.__observer.observe(document.body, {subtree: true, childList: true, characterData: true});
}""".replace("ANSWER", ANSWER)


def watch_answer(page, n: int, timeout_s: float = 180) -> tuple[str, list[int]]:  # type: ignore[no-untyped-def]
    """Wait for the n-th answer's footer: its text, and the lengths the newest answer grew
    through meanwhile (recorded in the page since WATCH_GROWTH was last run)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        answers = page.locator(ANSWER)
        if answers.count() >= n:
            text = answers.nth(n - 1).inner_text()
            if FOOTER.search(text):
                return text, page.evaluate("() => window.__lengths")
        time.sleep(0.1)
    raise AssertionError(f"answer {n} never finished: {page.content()[-1500:]}")


def test_chat_page_streams_answers_and_shows_the_routing(
    app_server: AppServer, tmp_path: Path
) -> None:
    from playwright.sync_api import sync_playwright

    with chat_page(app_server.url, tmp_path) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 1280, "height": 1400})
        page.goto(url)
        page.get_by_text(f"Connected to {app_server.url}").wait_for(timeout=60_000)
        before = page.locator(ANSWER).count()  # the page's own messages so far
        seen = []
        for n, question in enumerate(["Hello! What can you do?", "你好，请介绍一下你自己。"], 1):
            page.evaluate(WATCH_GROWTH)
            send(page, question)
            text, lengths = watch_answer(page, before + n)
            pool, reason, ttft = FOOTER.search(text).groups()  # type: ignore[union-attr]
            seen.append((pool, reason, int(ttft), lengths))
            print(f"\nanswer {n}: pool {pool}, route {reason}, TTFT {ttft} ms; "
                  f"the answer's text took {len(lengths)} lengths on the page")  # fmt: skip
            assert pool in ("low-latency", "throughput") and int(ttft) > 0
            assert len(lengths) >= 5, f"the answer did not stream: {lengths}"
            assert "tok/s" in text and "completion tokens" in text
        # the conversation kept its history: two questions, two answers on the page
        assert page.locator('[data-step-type="user_message"]').count() == 2
        page.screenshot(path=str(tmp_path / "chat.png"), full_page=True)
        if os.environ.get(SCREENSHOT_ENV):
            page.screenshot(path=os.environ[SCREENSHOT_ENV], full_page=True)
        # a TTFT target no pool can meet, set in the settings panel: the refusal is a message
        page.locator("#chat-settings-open-modal").click()
        target = page.locator("#ttft_ms")
        target.fill("1")
        page.get_by_role("button", name="Confirm").click()
        target.wait_for(state="hidden")
        send(page, "Answer within a millisecond.")
        refusal = page.get_by_text(re.compile(r"The app is busy \(429 slo-unmeetable\)"))
        try:
            refusal.wait_for(timeout=60_000)
        finally:
            page.screenshot(path=str(tmp_path / "refusal.png"))
        assert "Retry after" in refusal.inner_text()
        browser.close()


def test_chat_page_says_when_the_app_is_not_there(tmp_path: Path) -> None:
    """No app at the URL: the page says so and keeps checking, rather than failing a turn."""
    from playwright.sync_api import sync_playwright

    (nothing,) = free_ports(1)
    with chat_page(f"http://127.0.0.1:{nothing}", tmp_path) as url, sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium(), args=["--no-sandbox"])
        page = browser.new_page()
        page.goto(url)
        notice = page.get_by_text(f"Cannot reach the app at http://127.0.0.1:{nothing} yet")
        notice.wait_for(timeout=60_000)
        browser.close()
