"""The import graph of ``nnqueue/`` keeps the layering of PLAN.md / docs/architecture/index.md: parsed with ``ast``, so
imports inside functions and under ``TYPE_CHECKING`` count too.

Units are the subpackages (``nnqueue.db``, ...) and the top-level modules (``nnqueue.settings``, ...). Bottom
to top (layer 0 is what every layer reads: settings and the exception base), a unit imports only units of
lower layers; the entry points of layer 4 (the ``nnqueue`` command, the
demo and its embedded servers) also use each other, the API and the client. The client imports nothing of
the server: a light client install has no sqlalchemy, celery, boto3, fastapi or vllm.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "nnqueue"

LAYERS = {
    "settings": 0,
    "errors": 0,
    "logs": 0,
    "metrics": 0,
    "libc": 0,
    "timeline": 0,
    "probe_memo": 0,
    "isolation": 1,
    "netns": 1,
    "cgroups": 1,
    "mountns": 1,
    "seccomp_filter": 1,
    "trace_payload": 1,
    "outliers": 1,
    "db": 1,
    "storage": 1,
    "broker": 2,
    "enginecore": 2,
    "engines": 3,
    "scheduler": 3,
    "workers": 4,
    "api": 4,
    "cli": 4,
    "demo": 4,
    "embedded": 4,
    "up": 4,
    "__main__": 4,
    "client": 5,
    "harvest": 6,  # the streaming reader of harvests (nnqueue.harvest.open), over the client
}
# Edges within layer 4 (and up to the client) that the entry points need; no server package is among them.
ENTRY_POINT_EDGES = {
    ("__main__", "cli"),
    ("cli", "api"),
    ("cli", "workers"),
    ("cli", "demo"),
    ("cli", "embedded"),
    ("cli", "client"),
    ("demo", "api"),
    ("demo", "embedded"),
    ("demo", "client"),
    ("embedded", "api"),
    ("cli", "up"),
    ("up", "demo"),
    ("up", "client"),
}
# Modules of the server that the client imports too, importing nothing of nnqueue but the exception base: the
# prebuilt trace format, which the client writes and the worker reads; the outlier rows option, which the engine's
# shard writer and the client's export and reader apply.
SHARED_WITH_CLIENT = {"trace_payload", "outliers"}
# What the issue and PLAN.md name outright (also implied by the layers; kept as readable failures).
FORBIDDEN = {
    "enginecore": {"db", "storage", "broker", "scheduler", "api", "workers"},
    "scheduler": {"workers", "api"},
    "api": {"workers"},
}


def unit(module: str) -> str:
    """``nnqueue.db.lifecycle`` -> ``db``; ``nnqueue.settings`` -> ``settings``."""
    return module.split(".")[1]


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_time_statements(body: list[ast.stmt]) -> Iterator[ast.stmt]:
    """The statements that run when the module is imported: not function or class bodies, not ``TYPE_CHECKING``."""
    for node in body:
        yield node
        if isinstance(node, ast.If) and not (isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"):
            yield from import_time_statements(node.body + node.orelse)
        elif isinstance(node, ast.Try):
            yield from import_time_statements(node.body + node.orelse + node.finalbody)
            for handler in node.handlers:
                yield from import_time_statements(handler.body)


def imports(
    source: str, name: str, is_package: bool = False, *, import_time: bool = False
) -> Iterator[tuple[str, int]]:
    """Every nnqueue module that module ``name`` (its ``source``) imports, with the line: absolute and
    relative, at any depth (functions, ``TYPE_CHECKING`` blocks), or with ``import_time`` only those
    that run when it is imported."""
    package = name if is_package else name.rpartition(".")[0]
    tree = ast.parse(source)
    for node in import_time_statements(tree.body) if import_time else ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join([*parts[: len(parts) - node.level + 1], *([base] if base else [])])
            # ``from package import name``: the name may be a module of the package.
            targets = [base, *(f"{base}.{alias.name}" for alias in node.names)]
        else:
            continue
        for target in targets:
            if target == "nnqueue" or target.startswith("nnqueue."):
                yield target, node.lineno


def edges() -> dict[tuple[str, str], list[str]]:
    """(importing unit, imported unit) -> where: ``path:line imports module``; within a unit left out."""
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        if "migrations" in path.parts:  # Alembic's scripts, run by Alembic on the db layer's behalf
            continue
        name = module_name(path)
        source = unit(name) if name != "nnqueue" else None
        for target, line in imports(path.read_text(), name, path.name == "__init__.py"):
            if target == "nnqueue" or source is None or unit(target) == source:
                continue
            where = f"{path.relative_to(PACKAGE.parent)}:{line} imports {target}"
            found.setdefault((source, unit(target)), []).append(where)
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one unit (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, ()):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


@pytest.fixture(scope="module")
def graph_edges() -> dict[tuple[str, str], list[str]]:
    return edges()


def test_every_unit_has_a_layer(graph_edges: dict[tuple[str, str], list[str]]) -> None:
    units = {path.stem for path in PACKAGE.glob("*.py")} | {path.parent.name for path in PACKAGE.glob("*/__init__.py")}
    units -= {"__init__"}
    assert units - set(LAYERS) == set(), (
        "new top-level modules or packages need a layer here and in docs/architecture/index.md"
    )


def test_no_cycles_between_units(graph_edges: dict[tuple[str, str], list[str]]) -> None:
    graph: dict[str, set[str]] = {}
    for source, target in graph_edges:
        graph.setdefault(source, set()).add(target)
    assert cycles(graph) == []


def test_named_boundaries_hold(graph_edges: dict[tuple[str, str], list[str]]) -> None:
    crossings = [
        where
        for (source, target), places in graph_edges.items()
        if target in FORBIDDEN.get(source, set())
        for where in places
    ]
    assert crossings == []


def test_the_client_imports_nothing_of_the_server(graph_edges: dict[tuple[str, str], list[str]]) -> None:
    assert [
        where
        for (source, target), places in graph_edges.items()
        if source == "client" and target not in SHARED_WITH_CLIENT
        for where in places
    ] == []


def test_what_the_client_shares_imports_nothing_of_the_server_but_the_exception_base(
    graph_edges: dict[tuple[str, str], list[str]],
) -> None:
    assert {target for (source, target) in graph_edges if source in SHARED_WITH_CLIENT} <= {"errors"}


def test_units_import_only_lower_layers(graph_edges: dict[tuple[str, str], list[str]]) -> None:
    upward = [
        where
        for (source, target), places in graph_edges.items()
        if LAYERS[target] >= LAYERS[source] and (source, target) not in ENTRY_POINT_EDGES
        for where in places
    ]
    assert upward == []


def test_no_import_time_cycles_between_modules() -> None:
    """Within a unit too, no two modules need each other to be imported (e.g. the client's Job and Client)."""
    modules = {module_name(path): path for path in PACKAGE.rglob("*.py") if "migrations" not in path.parts}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        for target, _ in imports(path.read_text(), name, path.name == "__init__.py", import_time=True):
            if target in modules and target != name:
                graph.setdefault(name, set()).add(target)
    assert cycles(graph) == []


def test_no_import_circles_between_the_client_modules() -> None:
    """In the client, counting every import (in functions and under ``TYPE_CHECKING`` too), no two modules use
    each other: a piece two modules share sits in a module below both (``waiting``, ``cli_common``) or is
    named by a protocol (``errors.Followed``, ``backend.Submitter``). The package's ``__init__`` re-exports
    its modules, so it is left out (none of them imports it)."""
    client = PACKAGE / "client"
    modules = {module_name(path): path for path in client.rglob("*.py") if path.name != "__init__.py"}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        for target, _ in imports(path.read_text(), name):
            assert target != "nnqueue.client", f"{name} imports the package nnqueue.client: import the module instead"
            if target in modules and target != name:
                graph.setdefault(name, set()).add(target)
    assert len(graph) >= 5
    assert cycles(graph) == []


def test_the_parser_resolves_every_import_form() -> None:
    # The checks above can fail only if these forms are seen.
    source = """
from typing import TYPE_CHECKING
import nnqueue.db.models
from nnqueue.storage import keys
from . import heartbeat
from ..scheduler.claim import claim
if TYPE_CHECKING:
    from nnqueue.api.deps import Resources
def later():
    import nnqueue.broker
"""
    found = [target for target, _ in imports(source, "nnqueue.workers.main")]
    assert found == [
        "nnqueue.db.models",
        "nnqueue.storage",
        "nnqueue.storage.keys",
        "nnqueue.workers",
        "nnqueue.workers.heartbeat",
        "nnqueue.scheduler.claim",
        "nnqueue.scheduler.claim.claim",
        "nnqueue.api.deps",
        "nnqueue.api.deps.Resources",
        "nnqueue.broker",
    ]
    assert [target for target, _ in imports(source, "nnqueue.workers.main", import_time=True)] == found[:7]
    assert cycles({"scheduler": {"workers"}, "workers": {"scheduler"}, "db": set()}) == [["scheduler", "workers"]]
