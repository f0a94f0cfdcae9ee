import os
from pathlib import Path
from typing import Any

import pytest
import ray
import ray.exceptions
import yaml
from ray import serve

from serve_app import cli
from serve_app.constants import PLATFORM_ENV
from serve_app.engine import cpu_layout
from serve_app.profiles import Platform

ROOT = Path(__file__).resolve().parents[2]


def test_ray_stops_when_serve_controller_is_already_dying(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Ctrl-C right after `serve shutdown`: Ray still finds the dying controller by name and the
    call to it fails; the app must still stop Ray (it exited with 1 and left Ray to the reaper)."""
    stopped: list[str] = []

    def dying_controller() -> None:
        raise ray.exceptions.ActorDiedError()

    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(serve, "shutdown", dying_controller)
    monkeypatch.setattr(ray, "shutdown", lambda: stopped.append("ray"))
    cli.stop_serve_and_ray()
    assert stopped == ["ray"]
    assert "Serve was already stopping (ActorDiedError)" in capsys.readouterr().out


def test_nothing_to_stop_without_ray(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(serve, "shutdown", lambda: pytest.fail("Serve shut down without Ray"))
    cli.stop_serve_and_ray()


def shipped_config(profiles: list[str] | None = None) -> dict[str, Any]:
    config: dict[str, Any] = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    if profiles is not None:
        config["applications"][0]["args"]["profiles"] = profiles
    return config


@pytest.mark.parametrize("platform", list(Platform))
def test_the_engines_need_a_core_per_pool_replica_and_thread(platform: Platform) -> None:
    """On CPU a core per model thread (the shipped profiles' num_cpus 1), on a GPU one per
    engine core."""
    assert cli.engine_cpus(shipped_config(), platform) == 2  # low-latency and throughput
    assert cli.engine_cpus(shipped_config(["low-latency"]), platform) == 1


@pytest.fixture
def four_cores(monkeypatch: pytest.MonkeyPatch) -> list[set[int]]:
    """A CPU host of 4 cores; what this process's affinity was set to."""
    moved: list[set[int]] = []
    monkeypatch.setenv(PLATFORM_ENV, "cpu")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3})
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: moved.append(set(cpus)))
    for key in (cpu_layout.ENGINE_CPUS_ENV, cpu_layout.ENGINE_CPU_LOCKS_ENV):
        monkeypatch.delenv(key, raising=False)
    return moved


def test_the_app_moves_off_the_cores_it_reserves_for_its_engines(
    four_cores: list[set[int]],
) -> None:
    layout = cli.reserve_engine_cpus(shipped_config())
    assert layout == cpu_layout.Layout(serving=[0, 1], engines=[2, 3])
    assert four_cores == [{0, 1}]  # Ray, started next, inherits it
    assert os.environ[cpu_layout.ENGINE_CPUS_ENV] == "2,3"
    assert Path(os.environ[cpu_layout.ENGINE_CPU_LOCKS_ENV]).is_dir()


@pytest.mark.parametrize(("cores", "reserved"), [(16, [14, 15]), (10, [8, 9]), (9, None)])
def test_on_a_gpu_host_the_engine_cores_get_cores_where_the_app_keeps_four_per_engine(
    four_cores: list[set[int]], monkeypatch: pytest.MonkeyPatch, cores: int,
    reserved: list[int] | None,
) -> None:  # fmt: skip
    monkeypatch.setenv(PLATFORM_ENV, "cuda")
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)))
    layout = cli.reserve_engine_cpus(shipped_config())  # two pools: two engines
    assert (layout and layout.engines) == reserved
    assert four_cores == ([set(range(cores - 2))] if reserved else [])


@pytest.mark.parametrize("case", ["off", "no core left", "bad profile"])
def test_no_reservation(
    four_cores: list[set[int]], monkeypatch: pytest.MonkeyPatch, case: str
) -> None:
    config = shipped_config()
    if case == "off":
        monkeypatch.setenv(cpu_layout.ENGINE_CPUS_ENV, cpu_layout.OFF)
    elif case == "no core left":
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    else:  # `serve deploy` reports it
        config = shipped_config(["no-such-profile"])
    assert cli.reserve_engine_cpus(config) is None
    assert four_cores == []


@pytest.mark.parametrize("first", ["SIGTERM", "SIGINT"])
def test_sigterm_and_sigint_stop_alike_and_once(first: str) -> None:
    """Either signal unwinds to the shutdown; both are ignored while it runs."""
    import signal

    saved = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    try:
        cli._stop_on_signals()
        assert signal.getsignal(signal.SIGTERM) is signal.getsignal(signal.SIGINT)
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), getattr(signal, first))
        assert signal.getsignal(signal.SIGTERM) == signal.getsignal(signal.SIGINT) == signal.SIG_IGN
    finally:
        signal.signal(signal.SIGTERM, saved[0])
        signal.signal(signal.SIGINT, saved[1])
