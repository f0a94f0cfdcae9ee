import pytest
import ray
import ray.exceptions
from ray import serve

from serve_app import cli


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
