from pathlib import Path

import pytest
import yaml

from serve_app.app import build_app, resolve_profiles
from serve_app.config import AppArgs
from serve_app.engine.fake import FakeEngine
from serve_app.engine.replica import vllm_engine
from serve_app.profiles import Platform, ProfileError

ROOT = Path(__file__).resolve().parents[2]


def shipped_args() -> dict[str, object]:
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    args: dict[str, object] = config["applications"][0]["args"]
    return args


def test_serve_config_is_valid_for_serve() -> None:
    from ray.serve.schema import ServeDeploySchema

    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    schema = ServeDeploySchema.model_validate(config)
    assert schema.applications[0].import_path == "serve_app.app:build_app"
    assert schema.http_options.host == "127.0.0.1"


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_shipped_config_builds(platform: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SERVE_APP_PLATFORM", platform)
    app = build_app(shipped_args())
    assert app is not None


@pytest.mark.parametrize(("engine", "factory"), [("vllm", vllm_engine), ("fake", FakeEngine)])
def test_the_engine_is_chosen_by_config(engine: str, factory: object) -> None:
    app = build_app({**shipped_args(), "engine": engine})
    ingress = app._bound_deployment
    config, pools, _ = ingress.init_args
    assert config.engine == engine
    for pool in pools.values():
        assert pool._bound_deployment.init_args[2] is factory


def test_bad_block_size_fails_the_build(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SERVE_APP_PLATFORM", "cuda")
    (tmp_path / "tiny-blocks.yaml").write_text(
        "model: builtin:ernie-4.5-tiny\nengine: {block_size: 8, max_model_len: 2048}\n"
    )
    with pytest.raises(ProfileError, match="block_size 8 is not supported"):
        build_app({"profiles": ["tiny-blocks"], "profiles_dir": str(tmp_path)})


def test_args_reject_unknown_keys() -> None:
    with pytest.raises(ProfileError, match="serve_config args: profile: unknown key"):
        build_app({"profiles": ["low-latency"], "profile": "x"})


def test_pools_must_serve_one_model(tmp_path: Path) -> None:
    for name, model in (("a", "builtin:ernie-4.5-tiny"), ("b", "other/model")):
        (tmp_path / f"{name}.yaml").write_text(f"model: {model}\nengine: {{max_model_len: 2048}}\n")
    args = AppArgs(profiles=["a", "b"], profiles_dir=str(tmp_path))
    with pytest.raises(ProfileError, match="same model"):
        resolve_profiles(args, Platform.CUDA)


def test_routing_priors_must_name_pools() -> None:
    args = AppArgs.model_validate(
        {"profiles": ["low-latency"], "routing": {"priors": {"nope": {}}}}
    )
    with pytest.raises(ProfileError, match="unknown pools"):
        resolve_profiles(args, Platform.CPU)


def test_routing_colocated_must_name_pools() -> None:
    args = AppArgs.model_validate(
        {"profiles": ["low-latency"], "routing": {"colocated": [["low-latency", "nope"]]}}
    )
    with pytest.raises(ProfileError, match=r"colocated names unknown pools: \['nope'\]"):
        resolve_profiles(args, Platform.CPU)
