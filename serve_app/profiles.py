"""Engine profiles: named vLLM engine configurations, each served by one pool of replicas.

A profile is YAML written with vLLM's own engine-argument names. It is loaded and validated once
(unknown keys are errors that name the file and the key), then resolved for a platform: the
profile's `platforms.<name>` section overrides the base values, and the result is checked against
what that platform's attention kernels accept before any engine starts.
"""

from __future__ import annotations

import os
from enum import StrEnum
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from serve_app.constants import DEFAULT_PROFILES_DIR, PLATFORM_ENV, PROFILES_DIR_ENV


class ProfileError(ValueError):
    """A profile file is missing, malformed, or asks for what the platform cannot do."""


class Platform(StrEnum):
    CPU = "cpu"
    CUDA = "cuda"


# vLLM's CPU attention finds no common block size below 32 ("No common block size for 8"); the
# CUDA V1 backends (FlashAttention, Triton, FlexAttention) need a multiple of 16. Both measured.
BLOCK_SIZE_MULTIPLE: dict[Platform, int] = {Platform.CPU: 32, Platform.CUDA: 16}

_PAGED_ATTN_KEYS = ("enable_paged_attn", "enable_paged_attention", "paged_attention")


class EngineArgs(BaseModel):
    """The subset of vLLM's engine arguments a profile may set. None means vLLM's default."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    block_size: int | None = Field(None, ge=1, description="KV cache block size in tokens.")
    max_model_len: int | None = Field(
        None, ge=16, description="Longest prompt + output the engine accepts, in tokens."
    )
    max_num_seqs: int | None = Field(None, ge=1, description="Most sequences in one batch.")
    max_num_batched_tokens: int | None = Field(
        None, ge=16, description="Most tokens scheduled in one engine step."
    )
    gpu_memory_utilization: float | None = Field(
        None, gt=0, le=1, description="Fraction of device memory vLLM may use (host RAM on CPU)."
    )
    kv_cache_memory_bytes: int | None = Field(
        None, ge=1 << 20, description="KV cache size in bytes; overrides gpu_memory_utilization."
    )
    kv_cache_dtype: Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16"] | None = Field(
        None, description="Data type of the KV cache."
    )
    enable_chunked_prefill: bool | None = Field(None, description="Split long prefills.")
    enable_prefix_caching: bool | None = Field(None, description="Reuse KV of shared prefixes.")
    enforce_eager: bool | None = Field(None, description="Skip CUDA graphs / torch.compile.")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] | None = Field(
        None, description="Model weight and activation dtype."
    )
    seed: int | None = Field(None, description="Engine-wide random seed.")

    @model_validator(mode="before")
    @classmethod
    def _explain_paged_attention(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key in _PAGED_ATTN_KEYS:
                if key in data:
                    raise ValueError(
                        f"'{key}' is not a vLLM engine argument: paged KV cache (PagedAttention) "
                        "is always on in vLLM and cannot be switched off; remove the key"
                    )
        return data

    def merged(self, override: EngineArgs) -> EngineArgs:
        """This object with every field the override sets replaced."""
        return self.model_copy(update=override.model_dump(exclude_unset=True))

    def to_vllm_kwargs(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class PoolSpec(BaseModel):
    """How the pool of replicas serving a profile is sized and scaled."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    min_replicas: int = Field(1, ge=0, description="Fewest replicas autoscaling keeps.")
    max_replicas: int = Field(1, ge=1, description="Most replicas autoscaling starts.")
    target_ongoing_requests: float = Field(
        8, gt=0, description="Serve autoscaling target of in-flight requests per replica."
    )
    max_ongoing_requests: int = Field(
        64, ge=1, description="Requests one replica takes at once; more queue in the handle."
    )
    max_queued_requests: int = Field(
        256,
        ge=-1,
        description="Requests queued for the pool beyond its replicas' max_ongoing_requests; more "
        "are refused at once with 503 + Retry-After (-1: unbounded).",
    )
    target_waiting_per_replica: float | None = Field(
        4,
        gt=0,
        description="Engine waiting-queue depth per replica that adds replicas (None: Serve's "
        "ongoing-request policy alone).",
    )
    upscale_delay_s: float = Field(5.0, ge=0, description="Load must last this long to scale up.")
    downscale_delay_s: float = Field(30.0, ge=0, description="Idle this long to scale down.")
    num_cpus: float = Field(1, gt=0, description="CPUs reserved per replica on a CPU platform.")
    stream_messages_per_s: float | None = Field(
        16000,
        gt=0,
        description="Event budget of one replica's token streams. With N streams open, each "
        "takes its next output at most every N/budget seconds, carrying every token produced "
        "since (the first token always goes at once; no stream waits more than 50 ms); the "
        "budget shrinks while the ingress falls behind. None: every engine step.",
    )
    stream_channel: bool = Field(
        True,
        description="The ingress opens one channel per replica that carries all of its streams' "
        "chunks, one message per engine step (false: a message per chunk on each request's own "
        "call; set stream_messages_per_s to about 2000 then).",
    )

    frontends: int = Field(
        1,
        ge=1,
        le=16,
        description="Processes that serve one engine's requests, as `vllm serve "
        "--api-server-count`: the replica and frontends - 1 Ray actors beside it, each a client "
        "of the engine running vLLM's OpenAI layer for its share of the streams and sending "
        "their chunks straight to the ingress (engine/frontend.py). More than 1 pays where one "
        "process's event loop limits the streams (a GPU at high concurrency).",
    )

    @model_validator(mode="after")
    def _bounds_ordered(self) -> PoolSpec:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas})"
            )
        return self


class PlatformOverride(BaseModel):
    """Values that replace the profile's own on one platform (e.g. a miniature model on CPU)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    model: str | None = Field(None, description="Model to serve on this platform instead.")
    engine: EngineArgs = Field(default_factory=EngineArgs, description="Engine argument overrides.")
    frontends: int | None = Field(
        None, ge=1, le=16, description="pool.frontends on this platform instead."
    )


class EngineProfile(BaseModel):
    """One named engine configuration, as written in profiles/<name>.yaml."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str = Field(pattern=r"^[a-z0-9][a-z0-9-]{0,40}$", description="Pool name.")
    description: str = Field("", description="What this profile is for.")
    model: str = Field(description="Hugging Face id, local path, or builtin:<name>.")
    engine: EngineArgs = Field(description="vLLM engine arguments.")
    pool: PoolSpec = Field(default_factory=PoolSpec, description="Replica bounds and scaling.")
    platforms: dict[Platform, PlatformOverride] = Field(
        default_factory=dict, description="Per-platform overrides, applied before checks."
    )

    def resolve(self, platform: Platform) -> ResolvedProfile:
        """Apply the platform's overrides and check the result against what it accepts."""
        override = self.platforms.get(platform, PlatformOverride())
        engine = self.engine.merged(override.engine)
        resolved = ResolvedProfile(
            name=self.name,
            model=override.model or self.model,
            engine=engine,
            pool=self.pool
            if override.frontends is None
            else self.pool.model_copy(update={"frontends": override.frontends}),
            platform=platform,
        )
        check_platform(resolved)
        return resolved


class ResolvedProfile(BaseModel):
    """A profile as it will run on one platform: what an engine replica is built from."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    model: str
    engine: EngineArgs
    pool: PoolSpec
    platform: Platform
    served_model_name: str | None = None  # what clients call the model (default: `model`)

    @property
    def api_model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def max_model_len(self) -> int:
        assert self.engine.max_model_len is not None  # check_platform guarantees it
        return self.engine.max_model_len


def engine_env(profile: ResolvedProfile) -> dict[str, str]:
    """Environment an engine of this profile runs with (the app's replicas and the bench's).

    vLLM CPU binds OpenMP threads to cores itself ("auto"); several engines on one host would
    then pin to the same cores. Each engine instead runs as many threads as CPUs it was given,
    unbound unless `serve-app run` reserved cores for them (engine/cpu_layout.py).
    """
    if profile.platform is Platform.CUDA:
        # A process that touched CUDA (platform detection, NVML) cannot fork a CUDA worker.
        return {"VLLM_WORKER_MULTIPROC_METHOD": "spawn"}
    return {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "OMP_NUM_THREADS": str(engine_threads(profile))}


def engine_threads(profile: ResolvedProfile) -> int:
    """The threads a CPU engine of this profile runs its model on: one per CPU it was given."""
    return max(1, int(profile.pool.num_cpus))


def engine_cores(profile: ResolvedProfile) -> int:
    """Cores reserved for an engine of this profile where `serve-app run` reserves any
    (engine/cpu_layout.py): on CPU its model's threads; on a GPU the one busy thread of vLLM's
    engine core (scheduler and kernel launches), which sets the pace of every engine step."""
    return engine_threads(profile) if profile.platform is Platform.CPU else 1


def check_platform(profile: ResolvedProfile) -> None:
    """Refuse, before any engine starts, what the platform's vLLM would refuse later or worse."""
    where = f"profile '{profile.name}' on {profile.platform.value}"
    engine = profile.engine
    if engine.max_model_len is None:
        raise ProfileError(f"{where}: engine.max_model_len must be set (routing needs it)")
    multiple = BLOCK_SIZE_MULTIPLE[profile.platform]
    if engine.block_size is not None and engine.block_size % multiple:
        allowed = ", ".join(str(multiple * k) for k in (1, 2, 4, 8))
        raise ProfileError(
            f"{where}: block_size {engine.block_size} is not supported: vLLM's attention on "
            f"{profile.platform.value} needs a multiple of {multiple} ({allowed}). Set "
            f"platforms.{profile.platform.value}.engine.block_size to override it for this platform"
        )
    if profile.platform is Platform.CPU and engine.kv_cache_memory_bytes is None:
        raise ProfileError(
            f"{where}: set engine.kv_cache_memory_bytes (or platforms.cpu.engine."
            "kv_cache_memory_bytes): on CPU gpu_memory_utilization is a fraction of host RAM, "
            "so replicas sized by it would together overcommit memory"
        )


def _format_validation_error(err: ValidationError) -> str:
    parts = []
    for e in err.errors()[:5]:
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
        parts.append(f"{loc}: {msg}")
    return "; ".join(parts)


def load_profile(path: Path) -> EngineProfile:
    """Read and validate one profile file; every error names the file and the offending key."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ProfileError(f"{path}: cannot read profile: {e.strerror}") from None
    except yaml.YAMLError as e:
        raise ProfileError(f"{path}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: a profile must be a mapping of keys to values")
    data.setdefault("name", path.stem)
    try:
        profile = EngineProfile.model_validate(data)
    except ValidationError as e:
        raise ProfileError(f"{path}: {_format_validation_error(e)}") from None
    if profile.name != path.stem:
        raise ProfileError(f"{path}: name '{profile.name}' must match the file name '{path.stem}'")
    return profile


def profiles_dir(explicit: str | None = None) -> Path:
    """Profiles directory: the argument, else $SERVE_APP_PROFILES_DIR, else the checkout's."""
    chosen = explicit or os.environ.get(PROFILES_DIR_ENV)
    return Path(chosen).expanduser().resolve() if chosen else DEFAULT_PROFILES_DIR


def find_profile(name_or_path: str, directory: Path) -> Path:
    """A profile given as a name ('low-latency') or as a path to a YAML file."""
    as_path = Path(name_or_path).expanduser()
    if as_path.suffix in (".yaml", ".yml"):
        return as_path if as_path.is_absolute() else (directory / as_path.name)
    return directory / f"{name_or_path}.yaml"


def detect_platform() -> Platform:
    """$SERVE_APP_PLATFORM if set; else CUDA when the Ray cluster (or this host) has GPUs."""
    forced = os.environ.get(PLATFORM_ENV)
    if forced:
        try:
            return Platform(forced)
        except ValueError:
            raise ProfileError(f"${PLATFORM_ENV}={forced!r}: expected 'cpu' or 'cuda'") from None
    try:
        import ray

        # The app is built on the head node, which need not have a GPU itself (KubeRay's head
        # group has none); the cluster's resources say where engines will run.
        if ray.is_initialized() and ray.cluster_resources().get("GPU", 0) > 0:
            return Platform.CUDA
    except ImportError:
        pass
    import torch

    return Platform.CUDA if torch.cuda.is_available() else Platform.CPU
