"""The chat page's turn logic: what the settings ask of the app, what the page says after."""

import pytest
from openai.types import CompletionUsage

from serve_app.chat.turn import Settings, TurnStats, refusal_text


def test_settings_panel_values_become_headers_and_body() -> None:
    s = Settings.from_panel(
        {"slo_class": "batch", "ttft_ms": " 250 ", "tpot_ms": "", "max_tokens": 64.0,
         "temperature": 0.2, "truncate": False}
    )  # fmt: skip
    assert s.headers() == {"x-slo-class": "batch", "x-slo-ttft-ms": "250"}
    request = s.request()
    assert request["max_tokens"] == 64 and request["temperature"] == 0.2
    assert request["extra_body"] == {} and request["stream"] is True
    assert Settings().request()["extra_body"] == {"truncate_prompt": True}


@pytest.mark.parametrize("typed", ["abc", "-5", "0", "1e3", None])
def test_a_target_that_is_not_a_positive_integer_is_left_to_the_class(typed: object) -> None:
    assert "x-slo-ttft-ms" not in Settings.from_panel({"ttft_ms": typed}).headers()


def test_an_unknown_class_falls_back_to_interactive() -> None:
    assert Settings.from_panel({"slo_class": "vip"}).slo_class == "interactive"


# the OpenAI client's own type, with the app's extension field as the client parses it
USAGE = CompletionUsage.model_validate(
    {"prompt_tokens": 512, "completion_tokens": 11, "total_tokens": 523,
     "truncated_prompt_tokens": 4000}
)  # fmt: skip


def test_footer_reads_headers_stream_timing_and_usage() -> None:
    stats = TurnStats(sent_at=10.0)
    stats.read_headers(
        {"x-serve-pool": "low-latency", "x-route-reason": "slo",
         "server-timing": "proxy;dur=0.4, ingress;dur=1.2, ttft;dur=38.5"}
    )  # fmt: skip
    stats.token(10.040)
    for i in range(1, 11):
        stats.token(10.040 + i * 0.02)
    stats.read_usage(USAGE)
    assert stats.ttft_ms == pytest.approx(40.0)
    assert stats.server_ttft_ms == 38.5
    assert stats.tokens_per_s == pytest.approx(50.0)
    footer = stats.footer()
    for part in ["pool **low-latency**", "route `slo`", "TTFT 40 ms (app 38 ms)", "50.0 tok/s",
                 "512 prompt + 11 completion tokens (4000 cut"]:  # fmt: skip
        assert part in footer, footer


def test_footer_of_a_one_token_answer_has_no_speed() -> None:
    stats = TurnStats(sent_at=0.0)
    stats.token(0.1)
    stats.completion_tokens = 1
    assert stats.tokens_per_s is None and "tok/s" not in stats.footer()


def test_refusals_read_as_sentences_with_their_reason_and_retry_after() -> None:
    body = {"error": {"message": "pool low-latency is full", "type": "rate_limit",
                      "code": "pool_full"}}  # fmt: skip
    text = refusal_text(429, body, "2")
    assert text == "The app is busy (429 `pool_full`): pool low-latency is full Retry after 2 s."
    assert refusal_text(503, {"error": {"message": "loading"}}, None).startswith(
        "The app is unavailable (503): loading"
    )
    assert refusal_text(400, "bad", None) == "The app refused the request (400): bad"
