"""Writes a harvest chunk's captured rows as one safetensors shard, on a thread of the engine process.

The capture path (`nnqueue.enginecore.harvest_capture`) hands over a chunk's `Block` s (one per engine
step that had rows of it: host copies of each capture plus the rows' prompt index, position, token
id and prompt length) once all its prompts are captured. A chunk with an ``outliers`` option has its
rows over the limit dropped or clipped first (`nnqueue.outliers`; a ``times_median`` limit is taken
from the median norm of the chunk's rows, exactly). The writer orders the rows by prompt index, then
position, and streams the safetensors file (header, then each tensor's bytes, read straight out of
the blocks: no concatenated copy) to the chunk's sink, so a re-run of a chunk writes the same bytes.
When done it posts the shard's size, sha256, per-prompt row ranges, generated rows, outliers and
per-capture statistics (`nnqueue.enginecore.shard_stats`, taken from the rows as written) to the
outbox (an entry of kind `SHARD_ENTRY` whose id is the chunk's key on the engine); tensors never
leave the process.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import traceback
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from nnqueue.enginecore import outbox, sink
from nnqueue.enginecore.harvest_spec import (
    GENERATED,
    PROMPT_INDEX,
    PROMPT_LENGTH,
    SHARD_FORMAT,
    TOKEN_ID,
    TOKEN_POSITION,
)
from nnqueue.enginecore.shard_stats import shard_stats
from nnqueue.errors import NNqueueError
from nnqueue.outliers import Outliers, row_norms, screen

log = logging.getLogger(__name__)

SHARD_ENTRY = "harvest_shard"  # the outbox entry kind of a shard's outcome
_SAFETENSORS_DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}
_COLUMN_DTYPES = {np.dtype("<i8"): "I64", np.dtype("?"): "BOOL"}


class Cancelled(NNqueueError):
    """The chunk was aborted while its shard was being written."""


@dataclass
class Block:
    """One engine step's rows of one chunk.

    ``values`` maps capture key -> ``[rows, features]`` host tensor (pinned, filled by a copy on a side
    CUDA stream that ``ready`` marks done; None on CPU). For a ``mean`` selection each row is a
    float32 sum over ``counts`` tokens of one prompt, combined and divided by the writer (a prompt
    prefilled over several steps has one partial row per step).
    """

    prompt: np.ndarray
    position: np.ndarray
    token_id: np.ndarray
    prompt_length: np.ndarray  # each row's prompt's length in tokens
    counts: np.ndarray | None = None
    values: dict[str, torch.Tensor] = field(default_factory=dict)
    ready: Any = None
    keep: np.ndarray | None = None  # the rows to write, when some turned out not selected (a generation's end)

    def nbytes(self) -> int:
        return sum(value.numel() * value.element_size() for value in self.values.values())

    def kept(self) -> Block:
        """The block with only the rows ``keep`` marks (host rows: after ``ready``)."""
        if self.keep is None:
            return self
        keep = self.keep
        index = torch.from_numpy(np.flatnonzero(keep))
        values = {key: value.index_select(0, index) for key, value in self.values.items()}
        return Block(
            self.prompt[keep], self.position[keep], self.token_id[keep], self.prompt_length[keep], values=values
        )


@dataclass
class ShardJob:
    """Everything the writer needs for one chunk's shard."""

    chunk: str
    keys: list[str]
    dtype: torch.dtype
    mean: bool
    prompts: list[int]
    tokens: int
    blocks: list[Block]
    sink: dict[str, Any]
    metadata: dict[str, str]
    cancelled: threading.Event
    means_generated: bool = False  # a mean row averages generated tokens only
    outliers: Outliers | None = None


class ShardWriter:
    """Daemon threads writing shards and posting each outcome to the outbox.

    Several, so that chunks finishing close together are hashed and written in parallel (sha256 and
    file or socket writes release the GIL): one thread's hashing alone tops out near 2 GB/s.
    """

    def __init__(self, threads: int = 4) -> None:
        self.jobs: queue.SimpleQueue[ShardJob] = queue.SimpleQueue()
        self.pending: dict[str, threading.Event] = {}  # chunk -> its cancel flag, until written
        self._lock = threading.Lock()
        for index in range(threads):
            threading.Thread(target=self._run, name=f"nnqueue-shard-writer-{index}", daemon=True).start()

    def submit(self, job: ShardJob) -> None:
        with self._lock:
            self.pending[job.chunk] = job.cancelled
        self.jobs.put(job)

    def cancel(self, chunk: str) -> bool:
        """Stop writing ``chunk`` (nothing is posted for it); whether it was still to be written."""
        with self._lock:
            cancelled = self.pending.get(chunk)
        if cancelled is not None:
            cancelled.set()
        return cancelled is not None

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            try:
                if job.cancelled.is_set():
                    raise Cancelled
                outbox.post(write_shard(job))
            except Cancelled:
                pass
            except Exception as error:
                log.exception("harvest chunk %s: shard not written", job.chunk)
                outbox.post(failure(job.chunk, f"writing the shard failed: {error!r}\n{traceback.format_exc()}"))
            finally:
                job.blocks.clear()
                with self._lock:
                    self.pending.pop(job.chunk, None)


def failure(chunk: str, error: str) -> dict[str, Any]:
    return {"id": chunk, "kind": SHARD_ENTRY, "error": error}


def write_shard(job: ShardJob) -> dict[str, Any]:
    """Write ``job``'s shard to its sink; returns the outbox entry."""
    for block in job.blocks:
        if block.ready is not None:
            block.ready.synchronize()
    blocks = [_combine_means(job)] if job.mean else [block.kept() for block in job.blocks]
    outliers = _screened(job.outliers, job.keys, blocks) if job.outliers is not None else None
    if outliers is not None:
        blocks = [block.kept() for block in blocks]
    prompt = _concat([b.prompt for b in blocks])
    position = _concat([b.position for b in blocks])
    order = np.lexsort((position, prompt))
    prompt_length = _concat([b.prompt_length for b in blocks])[order]
    generated = np.full(len(order), job.means_generated) if job.mean else position[order] >= prompt_length
    columns = {
        PROMPT_INDEX: prompt[order],
        TOKEN_POSITION: position[order],
        TOKEN_ID: _concat([b.token_id for b in blocks])[order],
        PROMPT_LENGTH: prompt_length,
        GENERATED: np.ascontiguousarray(generated, dtype="?"),
    }
    runs = _runs(order, np.cumsum([0] + [len(b.prompt) for b in blocks]))
    rows = len(order)
    widths = {key: _width(blocks, key) for key in job.keys}
    stats = shard_stats(job.keys, widths, blocks)

    names = sorted([*job.keys, *columns])
    header: dict[str, Any] = {"__metadata__": {**job.metadata, "format": SHARD_FORMAT}}
    offset = 0
    for name in names:
        if name in columns:
            entry, nbytes = {"dtype": _COLUMN_DTYPES[columns[name].dtype], "shape": [rows]}, columns[name].nbytes
        else:
            entry = {"dtype": _SAFETENSORS_DTYPES[job.dtype], "shape": [rows, widths[name]]}
            nbytes = rows * widths[name] * job.dtype.itemsize
        header[name] = {**entry, "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    encoded = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    size = 8 + len(encoded) + offset

    def pieces() -> Iterator[Any]:
        yield len(encoded).to_bytes(8, "little") + encoded
        for name in names:
            if job.cancelled.is_set():
                raise Cancelled
            if name in columns:
                yield columns[name].tobytes()
                continue
            views = [_bytes_view(block.values[name]) for block in blocks]
            for block, start, stop in runs:
                yield views[block][start:stop]

    written = sink.write_stream(job.sink, size, pieces())
    first_rows = np.searchsorted(columns[PROMPT_INDEX], job.prompts, side="left")
    last_rows = np.searchsorted(columns[PROMPT_INDEX], job.prompts, side="right")
    return {
        "id": job.chunk,
        "kind": SHARD_ENTRY,
        "error": None,
        "rows": rows,
        "bytes": written.size,
        "sha256": written.sha256,
        "tokens": job.tokens,
        "steps": len(job.blocks),
        "prompts": [[int(p), int(a), int(b - a)] for p, a, b in zip(job.prompts, first_rows, last_rows, strict=True)],
        "generated_rows": int(columns[GENERATED].sum()),
        "outliers": outliers,
        "stats": stats,
    }


def _concat(arrays: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(arrays).astype(np.int64) if arrays else np.zeros(0, np.int64)


def _width(blocks: list[Block], key: str) -> int:
    widths = {block.values[key].shape[1] for block in blocks if key in block.values}
    if len(widths) > 1:
        raise RuntimeError(f"{key} had different widths in different steps: {sorted(widths)}")
    missing = [index for index, block in enumerate(blocks) if key not in block.values]
    if missing:
        raise RuntimeError(f"{key} was not captured in {len(missing)} of {len(blocks)} steps")
    return widths.pop() if widths else 0


def _bytes_view(value: torch.Tensor) -> np.ndarray:
    """``[rows, features]`` -> a ``[rows, bytes]`` uint8 view of the same memory."""
    return value.contiguous().view(torch.uint8).numpy()


def _runs(order: np.ndarray, starts: np.ndarray) -> list[tuple[int, int, int]]:
    """``order`` (global row numbers in output order) as (block, first, stop) runs of consecutive rows."""
    if not len(order):
        return []
    block = np.searchsorted(starts, order, side="right") - 1
    breaks = np.flatnonzero((np.diff(order) != 1) | (np.diff(block) != 0)) + 1
    heads = np.concatenate([[0], breaks])
    tails = np.concatenate([breaks, [len(order)]])
    return [
        (int(block[h]), int(order[h] - starts[block[h]]), int(order[h] - starts[block[h]] + t - h))
        for h, t in zip(heads, tails, strict=True)
    ]


def _screened(outliers: Outliers, keys: list[str], blocks: list[Block]) -> dict[str, Any]:
    """Drop or clip the blocks' rows over ``outliers``' limits (a drop marks `Block.keep`; a clip scales the rows
    in place); what was done: the limits, each capture's rows over its limit and the rows dropped."""
    norms = [{key: row_norms(block.values[key]) for key in keys} for block in blocks]
    limits = {}
    for key in keys:
        finite = torch.cat([norm[key] for norm in norms]) if norms else torch.zeros(0)
        finite = finite[torch.isfinite(finite)]
        limits[key] = outliers.limit(float(finite.median()) if len(finite) else 0.0)
    over, dropped = dict.fromkeys(keys, 0), 0
    for block, norm in zip(blocks, norms, strict=True):
        screened = screen(block.values, limits, outliers.action, norm)
        for key, count in screened.over.items():
            over[key] += count
        if screened.keep is not None:
            block.keep = screened.keep.numpy()
            dropped += int((~screened.keep).sum())
    return {**outliers.to_json(), "limits": limits, "over": over, "dropped_rows": dropped}


def _combine_means(job: ShardJob) -> Block:
    """One row per prompt: the float32 partial sums of every step, divided by the token count."""
    blocks = job.blocks
    prompt = _concat([b.prompt for b in blocks])
    counts = _concat([b.counts for b in blocks if b.counts is not None])
    prompts, first, inverse = np.unique(prompt, return_index=True, return_inverse=True)
    total = np.bincount(inverse, weights=counts, minlength=len(prompts))
    index = torch.from_numpy(inverse)
    values = {}
    for key in job.keys:
        sums = torch.cat([block.values[key] for block in blocks])
        combined = torch.zeros(len(prompts), sums.shape[1], dtype=torch.float32).index_add_(0, index, sums)
        values[key] = (combined / torch.from_numpy(total).to(torch.float32)[:, None]).to(job.dtype)
    none = np.full(len(prompts), -1, np.int64)
    lengths = _concat([b.prompt_length for b in blocks])[first]
    return Block(prompts.astype(np.int64), none, none.copy(), lengths, values=values)
