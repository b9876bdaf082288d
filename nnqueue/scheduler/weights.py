"""Weights versions on the scheduler's side: which versions live workers serve, the checkpoint swaps asked for a
model key, and a job's or harvest's pin.

A worker reports the version its engine serves in its registry row (``Worker.weights_version``, with when it
started serving it and where it came from); the worker side is :mod:`nnqueue.workers.weights`. A checkpoint swap
is a :class:`~nnqueue.db.models.WeightsUpdate` row: the database is the signal, as for a cancel. Each live worker
of the model sees it at its next heartbeat and loads it; a worker that starts later replays the model's updates
in order before it registers, so every worker of a model key ends on the newest version.

A pin (``weights_version`` in a job's or harvest's spec) is a version string, or ``"latest"``: the version the
model's live workers took most recently, resolved once at submit. A pin must name a version that is served now or
that an update will bring (400 otherwise: nothing could ever run it). A pinned job is claimed only by a worker
serving that version (:mod:`nnqueue.scheduler.claim`); when no live worker serves it any more (the model moved
on), the job stays QUEUED and its API views say why (:func:`waiting_reasons`) until it is cancelled or a worker
serving that version comes back.
"""

from __future__ import annotations

import hashlib
import json
import uuid
from collections import Counter
from collections.abc import Iterable
from pathlib import PurePosixPath

from sqlalchemy import select
from sqlalchemy.orm import Session

from nnqueue.db.models import Harvest, Job, JobStatus, WeightsUpdate, Worker
from nnqueue.errors import NNqueueError
from nnqueue.scheduler.registry import live_workers

LATEST = "latest"
MAX_TENSOR_NAMES = 100_000


class WeightsRejected(NNqueueError, ValueError):
    """A pin or an update that cannot be honoured; ``status`` is the HTTP status that says why."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status, self.reason = status, reason


def check_source(source: str, bucket: str | None) -> str:
    """``s3://<bucket>/<key>`` of this deployment's object store (``bucket`` None: a local store, any bucket name)
    or an absolute path the workers can read; returned as given."""
    if "\x00" in source or not source.strip():
        raise WeightsRejected(422, "the checkpoint source is empty or holds a NUL")
    if source.startswith("s3://"):
        store_bucket, _, key = source.removeprefix("s3://").partition("/")
        if not key:
            raise WeightsRejected(422, f"{source!r} names no object key (s3://<bucket>/<key>)")
        if bucket is not None and store_bucket != bucket:
            raise WeightsRejected(
                422, f"workers read checkpoints from the bucket {bucket!r} only, not {store_bucket!r}"
            )
        return source
    if not PurePosixPath(source).is_absolute():
        raise WeightsRejected(422, f"a checkpoint path must be absolute (on the workers' hosts), not {source!r}")
    return source


def store_key(source: str) -> str | None:
    """The object key of an ``s3://`` source (None for a path)."""
    return source.removeprefix("s3://").partition("/")[2] if source.startswith("s3://") else None


def request_update(
    session: Session, model_key: str, source: str, tensors: list[str] | None, owner: str, stale_after_s: float
) -> WeightsUpdate:
    """Add the update row (the caller commits): every live vLLM worker of ``model_key`` loads it at its next beat."""
    engines = {worker.engine for worker in live_workers(session, stale_after_s) if worker.model_key == model_key}
    if not engines:
        raise WeightsRejected(404, f"no live worker serves model key {model_key!r}")
    if engines != {"vllm"}:
        raise WeightsRejected(
            409,
            f"model key {model_key!r} is served by a {'/'.join(sorted(engines))} engine: "
            "checkpoint swaps load into vLLM engines only",
        )
    if tensors is not None and not tensors:
        raise WeightsRejected(422, "tensors: name at least one tensor, or leave it out to load every tensor")
    update = WeightsUpdate(model_key=model_key, version="", source=source, tensors=tensors, owner=owner)
    session.add(update)
    session.flush()  # its id
    digest = hashlib.sha256(json.dumps([model_key, update.id, source, tensors]).encode()).hexdigest()[:10]
    update.version = f"u{update.id}-{digest}"
    return update


def updates_after(session: Session, model_key: str, after_id: int) -> list[WeightsUpdate]:
    """``model_key``'s updates newer than ``after_id``, oldest first (a worker applies them in this order)."""
    query = select(WeightsUpdate).where(WeightsUpdate.model_key == model_key, WeightsUpdate.id > after_id)
    return list(session.scalars(query.order_by(WeightsUpdate.id)))


def served_versions(session: Session, model_key: str, stale_after_s: float) -> Counter[str]:
    """The versions ``model_key``'s live workers serve, each with its number of workers."""
    return Counter(
        worker.weights_version
        for worker in live_workers(session, stale_after_s)
        if worker.model_key == model_key and worker.weights_version is not None
    )


def latest_version(session: Session, model_key: str, stale_after_s: float) -> str | None:
    """The version the model's live workers took most recently (None: none reports one)."""
    workers = [
        worker
        for worker in live_workers(session, stale_after_s)
        if worker.model_key == model_key and worker.weights_version is not None
    ]
    newest = max(workers, key=_since, default=None)
    return None if newest is None else newest.weights_version


def resolve_pin(session: Session, model_key: str, pin: str | None, stale_after_s: float) -> str | None:
    """The version a submission pins (None: any): ``"latest"`` resolved now; a named one checked (see the module
    doc)."""
    if pin is None:
        return None
    if pin == LATEST:
        latest = latest_version(session, model_key, stale_after_s)
        if latest is None:
            raise WeightsRejected(409, f"no live worker of {model_key!r} reports a weights version to pin")
        return latest
    served = served_versions(session, model_key, stale_after_s)
    pending = session.scalar(
        select(WeightsUpdate.id).where(WeightsUpdate.model_key == model_key, WeightsUpdate.version == pin).limit(1)
    )
    if pin not in served and pending is None:
        shown = ", ".join(sorted(served)) or "none"
        raise WeightsRejected(
            400,
            f"no live worker of {model_key!r} serves weights version {pin!r}, and no update brings it "
            f"(served now: {shown})",
        )
    return pin


def waiting_reasons(session: Session, units: Iterable[Job | Harvest], stale_after_s: float) -> dict[uuid.UUID, str]:
    """Why each pinned job (QUEUED) or harvest (QUEUED or RUNNING: its chunks left) of ``units`` is not running,
    for those whose pinned version no live worker of their model serves (the others are absent). One query per
    model key."""
    served: dict[str, Counter[str]] = {}
    reasons = {}
    for unit in units:
        waits = unit.status is JobStatus.QUEUED or (isinstance(unit, Harvest) and unit.status is JobStatus.RUNNING)
        if not waits or unit.weights_pin is None:
            continue
        if unit.model_key not in served:
            served[unit.model_key] = served_versions(session, unit.model_key, stale_after_s)
        if unit.weights_pin not in served[unit.model_key]:
            shown = ", ".join(sorted(served[unit.model_key])) or "none"
            reasons[unit.id] = (
                f"waiting for a worker serving weights version {unit.weights_pin!r}; the live workers of "
                f"{unit.model_key!r} serve {shown}. It runs if such a worker comes back; cancel it, or submit it "
                "again pinned to a served version"
            )
    return reasons


def _since(worker: Worker) -> float:
    return worker.weights_since.timestamp() if worker.weights_since is not None else 0.0
