"""What a harvest will cost before it is queued: tokens, rows, bytes, shards and a duration.

From the dataset as it would be frozen, the spec and what the model's live workers published and measured:

* tokens: exact for prompts given as token ids; for text, its UTF-8 bytes times ``TOKENS_PER_BYTE`` (the
  API has no tokenizer; English text runs near 0.25-0.3 tokens per byte with today's tokenizers), each prompt
  cut at ``max_length``; with ``generate``, plus ``max_tokens - 1`` generated tokens per prompt run through the
  model (an upper bound: a sequence may end sooner);
* rows: each prompt's rows under the selection (`nnqueue.enginecore.harvest_spec.Selection.max_rows`), generated
  tokens included;
* bytes: rows times each capture's width (the workers publish it with their capture points; a capture whose
  width is not known is counted at the model's widest) in the stored dtype, plus the three int64 columns and
  a header per shard;
* duration: tokens over the rate the model's workers harvested at: the tokens of its chunks that completed
  in the last ``RATE_WINDOW_S``, over the time from the first of them starting to the last finishing. None
  when none completed in that window.

``NNQUEUE_HARVEST_MAX_OUTPUT_BYTES`` refuses (413) a harvest whose estimated bytes exceed it, with the estimate.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import timedelta
from typing import Annotated, Any

from pydantic import Field
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from nnqueue.db.models import HarvestChunk, JobStatus, utcnow
from nnqueue.scheduler.harvest_dataset import Example
from nnqueue.scheduler.harvest_spec import HarvestSpec

TOKENS_PER_BYTE = 0.3
RATE_WINDOW_S = 3600.0
SHARD_HEADER_BYTES = 1024
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}
COLUMN_BYTES = 3 * 8  # prompt_index, token_position, token_id: int64 each


@dataclass(frozen=True)
class HarvestEstimate:
    """A harvest's estimated size and duration (also the API's ``/v1/harvests/estimate`` body)."""

    prompts: int
    tokens: int
    tokens_exact: Annotated[bool, Field(description="True for token-id prompts; text is estimated.")]
    rows: int
    bytes: int
    shards: int
    widths: Annotated[dict[str, int], Field(description="Each capture's features, as counted.")]
    tokens_per_s: Annotated[float | None, Field(description="The model's measured harvest rate.")]
    duration_s: Annotated[float | None, Field(description="tokens / tokens_per_s; null when not measured.")]
    notes: list[str]

    def describe(self) -> str:
        duration = f"{self.duration_s:,.0f} s" if self.duration_s is not None else "unknown (no rate measured)"
        return (
            f"{self.prompts:,} prompts, {'' if self.tokens_exact else '~'}{self.tokens:,} tokens, {self.rows:,} rows, "
            f"{self.bytes:,} bytes in {self.shards:,} shards, about {duration}"
        )


def estimate(
    session: Session, spec: HarvestSpec, examples: list[Example], points: list[dict[str, Any]]
) -> HarvestEstimate:
    """The estimate of ``spec`` over ``examples`` on a model whose workers published ``points``."""
    notes = []
    limit = spec.max_length
    lengths, exact = [], True
    for example in examples:
        if isinstance(example, str):
            exact = False
            length = max(1, round(len(example.encode()) * TOKENS_PER_BYTE))
        else:
            length = len(example)
        lengths.append(min(length, limit) if limit else length)
    if not exact:
        notes.append(f"text prompts: tokens estimated at {TOKENS_PER_BYTE} per UTF-8 byte")
    generated = spec.generated_positions
    if spec.generate is not None:
        notes.append(
            f"generation: up to {spec.generate.max_tokens} tokens per prompt counted (sequences may end sooner)"
        )
    rows = sum(spec.selection.max_rows(length, generated) for length in lengths)
    widths = _widths(spec, points, notes)
    shards = -(-len(examples) // spec.prompts_per_chunk)
    row_bytes = sum(widths.values()) * DTYPE_BYTES[spec.dtype] + COLUMN_BYTES
    tokens = sum(lengths) + (len(lengths) * spec.generate.positions if spec.generate is not None else 0)
    rate = measured_rate(session, spec.model_key)
    if rate is None:
        notes.append(f"no chunk of {spec.model_key!r} completed in the last {RATE_WINDOW_S:.0f} s: no duration")
    return HarvestEstimate(
        prompts=len(examples),
        tokens=tokens,
        tokens_exact=exact,
        rows=rows,
        bytes=rows * row_bytes + shards * SHARD_HEADER_BYTES,
        shards=shards,
        widths=widths,
        tokens_per_s=rate,
        duration_s=tokens / rate if rate else None,
        notes=notes,
    )


def measured_rate(session: Session, model_key: str) -> float | None:
    """Tokens per second the model's workers harvested, over its chunks completed in the last window."""
    since = utcnow() - timedelta(seconds=RATE_WINDOW_S)
    tokens, first, last = session.execute(
        select(func.sum(HarvestChunk.tokens), func.min(HarvestChunk.started_at), func.max(HarvestChunk.finished_at))
        .where(HarvestChunk.model_key == model_key, HarvestChunk.status == JobStatus.COMPLETED)
        .where(HarvestChunk.finished_at >= since)
    ).one()
    if not tokens or first is None or last is None:
        return None
    elapsed = (last - first).total_seconds()  # min and max read back as the column type: aware UTC
    return int(tokens) / elapsed if elapsed > 0 else None


def _widths(spec: HarvestSpec, points: list[dict[str, Any]], notes: list[str]) -> dict[str, int]:
    published = {(p["module"], p["io"]): p.get("width") for p in points}
    widest = max((w for w in published.values() if isinstance(w, int)), default=0)
    widths = {}
    for capture in spec.captures:
        width = published.get((capture.module, capture.io))
        if not isinstance(width, int):
            notes.append(f"{capture.key}: width not published; counted at the model's widest ({widest})")
            width = widest
        widths[capture.key] = width
    return widths


def refusal(estimate_: HarvestEstimate, limit: int) -> str:
    """The 413 reason for a harvest over ``NNQUEUE_HARVEST_MAX_OUTPUT_BYTES``."""
    return (
        f"the harvest would write about {estimate_.bytes:,} bytes; the limit is {limit:,} "
        f"(NNQUEUE_HARVEST_MAX_OUTPUT_BYTES): {estimate_.describe()}. Estimate: {json.dumps(estimate_.__dict__)}"
    )
