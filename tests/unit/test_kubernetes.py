"""deploy/kubernetes/: each kustomization, built here as kustomize would (resources, the overlays' image and JSON
patches, the common labels), validates against the Kubernetes API's schemas (kubernetes-validate, offline: no
cluster here), and every command, variable, path, port and metric it names exists in Blink."""

from __future__ import annotations

import copy
from pathlib import Path

import jsonpatch
import kubernetes_validate
import pytest
import yaml
from prometheus_client import generate_latest

from blink.ingress.guard import OPEN_PATHS
from blink.ingress.metrics import Metrics
from blink.services.cli import main as blink_main
from blink.shared.settings import Settings
from tests.support.environment import EXTRA_VARIABLES

KUBERNETES = Path(__file__).resolve().parents[2] / "deploy" / "kubernetes"
KUSTOMIZATIONS = ("base", "cpu", "autoscaling")
VERSIONS = ("1.29.0", kubernetes_validate.latest_version())  # the oldest Kubernetes still widely run, the newest


def build(name: str) -> list[dict]:
    """The resources `kubectl apply -k deploy/kubernetes/NAME` would apply (the parts of kustomize Blink uses)."""
    directory = KUBERNETES / name
    kustomization = yaml.safe_load((directory / "kustomization.yaml").read_text())
    resources: list[dict] = []
    for entry in kustomization.get("resources", []):
        path = (directory / entry).resolve()
        if path.is_dir():
            resources += build(str(path.relative_to(KUBERNETES)))
        else:
            resources += [r for r in yaml.safe_load_all(path.read_text()) if r]
    for image in kustomization.get("images", []):
        for container in _containers(resources):
            if container["image"].split(":")[0] == image["name"].split(":")[0] and container["image"] == image["name"]:
                container["image"] = f"{image.get('newName', image['name'].split(':')[0])}:{image['newTag']}"
    for patch in kustomization.get("patches", []):
        target = patch["target"]
        for i, resource in enumerate(resources):
            if resource["kind"] == target["kind"] and resource["metadata"]["name"] == target["name"]:
                resources[i] = jsonpatch.apply_patch(resource, yaml.safe_load(patch["patch"]))
    for labels in kustomization.get("labels", []):
        for resource in resources:
            _label(resource, labels["pairs"], labels.get("includeSelectors", False))
    return resources


def _label(resource: dict, pairs: dict, selectors: bool) -> None:
    resource["metadata"].setdefault("labels", {}).update(pairs)
    if not selectors:
        return
    spec = resource.get("spec", {})
    if resource["kind"] == "Service":
        spec.setdefault("selector", {}).update(pairs)
    elif "selector" in spec:
        spec["selector"].setdefault("matchLabels", {}).update(pairs)
    if "template" in spec:
        spec["template"]["metadata"].setdefault("labels", {}).update(pairs)


def _containers(resources: list[dict]) -> list[dict]:
    return [c for r in resources if r["kind"] == "Deployment" for c in r["spec"]["template"]["spec"]["containers"]]


def _one(resources: list[dict], kind: str) -> dict:
    (found,) = [r for r in resources if r["kind"] == kind]
    return found


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_valid_against_the_kubernetes_api(name, version):
    for resource in build(name):
        kubernetes_validate.validate(copy.deepcopy(resource), version, strict=True)


def test_the_pod_shares_what_the_services_share():
    """As compose/: one IPC namespace with the slot table in memory-backed /dev/shm, one pid namespace (the
    watchdog kills a stalled service by pid), the runtime directory, the key from a Secret."""
    deployment = _one(build("base"), "Deployment")
    pod = deployment["spec"]["template"]["spec"]
    assert pod["shareProcessNamespace"] is True
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert volumes["shm"]["emptyDir"]["medium"] == "Memory"
    assert volumes["keys"]["secret"]["secretName"] == "blink-keys"
    settings = _one(build("base"), "ConfigMap")["data"]
    key_mount = next(m["mountPath"] for m in pod["containers"][0]["volumeMounts"] if m["name"] == "keys")
    assert settings["BLINK_CONTROL_KEY_FILE"] == f"{key_mount}/{volumes['keys']['secret']['items'][0]['path']}"
    for container in pod["containers"]:
        mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
        assert mounts == {"runtime": settings["BLINK_RUNTIME_DIR"], "shm": "/dev/shm", "cache":
                          settings["BLINK_CACHE_DIR"], "models": "/models", "keys": "/etc/blink"}, container["name"]
    assert settings["BLINK_MODEL"].startswith("/models/")
    engine = pod["containers"][0]
    assert engine["name"] == "engine" and engine["resources"]["limits"]["nvidia.com/gpu"] == 1
    assert pod["terminationGracePeriodSeconds"] > int(pod["containers"][1]["env"][2]["value"])  # the drain fits


def test_readiness_tells_the_load_balancer_the_truth():
    resources = build("base")
    pod = _one(resources, "Deployment")["spec"]["template"]
    ingress = next(c for c in pod["spec"]["containers"] if c["name"] == "ingress")
    assert ingress["readinessProbe"]["httpGet"]["path"] == "/ready"
    assert ingress["livenessProbe"]["httpGet"]["path"] == "/health"
    assert {ingress["readinessProbe"]["httpGet"]["path"], ingress["livenessProbe"]["httpGet"]["path"]} <= OPEN_PATHS
    service = _one(resources, "Service")
    assert service["spec"]["ports"][0]["targetPort"] == ingress["ports"][0]["name"]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    env = {e["name"]: e for e in ingress["env"]}
    assert env["BLINK_PORT"]["value"] == str(ingress["ports"][0]["containerPort"])
    assert env["BLINK_API_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "blink-keys"


def test_every_command_and_variable_exists(capsys):
    settings = {f"BLINK_{name.upper()}" for name in Settings.model_fields} | EXTRA_VARIABLES
    for name in KUSTOMIZATIONS:
        resources = build(name)
        for variable in _one(resources, "ConfigMap")["data"]:
            assert variable in settings, f"{name}: the ConfigMap sets {variable}, which Blink does not read"
        for container in _containers(resources):
            for variable in container.get("env", []):
                assert variable["name"] in settings, f"{name}: {container['name']} sets {variable['name']}"
            commands = [container["command"]] + [probe["exec"]["command"] for probe in
                                                 (container.get(p) for p in ("startupProbe", "livenessProbe"))
                                                 if probe and "exec" in probe]
            for command in commands:
                assert command[0] == "blink"
                with pytest.raises(SystemExit) as exit_:  # each subcommand's --help exits 0
                    blink_main([*command[1:], "--help"])
                assert exit_.value.code == 0, f"{name}: {command}"
    capsys.readouterr()


def test_the_cpu_overlay_asks_for_no_gpu():
    resources = build("cpu")
    assert _one(resources, "ConfigMap")["data"]["BLINK_DEVICE"] == "cpu"
    for container in _containers(resources):
        assert container["image"] == "blink:cpu"
        assert "nvidia.com/gpu" not in str(container["resources"])


def test_the_autoscaler_scales_on_the_queue_the_ingress_exports():
    hpa = _one(build("autoscaling"), "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["name"] == _one(build("base"), "Deployment")["metadata"]["name"]
    rule = yaml.safe_load((KUBERNETES / "autoscaling" / "prometheus-adapter-rules.yaml").read_text())
    (custom,) = rule["rules"]["custom"]
    assert hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == custom["name"]["as"]
    series = custom["seriesQuery"].split("{")[0]
    metrics = Metrics("m", "host", "shm")
    metrics.waiting.labels(model_name="m").set(3)
    assert f'{series}{{model_name="m"}} 3.0' in generate_latest(metrics.registry).decode()
