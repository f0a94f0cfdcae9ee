"""Provisioning against a local stand-in for Grafana's HTTP API (no Grafana installable here)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from serve_app.observability.dashboard import DASHBOARD_UID
from serve_app.observability.provision import ProvisioningError, provision

TOKEN = "glsa_test_token"


@dataclass
class FakeGrafana:
    folders: dict[str, dict[str, Any]] = field(default_factory=dict)
    dashboards: dict[str, dict[str, Any]] = field(default_factory=dict)
    auth_headers: list[str | None] = field(default_factory=list)
    fail_with: int | None = None
    folder_posts: int = 0


def make_handler(state: FakeGrafana) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

        def _reply(self, status: int, body: Any) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _authorized(self) -> bool:
            header = self.headers.get("Authorization")
            state.auth_headers.append(header)
            if state.fail_with:
                self._reply(state.fail_with, {"message": "nope"})
                return False
            if header != f"Bearer {TOKEN}":
                self._reply(401, {"message": "Unauthorized"})
                return False
            return True

        def do_GET(self) -> None:
            if not self._authorized():
                return
            if self.path.startswith("/api/folders"):
                self._reply(200, list(state.folders.values()))
            else:
                self._reply(404, {"message": "not found"})

        def do_POST(self) -> None:
            if not self._authorized():
                return
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            if self.path == "/api/folders":
                state.folder_posts += 1
                if body["uid"] in state.folders:
                    self._reply(409, {"message": "folder exists"})
                    return
                state.folders[body["uid"]] = {"uid": body["uid"], "title": body["title"]}
                self._reply(200, state.folders[body["uid"]])
            elif self.path == "/api/dashboards/db":
                dash = body["dashboard"]
                if not body.get("overwrite") and dash["uid"] in state.dashboards:
                    self._reply(412, {"message": "exists"})
                    return
                if body["folderUid"] not in state.folders:
                    self._reply(400, {"message": "folder not found"})
                    return
                state.dashboards[dash["uid"]] = body
                self._reply(
                    200, {"uid": dash["uid"], "url": f"/d/{dash['uid']}", "status": "success"}
                )
            else:
                self._reply(404, {"message": "not found"})

    return Handler


@pytest.fixture
def grafana() -> Iterator[tuple[str, FakeGrafana]]:
    state = FakeGrafana()
    server = ThreadingHTTPServer(("127.0.0.1", 0), make_handler(state))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", state
    finally:
        server.shutdown()
        server.server_close()


def test_provisioning_is_idempotent(grafana: tuple[str, FakeGrafana]) -> None:
    url, state = grafana
    env = {"GRAFANA_TOKEN": TOKEN}
    first = provision(url, "prom-uid", env)
    second = provision(url, "prom-uid", env)
    assert first == second
    assert first.dashboard_uid == DASHBOARD_UID and first.url == f"/d/{DASHBOARD_UID}"
    assert list(state.folders) == ["serve-app"] and state.folder_posts == 1
    assert list(state.dashboards) == [DASHBOARD_UID]
    stored = state.dashboards[DASHBOARD_UID]
    assert stored["folderUid"] == "serve-app" and stored["overwrite"] is True
    variable = stored["dashboard"]["templating"]["list"][0]
    assert variable["current"]["value"] == "prom-uid"
    panels = [p for p in stored["dashboard"]["panels"] if p["type"] != "row"]
    assert all(p["datasource"]["uid"] == "${datasource}" for p in panels)
    assert set(state.auth_headers) == {f"Bearer {TOKEN}"}


def test_basic_auth_is_sent(grafana: tuple[str, FakeGrafana]) -> None:
    url, state = grafana
    with pytest.raises(ProvisioningError):
        provision(url, "p", {"GRAFANA_USER": "admin", "GRAFANA_PASSWORD": "pw"})
    assert state.auth_headers[0] is not None and state.auth_headers[0].startswith("Basic ")


def test_unauthorized_is_a_clear_error(grafana: tuple[str, FakeGrafana]) -> None:
    url, _ = grafana
    with pytest.raises(ProvisioningError, match=r"401.*GRAFANA_TOKEN"):
        provision(url, "p", {"GRAFANA_TOKEN": "wrong"})


def test_server_error_is_a_clear_error(grafana: tuple[str, FakeGrafana]) -> None:
    url, state = grafana
    state.fail_with = 500
    with pytest.raises(ProvisioningError, match="Grafana failed: 500"):
        provision(url, "p", {"GRAFANA_TOKEN": TOKEN})


def test_unreachable_grafana_is_a_clear_error() -> None:
    with pytest.raises(ProvisioningError, match="cannot reach Grafana"):
        provision("http://127.0.0.1:9", "p", {"GRAFANA_TOKEN": TOKEN}, timeout_s=2)
