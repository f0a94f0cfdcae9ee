"""The application's configuration types: serve_config.yaml's `args` (AppArgs) and what the
ingress is built with (IngressConfig), with its limits and API-key sources. Routing's own types
(RoutingConfig and its priors) are in serve_app/routing/config.py; engine profiles in
serve_app/profiles.py.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from serve_app.constants import DEFAULT_MAX_TOKENS
from serve_app.ingress.truncation import HeadTail
from serve_app.routing.config import RoutingConfig
from serve_app.routing.estimator import DEFAULT_STEP_TOKENS

# LLM streams run for minutes: let a draining replica finish them before it is stopped.
GRACEFUL_SHUTDOWN_TIMEOUT_S = 300.0
# "vllm": the engines and the ingress's renderer are vLLM's. "fake": serve_app/engine/fake.py, a
# stand-in without vLLM (fixed text at a fixed pace, OpenAI-shaped) for tests of everything
# around the engine, which then start in seconds.
EngineKind = Literal["vllm", "fake"]


class AuthConfig(BaseModel):
    """Where API keys come from (serve_config.yaml `args.auth`). No keys: the API is open."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    api_keys_env: str | None = Field(
        "SERVE_APP_API_KEYS", description="Environment variable with comma-separated keys."
    )
    api_keys_file: str | None = Field(None, description="File with one key per line.")


class LimitsConfig(BaseModel):
    """Request size limits (serve_config.yaml `args.limits`)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_body_bytes: int = Field(1 << 20, ge=1024, description="Largest request body.")
    max_header_bytes: int = Field(8 << 10, ge=1024, description="Largest sum of header sizes.")
    body_timeout_s: float = Field(
        30.0,
        gt=0,
        description="Longest wait for the next part of a request body (slow uploads get 408).",
    )
    max_prompt_tokens: int | None = Field(
        None, ge=1, description="Longest prompt in tokens (None: the longest pool context)."
    )
    max_tokens: int | None = Field(
        None, ge=1, description="Largest max_tokens a request may ask (None: the context's room)."
    )


class PoolInfo(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    max_model_len: int
    min_replicas: int
    step_tokens: int = DEFAULT_STEP_TOKENS  # max_num_batched_tokens
    max_ongoing_requests: int = 64  # per replica; direct dispatch sends each at most this many
    stream_channel: bool = True  # the ingress opens stream channels to the pool's replicas


class IngressConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    served_model_name: str
    model: str  # what the engines load; the tokenizer comes from it
    pools: dict[str, PoolInfo]
    routing: RoutingConfig
    # the completion length routing predicts with when a request sets no max_tokens (vLLM then
    # generates up to the rest of the pool's context)
    default_max_tokens: int
    limits: LimitsConfig = LimitsConfig()
    auth: AuthConfig = AuthConfig()
    # Where each first token's time goes (serve_app/timing.py): the Server-Timing header, the
    # stream's final usage event and the per-stage histograms.
    server_timing: bool = True
    truncation: HeadTail = HeadTail()  # what a request's `truncate_prompt: true` keeps
    engine: EngineKind = "vllm"


class AppArgs(BaseModel):
    """`args:` of the application in serve_config.yaml."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    profiles: list[str] = Field(min_length=1, description="Profile names or YAML paths.")
    profiles_dir: str | None = Field(None, description="Where profile names are looked up.")
    served_model_name: str | None = Field(None, description="Model id clients send.")
    default_max_tokens: int = Field(DEFAULT_MAX_TOKENS, ge=1, description="When none is given.")
    routing: RoutingConfig = Field(default_factory=RoutingConfig, description="SLO routing.")
    limits: LimitsConfig = Field(default_factory=LimitsConfig, description="Request limits.")
    auth: AuthConfig = Field(default_factory=AuthConfig, description="Where API keys come from.")
    server_timing: bool = Field(
        True,
        description="Report where each first token's time goes (Server-Timing header, the "
        "stream's final usage, per-stage histograms).",
    )
    truncation: HeadTail = Field(
        default_factory=HeadTail,
        description="What a request's `truncate_prompt: true` keeps of a longer prompt: its "
        "first head_tokens and last tail_tokens (the ERNIE guides' 384 + 128).",
    )
    graceful_shutdown_timeout_s: float = Field(
        GRACEFUL_SHUTDOWN_TIMEOUT_S,
        ge=0,
        description="How long a replica being stopped (scale-down, redeploy) may finish its "
        "in-flight streams; size it for your longest generation.",
    )
    engine: EngineKind = Field(
        "vllm",
        description="vllm, or fake: a stand-in engine without vLLM for tests (engine/fake.py).",
    )
    num_gpus_per_replica: float | None = Field(
        None,
        ge=0,
        description="GPUs each engine replica reserves (None: 1 on CUDA, 0 on CPU). On CPU, 1 "
        "lets `ray start --num-gpus N` simulate GPU placement.",
    )

    @model_validator(mode="after")
    def _unique(self) -> AppArgs:
        if len(set(self.profiles)) != len(self.profiles):
            raise ValueError("profiles: each profile may appear once")
        return self
