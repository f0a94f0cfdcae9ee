"""Direct dispatch, the default: the shared app's ingress writes requests to the pool replicas
over kept Unix sockets. Streams come back whole, a client that leaves aborts its request in the
engine, and errors keep their status. (Its drain at a stop: test_reliability's redeploy with a
stream in flight; the Serve path with it off: test_cli.)"""

from __future__ import annotations

import contextlib

import psutil
import pytest

from tests.integration.conftest import AppServer, reached_directly, stream_then_leave

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def direct_sockets(processes: list[psutil.Process]) -> dict[int, list[str]]:
    """The direct-dispatch sockets each process holds: a listening replica holds its socket's
    path once, and once more per connection it accepted (Linux names no peer of a Unix
    socket, so the ingress's end shows no path)."""
    held: dict[int, list[str]] = {}
    for p in processes:
        with contextlib.suppress(psutil.Error):
            paths = [str(c.laddr) for c in p.net_connections(kind="unix")]
            found = [x for x in paths if "serve-app-direct-" in x]
            if found:
                held[p.pid] = found
    return held


def test_requests_go_over_the_socket_and_behave_as_over_serve(app_server: AppServer) -> None:
    with app_server.client() as c:
        body = {"prompt": "Tell me about Ray.", "max_tokens": 12, "ignore_eos": True}
        replicas = reached_directly(c)
        assert replicas and all(r["direct_dispatch"] for r in replicas), replicas
        # every pool replica listening, with (at least) this ingress's connection: this
        # process's ray.init() started the app's Ray, so its processes are our descendants
        held = direct_sockets(psutil.Process().children(recursive=True))
        assert len(held) == len(replicas) and all(len(p) >= 2 for p in held.values()), held
        # a whole stream, as over Serve: every token, then [DONE]
        with c.stream("POST", "/v1/completions", json=body | {"stream": True}) as r:
            assert r.status_code == 200
            events = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "data: [DONE]" and len(events) == 12 + 1, events
        # the engine's refusal keeps its status and names the parameter
        r = c.post("/v1/completions", json=body | {"max_tokens": 10**6})
        assert r.status_code == 400 and "max_tokens" in r.text, r.text
        # a client that leaves mid-stream aborts its request in the engine
        long = body | {"max_tokens": 1500, "stream": True}
        running, state = stream_then_leave(c, long)
        assert running == 1 and state["running"] == 0 and state["waiting"] == 0, state
        assert c.post("/v1/completions", json=body).status_code == 200  # still serving
