"""Latency prediction per pool: a linear model of load, scaled by factors learned online.

    ttft_ms = (ttft_base + ttft_per_prompt_token * prompt_tokens
               + ttft_per_waiting_request * waiting_per_replica
               + ttft_per_running_request * running_per_replica) * ttft_factor
    tpot_ms = (tpot_base + tpot_per_running_request * (running_per_replica + 1)) * tpot_factor

The coefficients are priors from the routing config (per pool). Each request's measured TTFT (at
its first token) and TPOT (at its end), taken at the ingress, move the pool's factor towards
measured / unscaled prediction by an exponentially weighted average, so a pool that turns out
slower or faster than its prior is predicted correctly after a few requests.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from serve_app.routing.config import LatencyPrior

_FACTOR_BOUNDS = (0.02, 50.0)


@dataclass(frozen=True, slots=True)
class Prediction:
    ttft_ms: float
    tpot_ms: float


@dataclass(frozen=True, slots=True)
class LatencyModel:
    prior: LatencyPrior
    ttft_factor: float = 1.0
    tpot_factor: float = 1.0

    def _raw(self, prompt_tokens: int, waiting: float, running: float) -> Prediction:
        p = self.prior
        return Prediction(
            ttft_ms=p.ttft_base_ms
            + p.ttft_ms_per_prompt_token * prompt_tokens
            + p.ttft_ms_per_waiting_request * waiting
            + p.ttft_ms_per_running_request * running,
            tpot_ms=p.tpot_base_ms + p.tpot_ms_per_running_request * (running + 1),
        )

    def predict(self, prompt_tokens: int, waiting: float, running: float) -> Prediction:
        """Latency of a new request given per-replica queued and running request counts."""
        raw = self._raw(prompt_tokens, waiting, running)
        return Prediction(raw.ttft_ms * self.ttft_factor, raw.tpot_ms * self.tpot_factor)

    def learn(
        self,
        prompt_tokens: int,
        waiting: float,
        running: float,
        ttft_ms: float | None,
        tpot_ms: float | None,
        rate: float,
    ) -> LatencyModel:
        """The model after one measurement, taken with the load seen when the request was routed."""
        raw = self._raw(prompt_tokens, waiting, running)
        model = self
        if ttft_ms is not None and raw.ttft_ms > 0:
            model = replace(
                model, ttft_factor=_ewma(model.ttft_factor, ttft_ms / raw.ttft_ms, rate)
            )
        if tpot_ms is not None and raw.tpot_ms > 0:
            model = replace(
                model, tpot_factor=_ewma(model.tpot_factor, tpot_ms / raw.tpot_ms, rate)
            )
        return model


def _ewma(old: float, sample: float, rate: float) -> float:
    lo, hi = _FACTOR_BOUNDS
    return min(hi, max(lo, (1 - rate) * old + rate * sample))
