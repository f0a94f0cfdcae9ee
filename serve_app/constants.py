"""Defaults shared across the package, in one place."""

from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
# A source checkout keeps profiles beside the package; an installed copy is told where they are.
DEFAULT_PROFILES_DIR = PACKAGE_DIR.parent / "profiles"
PROFILES_DIR_ENV = "SERVE_APP_PROFILES_DIR"
CACHE_DIR_ENV = "SERVE_APP_CACHE_DIR"
DEFAULT_CACHE_DIR = Path.home() / ".cache" / "serve_app"
PLATFORM_ENV = "SERVE_APP_PLATFORM"

BUILTIN_PREFIX = "builtin:"

# Engine start-up on 2 CPU cores takes ~30 s; a cold full-size model on a GPU ~60 s.
ENGINE_START_TIMEOUT_S = 600.0
# Replicas publish their engine stats this often; the ingress reads the board as often.
STATS_PERIOD_S = 0.25
# A replica that has not reported for this long is treated as gone.
STATS_STALE_AFTER_S = 3.0
READY_RETRY_AFTER_S = 5

DEFAULT_MAX_TOKENS = 256
# Calls a pool replica takes beyond its max_ongoing_requests: the ingress replicas' stream
# channels (serve_config.yaml's ingress scales to 2 replicas)
CHANNEL_SLOTS = 2
