"""deploy/kubernetes, checked offline: both overlays render (tests/deploy/kustomize.py, compared with
``kubectl kustomize`` where it is installed), every object validates against Kubernetes' own schemas
(kubernetes-validate's bundled, strict: unknown fields are errors), the KEDA ScaledObjects against the fields of
KEDA's CRD that they use, and the parts agree with each other and with the repository: references resolve,
images are ones docker-compose.yml builds from docker/, commands and options are nnqueue's, environment variables
are settings nnqueue reads, a worker's GPUs equal its tensor parallelism and its kill grace outlasts its drain."""

from __future__ import annotations

import copy
import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import typer.main
import yaml
from pydantic import BaseModel

from nnqueue.cli import app
from nnqueue.settings import Settings
from tests.deploy.kustomize import containers, render

ROOT = Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
OVERLAYS = ["cpu", "gpu"]
# The oldest Kubernetes release still supported upstream when this was written, and the newest bundled.
VERSIONS = ["1.32.0", kubernetes_validate.latest_version()]
# Variables only the worker's command line reads (through Kubernetes' $(VAR) expansion), not nnqueue's settings.
WORKER_ARGUMENTS = {"NNQUEUE_MODEL", "NNQUEUE_MODEL_KEY", "NNQUEUE_TENSOR_PARALLEL_SIZE", "NNQUEUE_MAX_CONCURRENT_JOBS"}
# The fields of KEDA's ScaledObject (keda.sh/v1alpha1, its CRD's openAPIV3Schema) that the manifests use; anything
# else is refused, so that a typo cannot pass as an unknown field KEDA would drop.
SCALED_OBJECT = {
    "type": "object",
    "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False,
    "properties": {
        "apiVersion": {"const": "keda.sh/v1alpha1"},
        "kind": {"const": "ScaledObject"},
        "metadata": {"type": "object", "required": ["name", "namespace"]},
        "spec": {
            "type": "object",
            "required": ["scaleTargetRef", "triggers"],
            "additionalProperties": False,
            "properties": {
                "scaleTargetRef": {
                    "type": "object",
                    "required": ["name"],
                    "additionalProperties": False,
                    "properties": {
                        "apiVersion": {"type": "string"},
                        "kind": {"type": "string"},
                        "name": {"type": "string"},
                    },
                },
                "minReplicaCount": {"type": "integer", "minimum": 0},
                "maxReplicaCount": {"type": "integer", "minimum": 1},
                "idleReplicaCount": {"type": "integer", "minimum": 0},
                "pollingInterval": {"type": "integer", "minimum": 1},
                "cooldownPeriod": {"type": "integer", "minimum": 0},
                "advanced": {
                    "type": "object",
                    "additionalProperties": False,
                    "properties": {
                        "restoreToOriginalReplicaCount": {"type": "boolean"},
                        "horizontalPodAutoscalerConfig": {
                            "type": "object",
                            "additionalProperties": False,
                            "properties": {"name": {"type": "string"}, "behavior": {"type": "object"}},
                        },
                    },
                },
                "triggers": {
                    "type": "array",
                    "minItems": 1,
                    "items": {
                        "type": "object",
                        "required": ["type", "metadata"],
                        "additionalProperties": False,
                        "properties": {
                            "type": {"const": "prometheus"},
                            "name": {"type": "string"},
                            "metricType": {"enum": ["AverageValue", "Value", "Utilization"]},
                            # The CRD: a map of strings. The Prometheus scaler's keys (keda.sh/docs, scalers/prometheus).
                            "metadata": {
                                "type": "object",
                                "required": ["serverAddress", "query", "threshold"],
                                "additionalProperties": False,
                                "properties": {
                                    key: {"type": "string"}
                                    for key in ("serverAddress", "query", "threshold", "activationThreshold")
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


@pytest.fixture(scope="module", params=OVERLAYS)
def rendered(request: pytest.FixtureRequest) -> list[dict[str, Any]]:
    return render(KUBERNETES / "overlays" / request.param)


def find(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> list[dict[str, Any]]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def one(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    found = find(objects, kind, name)
    assert len(found) == 1, f"{len(found)} {kind} named {name}"
    return found[0]


def environment(objects: list[dict[str, Any]], container: dict[str, Any]) -> dict[str, str]:
    """A container's environment: its envFrom ConfigMaps' and Secrets' keys, then its env."""
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(one(objects, "ConfigMap", source["configMapRef"]["name"])["data"])
        else:
            env.update(one(objects, "Secret", source["secretRef"]["name"])["stringData"])
    env.update({item["name"]: item["value"] for item in container.get("env", [])})
    return env


def workers(objects: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        o for o in find(objects, "Deployment") if o["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"
    ]


@pytest.mark.skipif(
    shutil.which("kubectl") is None, reason="kubectl is not installed: the renderer is compared where it is"
)
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_renderer_renders_what_kubectl_kustomize_does(overlay: str) -> None:
    printed = subprocess.run(
        ["kubectl", "kustomize", str(KUBERNETES / "overlays" / overlay)], capture_output=True, text=True, check=True
    ).stdout
    key = lambda o: (o["kind"], o["metadata"]["name"])  # noqa: E731
    assert sorted(yaml.safe_load_all(printed), key=key) == sorted(render(KUBERNETES / "overlays" / overlay), key=key)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_object_validates_against_the_kubernetes_schemas(rendered: list[dict[str, Any]], version: str) -> None:
    kinds = set()
    for obj in rendered:
        if obj["kind"] == "ScaledObject":
            continue  # a CRD's: checked below
        kubernetes_validate.validate(obj, version, strict=True)
        kinds.add(obj["kind"])
    expected = {
        "Namespace",
        "ConfigMap",
        "Secret",
        "Job",
        "Deployment",
        "Service",
        "PodDisruptionBudget",
        "NetworkPolicy",
    }
    assert expected <= kinds


def test_the_schemas_refuse_a_wrong_field_and_a_wrong_type(rendered: list[dict[str, Any]]) -> None:
    worker = copy.deepcopy(workers(rendered)[0])
    worker["spec"]["template"]["spec"]["terminationGracePeriod"] = 720  # misspelt
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(worker, VERSIONS[0], strict=True)
    worker = copy.deepcopy(workers(rendered)[0])
    worker["spec"]["replicas"] = "two"
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(worker, VERSIONS[0], strict=True)


def test_each_worker_is_scaled_by_keda_on_its_own_models_queue(rendered: list[dict[str, Any]]) -> None:
    scaled = find(rendered, "ScaledObject")
    assert len(scaled) == len(workers(rendered)) >= 1
    for obj in scaled:
        jsonschema.validate(obj, SCALED_OBJECT)
        target = one(
            rendered, obj["spec"]["scaleTargetRef"].get("kind", "Deployment"), obj["spec"]["scaleTargetRef"]["name"]
        )
        key = worker_settings(rendered, target)["NNQUEUE_MODEL_KEY"]
        queries = [trigger["metadata"]["query"] for trigger in obj["spec"]["triggers"]]
        metrics = {name for query in queries for name in re.findall(r"(nnqueue_\w+)\{", query)}
        assert metrics == {
            "nnqueue_queue_depth",
            "nnqueue_jobs_running",
            "nnqueue_queue_oldest_age_seconds",
            "nnqueue_harvest_chunks_queued",
            "nnqueue_harvest_chunks_running",
        }
        for query in queries:  # every series is the worker's model's
            assert re.findall(r"\{([^}]*)\}", query) and set(re.findall(r"\{([^}]*)\}", query)) == {f'model="{key}"'}
        for trigger in obj["spec"]["triggers"]:
            assert float(trigger["metadata"]["threshold"]) > 0
        assert obj["spec"]["minReplicaCount"] <= obj["spec"]["maxReplicaCount"]
        if obj["spec"]["minReplicaCount"] == 0:  # the API must queue the model's jobs while no worker runs
            api = one(rendered, "Deployment", "nnqueue-api")
            assert key in json.loads(worker_settings(rendered, api)["NNQUEUE_SCALE_TO_ZERO_MODELS"])


def test_the_gauges_keda_reads_are_the_ones_the_api_exports() -> None:
    source = (ROOT / "nnqueue" / "api" / "routers" / "metrics.py").read_text()
    for name in ("nnqueue_queue_depth", "nnqueue_jobs_running", "nnqueue_queue_oldest_age_seconds"):
        assert f'"{name}"' in source
    assert 'labels=["model"]' in source


def test_references_and_selectors_resolve(rendered: list[dict[str, Any]]) -> None:
    pods = {
        (o["kind"], o["metadata"]["name"]): o["spec"]["template"]["metadata"]["labels"]
        for o in rendered
        if o["kind"] in ("Deployment", "Job")
    }
    for obj in find(rendered, "Deployment"):
        assert obj["spec"]["selector"]["matchLabels"].items() <= pods[("Deployment", obj["metadata"]["name"])].items()
    for obj in [*find(rendered, "Service"), *find(rendered, "PodDisruptionBudget"), *find(rendered, "NetworkPolicy")]:
        selector = obj["spec"].get("selector") or obj["spec"]["podSelector"]
        assert any(_selects(selector, labels) for labels in pods.values()), f"{obj['metadata']['name']} selects no pod"
    for obj in find(rendered, "NetworkPolicy"):
        assert {name for name, labels in pods.items() if _selects(obj["spec"]["podSelector"], labels)} == {
            ("Deployment", w["metadata"]["name"]) for w in workers(rendered)
        }
    for obj in rendered:
        for container in containers(obj):
            environment(rendered, container)  # every ConfigMap and Secret it names exists
        for volume in obj.get("spec", {}).get("template", {}).get("spec", {}).get("volumes", []):
            if "persistentVolumeClaim" in volume:
                one(rendered, "PersistentVolumeClaim", volume["persistentVolumeClaim"]["claimName"])
    assert {o["metadata"].get("namespace") for o in rendered if o["kind"] != "Namespace"} == {"nnqueue"}


def _selects(selector: dict[str, Any], labels: dict[str, str]) -> bool:
    """A Service's plain selector or a ``matchLabels`` one (the manifests use no ``matchExpressions``)."""
    assert "matchExpressions" not in selector
    return selector.get("matchLabels", selector).items() <= labels.items()


def test_worker_network_policy_allows_only_the_datastores_and_dns(rendered: list[dict[str, Any]]) -> None:
    (policy,) = find(rendered, "NetworkPolicy")
    assert set(policy["spec"]["policyTypes"]) == {"Ingress", "Egress"}
    ports = sorted(port["port"] for rule in policy["spec"]["egress"] for port in rule["ports"])
    assert ports == [53, 53, 5432, 6379, 9000]
    for rule in policy["spec"]["egress"]:
        assert rule["to"], "an egress rule without destinations would allow any address"
        assert all("ipBlock" not in peer for peer in rule["to"])
    assert [port["port"] for rule in policy["spec"]["ingress"] for port in rule["ports"]] == [9100]


def test_images_are_the_ones_docker_compose_builds_from_docker() -> None:
    builds = compose_builds()
    for overlay in OVERLAYS:
        for obj in render(KUBERNETES / "overlays" / overlay):
            for container in containers(obj):
                name = container["image"].rsplit(":", 1)[0]
                assert name in builds, f"{overlay}: {obj['metadata']['name']} runs {name}, which docker/ does not build"
                dockerfile, target = builds[name]
                text = (ROOT / dockerfile).read_text()
                assert target is None or re.search(rf"^FROM \S+ AS {target}$", text, re.M)
                worker = obj["metadata"]["labels"].get("app.kubernetes.io/component") == "worker"
                assert worker == (target != "service"), f"{name} is the wrong build for {obj['metadata']['name']}"


def compose_builds() -> dict[str, tuple[str, str | None]]:
    """Image name (defaults filled in) to (Dockerfile, target) for every image docker-compose.yml builds."""
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    builds = {}
    for service in [*compose["services"].values(), compose["x-service-image"]]:
        if "build" in service:
            image = re.sub(r"\$\{[^:}]+:-([^}]*)\}", r"\1", service["image"]).rsplit(":", 1)[0]
            builds[image] = (service["build"]["dockerfile"], service["build"].get("target"))
    return builds


def test_commands_options_and_environment_are_nnqueues(rendered: list[dict[str, Any]]) -> None:
    cli = typer.main.get_command(app)
    for obj in rendered:
        for container in containers(obj):
            words = [*container["command"], *container.get("args", [])]
            assert words[0] == "nnqueue"
            command = cli
            rest = words[1:]
            while hasattr(command, "commands"):
                command, rest = command.commands[rest[0]], rest[1:]
            options = {opt for param in command.params for opt in param.opts}
            for word in rest:
                if word.startswith("--"):
                    assert word.split("=")[0] in options, f"{obj['metadata']['name']}: nnqueue has no {word}"
            env = environment(rendered, container)
            for variable in re.findall(r"\$\((\w+)\)", " ".join(words)):
                assert variable in env, f"{obj['metadata']['name']}: $({variable}) is not in its environment"
            for variable in env:
                if variable.startswith("NNQUEUE_") and variable not in WORKER_ARGUMENTS:
                    assert is_setting(variable), f"nnqueue reads no {variable}"


def is_setting(variable: str) -> bool:
    model: type[BaseModel] = Settings
    parts = variable.removeprefix("NNQUEUE_").lower().split("__")
    for depth, part in enumerate(parts):
        field = model.model_fields.get(part)
        if field is None:
            return False
        if depth < len(parts) - 1:
            inner = [arg for arg in getattr(field.annotation, "__args__", (field.annotation,)) if isinstance(arg, type)]
            nested = [arg for arg in inner if issubclass(arg, BaseModel)]
            if not nested:
                return False
            model = nested[0]
    return True


def test_settings_are_checked_for_real() -> None:
    assert is_setting("NNQUEUE_S3__SECRET_ACCESS_KEY") and is_setting("NNQUEUE_WORKER_DRAIN_S")
    assert not is_setting("NNQUEUE_S3__SECRET") and not is_setting("NNQUEUE_WORKER_DRAIN")


def worker_settings(rendered: list[dict[str, Any]], worker: dict[str, Any]) -> dict[str, str]:
    return environment(rendered, worker["spec"]["template"]["spec"]["containers"][0])


def test_a_workers_gpus_equal_its_tensor_parallelism_and_its_grace_outlasts_its_drain(
    rendered: list[dict[str, Any]],
) -> None:
    for worker in workers(rendered):
        pod = worker["spec"]["template"]["spec"]
        env = worker_settings(rendered, worker)
        resources = pod["containers"][0].get("resources", {})
        gpus = resources.get("limits", {}).get("nvidia.com/gpu")
        if gpus is not None:
            assert int(env["NNQUEUE_TENSOR_PARALLEL_SIZE"]) == gpus == resources["requests"]["nvidia.com/gpu"]
        else:
            assert env["NNQUEUE_TENSOR_PARALLEL_SIZE"] == "1"
        # The drain, then the engine's shutdown (a minute is generous), before the kubelet's SIGKILL.
        assert pod["terminationGracePeriodSeconds"] >= float(env["NNQUEUE_WORKER_DRAIN_S"]) + 60
        assert pod["containers"][0]["command"] == ["nnqueue", "worker"]  # supervised: SIGTERM is passed on
    gpu = render(KUBERNETES / "overlays" / "gpu")
    assert all(
        "nvidia.com/gpu" in w["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"] for w in workers(gpu)
    )


def test_the_secrets_hold_only_placeholders(rendered: list[dict[str, Any]]) -> None:
    for secret in find(rendered, "Secret"):
        for key, value in secret["stringData"].items():
            assert value == "" or "CHANGE-ME" in value, f"{key} holds what looks like a real credential"
