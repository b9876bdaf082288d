"""Accepting a harvest: check the spec against the world, freeze its dataset, split it into chunks; or, for a dry run, estimate it (:func:`estimate_harvest`).

The order makes an accepted harvest durable before any worker can run it, as for jobs: the uploaded file
and the frozen dataset go to the object store first, then the QUEUED harvest and its chunk rows are
committed in one transaction, then one token per chunk goes on the model's bulk queue (a token whose send
fails is re-sent by the reconciler: the harvest stays accepted). Every refusal is a :class:`HarvestRejected`
with the HTTP status and the reason. The API accepts a harvest in its request's transaction
(:func:`accept_harvest`, then :func:`queue_harvest`); ``nnqueue beat`` starts scheduled runs with
:func:`create_harvest`.
"""

from __future__ import annotations

import logging
import math
import uuid
from dataclasses import dataclass
from typing import Annotated, Any

from celery import Celery
from pydantic import Field
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from nnqueue.db.ids import starting_with
from nnqueue.db.models import Harvest, HarvestChunk, JobStatus, utcnow
from nnqueue.db.session import transaction
from nnqueue.enginecore.capture_points import check_against
from nnqueue.enginecore.harvest_spec import SpecError
from nnqueue.scheduler.enqueue import send_chunk_tokens
from nnqueue.scheduler.harvest_dataset import Example, Limits, freeze, load_examples, upload_key, uploaded_examples
from nnqueue.scheduler.harvest_estimate import HarvestEstimate, estimate, refusal
from nnqueue.scheduler.harvest_spec import HarvestRejected, HarvestSpec
from nnqueue.scheduler.registry import live_capture_points, live_workers
from nnqueue.scheduler.weights import WeightsRejected, resolve_pin
from nnqueue.storage.keys import DATASET_FILE, harvest_key, shard_name
from nnqueue.storage.object_store import ObjectStore

log = logging.getLogger(__name__)
S = JobStatus


@dataclass(frozen=True)
class Upload:
    filename: str
    data: bytes


@dataclass(frozen=True)
class Submission:
    """Who submits a harvest, and from where: a caller's key, or a schedule."""

    owner: str
    limits: Limits
    stale_after_s: float
    api_key_id: int | None = None
    upload: Upload | None = None
    schedule_id: int | None = None
    max_output_bytes: int | None = None  # NNQUEUE_HARVEST_MAX_OUTPUT_BYTES
    # A model still takes harvests this long after its last live worker (NNQUEUE_WORKER_RESTART_GRACE_S), and
    # these models whenever a worker of theirs ever published capture points (NNQUEUE_SCALE_TO_ZERO_MODELS).
    restart_grace_s: float = 0.0
    scale_to_zero_models: tuple[str, ...] = ()


def accept_harvest(session: Session, store: ObjectStore, spec: HarvestSpec, submission: Submission) -> Harvest:
    """Check the spec, store its dataset frozen, and add the QUEUED harvest and its chunks to the caller's
    transaction; raises :class:`HarvestRejected`. The caller commits, then calls :func:`queue_harvest`."""
    points = check_captures(session, spec, submission)
    try:
        pin = resolve_pin(session, spec.model_key, spec.weights_version, submission.stale_after_s)
    except WeightsRejected as refused:
        raise HarvestRejected(refused.status, refused.reason) from None
    _refuse_if_full(session, submission)
    harvest_id = uuid.uuid4()
    if submission.upload is not None:
        upload_at = upload_key(submission.owner, str(harvest_id), submission.upload.filename)
        examples = _upload_examples(spec, submission, upload_at)
    else:
        examples = load_examples(store, spec.dataset, submission.owner, submission.limits)
    limit = submission.max_output_bytes
    if limit is not None:
        guess = estimate(session, spec, examples, points)
        if guess.bytes > limit:
            raise HarvestRejected(413, refusal(guess, limit))
    if submission.upload is not None:  # kept under the owner's prefix (once it parsed and fits), for later specs
        store.put_bytes(upload_at, submission.upload.data)
        spec = spec.model_copy(update={"dataset": spec.dataset.model_copy(update={"path": upload_at})})
    frozen = freeze(examples)
    dataset_key = harvest_key(harvest_id, DATASET_FILE)
    store.put_bytes(dataset_key, frozen.data)

    per_chunk, now = spec.prompts_per_chunk, utcnow()
    harvest = Harvest(
        id=harvest_id,
        owner=submission.owner,
        api_key_id=submission.api_key_id,
        model_key=spec.model_key,
        status=S.QUEUED,
        priority=spec.priority,
        spec=spec.model_dump(mode="json"),
        dataset_key=dataset_key,
        dataset_digest=frozen.digest,
        prompts=frozen.prompts,
        chunks_total=-(-frozen.prompts // per_chunk),
        schedule_id=submission.schedule_id,
        weights_pin=pin,
        created_at=now,
    )
    session.add(harvest)
    session.flush()
    session.add_all(
        HarvestChunk(
            harvest_id=harvest_id,
            index=index,
            model_key=spec.model_key,
            owner=submission.owner,
            priority=spec.priority,
            status=S.QUEUED,
            first_prompt=first,
            prompts=min(per_chunk, frozen.prompts - first),
            dataset_start=frozen.line_starts[first],
            dataset_end=frozen.line_starts[min(first + per_chunk, frozen.prompts)],
            shard_key=harvest_key(harvest_id, shard_name(index)),
            weights_pin=pin,
            queued_at=now,
        )
        for index, first in enumerate(range(0, frozen.prompts, per_chunk))
    )
    return harvest


def estimate_harvest(
    session: Session, store: ObjectStore, spec: HarvestSpec, submission: Submission
) -> HarvestEstimate:
    """What accepting ``spec`` would harvest (:mod:`nnqueue.scheduler.harvest_estimate`), checked as
    :func:`accept_harvest` checks it, with nothing stored or queued; raises :class:`HarvestRejected`."""
    points = check_captures(session, spec, submission)
    if submission.upload is None:
        examples = load_examples(store, spec.dataset, submission.owner, submission.limits)
    else:
        examples = _upload_examples(spec, submission, submission.upload.filename)
    return estimate(session, spec, examples, points)


def queue_harvest(app: Celery, harvest: Harvest) -> None:
    """Send a committed harvest's chunk tokens; a failed send is logged, and the reconciler sends them later."""
    try:
        send_chunk_tokens(app, harvest.model_key, harvest.chunks_total)
    except Exception:  # the harvest is accepted: a worker's reconciler sends the tokens at its next beat
        log.exception("harvest %s queued, but its chunk tokens could not be sent; the reconciler will", harvest.id)


def create_harvest(
    sessions: sessionmaker[Session], store: ObjectStore, app: Celery, spec: HarvestSpec, submission: Submission
) -> Harvest:
    """:func:`accept_harvest` in a transaction of its own, then :func:`queue_harvest`."""
    with transaction(sessions) as session:
        harvest = accept_harvest(session, store, spec, submission)
    queue_harvest(app, harvest)
    return harvest


def _refuse_if_full(session: Session, submission: Submission) -> None:
    """429 if the submitting key has its limit of harvests queued or running (``Limits.max_in_flight_per_key``)."""
    limit = submission.limits.max_in_flight_per_key
    if limit is None or submission.api_key_id is None:
        return
    in_flight = session.scalar(
        select(func.count())
        .select_from(Harvest)
        .where(Harvest.api_key_id == submission.api_key_id, Harvest.status.in_((S.QUEUED, S.RUNNING)))
    )
    if (in_flight or 0) >= limit:
        raise HarvestRejected(
            429,
            f"this API key already has {in_flight} harvests queued or running; the limit is {limit} "
            "(NNQUEUE_MAX_HARVESTS_IN_FLIGHT_PER_KEY): wait for some to finish",
        )


def check_captures(session: Session, spec: HarvestSpec, submission: Submission) -> list[dict[str, Any]]:
    """Refuse a model no live worker serves (400; a worker live within the restart grace, or ever for a model
    scaled to zero, counts), one whose workers run no harvests (400), and captures its workers did not publish
    as capturable (422, naming the capturable modules); returns the capture points."""
    grace = math.inf if spec.model_key in submission.scale_to_zero_models else submission.restart_grace_s
    points = live_capture_points(session, spec.model_key, submission.stale_after_s, grace)
    if points is None:
        live = sorted({worker.model_key for worker in live_workers(session, submission.stale_after_s)})
        raise HarvestRejected(
            400, f"no live worker serves model {spec.model_key!r}; live models: {', '.join(live) or 'none'}"
        )
    if not points:
        raise HarvestRejected(
            400, f"the live workers of model {spec.model_key!r} run no harvests (harvests run on vLLM workers)"
        )
    try:
        check_against(spec.captures, points)
    except SpecError as error:
        raise HarvestRejected(422, f"{spec.model_key!r}: {error}") from None
    return points


def _upload_examples(spec: HarvestSpec, submission: Submission, key: str) -> list[Example]:
    """The examples of the file uploaded with ``spec`` (to be kept at ``key``), parsed from the request's bytes."""
    upload, limit = submission.upload, submission.limits.max_bytes
    assert upload is not None
    if spec.dataset.inline is not None or spec.dataset.path or spec.dataset.prefix:
        raise HarvestRejected(422, "a file was uploaded, so the spec's dataset must not name another source")
    if len(upload.data) > limit:
        raise HarvestRejected(
            413, f"the upload is {len(upload.data)} bytes; the limit is {limit} (NNQUEUE_HARVEST_MAX_DATASET_BYTES)"
        )
    return uploaded_examples(upload.data, key, spec.dataset, submission.limits)


def recent_harvests(
    session: Session, owner: str | None, status: JobStatus | None, limit: int, id_prefix: str | None = None
) -> list[Harvest]:
    """The newest ``limit`` harvests of ``owner`` (everyone's for None), only those in ``status`` and whose id starts
    with ``id_prefix`` (:mod:`nnqueue.db.ids`) when given."""
    query = select(Harvest).order_by(Harvest.created_at.desc(), Harvest.id.desc()).limit(limit)
    if owner is not None:
        query = query.where(Harvest.owner == owner)
    if status is not None:
        query = query.where(Harvest.status == status)
    if id_prefix is not None:
        query = query.where(starting_with(Harvest.id, id_prefix))
    return list(session.scalars(query))


@dataclass(frozen=True)
class HarvestProgress:
    """A harvest's progress from its completed chunks (also the API's ``progress`` body)."""

    chunks_done: int
    chunks_total: int
    prompts_done: int
    prompts_total: int
    tokens: int
    bytes: int
    tokens_per_s: Annotated[
        float | None, Field(description="Tokens harvested per second since the first chunk started.")
    ]
    eta_s: Annotated[float | None, Field(description="Seconds left at that rate; null until a chunk has completed.")]


def progress(session: Session, harvests: list[Harvest]) -> dict[uuid.UUID, HarvestProgress]:
    """Each harvest's progress from its completed chunks, in one query."""
    if not harvests:
        return {}
    rows = session.execute(
        select(
            HarvestChunk.harvest_id,
            func.count(),
            func.sum(HarvestChunk.prompts),
            func.sum(HarvestChunk.tokens),
            func.sum(HarvestChunk.bytes),
        )
        .where(HarvestChunk.harvest_id.in_([h.id for h in harvests]), HarvestChunk.status == S.COMPLETED)
        .group_by(HarvestChunk.harvest_id)
    ).all()
    # int(): Postgres sums bigints as numeric (Decimal), which float arithmetic refuses.
    done = {harvest_id: (int(c), int(p or 0), int(t or 0), int(b or 0)) for harvest_id, c, p, t, b in rows}
    return {harvest.id: _progress(harvest, *done.get(harvest.id, (0, 0, 0, 0))) for harvest in harvests}


def _progress(harvest: Harvest, chunks: int, prompts: int, tokens: int, size: int) -> HarvestProgress:
    started, finished = harvest.started_at, harvest.finished_at
    elapsed = None if started is None else max(((finished or utcnow()) - started).total_seconds(), 1e-6)
    rate = tokens / elapsed if elapsed and tokens else None
    eta = None
    if elapsed and prompts and harvest.status in (S.QUEUED, S.RUNNING):
        eta = (harvest.prompts - prompts) * elapsed / prompts
    return HarvestProgress(chunks, harvest.chunks_total, prompts, harvest.prompts, tokens, size, rate, eta)
