"""Where a worker's model came from, for a harvest's manifest: repository and revision, or the checkpoint's digest
and where it came from; its tokenizer, the tokenizer files' digest and whether it adds a BOS token; the dtype the
engine computes in.

A model named by a Hugging Face repository id is recorded as that id and its revision (the one asked for, else
the commit of the snapshot in the local cache). A local folder inside the Hugging Face cache
(``.../models--<org>--<name>/snapshots/<commit>``) is the same thing under another name and is recorded so. Any
other local folder (a converted or fine-tuned checkpoint) is recorded by its name, its path relative to the
worker's working directory (none when it is outside it: an absolute path says nothing on another machine and
tells the operator's layout), the sha256 of its files (each file's name and sha256, in name order: computed once
when the worker starts, from files the engine has just read, so mostly from the page cache; about 1-2 GB/s) and,
when the folder says where its weights came from (``origin`` in its ``.nnqueue-model.json``, which ``nnqueue
demo`` writes for the model it converts), that.

The tokenizer's ``sha256`` is over its files (``tokenizer.json``, ``tokenizer_config.json``, ...: `TOKENIZER_FILES`,
as `folder_digest` hashes them) in its folder or cached snapshot; null when neither is on this machine.

vLLM's ``ModelConfig`` (``vllm/config/model.py``) gives ``model``, ``revision``, ``tokenizer``,
``tokenizer_revision`` and the resolved ``dtype``.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

_SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<commit>[0-9a-f]{40})/?$")
_PIECE = 1 << 20
# A model folder's own note of where its weights came from (the file `nnqueue demo` writes: nnqueue.demo.MARKER).
ORIGIN_FILE = ".nnqueue-model.json"
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
)


def provenance(model_config: Any, tokenizer: Any) -> dict[str, Any]:
    """``{"model": {...}, "tokenizer": {...}, "engine_dtype": ...}`` for the manifest."""
    tokenizer_name = str(model_config.tokenizer or model_config.model)
    return {
        "model": source(str(model_config.model), getattr(model_config, "revision", None)),
        "tokenizer": {
            **source(tokenizer_name, model_config.tokenizer_revision, digest=False),
            "sha256": tokenizer_digest(tokenizer_name),
            "class": type(tokenizer).__name__,
            "bos_token_id": getattr(tokenizer, "bos_token_id", None),
            "adds_bos_token": adds_bos(tokenizer),
        },
        "engine_dtype": str(model_config.dtype).removeprefix("torch."),
    }


def source(name: str, revision: str | None, *, digest: bool = True) -> dict[str, Any]:
    """A model or tokenizer named ``name``: ``{"repository", "revision"}``, or ``{"name", "path", "sha256"}`` and
    its ``origin`` if it has one (``sha256`` only with ``digest``)."""
    path = Path(name)
    if not path.is_dir():
        return {"repository": name, "revision": revision or _cached_commit(name)}
    folder = path.resolve()
    snapshot = _SNAPSHOT.search(folder.as_posix())
    if snapshot is not None:
        return {"repository": f"{snapshot['org']}/{snapshot['name']}", "revision": snapshot["commit"]}
    found: dict[str, Any] = {"name": folder.name, "path": relative(folder)}
    if digest:
        found["sha256"] = folder_digest(folder)
    origin = _origin(folder)
    if origin is not None:
        found["origin"] = origin
    return found


def relative(folder: Path) -> str | None:
    """``folder`` relative to the working directory, or None when it is outside it."""
    try:
        return folder.relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return None


def folder_digest(folder: Path) -> str:
    """sha256 over each file's relative name and sha256, in name order (hidden files left out)."""
    return _digest(folder, (p for p in folder.rglob("*") if p.is_file()))


def tokenizer_digest(name: str) -> str | None:
    """sha256 of the tokenizer files (`TOKENIZER_FILES`) of folder ``name``, or of repository ``name``'s cached
    snapshot, as `folder_digest` hashes files; None when there are none here."""
    folder = Path(name) if Path(name).is_dir() else _cached_snapshot(name)
    files = [folder / file for file in TOKENIZER_FILES if (folder / file).is_file()] if folder is not None else []
    return _digest(folder, files) if folder is not None and files else None


def _digest(folder: Path, files: Iterable[Path]) -> str:
    outer = hashlib.sha256()
    for file in sorted(files):
        relative_name = file.relative_to(folder).as_posix()
        if any(part.startswith(".") for part in Path(relative_name).parts):
            continue
        inner = hashlib.sha256()
        with open(file, "rb") as handle:
            while piece := handle.read(_PIECE):
                inner.update(piece)
        outer.update(f"{relative_name}\0{inner.hexdigest()}\n".encode())
    return outer.hexdigest()


def adds_bos(tokenizer: Any) -> bool | None:
    """Whether the tokenizer puts its BOS token first when asked for special tokens (None: it has none)."""
    bos = getattr(tokenizer, "bos_token_id", None)
    if bos is None:
        return None
    try:
        ids = tokenizer("a", add_special_tokens=True).input_ids
    except Exception:  # noqa: BLE001  (a tokenizer that cannot encode is recorded as unknown)
        return None
    return bool(ids) and ids[0] == bos


def _origin(folder: Path) -> Any:
    """The ``origin`` the folder's `ORIGIN_FILE` records, if any."""
    try:
        return json.loads((folder / ORIGIN_FILE).read_text()).get("origin")
    except (OSError, ValueError, AttributeError):
        return None


def _cached_snapshot(repository: str) -> Path | None:
    """The repository's snapshot folder in the local Hugging Face cache, if exactly one is there."""
    try:
        from huggingface_hub import constants
    except ImportError:
        return None
    snapshots = Path(constants.HF_HUB_CACHE) / f"models--{repository.replace('/', '--')}" / "snapshots"
    found = [p for p in snapshots.iterdir() if p.is_dir()] if snapshots.is_dir() else []
    return found[0] if len(found) == 1 else None


def _cached_commit(repository: str) -> str | None:
    """The commit of the repository's snapshot in the local Hugging Face cache, if exactly one is there."""
    snapshot = _cached_snapshot(repository)
    return snapshot.name if snapshot is not None else None
