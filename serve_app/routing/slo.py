"""Latency objectives from request headers.

`x-slo-ttft-ms` / `x-slo-tpot-ms` (llm-d's `x-llm-d-slo-ttft-ms` / `x-llm-d-slo-tpot-ms` too) set
targets in milliseconds; `x-slo-class` names a class whose targets fill in the rest; with neither,
the configured default class applies. `x-slo-policy: best-effort` asks to be served even when no
pool is predicted to meet the targets.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from serve_app.routing.config import Placement, Policy, Protect, RoutingConfig

TTFT_HEADERS = ("x-slo-ttft-ms", "x-llm-d-slo-ttft-ms")
TPOT_HEADERS = ("x-slo-tpot-ms", "x-llm-d-slo-tpot-ms")
CLASS_HEADER = "x-slo-class"
POLICY_HEADER = "x-slo-policy"
ROUTE_POLICY_HEADER = "x-route-policy"
# x-route-policy: slo:<placement>:<protect>:<switch>[+<switch>]: each sets one routing setting
# for the request (to compare with and without it on the same replicas)
SWITCHES = {
    "own": ("protect_across_ingresses", False),  # protect this ingress's requests only
    "modelled": ("tpot_at_least_pace", False),  # the TPOT model alone
    "paced": ("tpot_at_least_pace", True),  # the TPOT model floored by the live pace
}
_MAX_TARGET_MS = 3_600_000
_MAX_TARGET_DIGITS = len(str(_MAX_TARGET_MS))
# Headers that decide a request's SLO and route: each may be given once.
ROUTE_HEADERS = frozenset(
    {*TTFT_HEADERS, *TPOT_HEADERS, CLASS_HEADER, POLICY_HEADER, ROUTE_POLICY_HEADER}
)


class SLOHeaderError(ValueError):
    def __init__(self, header: str, message: str) -> None:
        super().__init__(message)
        self.header = header


@dataclass(frozen=True, slots=True)
class SLO:
    slo_class: str
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    best_effort: bool = False


def _parse_ms(headers: Mapping[str, str], names: tuple[str, ...]) -> float | None:
    for name in names:
        raw = headers.get(name)
        if raw is None:
            continue
        raw = raw.strip()
        # ASCII digits only ("²".isdigit() is True, and int() of 4,300+ digits raises), bounded
        # before int() so a long value costs nothing
        valid = raw.isascii() and raw.isdigit() and len(raw) <= _MAX_TARGET_DIGITS
        if not valid or not 0 < int(raw) <= _MAX_TARGET_MS:
            raise SLOHeaderError(
                name,
                f"header {name} must be a positive integer of milliseconds (1..{_MAX_TARGET_MS})",
            )
        return float(raw)
    return None


def route_headers(raw: Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """The request's SLO and routing headers from its ASGI header list, names lower case.
    Raises SLOHeaderError when one of them is given twice (which one would count is ambiguous)."""
    out: dict[str, str] = {}
    for key, value in raw:
        name = key.decode("latin-1").lower()
        if name not in ROUTE_HEADERS:
            continue
        if name in out:
            raise SLOHeaderError(name, f"header {name} may be given only once")
        out[name] = value.decode("latin-1")
    return out


def parse_slo(headers: Mapping[str, str], config: RoutingConfig) -> SLO:
    """The request's SLO; headers are looked up case-insensitively by the caller's mapping."""
    class_name = headers.get(CLASS_HEADER, "").strip() or config.default_class
    cls = config.classes.get(class_name)
    if cls is None:
        raise SLOHeaderError(
            CLASS_HEADER,
            f"header {CLASS_HEADER}: unknown class (known: {', '.join(sorted(config.classes))})",
        )
    policy = headers.get(POLICY_HEADER, "").strip().lower()
    if policy not in ("", "strict", "best-effort"):
        raise SLOHeaderError(POLICY_HEADER, f"header {POLICY_HEADER} must be strict or best-effort")
    ttft = _parse_ms(headers, TTFT_HEADERS)
    tpot = _parse_ms(headers, TPOT_HEADERS)
    return SLO(
        slo_class=class_name,
        ttft_ms=ttft if ttft is not None else cls.ttft_ms,
        tpot_ms=tpot if tpot is not None else cls.tpot_ms,
        best_effort=policy == "best-effort",
    )


def parse_route_policy(
    headers: Mapping[str, str], config: RoutingConfig, pools: Iterable[str]
) -> tuple[Policy, str | None]:
    """`x-route-policy: slo[:<placement>[:<protect>[:<switch>[+<switch>]]]] | round-robin |
    least-load | single:<pool>`, honoured only when the config allows (switches: `SWITCHES`).
    Returns the policy and its argument (the pool, or the placement with what admission
    protects and the switches, as given)."""
    raw = headers.get(ROUTE_POLICY_HEADER, "").strip()
    if not raw or not config.allow_policy_header:
        return Policy.SLO, None
    name, _, pool = raw.partition(":")
    try:
        policy = Policy(name)
    except ValueError:
        raise SLOHeaderError(
            ROUTE_POLICY_HEADER,
            f"header {ROUTE_POLICY_HEADER}: slo[:<placement>[:<protect>[:<switches>]]], "
            "round-robin, "
            "least-load or "
            "single:<pool>",
        ) from None
    if policy is Policy.SINGLE and pool not in set(pools):
        raise SLOHeaderError(ROUTE_POLICY_HEADER, f"header {ROUTE_POLICY_HEADER}: unknown pool")
    placement, _, rest = pool.partition(":")
    protect, _, switches = rest.partition(":")
    if policy is Policy.SLO and placement and placement not in set(Placement):
        raise SLOHeaderError(
            ROUTE_POLICY_HEADER,
            f"header {ROUTE_POLICY_HEADER}: placement must be one of {', '.join(Placement)}",
        )
    if policy is Policy.SLO and protect and protect not in set(Protect):
        raise SLOHeaderError(
            ROUTE_POLICY_HEADER,
            f"header {ROUTE_POLICY_HEADER}: protect must be one of {', '.join(Protect)}",
        )
    if policy is Policy.SLO and not set(filter(None, switches.split("+"))) <= SWITCHES.keys():
        raise SLOHeaderError(
            ROUTE_POLICY_HEADER,
            f"header {ROUTE_POLICY_HEADER}: switches after <protect> are "
            f"{', '.join(SWITCHES)}, joined by '+'",
        )
    return policy, (pool if policy in (Policy.SINGLE, Policy.SLO) and pool else None)
