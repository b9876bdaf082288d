"""Run one harvest chunk on an engine: begin it, prefill its prompts, await the shard written by the engine.

Runs on the worker's engine loop. The chunk's prompts arrive tokenized and truncated (the scheduler's
harvest planning does that); each becomes a ``TokensPrompt`` with ``max_tokens=1`` (a prefill), or with the
chunk's `Generation` settings (`sampling_params`), tagged for the engine's capture path
(`nnqueue.enginecore.harvest_capture`). The engine captures, writes the
shard to the sink and posts its size, checksum, per-prompt row ranges, generated rows and outliers to the
outbox; nothing but those numbers comes back here.

Cancelling `run_chunk` (or any failure) aborts the chunk's requests and drops the chunk on the engine.
"""

from __future__ import annotations

import asyncio
import re
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import accumulate
from typing import Any, TypeVar

from nnqueue.enginecore import harvest_stats
from nnqueue.enginecore.capture_points import merge_stages
from nnqueue.enginecore.harvest_capture import TAG
from nnqueue.enginecore.harvest_spec import (
    Capture,
    Generation,
    Selection,
    check_captures,
    check_dtype,
    check_generation,
)
from nnqueue.enginecore.shard_writer import SHARD_ENTRY
from nnqueue.engines.outbox import poller
from nnqueue.errors import NNqueueError
from nnqueue.outliers import Outliers

__all__ = [
    "Capture",
    "ChunkResult",
    "ChunkWork",
    "Generation",
    "HarvestError",
    "Outliers",
    "PromptRows",
    "Selection",
    "capture_chunk",
    "run_chunk",
    "sampling_params",
]

_SHA256 = re.compile(r"[0-9a-f]{64}")
T = TypeVar("T")


class HarvestError(NNqueueError, RuntimeError):
    """The engine refused the chunk, or could not capture or write it; the message says why."""


@dataclass(frozen=True)
class ChunkWork:
    """One chunk of a harvest, ready to run on an engine.

    Attributes:
        chunk_id: the chunk's stable name (the same on every attempt); written into the shard's metadata.
        prompt_indices: each prompt's index in the harvest's dataset (unique).
        token_ids: each prompt's token ids, tokenized and truncated, in the same order (none empty).
        captures: what to capture (`Capture`), at least one; tensor names `Capture.key` must differ.
        selection: which tokens of each prompt become rows (`Selection`).
        dtype: the stored dtype: ``"bfloat16"``, ``"float16"`` or ``"float32"``.
        sink: where the engine writes the shard (`nnqueue.enginecore.sink`): the worker's pipe, or a handoff
            file path.
        metadata: extra string pairs for the shard's safetensors metadata (e.g. the harvest id).
        generation: let the model generate after each prompt (`Generation`); None: prefill only.
        outliers: drop or clip rows over a norm limit (`nnqueue.outliers.Outliers`); None: keep every row.
    """

    chunk_id: str
    prompt_indices: Sequence[int]
    token_ids: Sequence[Sequence[int]]
    captures: Sequence[Capture]
    selection: Selection
    dtype: str
    sink: Mapping[str, Any]
    metadata: Mapping[str, str] = field(default_factory=dict)
    generation: Generation | None = None
    outliers: Outliers | None = None

    def __post_init__(self) -> None:
        if not self.prompt_indices or len(self.prompt_indices) != len(self.token_ids):
            raise ValueError("a chunk needs one token-id list per prompt index, and at least one prompt")
        if len(set(self.prompt_indices)) != len(self.prompt_indices):
            raise ValueError("a chunk's prompt indices must be unique")
        if not all(self.token_ids):
            raise ValueError("a prompt has no tokens")
        check_captures(list(self.captures))
        check_dtype(self.dtype)
        check_generation(self.selection, self.generation)


@dataclass(frozen=True)
class PromptRows:
    """Where one prompt's rows are in the shard: rows ``first_row .. first_row + rows - 1``."""

    prompt_index: int
    first_row: int
    rows: int


@dataclass(frozen=True)
class ChunkResult:
    """What the engine reports for a written shard (validated here: the engine process is untrusted).

    Attributes:
        chunk_id: the `ChunkWork.chunk_id`.
        rows: rows of every capture tensor in the shard.
        bytes: the shard's size; ``sha256`` its checksum (hex).
        prompts: every prompt of the chunk, in prompt-index order, with its rows.
        tokens: tokens run through the model (prompts, and generated tokens but each sequence's last).
        steps: engine steps that captured rows of the chunk (how its prompts were batched).
        seconds: wall time of the chunk on the engine, from begin to the shard written.
        stats: per capture key, the shard's mergeable statistics (`nnqueue.enginecore.harvest_stats`).
        generated_rows: the shard's rows of generated tokens.
        outliers: for a chunk with `ChunkWork.outliers`, ``{"limits": {key: norm}, "over": {key: rows over its
            limit}, "dropped_rows": rows left out}``; None without.
    """

    chunk_id: str
    rows: int
    bytes: int
    sha256: str
    prompts: tuple[PromptRows, ...]
    tokens: int
    steps: int
    seconds: float
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)
    generated_rows: int = 0
    outliers: dict[str, Any] | None = None


async def run_chunk(llm: Any, work: ChunkWork) -> ChunkResult:
    """Run ``work`` on the engine ``llm`` (an ``AsyncLLM`` whose workers mix in ``NNqueueRPC``).

    Raises `HarvestError` when the engine refuses the chunk or reports it failed (then at once, without
    waiting for its remaining prompts); on any failure or cancellation the chunk's requests are aborted
    and the chunk is dropped on the engine.
    """
    request_ids = [f"nnqh-{uuid.uuid4().hex[:12]}-{index}" for index in work.prompt_indices]

    def prefills(key: str) -> Awaitable[Any]:
        return asyncio.gather(
            *(
                _request(llm, request_id, ids, sampling_params(work.generation, {"chunk": key, "prompt": index}))
                for request_id, index, ids in zip(request_ids, work.prompt_indices, work.token_ids, strict=True)
            )
        )

    _, result = await capture_chunk(llm, work, request_ids, prefills)
    return result


async def capture_chunk(
    llm: Any, work: ChunkWork, request_ids: list[str], requests: Callable[[str], Awaitable[T]]
) -> tuple[T, ChunkResult]:
    """Begin ``work`` on the engine, run ``requests(key)``, await the shard; what the requests returned, and the
    shard's `ChunkResult`.

    ``requests(key)`` sends the chunk's prompts (ids ``request_ids``), each tagged ``extra_args[TAG] = {"chunk":
    key, "prompt": its index}``: `run_chunk`'s prefills, or a steering job's generations
    (`nnqueue.engines.steer_runner.run_steering_captured`). Failures and cancellation as `run_chunk`'s.
    """
    started = time.perf_counter()
    key = f"{work.chunk_id}/{secrets.token_hex(4)}"  # this attempt's name on the engine
    report = poller(llm).expect(key)  # before the engine can post it
    running: asyncio.Future[T] | None = None
    try:
        answers = await llm.collective_rpc("nnqueue_harvest_begin", args=(_engine_spec(work, key),))
        answer = _taken(answers)
        if not isinstance(answer, dict) or answer.get("chunk") != key:
            raise HarvestError(f"the engine refused chunk {work.chunk_id}: {_reason(answer)}")
        running = asyncio.ensure_future(requests(key))
        pending: set[asyncio.Future[Any]] = {running, report}
        await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if not report.done() or report.result().get("error") is None:  # a failure ends the chunk early
            await running
        entry = await report
        if entry.get("kind") != SHARD_ENTRY or entry.get("error") is not None:
            raise HarvestError(f"chunk {work.chunk_id} failed on the engine: {str(entry.get('error'))[:4000]}")
    except BaseException:
        if running is not None:
            running.cancel()
        report.cancel()
        await asyncio.shield(_drop(llm, key, request_ids))
        raise
    assert running is not None
    return running.result(), _result(work, entry, time.perf_counter() - started)


async def capture_points(llm: Any) -> list[dict[str, Any]]:
    """The engine's capturable points (``{"module", "io", "parts"}``, and ``stage`` under pipeline parallelism),
    every stage's, for validating harvest specs."""
    return merge_stages(await llm.collective_rpc("nnqueue_capture_points"))


def _taken(answers: list[Any]) -> Any:
    """The answer to a chunk's begin: a refusal from any stage, else the stage that took it (each pipeline
    stage's reporting rank answers; a stage without the chunk's captures and the other ranks answer None)."""
    given = [answer for answer in answers if answer is not None]
    refused = [answer for answer in given if isinstance(answer, dict) and "error" in answer]
    if refused or not given:
        return refused[0] if refused else {"error": "no pipeline stage of the engine holds the chunk's captures"}
    return given[0]


def _engine_spec(work: ChunkWork, key: str) -> dict[str, Any]:
    return {
        "chunk": key,
        "captures": [capture.to_json() for capture in work.captures],
        "selection": work.selection.to_json(),
        "dtype": work.dtype,
        "prompts": list(work.prompt_indices),
        "sink": dict(work.sink),
        "metadata": {**work.metadata, "chunk": work.chunk_id},
        "generate": work.generation.to_json() if work.generation is not None else None,
        "outliers": work.outliers.to_json() if work.outliers is not None else None,
    }


def sampling_params(generation: Generation | None, tag: dict[str, Any]) -> Any:
    """vLLM's ``SamplingParams`` for one harvest request tagged ``tag`` (``{"chunk", "prompt"}``): a prefill
    (one greedy token), or ``generation``'s sampling as a trace given the same settings samples it. Every token
    runs through the model (no prefix-cache reads), so that each can be captured."""
    from vllm import SamplingParams

    sampling: dict[str, Any] = {"max_tokens": 1, "temperature": 0.0}
    if generation is not None:
        sampling = {
            "max_tokens": generation.max_tokens,
            "temperature": generation.temperature,
            "seed": generation.seed,
            "ignore_eos": generation.ignore_eos,
        }
    return SamplingParams(**sampling, detokenize=False, skip_reading_prefix_cache=True, extra_args={TAG: tag})


async def _request(llm: Any, request_id: str, token_ids: Sequence[int], params: Any) -> None:
    from vllm.inputs import TokensPrompt

    final = None
    async for output in llm.generate(TokensPrompt(prompt_token_ids=list(token_ids)), params, request_id):
        final = output
    reason = final.outputs[0].finish_reason if final is not None and final.outputs else None
    if reason == "abort":
        raise HarvestError(f"prompt {params.extra_args[TAG]['prompt']} was aborted by the engine")


async def _drop(llm: Any, key: str, request_ids: list[str]) -> None:
    await llm.abort(request_ids)
    await llm.collective_rpc("nnqueue_harvest_abort", args=(key,))


def _reason(answer: Any) -> str:
    if isinstance(answer, dict) and "error" in answer:
        return str(answer["error"])[:2000]
    return f"unexpected answer {answer!r:.200}"


def _result(work: ChunkWork, entry: dict[str, Any], seconds: float) -> ChunkResult:
    def integer(value: Any, name: str) -> int:
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise HarvestError(f"the engine reported an invalid {name} for chunk {work.chunk_id}: {value!r:.100}")
        return value

    rows = integer(entry.get("rows"), "row count")
    sha256 = entry.get("sha256")
    if not isinstance(sha256, str) or not _SHA256.fullmatch(sha256):
        raise HarvestError(f"the engine reported an invalid sha256 for chunk {work.chunk_id}")
    reported = entry.get("prompts")
    if not isinstance(reported, list) or any(not isinstance(p, list) or len(p) != 3 for p in reported):
        raise HarvestError(f"the engine reported invalid prompt rows for chunk {work.chunk_id}")
    prompts = tuple(PromptRows(*(integer(v, "prompt row") for v in p)) for p in reported)
    firsts = list(accumulate((p.rows for p in prompts), initial=0))[:-1]
    if [p.prompt_index for p in prompts] != sorted(work.prompt_indices) or [p.first_row for p in prompts] != firsts:
        raise HarvestError(f"the engine's prompt rows for chunk {work.chunk_id} do not match its prompts")
    if sum(p.rows for p in prompts) != rows:
        raise HarvestError(f"the engine's prompt rows for chunk {work.chunk_id} do not add up to its rows")
    keys = [capture.key for capture in work.captures]
    try:
        stats = harvest_stats.check(entry.get("stats"), keys)
    except (ValueError, TypeError) as error:
        raise HarvestError(f"the engine reported invalid statistics for chunk {work.chunk_id}: {error}") from None
    generated_rows = integer(entry.get("generated_rows"), "generated row count")
    outliers = None
    if work.outliers is not None:
        reported_outliers = entry.get("outliers")
        if not isinstance(reported_outliers, dict):
            raise HarvestError(f"the engine reported no outliers for chunk {work.chunk_id}")
        over, limits = reported_outliers.get("over"), reported_outliers.get("limits")
        if (
            not isinstance(over, dict)
            or not isinstance(limits, dict)
            or not sorted(over) == sorted(limits) == sorted(keys)
        ):
            raise HarvestError(f"the engine reported outliers of other captures for chunk {work.chunk_id}")
        if any(isinstance(v, bool) or not isinstance(v, int | float) for v in limits.values()):
            raise HarvestError(f"the engine reported invalid outlier limits for chunk {work.chunk_id}")
        outliers = {
            "limits": {key: float(limits[key]) for key in keys},
            "over": {key: integer(over[key], "outlier count") for key in keys},
            "dropped_rows": integer(reported_outliers.get("dropped_rows"), "dropped row count"),
        }
    if generated_rows > rows:
        raise HarvestError(f"the engine reported more generated rows than rows for chunk {work.chunk_id}")
    return ChunkResult(
        chunk_id=work.chunk_id,
        rows=rows,
        bytes=integer(entry.get("bytes"), "size"),
        sha256=sha256,
        prompts=prompts,
        tokens=integer(entry.get("tokens"), "token count"),
        steps=integer(entry.get("steps"), "step count"),
        seconds=seconds,
        stats=stats,
        generated_rows=generated_rows,
        outliers=outliers,
    )
