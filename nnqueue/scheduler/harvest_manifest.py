"""A completed harvest's ``manifest.json``: everything needed to read and trust its shards without nnqueue.

Written once, by the worker that completes the harvest's last chunk, from the database alone (so two
workers finishing the last chunks at once write the same bytes): the spec; the model key, the model the
worker loaded (its repository id, or its folder's path relative to the worker's directory, or its name: never
an absolute path) and its revision, and its ``provenance`` (:mod:`nnqueue.workers.provenance`: repository id and
revision or the checkpoint's sha256 and origin, the tokenizer and its files' sha256, whether it adds a BOS token,
the engine's dtype); the versions of nnqueue, vLLM, nnsight and torch; the frozen dataset's key and sha256; and
per shard its file, rows, bytes and sha256 (of the shard as the worker uploaded it), tokens, its rows of generated
tokens, what the spec's ``outliers`` option did to it, and the row offsets of its prompts: global prompt
``first_prompt + i`` has the shard's rows ``row_offsets[i]:row_offsets[i + 1]``. ``generated_rows`` and
``outliers`` add those up (the latter with the option itself; null without it).
``weights_versions`` lists the weights versions the chunks ran on (each shard has its ``weights_version``:
:mod:`nnqueue.workers.weights`; one, unless the model's weights changed while the harvest ran, which its
``weights_pin`` prevents). ``statistics`` sums the shards' per-capture statistics (count, mean and std per dimension, norm percentiles, NaN/Inf:
:mod:`nnqueue.enginecore.harvest_stats`); they are what the engine reported, as the rows are.
"""

from __future__ import annotations

import json
from pathlib import PurePath
from typing import Any

from nnqueue.db.models import Harvest, HarvestChunk
from nnqueue.enginecore.harvest_stats import merge, summarize
from nnqueue.storage.keys import shard_name

# /2: shards have the prompt_length and generated columns; generated_rows and outliers are counted.
FORMAT = "nnqueue-harvest/2"


def build_manifest(harvest: Harvest, chunks: list[HarvestChunk], engine: dict[str, Any]) -> dict[str, Any]:
    """``engine``: ``{"model": ..., "revision": ..., "versions": {package: version}, "provenance": {...}}`` from the
    worker."""
    provenance = _provenance(harvest, engine.get("provenance"))
    return {
        "format": FORMAT,
        "harvest_id": str(harvest.id),
        "owner": harvest.owner,
        "model_key": harvest.model_key,
        "model": _model_name(engine.get("model"), provenance),
        "revision": engine.get("revision"),
        "versions": engine.get("versions", {}),
        "provenance": provenance,
        "spec": harvest.spec,
        "weights_pin": harvest.weights_pin,
        "weights_versions": sorted({chunk.weights_version for chunk in chunks if chunk.weights_version}),
        "dataset": {"key": harvest.dataset_key, "sha256": harvest.dataset_digest, "prompts": harvest.prompts},
        "rows": sum(chunk.rows or 0 for chunk in chunks),
        "tokens": sum(chunk.tokens or 0 for chunk in chunks),
        "bytes": sum(chunk.bytes or 0 for chunk in chunks),
        "generated_rows": sum(chunk.generated_rows or 0 for chunk in chunks),
        "outliers": _outliers(harvest.spec.get("outliers"), chunks),
        "statistics": summarize(merge([chunk.stats for chunk in chunks if chunk.stats])),
        "shards": [
            {
                "file": shard_name(chunk.index),
                "index": chunk.index,
                "first_prompt": chunk.first_prompt,
                "prompts": chunk.prompts,
                "rows": chunk.rows,
                "bytes": chunk.bytes,
                "sha256": chunk.sha256,
                "tokens": chunk.tokens,
                "row_offsets": chunk.offsets,
                "generated_rows": chunk.generated_rows,
                "outliers": chunk.outliers,
                "weights_version": chunk.weights_version,
            }
            for chunk in sorted(chunks, key=lambda chunk: chunk.index)
        ],
    }


def _provenance(harvest: Harvest, engine: dict[str, Any] | None) -> dict[str, Any] | None:
    """The engine's provenance, plus whether text prompts began with the tokenizer's BOS token (they do when the
    spec let the tokenizer add its special tokens and the tokenizer adds a BOS) and whether the harvest's prompts
    did: its inline token ids checked against the BOS token, else as its text prompts (a file's examples given as
    token ids are not read here)."""
    if engine is None:
        return None
    tokenizer = engine.get("tokenizer") or {}
    text = bool(harvest.spec.get("add_special_tokens", True) and tokenizer.get("adds_bos_token"))
    ids, bos = (harvest.spec.get("dataset") or {}).get("token_ids"), tokenizer.get("bos_token_id")
    given = bos is not None and all(prompt[:1] == [bos] for prompt in ids) if ids is not None else text
    return {**engine, "text_prompts_start_with_bos": text, "prompts_start_with_bos": given}


def _model_name(loaded: str | None, provenance: dict[str, Any] | None) -> str | None:
    """The model as the manifest names it: its repository, its folder relative to the worker's directory, or the
    folder's name; never an absolute path."""
    model = (provenance or {}).get("model") or {}
    name = model.get("repository") or model.get("path") or model.get("name") or loaded
    return PurePath(name).name if name is not None and PurePath(name).is_absolute() else name


def _outliers(option: dict[str, Any] | None, chunks: list[HarvestChunk]) -> dict[str, Any] | None:
    """The spec's outliers option, with its chunks' rows over the limits and rows dropped added up."""
    if not option:
        return None
    over: dict[str, int] = {}
    for chunk in chunks:
        for key, count in ((chunk.outliers or {}).get("over") or {}).items():
            over[key] = over.get(key, 0) + count
    dropped = sum((chunk.outliers or {}).get("dropped_rows", 0) for chunk in chunks)
    return {**option, "over": over, "dropped_rows": dropped}


def dumps(manifest: dict[str, Any]) -> bytes:
    return json.dumps(manifest, indent=1, sort_keys=True).encode()
