"""Retention: the payloads and results of jobs that ended long ago are deleted; their rows stay.

With ``NNQUEUE_RETENTION_DAYS`` set, :func:`purge_expired` (``nnqueue gc``, or a periodic task) deletes the
objects (and a payload kept in the database) of every job that ended (completed, failed or cancelled) more
than that long ago and marks the row ``purged_at``, so the API answers 410 for its result and the history (status, times, errors, sizes) remains.
Unset, nothing is ever deleted: results are the users' data, and deleting them is the operator's choice.

Objects are deleted before the row is marked, so an interrupted run leaves rows that the next run
finishes (deleting a missing object is not an error). Ended jobs never change again, so nothing races it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import delete, func, select, update
from sqlalchemy.orm import Session, sessionmaker

from nnqueue.db.models import ENDED, Job, JobPayload, utcnow
from nnqueue.db.session import transaction
from nnqueue.storage.keys import results_prefix
from nnqueue.storage.object_store import ObjectStore

log = logging.getLogger(__name__)
BATCH_SIZE = 500


@dataclass(frozen=True)
class PurgeReport:
    jobs: int  # jobs whose objects were deleted (or, in a dry run, would be)
    cutoff: datetime  # jobs that ended before this


def purge_expired(
    sessions: sessionmaker[Session],
    store: ObjectStore,
    older_than: timedelta,
    *,
    dry_run: bool = False,
    batch_size: int = BATCH_SIZE,
) -> PurgeReport:
    """Delete the payload and results of every job that ended more than ``older_than`` ago and is not yet purged."""
    cutoff = utcnow() - older_than
    expired = select(Job.id, Job.payload_key).where(
        Job.status.in_(ENDED), Job.purged_at.is_(None), Job.finished_at < cutoff
    )
    if dry_run:
        with sessions() as session:
            count = session.scalar(select(func.count()).select_from(expired.subquery()))
        return PurgeReport(count or 0, cutoff)
    purged = 0
    while True:
        with sessions() as session:
            batch = session.execute(expired.order_by(Job.finished_at).limit(batch_size)).all()
        if not batch:
            break
        for job_id, payload_key in batch:
            if payload_key is not None:  # None: the payload is in the database
                store.delete(payload_key)
            # Every attempt's results (a lost attempt may have left some), and the per-job keys of older
            # versions: whatever is under the job's folder, found by one listing.
            store.delete_prefix(results_prefix(job_id))
        ids = [job_id for job_id, _ in batch]
        with transaction(sessions) as session:
            session.execute(delete(JobPayload).where(JobPayload.job_id.in_(ids)))
            session.execute(
                update(Job)
                .where(Job.id.in_(ids), Job.purged_at.is_(None))
                .values(purged_at=utcnow())
                .execution_options(synchronize_session=False)
            )
        purged += len(batch)
        if len(batch) < batch_size:
            break
    log.info("retention: deleted the payloads and results of %d jobs that ended before %s", purged, cutoff)
    return PurgeReport(purged, cutoff)
