"""What ``pip install nnqueue`` (no extra, a researcher's machine) installs: its requirements' closure, resolved from
the metadata of the packages installed here (the versions CI tests), has no torch, CUDA wheel, triton or vLLM, and
docs/getting-started.md states the packages and megabytes measured here."""

from __future__ import annotations

import importlib.metadata
import re
import tomllib
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
HEAVY = re.compile(r"^(torch|triton|vllm|nnsight|nvidia-.*|transformers)$")


def closure(requirements: list[str]) -> dict[str, importlib.metadata.Distribution]:
    """The installed distributions that ``requirements`` pull in, transitively (no extras; markers of this Python)."""
    found: dict[str, importlib.metadata.Distribution] = {}
    pending = [Requirement(text) for text in requirements]
    while pending:
        requirement = pending.pop()
        if requirement.marker is not None and not requirement.marker.evaluate({"extra": ""}):
            continue
        name = canonicalize_name(requirement.name)
        if name not in found:
            found[name] = importlib.metadata.distribution(requirement.name)
            pending += [Requirement(text) for text in found[name].requires or []]
    return found


def client_install() -> tuple[int, float]:
    """The packages and megabytes (their installed files) of ``pip install nnqueue``, nnqueue itself aside."""
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    installed = closure(dependencies)
    assert not [name for name in installed if HEAVY.match(name)], sorted(installed)
    size = sum(file.size or 0 for dist in installed.values() for file in dist.files or [])
    return len(installed), size / 1e6


def test_a_client_install_pulls_no_torch_or_cuda_and_the_docs_say_its_size() -> None:
    packages, megabytes = client_install()
    text = (ROOT / "docs" / "getting-started.md").read_text().replace("\n", " ")
    stated = re.search(r"`pip install nnqueue` \(no extra\).*?: (\d+) packages, (\d+) MB", text)
    assert stated, "getting-started.md no longer states the client install's size"
    assert int(stated[1]) == packages and abs(int(stated[2]) - megabytes) <= max(2.0, 0.15 * megabytes), (
        f"measured {packages} packages, {megabytes:.1f} MB"
    )


def test_the_extras_that_write_traces_and_run_workers_have_nnsight() -> None:
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["trace"] == ["nnsight==0.8.1"]
    for extra in ("cpu", "gpu"):
        assert any(re.fullmatch(r"nnqueue\[.*\btrace\b.*\]", requirement) for requirement in extras[extra]), extra
