"""A small kustomize renderer for the subset deploy/kubernetes uses, so that the manifests are checked where no
``kubectl`` is installed (CI). Where ``kubectl`` is, the tests compare this renderer's output with
``kubectl kustomize``'s, so the subset is kept honest.

Supported: ``resources`` (files and folders with a kustomization.yaml), ``namespace``, ``images`` (``newName``,
``newTag``) and ``patches`` given inline as JSON 6902 operations (``add``, ``replace``, ``remove``) with a
``target`` of ``kind`` and ``name``. Anything else in a kustomization.yaml is refused, so that a manifest change
that outgrows the subset fails here rather than being rendered wrong.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml

SUPPORTED = {"apiVersion", "kind", "namespace", "resources", "images", "patches"}
# Kinds kustomize's namespace transformer leaves alone (the subset of cluster-scoped kinds a manifest might hold).
CLUSTER_SCOPED = {"Namespace", "ClusterRole", "ClusterRoleBinding", "CustomResourceDefinition", "PersistentVolume"}


def render(folder: Path) -> list[dict[str, Any]]:
    """The objects ``kubectl kustomize folder`` would print (in file order, not kustomize's)."""
    spec = yaml.safe_load((folder / "kustomization.yaml").read_text())
    unknown = set(spec) - SUPPORTED
    if unknown:
        raise ValueError(f"{folder}: kustomization fields this renderer does not support: {sorted(unknown)}")
    objects: list[dict[str, Any]] = []
    for resource in spec.get("resources", []):
        path = (folder / resource).resolve()
        if path.is_dir():
            objects += render(path)
        else:
            objects += [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
    for patch in spec.get("patches", []):
        target = patch["target"]
        matches = [o for o in objects if o["kind"] == target["kind"] and o["metadata"]["name"] == target["name"]]
        if len(matches) != 1:
            raise ValueError(f"{folder}: patch target {target} matches {len(matches)} objects")
        for operation in yaml.safe_load(patch["patch"]):
            apply_operation(matches[0], operation)
    for image in spec.get("images", []):
        for obj in objects:
            for container in containers(obj):
                name, _, tag = container["image"].partition(":")
                if name == image["name"]:
                    container["image"] = f"{image.get('newName', name)}:{image.get('newTag', tag)}"
    if "namespace" in spec:
        for obj in objects:
            if obj["kind"] not in CLUSTER_SCOPED:
                obj["metadata"]["namespace"] = spec["namespace"]
    return objects


def containers(obj: dict[str, Any]) -> list[dict[str, Any]]:
    """The containers of a workload's pod template (Deployment, Job, ...); none for other kinds."""
    pod = obj.get("spec", {}).get("template", {}).get("spec", {})
    return [*pod.get("initContainers", []), *pod.get("containers", [])]


def apply_operation(document: dict[str, Any], operation: dict[str, Any]) -> None:
    """One JSON 6902 ``add``, ``replace`` or ``remove`` on ``document``, in place."""
    *parents, last = [_unescape(part) for part in operation["path"].lstrip("/").split("/")]
    node: Any = document
    for part in parents:
        node = node[int(part)] if isinstance(node, list) else node[part]
    op = operation["op"]
    if isinstance(node, list):
        index = len(node) if last == "-" else int(last)
        if op == "add":
            node.insert(index, copy.deepcopy(operation["value"]))
        elif op == "replace":
            node[index] = copy.deepcopy(operation["value"])
        elif op == "remove":
            del node[index]
        else:
            raise ValueError(f"unsupported operation {op!r}")
        return
    if op in ("replace", "remove") and last not in node:
        raise ValueError(f"{operation['path']}: nothing to {op}")
    if op in ("add", "replace"):
        node[last] = copy.deepcopy(operation["value"])
    elif op == "remove":
        del node[last]
    else:
        raise ValueError(f"unsupported operation {op!r}")


def _unescape(part: str) -> str:
    return part.replace("~1", "/").replace("~0", "~")
