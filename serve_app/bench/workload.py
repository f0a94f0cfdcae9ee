"""Benchmark workloads: YAML files describing arrivals, lengths, SLO mix and bounds.

A workload expands, deterministically from its seed, into a list of `RequestSpec`s: token-id
prompts (so every target sees the exact same prompt lengths, tokenizer aside), output lengths,
SLO classes and arrival offsets.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from serve_app.routing.config import SLOClass


class WorkloadError(ValueError):
    pass


class Lengths(BaseModel):
    """A token-length distribution: fixed, uniform [min, max], or drawn from a list."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["fixed", "uniform", "list"] = "fixed"
    value: int | None = Field(None, ge=1)
    min: int | None = Field(None, ge=1)
    max: int | None = Field(None, ge=1)
    values: list[int] | None = Field(None, min_length=1)

    @model_validator(mode="after")
    def _complete(self) -> Lengths:
        needed = {"fixed": ("value",), "uniform": ("min", "max"), "list": ("values",)}[self.kind]
        missing = [f for f in needed if getattr(self, f) is None]
        if missing:
            raise ValueError(f"kind {self.kind} needs {', '.join(missing)}")
        if self.kind == "uniform" and (self.min or 0) > (self.max or 0):
            raise ValueError("min exceeds max")
        return self

    def draw(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            assert self.value is not None
            return self.value
        if self.kind == "uniform":
            assert self.min is not None and self.max is not None
            return rng.randint(self.min, self.max)
        assert self.values is not None
        return rng.choice(self.values)


class Arrival(BaseModel):
    """Poisson at `rate` req/s, constant at `rate`, or a closed loop of `concurrency` users."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kind: Literal["poisson", "constant", "closed"] = "closed"
    rate: float | None = Field(None, gt=0)
    concurrency: int | None = Field(None, ge=1)
    window_s: float | None = Field(
        None,
        gt=0,
        description="Poisson only: offer the workload's requests within this window, as a "
        "Poisson process conditioned on that many arrivals in it (sorted uniform times). Every "
        "draw then offers exactly requests / window_s req/s; with exponential gaps alone the "
        "last of N arrivals at rate r falls around N / r, its standard deviation 1 / √N of that "
        "(8 % at N = 160).",
    )

    @model_validator(mode="after")
    def _complete(self) -> Arrival:
        if self.kind == "closed" and self.concurrency is None:
            raise ValueError("a closed loop needs concurrency")
        if self.kind != "closed" and self.rate is None:
            raise ValueError(f"{self.kind} arrivals need rate")
        if self.window_s is not None and self.kind != "poisson":
            raise ValueError("window_s is for poisson arrivals")
        return self


class ClassShape(BaseModel):
    """Lengths of one SLO class's requests (e.g. short chats beside long documents)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    prompt_tokens: Lengths
    output_tokens: Lengths


class Workload(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    description: str = ""
    arrival: Arrival
    prompt_tokens: Lengths
    output_tokens: Lengths
    slo_mix: dict[str, float] = Field(default_factory=lambda: {"standard": 1.0})
    slo_classes: dict[str, SLOClass] = Field(
        default_factory=dict, description="Targets per class, for attainment and goodput."
    )
    class_shapes: dict[str, ClassShape] = Field(
        default_factory=dict,
        description="Lengths per class; classes not named here use prompt_tokens/output_tokens.",
    )
    requests: int = Field(100, ge=1, le=100_000)
    duration_s: float = Field(600, gt=0, description="Hard bound on one run's wall time.")
    seed: int = 0
    content_salt: int = Field(
        0,
        description="Changes the prompts' token ids, not their lengths, classes or arrivals: "
        "runs that replay one workload (policies, targets, repeats) then share no prompt, so "
        "none is served from the prefix cache another run filled.",
    )

    @model_validator(mode="after")
    def _classes_known(self) -> Workload:
        unknown = set(self.slo_mix) - set(self.slo_classes)
        if self.slo_classes and unknown:
            raise ValueError(f"slo_mix names classes without targets: {sorted(unknown)}")
        return self

    def with_arrival(self, arrival: Arrival) -> Workload:
        return self.model_copy(update={"arrival": arrival})

    def with_targets(self, slo_class: str, ttft_ms: float, tpot_ms: float) -> Workload:
        classes = {**self.slo_classes, slo_class: SLOClass(ttft_ms=ttft_ms, tpot_ms=tpot_ms)}
        return self.model_copy(update={"slo_classes": classes})


@dataclass(frozen=True, slots=True)
class RequestSpec:
    index: int
    prompt_token_ids: list[int]
    max_tokens: int
    slo_class: str
    arrival_s: float  # offset from the run's start (open-loop arrivals); 0 for closed loops


def expand(workload: Workload, vocab_size: int = 4000) -> list[RequestSpec]:
    """The workload's requests, the same on every call. Token ids avoid the special ids 0-4."""
    rng = random.Random(workload.seed)
    content = random.Random(f"{workload.seed}/{workload.content_salt}")  # token ids only
    classes = list(workload.slo_mix)
    weights = [workload.slo_mix[c] for c in classes]
    at = 0.0
    window = workload.arrival.window_s
    times = None  # windowed arrivals: every offset drawn up front, from a stream of their own
    if window is not None:
        arrivals = random.Random(f"{workload.seed}/arrivals")
        times = sorted(arrivals.uniform(0, window) for _ in range(workload.requests))
    specs = []
    for i in range(workload.requests):
        shape = None
        if workload.class_shapes:  # the class decides the lengths: draw it first
            slo_class = rng.choices(classes, weights)[0]
            shape = workload.class_shapes.get(slo_class)
        n = (shape.prompt_tokens if shape else workload.prompt_tokens).draw(rng)
        prompt = [content.randrange(5, vocab_size) for _ in range(n)]
        if times is not None:
            at = times[i]
        elif workload.arrival.kind == "poisson":
            assert workload.arrival.rate is not None
            at += rng.expovariate(workload.arrival.rate)
        elif workload.arrival.kind == "constant":
            assert workload.arrival.rate is not None
            at = i / workload.arrival.rate
        max_tokens = (shape.output_tokens if shape else workload.output_tokens).draw(rng)
        if not workload.class_shapes:
            slo_class = rng.choices(classes, weights)[0]
        specs.append(
            RequestSpec(
                index=i,
                prompt_token_ids=prompt,
                max_tokens=max_tokens,
                slo_class=slo_class,
                arrival_s=at,
            )
        )
    return specs


def load_workload(path: Path) -> Workload:
    try:
        data = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as e:
        raise WorkloadError(f"{path}: {e}") from None
    if isinstance(data, dict):
        data.setdefault("name", path.stem)
    try:
        return Workload.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        loc = ".".join(str(p) for p in first["loc"])
        raise WorkloadError(f"{path}: {loc}: {first['msg']}") from None
