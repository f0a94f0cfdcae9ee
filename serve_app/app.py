"""The Serve application: `import_path: serve_app.app:build_app` in serve_config.yaml.

    Ingress ──> pool-<profile> (one deployment per profile, EngineReplica each)
       └──────> pool-state (board the replicas report to and the ingress reads)

Profiles are loaded, resolved for the platform and checked here, at deploy time, so a bad profile
fails `serve deploy` with a message instead of a replica crash loop.
"""

from __future__ import annotations

from pathlib import Path, PurePath
from typing import Any, cast

from pydantic import ValidationError
from ray import serve
from ray.serve import Application
from ray.serve.deployment import Deployment

from serve_app.autoscaling import POLICY_PATH
from serve_app.config import AppArgs, IngressConfig, PoolInfo
from serve_app.constants import BUILTIN_PREFIX, CHANNEL_SLOTS
from serve_app.engine.fake import FakeEngine
from serve_app.engine.replica import EngineReplica, vllm_engine
from serve_app.ingress.api import Ingress
from serve_app.pool_state import PoolStateBoard
from serve_app.profiles import (
    Platform,
    ProfileError,
    ResolvedProfile,
    _format_validation_error,
    detect_platform,
    engine_env,
    find_profile,
    load_profile,
    profiles_dir,
)
from serve_app.routing.estimator import DEFAULT_STEP_TOKENS

# Serve replaces a replica after 3 failed checks in a row: a dead engine is gone in ~6 s.
HEALTH_CHECK_PERIOD_S = 2.0


INGRESS_MAX_QUEUED = 2048


def _served_name(model: str) -> str:
    if model.startswith(BUILTIN_PREFIX):
        return model.removeprefix(BUILTIN_PREFIX)
    return PurePath(model).name or model


def _actor_options(profile: ResolvedProfile, num_gpus: float | None) -> dict[str, Any]:
    if profile.platform is Platform.CUDA:
        return {"num_gpus": 1 if num_gpus is None else num_gpus, "num_cpus": 1}
    env = engine_env(profile)
    options: dict[str, Any] = {"num_cpus": profile.pool.num_cpus, "runtime_env": {"env_vars": env}}
    if num_gpus:
        options["num_gpus"] = num_gpus
    return options


def _autoscaling_config(profile: ResolvedProfile) -> dict[str, Any]:
    pool = profile.pool
    config: dict[str, Any] = {
        "min_replicas": pool.min_replicas,
        "initial_replicas": max(pool.min_replicas, 1),
        "max_replicas": pool.max_replicas,
        "target_ongoing_requests": pool.target_ongoing_requests,
        "upscale_delay_s": pool.upscale_delay_s,
        "downscale_delay_s": pool.downscale_delay_s,
    }
    if pool.target_waiting_per_replica is not None:
        config["policy"] = {
            "policy_function": POLICY_PATH,
            "policy_kwargs": {"target_waiting_per_replica": pool.target_waiting_per_replica},
        }
    return config


def _pool_deployment(profile: ResolvedProfile, board: Application, args: AppArgs) -> Application:
    pool = profile.pool
    return (
        cast(Deployment, serve.deployment(EngineReplica))
        .options(
            name=f"pool-{profile.name}",
            # a stream channel per ingress replica is a call in flight too (engine/channel.py)
            max_ongoing_requests=pool.max_ongoing_requests
            + (CHANNEL_SLOTS if pool.stream_channel else 0),
            max_queued_requests=pool.max_queued_requests,
            autoscaling_config=_autoscaling_config(profile),
            ray_actor_options=_actor_options(profile, args.num_gpus_per_replica),
            health_check_period_s=HEALTH_CHECK_PERIOD_S,
            health_check_timeout_s=30,
            graceful_shutdown_timeout_s=args.graceful_shutdown_timeout_s,
        )
        .bind(
            profile,
            board,
            FakeEngine if args.engine == "fake" else vllm_engine,
            args.graceful_shutdown_timeout_s,
        )
    )


def resolve_profiles(args: AppArgs, platform: Platform) -> list[ResolvedProfile]:
    directory = profiles_dir(args.profiles_dir)
    resolved = [load_profile(find_profile(n, directory)).resolve(platform) for n in args.profiles]
    models = {p.model for p in resolved}
    if len(models) > 1:
        raise ProfileError(
            f"all pools must serve the same model on {platform.value}; got {sorted(models)}"
        )
    names = {p.name for p in resolved}
    unknown = set(args.routing.priors) - names
    if unknown:
        raise ProfileError(f"routing.priors names unknown pools: {sorted(unknown)}")
    unknown = {pool for group in args.routing.colocated or [] for pool in group} - names
    if unknown:
        raise ProfileError(f"routing.colocated names unknown pools: {sorted(unknown)}")
    return resolved


def ingress_config(args: AppArgs, profiles: list[ResolvedProfile]) -> IngressConfig:
    """What the ingress is built with, from the app's args and its pools' resolved profiles."""
    return IngressConfig(
        served_model_name=profiles[0].api_model_name,
        model=profiles[0].model,
        pools={
            p.name: PoolInfo(
                max_model_len=p.max_model_len,
                min_replicas=p.pool.min_replicas,
                step_tokens=p.engine.max_num_batched_tokens or DEFAULT_STEP_TOKENS,
                max_ongoing_requests=p.pool.max_ongoing_requests,
                stream_channel=p.pool.stream_channel,
            )
            for p in profiles
        },
        routing=args.routing,
        default_max_tokens=args.default_max_tokens,
        limits=args.limits,
        auth=args.auth,
        truncation=args.truncation,
        server_timing=args.server_timing,
        engine=args.engine,
    )


def build_app(raw_args: dict[str, Any]) -> Application:
    """Build the application from serve_config.yaml's `args`; raises with a clear message."""
    try:
        args = AppArgs.model_validate(raw_args)
    except ValidationError as e:
        raise ProfileError(f"serve_config args: {_format_validation_error(e)}") from None
    if args.auth.api_keys_file and not Path(args.auth.api_keys_file).is_file():
        raise ProfileError(f"auth.api_keys_file {args.auth.api_keys_file} does not exist")
    profiles = resolve_profiles(args, detect_platform())
    served = args.served_model_name or _served_name(profiles[0].model)
    profiles = [p.model_copy(update={"served_model_name": served}) for p in profiles]
    names = [p.name for p in profiles]
    board = (
        cast(Deployment, serve.deployment(PoolStateBoard))
        .options(name="pool-state", num_replicas=1, ray_actor_options={"num_cpus": 0})
        .bind(names)
    )
    pools = {p.name: _pool_deployment(p, board, args) for p in profiles}
    config = ingress_config(args, profiles)
    return (
        cast(Deployment, Ingress)
        .options(
            ray_actor_options={"num_cpus": 0},
            max_ongoing_requests=1024,
            # past this many requests waiting for an ingress replica, Serve answers 503 at once
            # rather than queueing without bound behind slow clients
            max_queued_requests=INGRESS_MAX_QUEUED,
            graceful_shutdown_timeout_s=args.graceful_shutdown_timeout_s,
        )
        .bind(config, pools, board)
    )
