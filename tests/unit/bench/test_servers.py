import socket
from pathlib import Path

import pytest
import yaml

from serve_app.bench import servers
from serve_app.profiles import EngineArgs, EngineProfile, Platform

ROOT = Path(__file__).resolve().parents[3]


def test_vllm_serve_flags_carry_every_engine_argument() -> None:
    profile = EngineProfile(
        name="p",
        model="m",
        engine=EngineArgs(
            max_model_len=2048,
            block_size=32,
            enforce_eager=True,
            enable_prefix_caching=False,
            kv_cache_memory_bytes=1 << 28,
        ),
    ).resolve(Platform.CPU)
    flags = servers.vllm_serve_flags(profile)
    assert flags[flags.index("--max-model-len") + 1] == "2048"
    assert flags[flags.index("--block-size") + 1] == "32"
    assert "--enforce-eager" in flags and "--no-enable-prefix-caching" in flags
    assert flags[flags.index("--kv-cache-memory-bytes") + 1] == str(1 << 28)


def test_bench_profile_keeps_the_engine_and_opens_the_pool(tmp_path: Path) -> None:
    source = ROOT / "profiles" / "low-latency.yaml"
    written = yaml.safe_load(servers._bench_profile(source, tmp_path).read_text())
    original = yaml.safe_load(source.read_text())
    assert written["engine"] == original["engine"]
    assert written["platforms"] == original["platforms"]
    assert written["pool"]["max_replicas"] == 1
    assert written["pool"]["max_ongoing_requests"] >= 1024


def test_app_config_serves_one_pool_without_slo_refusals(tmp_path: Path) -> None:
    config = servers._app_config("low-latency", tmp_path, 9999)
    args = config["applications"][0]["args"]
    assert args["profiles"] == ["low-latency"] and args["profiles_dir"] == str(tmp_path)
    assert args["routing"]["default_class"] == "batch"
    assert set(args["routing"]["priors"]) == {"low-latency"}
    assert config["http_options"] == {**config["http_options"], "port": 9999}


def test_free_ports_are_distinct_and_outside_the_ephemeral_range() -> None:
    ports = servers.free_ports(8)
    assert len(set(ports)) == 8
    ephemeral = servers._ephemeral_ports()
    assert all(p in servers.LISTEN_PORTS and p not in ephemeral for p in ports), ports


def test_free_ports_skip_a_port_in_use(monkeypatch: pytest.MonkeyPatch) -> None:
    taken = servers.free_port()
    monkeypatch.setattr(servers, "LISTEN_PORTS", range(taken - 1, taken + 1))
    with socket.socket() as s:
        s.bind(("127.0.0.1", taken))
        s.listen()
        assert servers.free_ports(1) == [taken - 1]
        with pytest.raises(RuntimeError, match="fewer than 2 free ports"):
            servers.free_ports(2)


def test_an_interrupted_stop_leaves_no_server_unsignalled() -> None:
    """The app stops first and slowly; a second SIGTERM (or Ctrl-C) while waiting for it must not
    leave `vllm serve` running: every server is signalled before any is waited for."""
    import signal
    import subprocess
    import sys

    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    app, vllm = subprocess.Popen(sleeper), subprocess.Popen(sleeper)
    real_wait = app.wait

    def interrupted(timeout: float | None = None) -> int:
        raise SystemExit(143)  # the bench's SIGTERM handler, as the wait is interrupted

    app.wait = interrupted  # type: ignore[method-assign]
    try:
        with pytest.raises(SystemExit):
            servers.stop_processes([app, vllm])
        app.wait = real_wait  # type: ignore[method-assign]
        assert real_wait(timeout=10) == -signal.SIGTERM
        assert vllm.wait(timeout=10) == -signal.SIGTERM
    finally:
        for proc in (app, vllm):
            proc.kill()
            proc.wait()
