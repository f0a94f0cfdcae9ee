import tomllib
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
    """Serve's settings as `serve-app run` has them, HAProxy (through the loopback launcher the
    image installs, cluster/Dockerfile) the HTTP path."""
    from serve_app.cli import HAPROXY_ENV, SERVE_ENV
    from serve_app.haproxy_loopback import BINARY_ENV

    cluster = rayservice()["spec"]["rayClusterConfig"]
    groups = [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]
    dockerfile = (ROOT / "cluster" / "Dockerfile").read_text()
    for group in groups:
        env = {e["name"]: e["value"] for e in group["template"]["spec"]["containers"][0]["env"]}
        assert (SERVE_ENV | HAPROXY_ENV).items() <= env.items()
        assert env[BINARY_ENV].endswith("/serve-app-haproxy") and env[BINARY_ENV] in dockerfile
    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    script = pyproject["project"]["scripts"]["serve-app-haproxy"]
    assert script == "serve_app.haproxy_loopback:cli"
    launcher = yaml.safe_load((ROOT / "cluster" / "ray-cluster.yaml").read_text())
    starts = launcher["head_start_ray_commands"] + launcher["worker_start_ray_commands"]
    for start in [c for c in starts if "ray start" in c]:
        assert all(f"{k}={v}" in start for k, v in (SERVE_ENV | HAPROXY_ENV).items())
        assert f"{BINARY_ENV}=$(command -v serve-app-haproxy)" in start


def ray_pod_specs() -> list[dict[str, Any]]:
    cluster = rayservice()["spec"]["rayClusterConfig"]
    return [g["template"] for g in [cluster["headGroupSpec"], *cluster["workerGroupSpecs"]]]


def test_ray_token_authentication_is_on() -> None:
    assert rayservice()["spec"]["rayClusterConfig"]["authOptions"] == {"mode": "token"}
    launcher = yaml.safe_load((ROOT / "cluster" / "ray-cluster.yaml").read_text())
    starts = launcher["head_start_ray_commands"] + launcher["worker_start_ray_commands"]
    assert all("RAY_AUTH_MODE=token ray start" in c for c in starts if "ray start" in c)
    assert "~/.ray/auth_token" in launcher["file_mounts"]


def test_every_ray_pod_reads_the_api_keys_from_the_secret() -> None:
    keys_dir, keys_name = kuberay.CLUSTER_API_KEYS_FILE.rsplit("/", 1)
    for template in ray_pod_specs():
        spec = template["spec"]
        volumes = {v["name"]: v for v in spec["volumes"]}
        (mount,) = [
            m for m in spec["containers"][0]["volumeMounts"] if m["mountPath"] == keys_dir
        ]  # fmt: skip
        assert mount["readOnly"] is True
        assert volumes[mount["name"]]["secret"] == {"secretName": "serve-app-api-keys"}
    for app in kuberay.serve_config_v2(RAYSERVICE.read_text())["applications"]:
        assert app["args"]["auth"]["api_keys_file"] == kuberay.CLUSTER_API_KEYS_FILE
    # the README's command creates the Secret with that key
    assert f"--from-literal={keys_name}=" in (ROOT / "cluster" / "README.md").read_text()
    launcher = yaml.safe_load((ROOT / "cluster" / "ray-cluster.yaml").read_text())
    assert kuberay.CLUSTER_API_KEYS_FILE in launcher["file_mounts"]


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    assert set(selector) == {"matchLabels"}, selector  # the only form these files use
    return bool(selector["matchLabels"].items() <= labels.items())


def test_network_policy_admits_only_the_api_from_outside_the_ray_pods() -> None:
    policy = yaml.safe_load((ROOT / "cluster" / "networkpolicy.yaml").read_text())
    assert (policy["apiVersion"], policy["kind"]) == ("networking.k8s.io/v1", "NetworkPolicy")
    spec = policy["spec"]
    assert spec["policyTypes"] == ["Ingress"]
    pod_labels = [t["metadata"]["labels"] for t in ray_pod_specs()]
    assert all(_selects(spec["podSelector"], labels) for labels in pod_labels)
    open_ports: dict[int, list[str]] = {}
    for rule in spec["ingress"]:
        ports = [p["port"] for p in rule.get("ports", [])]
        sources = rule.get("from")
        if sources is None:  # from anywhere: only the API
            assert ports == [8000], rule
            continue
        for source in sources:
            pods_only = "namespaceSelector" not in source and "ipBlock" not in source
            if pods_only and all(_selects(source["podSelector"], lb) for lb in pod_labels):
                continue  # the Ray pods themselves: every port
            assert ports, f"a source outside the Ray pods reaches every port: {source}"
            who = source.get("podSelector", {}).get("matchLabels", source)
            for port in ports:
                open_ports.setdefault(port, []).append(str(who))
    # the control plane: the operator alone reaches the dashboard; GCS and client port nobody
    assert set(open_ports) == {8265, 52365, 8080}, open_ports
    assert open_ports[8265] == ["{'app.kubernetes.io/name': 'kuberay-operator'}"]


def test_manifests_pass_kubernetes_schemas() -> None:
    """The NetworkPolicy and each Ray pod template, checked strictly (unknown fields fail)
    against the Kubernetes API's own schemas, as `kubectl apply --dry-run` would."""
    import kubernetes_validate

    version = "1.31.0"  # the oldest Kubernetes KubeRay 1.5 supports
    policy = yaml.safe_load((ROOT / "cluster" / "networkpolicy.yaml").read_text())
    kubernetes_validate.validate(policy, version, strict=True)
    for template in ray_pod_specs():
        pod = {"apiVersion": "v1", "kind": "Pod", "metadata": template["metadata"]}
        kubernetes_validate.validate({**pod, "spec": template["spec"]}, version, strict=True)


def test_kubernetes_schema_check_catches_a_mistake() -> None:
    import kubernetes_validate

    policy = yaml.safe_load((ROOT / "cluster" / "networkpolicy.yaml").read_text())
    policy["spec"]["ingress"][1]["ports"][0]["port"] = [8000]  # not an int or a name
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(policy, "1.31.0", strict=True)
