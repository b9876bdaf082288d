"""Where a worker's model came from, for a harvest's manifest: repository and revision, or the checkpoint's digest;
its tokenizer and whether it adds a BOS token; the dtype the engine computes in.

A model named by a Hugging Face repository id is recorded as that id and its revision (the one asked for, else
the commit of the snapshot in the local cache). A local folder inside the Hugging Face cache
(``.../models--<org>--<name>/snapshots/<commit>``) is the same thing under another name and is recorded so. Any
other local folder (a converted or fine-tuned checkpoint) is recorded by path and by the sha256 of its files
(each file's name and sha256, in name order): computed once when the worker starts, from files the engine has just
read (so mostly from the page cache; about 1-2 GB/s).

vLLM's ``ModelConfig`` (``vllm/config/model.py``) gives ``model``, ``revision``, ``tokenizer``,
``tokenizer_revision`` and the resolved ``dtype``.
"""

from __future__ import annotations

import hashlib
import re
from pathlib import Path
from typing import Any

_SNAPSHOT = re.compile(r"models--(?P<org>[^/]+?)--(?P<name>[^/]+)/snapshots/(?P<commit>[0-9a-f]{40})/?$")
_PIECE = 1 << 20


def provenance(model_config: Any, tokenizer: Any) -> dict[str, Any]:
    """``{"model": {...}, "tokenizer": {...}, "engine_dtype": ...}`` for the manifest."""
    return {
        "model": source(str(model_config.model), getattr(model_config, "revision", None)),
        "tokenizer": {
            **source(str(model_config.tokenizer or model_config.model), model_config.tokenizer_revision, digest=False),
            "class": type(tokenizer).__name__,
            "bos_token_id": getattr(tokenizer, "bos_token_id", None),
            "adds_bos_token": adds_bos(tokenizer),
        },
        "engine_dtype": str(model_config.dtype).removeprefix("torch."),
    }


def source(name: str, revision: str | None, *, digest: bool = True) -> dict[str, Any]:
    """A model or tokenizer named ``name``: ``{"repository", "revision"}``, or ``{"path", "sha256"}``."""
    path = Path(name)
    if not path.is_dir():
        return {"repository": name, "revision": revision or _cached_commit(name)}
    snapshot = _SNAPSHOT.search(path.resolve().as_posix())
    if snapshot is not None:
        return {"repository": f"{snapshot['org']}/{snapshot['name']}", "revision": snapshot["commit"]}
    return {"path": str(path.resolve()), "sha256": folder_digest(path) if digest else None}


def folder_digest(folder: Path) -> str:
    """sha256 over each file's relative name and sha256, in name order (hidden files left out)."""
    outer = hashlib.sha256()
    for file in sorted(p for p in folder.rglob("*") if p.is_file()):
        relative = file.relative_to(folder).as_posix()
        if any(part.startswith(".") for part in Path(relative).parts):
            continue
        inner = hashlib.sha256()
        with open(file, "rb") as handle:
            while piece := handle.read(_PIECE):
                inner.update(piece)
        outer.update(f"{relative}\0{inner.hexdigest()}\n".encode())
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


def _cached_commit(repository: str) -> str | None:
    """The commit of the repository's snapshot in the local Hugging Face cache, if exactly one is there."""
    try:
        from huggingface_hub import constants
    except ImportError:
        return None
    snapshots = Path(constants.HF_HUB_CACHE) / f"models--{repository.replace('/', '--')}" / "snapshots"
    commits = [p.name for p in snapshots.iterdir()] if snapshots.is_dir() else []
    return commits[0] if len(commits) == 1 else None
