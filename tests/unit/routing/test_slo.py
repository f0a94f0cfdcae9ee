import pytest

from serve_app.routing.config import Policy, RoutingConfig
from serve_app.routing.slo import (
    SLO,
    SLOHeaderError,
    parse_route_policy,
    parse_slo,
    route_headers,
)

CONFIG = RoutingConfig()


def test_no_headers_get_the_default_class() -> None:
    assert parse_slo({}, CONFIG) == SLO("standard", ttft_ms=2000, tpot_ms=100)


def test_class_supplies_targets_and_headers_override_them() -> None:
    slo = parse_slo({"x-slo-class": "interactive", "x-slo-ttft-ms": "150"}, CONFIG)
    assert slo == SLO("interactive", ttft_ms=150, tpot_ms=50)


@pytest.mark.parametrize("prefix", ["x-slo", "x-llm-d-slo"])
def test_llm_d_names_are_accepted(prefix: str) -> None:
    slo = parse_slo({f"{prefix}-ttft-ms": "300", f"{prefix}-tpot-ms": "20"}, CONFIG)
    assert (slo.ttft_ms, slo.tpot_ms) == (300, 20)


def test_batch_class_has_no_targets() -> None:
    assert parse_slo({"x-slo-class": "batch"}, CONFIG) == SLO("batch")


def test_best_effort_policy() -> None:
    assert parse_slo({"x-slo-policy": "best-effort"}, CONFIG).best_effort
    assert not parse_slo({"x-slo-policy": "strict"}, CONFIG).best_effort


@pytest.mark.parametrize(
    ("headers", "bad"),
    [
        ({"x-slo-ttft-ms": "abc"}, "x-slo-ttft-ms"),
        ({"x-slo-ttft-ms": "0"}, "x-slo-ttft-ms"),
        ({"x-slo-ttft-ms": "-5"}, "x-slo-ttft-ms"),
        ({"x-slo-tpot-ms": "1.5"}, "x-slo-tpot-ms"),
        ({"x-llm-d-slo-tpot-ms": ""}, "x-llm-d-slo-tpot-ms"),
        ({"x-slo-ttft-ms": "99999999999"}, "x-slo-ttft-ms"),
        ({"x-slo-class": "platinum"}, "x-slo-class"),
        ({"x-slo-policy": "maybe"}, "x-slo-policy"),
    ],
)
def test_malformed_headers_name_the_header(headers: dict[str, str], bad: str) -> None:
    with pytest.raises(SLOHeaderError) as err:
        parse_slo(headers, CONFIG)
    assert err.value.header == bad
    assert bad in str(err.value)


def test_route_policy_header_needs_the_config_to_allow_it() -> None:
    headers = {"x-route-policy": "round-robin"}
    assert parse_route_policy(headers, CONFIG, ["a"]) == (Policy.SLO, None)
    allowed = RoutingConfig(allow_policy_header=True)
    assert parse_route_policy(headers, allowed, ["a"]) == (Policy.ROUND_ROBIN, None)
    single = {"x-route-policy": "single:a"}
    assert parse_route_policy(single, allowed, ["a"]) == (Policy.SINGLE, "a")
    best_fit = {"x-route-policy": "slo:best-fit"}
    assert parse_route_policy(best_fit, allowed, ["a"]) == (Policy.SLO, "best-fit")
    least = {"x-route-policy": "least-load"}
    assert parse_route_policy(least, allowed, ["a"]) == (Policy.LEAST_LOAD, None)
    decoding = {"x-route-policy": "slo:headroom:decoding"}
    assert parse_route_policy(decoding, allowed, ["a"]) == (Policy.SLO, "headroom:decoding")
    own = {"x-route-policy": "slo:headroom:queued:own"}
    assert parse_route_policy(own, allowed, ["a"]) == (Policy.SLO, "headroom:queued:own")
    both = {"x-route-policy": "slo:headroom:queued:own+paced"}
    assert parse_route_policy(both, allowed, ["a"]) == (Policy.SLO, "headroom:queued:own+paced")
    for bad in ("single:zzz", "random", "slo:nearest", "slo:headroom:nobody", "slo::queued:all"):
        with pytest.raises(SLOHeaderError):
            parse_route_policy({"x-route-policy": bad}, allowed, ["a"])


@pytest.mark.parametrize(
    "value",
    ["²", "１００", "9" * 4301, "1" * 8, " ", "-5", "1e3", "0x10"],
)
def test_targets_are_ascii_digits_of_bounded_length(value: str) -> None:
    """Unicode digits and 4,301-digit numbers were 500s (int() raised past isdigit())."""
    with pytest.raises(SLOHeaderError) as e:
        parse_slo({"x-slo-ttft-ms": value}, RoutingConfig())
    assert e.value.header == "x-slo-ttft-ms"


def test_a_routing_header_given_twice_is_refused() -> None:
    raw = [(b"x-slo-ttft-ms", b"100"), (b"X-SLO-TTFT-MS", b"abc"), (b"other", b"1")]
    with pytest.raises(SLOHeaderError, match="only once") as e:
        route_headers(raw)
    assert e.value.header == "x-slo-ttft-ms"
    ok = route_headers([(b"X-Slo-Class", b"batch"), (b"x-other", b"1"), (b"x-other", b"2")])
    assert ok == {"x-slo-class": "batch"}
