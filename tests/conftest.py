import os

# Before anything imports ray: a local Ray node must bind to loopback (see serve_app.cli).
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
