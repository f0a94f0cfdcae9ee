"""What the serving layer needs from an engine, independent of vLLM.

The replica deployment talks to an `Engine`; `vllm_engine.VLLMEngine` is the real one, and unit
tests inject a scripted one. Everything that crosses a Ray hop here is a small slotted dataclass
(cheap to pickle).
"""

from __future__ import annotations

import abc
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


class EngineDeadError(RuntimeError):
    """The engine can no longer serve; the replica must be replaced."""


class EngineRequestError(ValueError):
    """The engine refused this request's parameters (a client error)."""


class ApiKind(StrEnum):
    COMPLETION = "completion"
    CHAT = "chat"


@dataclass(frozen=True, slots=True)
class ApiCall:
    """An OpenAI request as vLLM's own OpenAI layer sees it, rendered at the ingress.

    `request` is vLLM's request model (validated at the ingress), `inputs` vLLM's engine inputs
    with the prompt's token ids (rendered once, at the ingress, by vLLM's GPU-less renderer; head
    + tail truncation already applied) and, for chat, `conversation` the parsed messages. The
    replica hands them to vLLM's serving classes in place of rendering again.
    """

    kind: ApiKind
    request: Any
    inputs: list[Any]
    conversation: list[Any] | None = None


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # wall clock when the ingress dispatched it (the `dispatch` stage); 0: the ingress does not
    # time requests (server_timing off), so neither the replica nor the engine does
    sent_at: float = 0.0
    # The OpenAI request, when the response is to be vLLM's own (every request of the HTTP API);
    # None: plain generation (benchmarks of the bare replica, tests)
    api: ApiCall | None = None
    # The ingress whose stream channel to the replica may carry this request's chunks
    # (engine/channel.py); empty: its own call carries them
    channel: str = ""

    @property
    def prompt_tokens(self) -> int:
        if self.api is not None:
            return sum(len(i["prompt_token_ids"]) for i in self.api.inputs)
        return len(self.prompt_token_ids)


@dataclass(slots=True)
class StreamChunk:
    """New output since the previous chunk of the same request.

    `completion_tokens` is cumulative, so the last chunk carries the request's usage.
    """

    text: str
    num_tokens: int
    completion_tokens: int
    prompt_tokens: int
    finish_reason: str | None = None
    sent_at: float = 0.0  # wall clock when the replica sent it: the consumer measures its lag
    # First chunk only: ms per stage measured by the replica and its engine (serve_app/timing.py)
    stages: dict[str, float] | None = None
    # For an ApiCall: the response's own bytes, as vLLM's OpenAI layer made them (a JSON body, or
    # one SSE event of a stream); None on a chunk that only says the first token is out.
    data: str | None = None
    status: int = 200  # an error's HTTP status (data is then vLLM's error body)
    # A receipt: an engine frontend sent this chunk on its own channel to the ingress, and tells
    # its replica of it (the first token's and the last chunk); not to be sent again
    carried: bool = False
    # First token's chunk: prompt tokens the engine found in its prefix cache (not prefilled)
    cached_tokens: int = 0


@dataclass(frozen=True, slots=True)
class EngineStats:
    """Scheduler state of one engine as of its last step."""

    waiting: int = 0
    running: int = 0
    kv_cache_usage: float = 0.0
    prefix_cache_hit_rate: float = 0.0
    healthy: bool = True
    # when the engine step it describes ended (time.monotonic(), the machine's clock on Linux):
    # with several clients of one engine, each sees the steps' stats only now and then
    recorded_at: float = 0.0


@dataclass(frozen=True, slots=True)
class Placement:
    """Where a replica runs: its Ray node and the accelerator ids Ray gave it."""

    node_id: str = ""
    node_ip: str = ""
    gpu_ids: tuple[str, ...] = ()
    dispatch_path: str = ""  # its direct-dispatch socket (engine/direct.py), if it listens


@dataclass(frozen=True, slots=True)
class ReplicaReport:
    """What a replica publishes about itself on the pool state board."""

    pool: str
    replica_id: str
    stats: EngineStats
    max_model_len: int
    reported_at: float
    ttft_ms_recent: tuple[float, ...] = field(default=())
    tpot_ms_recent: tuple[float, ...] = field(default=())
    placement: Placement = field(default_factory=Placement)
    queued_tokens: int = 0  # prompt tokens handed to the engine and not yet prefilled
    prefill_tok_s: float | None = None  # measured prefill rate (engine/prefill.py)


@dataclass(frozen=True, slots=True)
class BoardReply:
    """What the board answers a replica's report with."""

    consumer_lag_ms: float | None = None  # worst recent lag of the pool's chunks at an ingress
    refused_per_s: float = 0.0  # the pool's refused demand, this replica's share


class Engine(abc.ABC):
    """An inference engine owned by one replica."""

    @abc.abstractmethod
    async def start(self) -> None:
        """Load the model and become ready; raises if the engine cannot start."""

    @abc.abstractmethod
    def generate(self, request: GenerationRequest) -> AsyncIterator[StreamChunk]:
        """Yield deltas until the request finishes; the last chunk has a finish_reason.

        Cancelling the iteration (client gone) aborts the engine request. Raises
        EngineRequestError for parameters the engine refuses and EngineDeadError when the
        engine died.
        """

    @abc.abstractmethod
    async def check_health(self) -> None:
        """Raise EngineDeadError when the engine cannot serve."""

    @abc.abstractmethod
    def stats(self) -> EngineStats:
        """The latest scheduler state; cheap, never blocks."""

    @abc.abstractmethod
    def shutdown(self) -> None:
        """Stop the engine and its processes."""
