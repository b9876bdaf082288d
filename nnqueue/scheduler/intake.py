"""Adding a submitted job to the database: its QUEUED row, its first event and (when small) its payload, provided
its API key has room (:mod:`nnqueue.scheduler.admission`), and its place in the queue, read back.

On Postgres this is one statement built once: the key's jobs in flight and its owner's through all its keys, each
counted up to its limit, decide whether the row is inserted, data-modifying ``WITH`` clauses add the event and the payload beside it, and the same
statement counts the queued jobs ahead of it (which cannot see the new row: the place is one more). One round
trip, no ORM unit of work: the API runs it for every submission, where the ORM's flush of three objects, the
count and the position query, each its own statement, cost about three times the CPU. SQLite has no
data-modifying ``WITH``: there the same steps run one by one, through the ORM.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import (
    BigInteger,
    BindParameter,
    LargeBinary,
    Select,
    String,
    bindparam,
    insert,
    literal,
    null,
    select,
    true,
)
from sqlalchemy.orm import Session

from nnqueue.db.lifecycle import create_job
from nnqueue.db.models import Job, JobEvent, JobPayload
from nnqueue.scheduler.admission import IN_FLIGHT_COUNT, OWNER_IN_FLIGHT_COUNT, refuse_if_full
from nnqueue.scheduler.payloads import keep_inline
from nnqueue.scheduler.positions import jobs_ahead, queue_positions
from nnqueue.scheduler.trust_domains import grouped_domain, own_domain

_JOBS = Job.__table__
# The job's attribute behind each column of its table (``meta`` is stored as ``metadata``).
_ATTRIBUTES = {prop.columns[0].name: prop.key for prop in Job.__mapper__.column_attrs}
_NO_LIMIT = 2**62  # the owner limit bound when there is none (the statement always counts)


def add_job(
    session: Session,
    job: Job,
    inline_payload: bytes | None,
    max_in_flight: int,
    max_owner_in_flight: int | None = None,
) -> int:
    """Add ``job`` (new, QUEUED, every column set) with its first event and ``inline_payload`` (None: its payload
    is in the object store) to the session's transaction, and return its 1-based queue position; raises
    :class:`~nnqueue.scheduler.admission.TooManyJobsInFlight`, adding nothing, when its API key already has
    ``max_in_flight`` jobs queued or running, or the key's owner ``max_owner_in_flight`` through all its keys
    (None: no owner limit). ``job.domain``: its owner's own domain (then the group an admin put
    the owner in, if any, replaces it: :mod:`nnqueue.scheduler.trust_domains`) or the deployment's. The caller
    commits."""
    detail = {"payload_bytes": job.payload_size}
    counts = _count_params(job, max_in_flight, max_owner_in_flight)
    if session.get_bind().dialect.name == "postgresql":
        return _add_in_one_statement(session, job, inline_payload, counts, detail, max_owner_in_flight)
    refuse_if_full(
        session.scalar(IN_FLIGHT_COUNT, counts) or 0,
        max_in_flight,
        session.scalar(OWNER_IN_FLIGHT_COUNT, counts) or 0,
        max_owner_in_flight,
    )
    owner = literal(_grouped_owner(job), String)
    job.domain = session.scalar(select(grouped_domain(owner, literal(job.domain, String))))
    create_job(session, job, detail)
    if inline_payload is not None:
        keep_inline(session, job.id, inline_payload)
    return queue_positions(session, [job])[job.id]


def _count_params(job: Job, max_in_flight: int, max_owner_in_flight: int | None) -> dict[str, Any]:
    """The parameters of the in-flight counts: the job's key and its owner (none without a key), the limits."""
    owner_limit = max_owner_in_flight if max_owner_in_flight is not None else _NO_LIMIT
    key_owner = job.owner if job.api_key_id is not None else None
    return {"key": job.api_key_id, "limit": max_in_flight, "key_owner": key_owner, "owner_limit": owner_limit}


def _add_in_one_statement(
    session: Session,
    job: Job,
    inline_payload: bytes | None,
    counts: dict[str, Any],
    detail: dict[str, Any],
    max_owner_in_flight: int | None,
) -> int:
    values = {column: getattr(job, attribute) for column, attribute in _ATTRIBUTES.items()}
    params = {**values, **counts, "detail": detail, "grouped": _grouped_owner(job)}
    statement = _ADD_WITH_PAYLOAD if inline_payload is not None else _ADD
    row = session.connection().execute(statement, {**params, "payload": inline_payload}).one()
    in_flight, owner_in_flight, added, ahead, job.domain = row
    if not added:
        refuse_if_full(in_flight, counts["limit"], owner_in_flight, max_owner_in_flight)
    return int(ahead) + 1


def _grouped_owner(job: Job) -> str | None:
    """The owner whose group replaces the job's domain: none where the job is in the deployment's domain."""
    return job.owner if job.domain == own_domain(job.owner) else None


def _add_statement(with_payload: bool) -> Select[Any]:
    """The one statement that adds a job (and its inline payload when ``with_payload``), see the module doc.
    Its row: the key's and its owner's jobs in flight (each counted up to its limit), whether the job was added, the
    jobs ahead of it, the job's domain (parameter ``grouped``: the owner whose group, if any, replaces ``domain``)."""
    job: dict[str, BindParameter[Any]] = {column.name: bindparam(column.name, type_=column.type) for column in _JOBS.c}
    in_flight = IN_FLIGHT_COUNT.cte("in_flight")
    owner_in_flight = OWNER_IN_FLIGHT_COUNT.cte("owner_in_flight")
    domain = grouped_domain(bindparam("grouped", type_=String), job["domain"])
    values = [domain if name == "domain" else value for name, value in job.items()]
    counts = in_flight.join(owner_in_flight, true())  # two one-row counts side by side
    room = (
        select(*values)
        .select_from(counts)
        .where(
            in_flight.c[0] < bindparam("limit", type_=BigInteger),
            owner_in_flight.c[0] < bindparam("owner_limit", type_=BigInteger),
        )
    )
    added = insert(Job).from_select(list(job), room).returning(_JOBS.c.id, _JOBS.c.domain).cte("added")
    event = insert(JobEvent).from_select(
        ["job_id", "from_status", "to_status", "at", "detail"],
        select(added.c.id, null(), job["status"], job["queued_at"], bindparam("detail", type_=JobEvent.detail.type)),
    )
    writes = [event.cte("event")]
    if with_payload:
        kept = select(added.c.id, bindparam("payload", type_=LargeBinary))
        writes.append(insert(JobPayload).from_select(["job_id", "data"], kept).cte("payload"))
    ahead = jobs_ahead(job["model_key"], job["owner"], job["priority"])
    recorded = select(added.c.domain).scalar_subquery()
    row = select(in_flight.c[0], owner_in_flight.c[0], select(added.c.id).exists(), ahead, recorded)
    return row.select_from(counts).add_cte(*writes)


_ADD, _ADD_WITH_PAYLOAD = _add_statement(with_payload=False), _add_statement(with_payload=True)
