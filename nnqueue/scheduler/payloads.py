"""Where a job's payload is kept: beside its row in the database when small, otherwise in the object store.

A payload of at most ``NNQUEUE_INLINE_PAYLOAD_MAX_BYTES`` is inserted into ``job_payloads`` in the same
transaction as its job (an object-store PUT costs a round trip and a request signature, several times the
insert); a larger one goes to the store under a key derived from the job's id, which the job's row names, while
the job's transaction is open (after the row was added, so a refused job stores nothing). Either way the payload
is durable before the job is committed, and deleting the job removes a kept payload.
"""

from __future__ import annotations

import uuid

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from nnqueue import metrics
from nnqueue.db.models import Job, JobPayload
from nnqueue.errors import NNqueueError
from nnqueue.storage.keys import payload_key
from nnqueue.storage.object_store import ObjectNotFound, ObjectStore


class PayloadMissing(NNqueueError, LookupError):
    """The job's payload is neither in the database nor in the object store."""


def object_key(job_id: uuid.UUID, size: int, inline_max_bytes: int) -> str | None:
    """The object-store key of a payload of ``size`` bytes too large to keep inline; None for a small one, which
    goes into ``job_payloads`` beside its job."""
    return None if size <= inline_max_bytes else payload_key(job_id)


def store_payload(store: ObjectStore, key: str, data: bytes) -> None:
    """Put a payload too large to keep inline into the object store, before its job's transaction commits."""
    store.put_bytes(key, data)
    metrics.STORE_BYTES_WRITTEN.labels("payload").inc(len(data))


def keep_inline(session: Session, job_id: uuid.UUID, data: bytes) -> None:
    """Add a small payload to the session, beside its (already added) job. The caller commits."""
    session.add(JobPayload(job_id=job_id, data=data))


def load_inline(sessions: sessionmaker[Session], job_ids: list[uuid.UUID]) -> dict[uuid.UUID, bytes]:
    """The payloads the database keeps for these jobs, read in one query (a job missing from it has none there)."""
    with sessions() as session:
        rows = session.execute(select(JobPayload.job_id, JobPayload.data).where(JobPayload.job_id.in_(job_ids)))
        return {job_id: data for job_id, data in rows}


def load_payload(sessions: sessionmaker[Session], store: ObjectStore, job: Job) -> bytes:
    """The job's payload, from wherever it is kept; raises :class:`PayloadMissing`."""
    if job.payload_key is None:
        with sessions() as session:
            kept = session.get(JobPayload, job.id)
        if kept is None:
            raise PayloadMissing(f"the job's payload is not in the database (job_payloads, job {job.id})")
        return kept.data
    try:
        return store.get_bytes(job.payload_key)
    except ObjectNotFound:
        raise PayloadMissing(f"the job's payload {job.payload_key} is not in the object store") from None
