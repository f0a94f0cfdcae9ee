"""Bad profiles fail `serve deploy` with a clear message, and leave the running app alone."""

from __future__ import annotations

import copy
import time
from pathlib import Path

import httpx
import pytest

from serve_app.cli import serve_deploy
from tests.integration.conftest import AppServer, app_statuses, redeploy

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

BAD_PROFILES = {
    "tiny-blocks": "engine: {block_size: 8, max_model_len: 2048, kv_cache_memory_bytes: 268435456}",
    "paged-off": (
        "engine: {max_model_len: 2048, kv_cache_memory_bytes: 268435456, enable_paged_attn: false}"
    ),
}
EXPECTED = {
    "tiny-blocks": "block_size 8 is not supported: vLLM's attention on cpu needs a multiple of 32",
    "paged-off": "paged KV cache (PagedAttention) is always on in vLLM",
}


def test_bad_profiles_fail_the_deploy(app_server: AppServer, tmp_path: Path) -> None:
    for name, body in BAD_PROFILES.items():
        (tmp_path / f"{name}.yaml").write_text(f"model: builtin:ernie-4.5-tiny\n{body}\n")
    config = copy.deepcopy(app_server.config)
    good = config["applications"][0]
    for name in BAD_PROFILES:
        config["applications"].append(
            {
                "name": f"bad-{name}",
                "route_prefix": f"/bad-{name}",
                "import_path": good["import_path"],
                "args": {"profiles": [name], "profiles_dir": str(tmp_path)},
            }
        )
    serve_deploy(config, app_server.dashboard_url)
    try:
        deadline = time.monotonic() + 120
        apps = app_statuses(app_server.dashboard_url)
        wanted = [f"bad-{n}" for n in BAD_PROFILES]
        while time.monotonic() < deadline and any(
            apps.get(a, {}).get("status") != "DEPLOY_FAILED" for a in wanted
        ):
            time.sleep(1)
            apps = app_statuses(app_server.dashboard_url)
        for name, expected in EXPECTED.items():
            app = apps[f"bad-{name}"]
            assert app["status"] == "DEPLOY_FAILED"
            assert expected in app["message"]
            assert name in app["message"]  # the file or profile at fault is named
        # the good app kept serving throughout
        assert apps["llm"]["status"] == "RUNNING"
        r = httpx.post(f"{app_server.url}/v1/completions", json={"prompt": "hi", "max_tokens": 2})
        assert r.status_code == 200
    finally:
        redeploy(app_server, app_server.config)
