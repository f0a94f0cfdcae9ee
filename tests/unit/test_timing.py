"""Server-Timing formatting and parsing, and the proxy stamp's bounds."""

import pytest

from serve_app.timing import (
    MAX_PROXY_MS,
    Stage,
    elapsed_ms,
    format_server_timing,
    parse_server_timing,
    proxy_ms,
)


def test_format_then_parse_round_trips_in_order() -> None:
    stages = {Stage.INGRESS: 1.234, Stage.QUEUE: 0.0, "ttft": 25.5}
    header = format_server_timing(stages)
    assert header == "ingress;dur=1.23, queue;dur=0.00, ttft;dur=25.50"
    assert parse_server_timing(header) == {"ingress": 1.23, "queue": 0.0, "ttft": 25.5}


def test_parse_follows_the_w3c_grammar_loosely() -> None:
    # desc before dur, quoted dur, a metric without dur, a broken dur, spaces
    header = 'db;desc="x";dur=3.5 , cache;desc=hit, app;dur="2", bad;dur=abc,  ;dur=1'
    assert parse_server_timing(header) == {"db": 3.5, "app": 2.0}


def test_proxy_stamp_is_believed_only_within_bounds() -> None:
    assert proxy_ms("100.0", 100.002) == pytest.approx(2.0)
    assert proxy_ms(None, 1.0) is None
    assert proxy_ms("", 1.0) is None
    assert proxy_ms("nan", 1.0) is None
    assert proxy_ms("abc", 1.0) is None
    assert proxy_ms("101", 100.0) is None  # from the future: skewed or forged
    assert proxy_ms("0", MAX_PROXY_MS / 1e3 + 1) is None  # far past


def test_elapsed_is_never_negative() -> None:
    assert elapsed_ms(2.0, 1.0) == 0.0
    assert elapsed_ms(1.0, 1.5) == 500.0
