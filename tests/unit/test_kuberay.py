from pathlib import Path
from typing import Any

import pytest
import yaml

from serve_app import kuberay

ROOT = Path(__file__).resolve().parents[2]
RAYSERVICE = ROOT / "cluster" / "rayservice.yaml"


def rayservice() -> dict[str, Any]:
    doc: dict[str, Any] = yaml.safe_load(RAYSERVICE.read_text())
    return doc


def test_rayservice_serve_config_matches_serve_config_yaml() -> None:
    current, wanted = kuberay.expected()
    assert current == wanted, "run `python -m serve_app.kuberay write`"


def test_check_fails_on_drift(tmp_path: Path) -> None:
    config = yaml.safe_load((ROOT / "serve_config.yaml").read_text())
    config["applications"][0]["args"]["default_max_tokens"] = 7
    changed = tmp_path / "serve_config.yaml"
    changed.write_text(yaml.safe_dump(config))
    copy = tmp_path / "rayservice.yaml"
    copy.write_text(RAYSERVICE.read_text())
    args = ["--rayservice", str(copy), "--serve-config", str(changed)]
    assert kuberay.main(["check", *args]) == 1
    assert kuberay.main(["write", *args]) == 0
    assert kuberay.main(["check", *args]) == 0
    assert (
        kuberay.serve_config_v2(copy.read_text())["applications"][0]["args"]["default_max_tokens"]
        == 7
    )
    # Only the block changed: the rest of the file (comments included) is as it was.
    before, after = RAYSERVICE.read_text().splitlines(), copy.read_text().splitlines()
    assert [x for x in before if x.startswith("#")] == [x for x in after if x.startswith("#")]
    assert before[-5:] == after[-5:]


def test_render_needs_exactly_one_block() -> None:
    with pytest.raises(ValueError, match="exactly one"):
        kuberay.render("spec:\n  other: 1\n", {})


def test_serve_config_v2_passes_serve_deploy_schema() -> None:
    from ray.serve.schema import ServeDeploySchema  # what `serve deploy` validates with

    schema = ServeDeploySchema.model_validate(kuberay.serve_config_v2(RAYSERVICE.read_text()))
    assert schema.http_options.host == "0.0.0.0"
    assert schema.proxy_location.value == "EveryNode"
    assert [a.import_path for a in schema.applications] == ["serve_app.app:build_app"]


def test_rayservice_structure() -> None:
    doc = rayservice()
    assert (doc["apiVersion"], doc["kind"]) == ("ray.io/v1", "RayService")
    cluster = doc["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    head = cluster["headGroupSpec"]
    assert head["rayStartParams"]["num-gpus"] == "0"
    head_container = head["template"]["spec"]["containers"][0]
    assert "nvidia.com/gpu" not in head_container["resources"]["limits"]
    (group,) = cluster["workerGroupSpecs"]
    assert group["minReplicas"] <= group["replicas"] <= group["maxReplicas"]
    worker = group["template"]["spec"]["containers"][0]
    gpus = group["rayStartParams"]["num-gpus"]
    # One engine replica per GPU: Ray offers exactly the GPUs Kubernetes gives the pod.
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == gpus
    assert worker["resources"]["requests"]["nvidia.com/gpu"] == gpus
    for container in (head_container, worker):
        assert {"readinessProbe", "livenessProbe"} <= set(container)
        assert container["image"] == head_container["image"]


def test_rayservice_ray_version_matches_the_pin() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    version = rayservice()["spec"]["rayClusterConfig"]["rayVersion"]
    assert f'"ray[serve]=={version}"' in pyproject
    assert f"rayproject/ray:{version}-" in (ROOT / "cluster" / "Dockerfile").read_text()


def test_ray_cluster_launcher_config_is_valid() -> None:
    # What `ray up` does before it touches a cloud: fill in defaults, then validate the schema.
    from ray.autoscaler._private.util import prepare_config, validate_config

    config = prepare_config(yaml.safe_load((ROOT / "cluster" / "ray-cluster.yaml").read_text()))
    validate_config(config)
    worker = config["available_node_types"]["gpu-worker"]
    assert worker["resources"]["GPU"] >= 1
    assert config["available_node_types"][config["head_node_type"]]["resources"]["GPU"] == 0


def test_export_prints_what_the_rayservice_carries(capsys: pytest.CaptureFixture[str]) -> None:
    assert kuberay.main(["export"]) == 0
    exported = yaml.safe_load(capsys.readouterr().out)
    assert exported == kuberay.serve_config_v2(RAYSERVICE.read_text())


def test_every_ray_container_runs_serve_in_the_apps_mode() -> None:
    from serve_app.cli import SERVE_ENV

    cluster = rayservice()["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    for group in groups:
        env = {e["name"]: e["value"] for e in group["template"]["spec"]["containers"][0]["env"]}
        assert SERVE_ENV.items() <= env.items()
