"""Routing configuration (serve_config.yaml `args.routing`): SLO classes, thresholds, priors."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Policy(StrEnum):
    """How the ingress picks a pool; SLO routing is the product, the others are baselines."""

    SLO = "slo"
    ROUND_ROBIN = "round-robin"
    LEAST_LOAD = "least-load"
    SINGLE = "single"


class Placement(StrEnum):
    """Which pool takes a request when several are predicted to meet its SLO with margin."""

    HEADROOM = "headroom"  # the lowest predicted latency / target: most room before a miss
    BEST_FIT = "best-fit"  # the highest ratio under the margin: keep fast pools for tight SLOs
    LEAST_LOAD = "least-load"  # the fewest requests (waiting + running) per replica


class Protect(StrEnum):
    """Whose TPOT a new request's prefill must leave within target (routing/policy.py)."""

    DECODING = "decoding"  # the requests decoding on its pool (and on pools sharing its device)
    QUEUED = "queued"  # those, and the requests queued there for their first token


class SLOClass(BaseModel):
    """Default latency targets of a named class of traffic."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ttft_ms: float | None = Field(None, gt=0, description="Time-to-first-token target.")
    tpot_ms: float | None = Field(None, gt=0, description="Time-per-output-token target.")


class LatencyPrior(BaseModel):
    """Starting coefficients of a pool's latency model (see routing/estimator.py).

    The estimator scales them by factors learned from measured latencies, so rough values do.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    ttft_base_ms: float = Field(20.0, ge=0, description="TTFT of a short prompt on an idle pool.")
    ttft_ms_per_prompt_token: float = Field(
        0.05,
        ge=0,
        description="Prefill cost per token, of the request's prompt and of the prompt tokens "
        "queued ahead of it; replaced by the replicas' measured prefill rate once they have one.",
    )
    ttft_ms_per_waiting_request: float = Field(
        2.0, ge=0, description="Added TTFT per request queued ahead, per replica (scheduling)."
    )
    ttft_ms_per_running_request: float = Field(
        1.0, ge=0, description="Added TTFT per request already decoding, per replica."
    )
    tpot_base_ms: float = Field(5.0, ge=0, description="TPOT on an idle pool.")
    tpot_ms_per_running_request: float = Field(
        0.5, ge=0, description="Added TPOT per request decoding in the same batch."
    )
    tpot_ms_per_prefill_token: float = Field(
        0.0,
        ge=0,
        description="Added TPOT per prompt token queued for prefill (up to the step's token "
        "budget): chunked prefill shares each engine step with the decodes.",
    )


def _default_classes() -> dict[str, SLOClass]:
    return {
        "interactive": SLOClass(ttft_ms=500, tpot_ms=50),
        "standard": SLOClass(ttft_ms=2000, tpot_ms=100),
        "batch": SLOClass(),
    }


class RoutingConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    classes: dict[str, SLOClass] = Field(
        default_factory=_default_classes, description="SLO classes by name."
    )
    default_class: str = Field("standard", description="Class of requests that name no SLO.")
    fit_margin: float = Field(
        0.8,
        gt=0,
        le=1,
        description="A pool 'fits' when its predicted latency is at most this share of the target.",
    )
    max_waiting_per_replica: float = Field(
        16, gt=0, description="A pool with more queued requests per replica is saturated."
    )
    learning_rate: float = Field(
        0.2, gt=0, le=1, description="EWMA weight of each measured latency in the model's factors."
    )
    factor_half_life_s: float = Field(
        10.0,
        gt=0,
        description="Without new measurements, learned factors relax to the prior with this "
        "half-life (a stall must not keep a pool refused after it has passed).",
    )
    path_half_life_s: float = Field(
        2.0,
        gt=0,
        description="Without new measurements, the learned path delay (TTFT outside the "
        "engine's queue and prefill: replica-slot waits, a busy proxy) relaxes to 0 with this "
        "half-life; shorter than the factors', as that delay ends with the load that caused it.",
    )
    placement: Placement = Field(
        Placement.HEADROOM,
        description="Which pool takes a request when several meet its SLO with margin.",
    )
    protect: Protect = Field(
        Protect.QUEUED,
        description="Whose TPOT admission protects: the requests decoding on a pool, or those "
        "and the requests queued there for their first token (each decodes while the prompts "
        "queued after it prefill).",
    )
    protect_across_ingresses: bool = Field(
        True,
        description="Protect the requests every ingress replica dispatched (each posts its own "
        "to the pool-state board and takes the others', a board round trip late), not only "
        "this replica's.",
    )
    tpot_at_least_pace: bool = Field(
        False,
        description="A pool's predicted TPOT is at least the pace its decoding requests keep "
        "now (the median of their measured time per token): every request on an engine gets "
        "a token per step, so theirs is the step time a new one would share. Off by default: "
        "on the CPU machine it cut the documents' TPOT misses but also moved interactive "
        "requests to the pool beside the documents (docs/results/goodput.md).",
    )
    max_held: int = Field(
        64,
        ge=0,
        description="Requests per ingress that may wait, instead of being refused at once, for "
        "a pool that would meet their SLO but protects its running requests: each is decided "
        "again every `hold_poll_ms` while its TTFT target still allows (0: refuse at once).",
    )
    hold_poll_ms: float = Field(
        20.0, gt=0, description="How often a held request is decided again (ms)."
    )
    allow_policy_header: bool = Field(
        False,
        description="Honour `x-route-policy` (slo[:<placement>[:<protect>[:<switches>]]] | "
        "round-robin | "
        "least-load | single:<pool>) per request: "
        "for benchmarks comparing policies on the same replicas; never on an open endpoint.",
    )
    priors: dict[str, LatencyPrior] = Field(
        default_factory=dict, description="Latency model priors by pool; default for the rest."
    )
    colocated: list[list[str]] | None = Field(
        None,
        description="Groups of pools whose engines share a device (fractions of one GPU, the "
        "cores of one CPU): a prefill admitted to one slows the decodes of all, so admission "
        "protects the decodes of the whole group. Unset: pools share where their replicas do, "
        "as the replicas report it (one GPU id on one node; replicas without GPUs: one node).",
    )

    @model_validator(mode="after")
    def _default_class_exists(self) -> RoutingConfig:
        if self.default_class not in self.classes:
            raise ValueError(
                f"default_class '{self.default_class}' is not one of the classes "
                f"({', '.join(self.classes)})"
            )
        return self

    @model_validator(mode="after")
    def _colocated_groups_are_disjoint(self) -> RoutingConfig:
        seen: set[str] = set()
        for group in self.colocated or []:
            if twice := seen & set(group):
                raise ValueError(f"colocated names {sorted(twice)} in more than one group")
            seen |= set(group)
        return self

    def sharing(self, pool: str) -> frozenset[str]:
        """The pools configured to share a device with `pool`, itself included."""
        for group in self.colocated or []:
            if pool in group:
                return frozenset(group)
        return frozenset({pool})

    def prior(self, pool: str) -> LatencyPrior:
        return self.priors.get(pool, LatencyPrior())
