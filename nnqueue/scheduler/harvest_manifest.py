"""A completed harvest's ``manifest.json``: everything needed to read and trust its shards without nnqueue.

Written once, by the worker that completes the harvest's last chunk, from the database alone (so two
workers finishing the last chunks at once write the same bytes): the spec; the model key, the model the
worker loaded and its revision, and its ``provenance`` (:mod:`nnqueue.workers.provenance`: repository id and
revision or the checkpoint's sha256, the tokenizer, whether it adds a BOS token, the engine's dtype); the
versions of nnqueue, vLLM, nnsight and torch; the frozen dataset's key and sha256; and per shard its file, rows,
bytes and sha256 (of the shard as the worker uploaded it), tokens and the row offsets of its prompts:
global prompt ``first_prompt + i`` has the shard's rows ``row_offsets[i]:row_offsets[i + 1]``.
``weights_versions`` lists the weights versions the chunks ran on (each shard has its ``weights_version``:
:mod:`nnqueue.workers.weights`; one, unless the model's weights changed while the harvest ran, which its
``weights_pin`` prevents). ``statistics`` sums the shards' per-capture statistics (count, mean and std per dimension, norm percentiles, NaN/Inf:
:mod:`nnqueue.enginecore.harvest_stats`); they are what the engine reported, as the rows are.
"""

from __future__ import annotations

import json
from typing import Any

from nnqueue.db.models import Harvest, HarvestChunk
from nnqueue.enginecore.harvest_stats import merge, summarize
from nnqueue.storage.keys import shard_name

FORMAT = "nnqueue-harvest/1"


def build_manifest(harvest: Harvest, chunks: list[HarvestChunk], engine: dict[str, Any]) -> dict[str, Any]:
    """``engine``: ``{"model": ..., "revision": ..., "versions": {package: version}}`` from the worker."""
    return {
        "format": FORMAT,
        "harvest_id": str(harvest.id),
        "owner": harvest.owner,
        "model_key": harvest.model_key,
        "model": engine.get("model"),
        "revision": engine.get("revision"),
        "versions": engine.get("versions", {}),
        "provenance": _provenance(harvest, engine.get("provenance")),
        "spec": harvest.spec,
        "weights_pin": harvest.weights_pin,
        "weights_versions": sorted({chunk.weights_version for chunk in chunks if chunk.weights_version}),
        "dataset": {"key": harvest.dataset_key, "sha256": harvest.dataset_digest, "prompts": harvest.prompts},
        "rows": sum(chunk.rows or 0 for chunk in chunks),
        "tokens": sum(chunk.tokens or 0 for chunk in chunks),
        "bytes": sum(chunk.bytes or 0 for chunk in chunks),
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
                "weights_version": chunk.weights_version,
            }
            for chunk in sorted(chunks, key=lambda chunk: chunk.index)
        ],
    }


def _provenance(harvest: Harvest, engine: dict[str, Any] | None) -> dict[str, Any] | None:
    """The engine's provenance, plus whether text prompts began with the tokenizer's BOS token (they do when the
    spec let the tokenizer add its special tokens and the tokenizer adds a BOS; token-id prompts are as given)."""
    if engine is None:
        return None
    adds = (engine.get("tokenizer") or {}).get("adds_bos_token")
    return {**engine, "text_prompts_start_with_bos": bool(harvest.spec.get("add_special_tokens", True) and adds)}


def dumps(manifest: dict[str, Any]) -> bytes:
    return json.dumps(manifest, indent=1, sort_keys=True).encode()
