"""deploy/kubernetes, checked offline: both overlays render (tests/deploy/kustomize.py, compared with
``kubectl kustomize`` where it is installed), every object validates against Kubernetes' own schemas
(kubernetes-validate's bundled, strict: unknown fields are errors), the KEDA ScaledObjects against the fields of
KEDA's CRD that they use, and the parts agree with each other and with the repository: references resolve,
images are ones docker-compose.yml builds from docker/, commands and options are nnqueue's, environment variables
are settings nnqueue reads, a worker's GPUs equal its tensor parallelism and its kill grace outlasts its drain."""

from __future__ import annotations

import copy
import dataclasses
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
WORKER_ARGUMENTS = {"NNQUEUE_MODEL", "NNQUEUE_MODEL_KEY", "NNQUEUE_TENSOR_PARALLEL_SIZE", "NNQUEUE_MAX_NUM_SEQS"}
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
                "fallback": {
                    "type": "object",
                    "required": ["failureThreshold", "replicas"],
                    "additionalProperties": False,
                    "properties": {
                        "failureThreshold": {"type": "integer", "minimum": 1},
                        "replicas": {"type": "integer", "minimum": 1},
                    },
                },
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
                                    for key in (
                                        "serverAddress",
                                        "query",
                                        "threshold",
                                        "activationThreshold",
                                        "ignoreNullValues",
                                    )
                                },
                            },
                        },
                    },
                },
            },
        },
    },
}


# The fields of the Prometheus Operator's ServiceMonitor and PodMonitor (monitoring.coreos.com/v1) that the manifests
# use, as for the ScaledObject.
ENDPOINT = {
    "type": "object",
    "required": ["port"],
    "additionalProperties": False,
    "properties": {"port": {"type": "string"}, "path": {"type": "string"}, "interval": {"type": "string"}},
}
MONITORS = {
    kind: {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "additionalProperties": False,
        "properties": {
            "apiVersion": {"const": "monitoring.coreos.com/v1"},
            "kind": {"const": kind},
            "metadata": {"type": "object", "required": ["name", "namespace"]},
            "spec": {
                "type": "object",
                "required": ["selector", endpoints],
                "additionalProperties": False,
                "properties": {
                    "selector": {
                        "type": "object",
                        "required": ["matchLabels"],
                        "additionalProperties": False,
                        "properties": {"matchLabels": {"type": "object"}},
                    },
                    endpoints: {"type": "array", "minItems": 1, "items": ENDPOINT},
                },
            },
        },
    }
    for kind, endpoints in (("ServiceMonitor", "endpoints"), ("PodMonitor", "podMetricsEndpoints"))
}
CUSTOM_KINDS = {"ScaledObject", *MONITORS}


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
        if obj["kind"] in CUSTOM_KINDS:
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


def test_keda_fails_loudly_without_the_gauges_and_falls_back_to_a_worker(rendered: list[dict[str, Any]]) -> None:
    """No `or vector(0)`: an unscraped API is an error (a scale-to-zero model's gauges exist while it is idle), and
    the fallback gives the load triggers one worker, so queued work is never left at zero workers silently."""
    for obj in find(rendered, "ScaledObject"):
        assert obj["spec"]["fallback"]["replicas"] >= 1
        for trigger in obj["spec"]["triggers"]:
            assert "vector(" not in trigger["metadata"]["query"] and " or " not in trigger["metadata"]["query"]
            assert trigger["metadata"]["ignoreNullValues"] == "false"
        assert any(trigger.get("metricType", "AverageValue") == "AverageValue" for trigger in obj["spec"]["triggers"])
        worker = one(rendered, "Deployment", obj["spec"]["scaleTargetRef"]["name"])
        [load] = [trigger for trigger in obj["spec"]["triggers"] if trigger["name"] == "load"]
        assert load["metadata"]["threshold"] == worker_settings(rendered, worker)["NNQUEUE_MAX_NUM_SEQS"]


def test_prometheus_operator_scrapes_the_api_and_the_workers(rendered: list[dict[str, Any]]) -> None:
    services = {o["metadata"]["name"]: o for o in find(rendered, "Service")}
    [service_monitor] = find(rendered, "ServiceMonitor")
    jsonschema.validate(service_monitor, MONITORS["ServiceMonitor"])
    [scraped] = [o for o in services.values() if _selects(service_monitor["spec"]["selector"], o["metadata"]["labels"])]
    assert scraped["metadata"]["name"] == "nnqueue-api"  # the gauges KEDA reads
    assert {e["port"] for e in service_monitor["spec"]["endpoints"]} <= {p["name"] for p in scraped["spec"]["ports"]}
    [pod_monitor] = find(rendered, "PodMonitor")
    jsonschema.validate(pod_monitor, MONITORS["PodMonitor"])
    for worker in workers(rendered):
        template = worker["spec"]["template"]
        assert _selects(pod_monitor["spec"]["selector"], template["metadata"]["labels"])
        ports = {port["name"] for port in template["spec"]["containers"][0]["ports"]}
        assert {e["port"] for e in pod_monitor["spec"]["podMetricsEndpoints"]} <= ports
    api = one(rendered, "Deployment", "nnqueue-api")
    assert not _selects(pod_monitor["spec"]["selector"], api["spec"]["template"]["metadata"]["labels"])


def test_a_worker_rollout_keeps_the_old_pod_serving_until_the_new_one_is_ready(rendered: list[dict[str, Any]]) -> None:
    for worker in workers(rendered):
        rolling = worker["spec"]["strategy"]["rollingUpdate"]
        assert rolling["maxUnavailable"] == 0 and rolling["maxSurge"] >= 1
        assert "readinessProbe" in worker["spec"]["template"]["spec"]["containers"][0]


def test_a_hung_engine_fails_the_workers_liveness_probe(rendered: list[dict[str, Any]]) -> None:
    """The probe reads the stamp the worker sets after each round trip to its engine (tests/api/test_results.py runs
    it against a worker whose engine is stopped); it restarts a pod well after the longest step."""
    from nnqueue.workers.engine_liveness import INTERVAL_S, RESPONDED

    for worker in workers(rendered):
        probe = worker["spec"]["template"]["spec"]["containers"][0]["livenessProbe"]
        code = probe["exec"]["command"][2]
        compile(code, "livenessProbe", "exec")
        assert RESPONDED._name in code and "127.0.0.1:9100" in code
        assert float(re.search(r"> (\d+)\)", code)[1]) >= 30 * INTERVAL_S  # type: ignore[index]
        assert probe["periodSeconds"] * probe["failureThreshold"] >= 60


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
    from vllm.engine.arg_utils import EngineArgs  # here: importing vLLM takes seconds

    engine_options = {field.name for field in dataclasses.fields(EngineArgs)}
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
                if word.startswith("--") and word.split("=")[0] not in options:
                    # The worker passes the options it does not have to vLLM's engine: they must be vLLM's.
                    assert words[:2] == ["nnqueue", "worker"], f"{obj['metadata']['name']}: nnqueue has no {word}"
                    assert word.split("=")[0][2:].replace("-", "_") in engine_options, f"vLLM has no {word}"
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


def image_tags(root: Path) -> set[str]:
    """The tags of nnqueue's images in both overlays and docker-compose.yml's defaults under ``root``."""
    tags = {
        container["image"].rsplit(":", 1)[1]
        for overlay in OVERLAYS
        for obj in render(root / "deploy" / "kubernetes" / "overlays" / overlay)
        for container in containers(obj)
    }
    return tags | set(re.findall(r"\$\{NNQUEUE_IMAGE_TAG:-([^}]+)\}", (root / "docker-compose.yml").read_text()))


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
def test_images_are_pinned_to_nnqueues_version_and_make_pin_images_moves_them(tmp_path: Path) -> None:
    version = re.search(r'(?m)^version = "(.+)"$', (ROOT / "pyproject.toml").read_text())
    assert version and image_tags(ROOT) == {version[1]}  # never :latest
    for path in ("Makefile", "pyproject.toml", "docker-compose.yml"):
        shutil.copy(ROOT / path, tmp_path / path)
    shutil.copytree(KUBERNETES, tmp_path / "deploy" / "kubernetes")
    subprocess.run(["make", "-C", str(tmp_path), "pin-images", "IMAGE_TAG=9.9.9"], check=True, capture_output=True)
    assert image_tags(tmp_path) == {"9.9.9"}
    compose = yaml.safe_load((ROOT / "docker-compose.yml").read_text())
    assert all(not service["image"].endswith(":latest") for service in compose["services"].values())


def test_the_gpu_image_and_the_gpu_extra_pin_the_same_vllm() -> None:
    pinned = re.search(r"(?m)^ARG VLLM_VERSION=(\S+)$", (ROOT / "docker" / "Dockerfile").read_text())
    extra = re.search(r'(?m)^gpu = \[.*"vllm==([^"]+)"\]$', (ROOT / "pyproject.toml").read_text())
    assert pinned and extra and pinned[1] == extra[1]
