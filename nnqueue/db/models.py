"""The job-state schema: API keys, jobs and their append-only status history; harvests, their chunks and schedules.

Postgres in production, SQLite for the embedded default: only portable column types are used
(enums are stored as checked strings, not native Postgres enums, so migrations stay symmetric).
Status changes go through :mod:`nnqueue.db.lifecycle`, never by assigning ``Job.status`` directly.
"""

from __future__ import annotations

import enum
import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Enum,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    MetaData,
    String,
    Text,
    TypeDecorator,
    text,
)
from sqlalchemy.engine import Dialect
from sqlalchemy.orm import DeclarativeBase, Mapped, mapped_column, relationship

# A trust domain's name: "owner:" and an owner (200 characters), a group's name, or "deployment".
DOMAIN_LENGTH = 220


def utcnow() -> datetime:
    return datetime.now(UTC)


class Base(DeclarativeBase):
    # Named constraints make Alembic migrations deterministic across databases.
    metadata = MetaData(
        naming_convention={
            "ix": "ix_%(column_0_label)s",
            "uq": "uq_%(table_name)s_%(column_0_name)s",
            "ck": "ck_%(table_name)s_%(constraint_name)s",
            "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
            "pk": "pk_%(table_name)s",
        }
    )


class JobStatus(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


# The statuses a job or chunk never leaves.
ENDED = frozenset({JobStatus.COMPLETED, JobStatus.FAILED, JobStatus.CANCELLED})


class JobKind(enum.StrEnum):
    TRACE = "trace"  # a serialized nnsight trace
    HARVEST = "harvest"  # a declarative "save these activations for this dataset" spec
    STEER = "steer"  # a declarative "generate with these edits" spec (nnqueue.scheduler.steering)


class EngineKind(enum.StrEnum):
    """The engine a worker holds, which decides the traces it runs."""

    VLLM = "vllm"  # nnsight's VLLM traces, batched by vLLM
    TRANSFORMERS = "transformers"  # nnsight's LanguageModel traces (and sessions) on a Hugging Face model


def _enum_column(enum_cls: type[enum.Enum], name: str) -> Enum:
    return Enum(
        enum_cls,
        name=name,
        native_enum=False,
        create_constraint=True,
        length=16,
        values_callable=lambda cls: [member.value for member in cls],
    )


class UTCDateTime(TypeDecorator[datetime]):
    """A moment in time, written and read back as an aware UTC ``datetime`` on every database.

    Postgres keeps the zone (``timestamptz``); SQLite keeps none and hands back the naive UTC value that was
    written. Converting here, at the column, means no reader has to know which database it reads.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None or value.tzinfo is None:  # a naive value is taken to be UTC already, as SQLite's are
            return value
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


Timestamp = UTCDateTime()


class ApiKey(Base):
    __tablename__ = "api_keys"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    # sha256 of the secret; the secret itself is shown once, at creation, and never stored.
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    # The first characters of the secret, so owners can tell their keys apart in listings.
    key_prefix: Mapped[str] = mapped_column(String(16))
    owner: Mapped[str] = mapped_column(String(200), index=True)
    scopes: Mapped[list[str]] = mapped_column(JSON, default=list)
    created_at: Mapped[datetime] = mapped_column(Timestamp, default=utcnow)
    revoked_at: Mapped[datetime | None] = mapped_column(Timestamp)


class Job(Base):
    __tablename__ = "jobs"
    __table_args__ = (
        Index("ix_jobs_owner_created_at", "owner", "created_at"),
        Index("ix_jobs_api_key_id_status", "api_key_id", "status"),
        # Retention finds ended jobs not yet purged, oldest first (nnqueue.scheduler.retention).
        Index("ix_jobs_purged_at_finished_at", "purged_at", "finished_at"),
        # A model's queued jobs in claim order (nnqueue.scheduler.claim.JOB_ORDER): the claim reads the first
        # entry, a queue position counts the entries before a job; ended jobs are not in it.
        Index(
            "ix_jobs_queued_order",
            "model_key",
            text("priority DESC"),
            "queued_at",
            "id",
            postgresql_where=text("status = 'queued'"),
            sqlite_where=text("status = 'queued'"),
        ),
        # A key's engine crashes, newest first (nnqueue.scheduler.crash_cooldown), read at each of its submissions.
        Index(
            "ix_jobs_engine_crashes",
            "api_key_id",
            "finished_at",
            postgresql_where=text("error_type = 'EngineCrash'"),
            sqlite_where=text("error_type = 'EngineCrash'"),
        ),
    )

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=uuid.uuid4)
    owner: Mapped[str] = mapped_column(String(200))
    # The owner's trust domain when the job was accepted (nnqueue.scheduler.trust_domains): a trace runs only on an
    # engine serving it. Regrouping an owner moves their queued jobs too; null only for rows older than domains.
    domain: Mapped[str | None] = mapped_column(String(DOMAIN_LENGTH))
    # The API key that submitted the job (the API limits jobs in flight per key); null for jobs
    # submitted without the API. No foreign key: keys are revoked, never deleted.
    api_key_id: Mapped[int | None] = mapped_column(Integer)
    model_key: Mapped[str] = mapped_column(String(500), index=True)
    kind: Mapped[JobKind] = mapped_column(_enum_column(JobKind, "job_kind"))
    status: Mapped[JobStatus] = mapped_column(_enum_column(JobStatus, "job_status"), index=True)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    timeout_s: Mapped[float] = mapped_column(default=600.0)
    meta: Mapped[dict[str, Any]] = mapped_column("metadata", JSON, default=dict)

    # The payload's object-store key; null when the payload is small enough to be kept in the database
    # (job_payloads), which saves an object-store round trip on submission (nnqueue.scheduler.payloads).
    payload_key: Mapped[str | None] = mapped_column(String(1024))
    payload_size: Mapped[int] = mapped_column(BigInteger)
    result_key: Mapped[str | None] = mapped_column(String(1024))
    result_size: Mapped[int | None] = mapped_column(BigInteger)
    result_format: Mapped[str | None] = mapped_column(String(32))
    # sha256 (hex) of the result object as the worker uploaded it; the safetensors copy's size and sha256.
    result_sha256: Mapped[str | None] = mapped_column(String(64))
    result_safetensors_size: Mapped[int | None] = mapped_column(BigInteger)
    result_safetensors_sha256: Mapped[str | None] = mapped_column(String(64))
    # A trace's result is written as safetensors too only when asked (a second copy of every saved byte).
    wants_safetensors: Mapped[bool] = mapped_column(Boolean, default=False)

    error_type: Mapped[str | None] = mapped_column(String(200))
    error_message: Mapped[str | None] = mapped_column(Text)
    error_traceback: Mapped[str | None] = mapped_column(Text)

    attempts: Mapped[int] = mapped_column(Integer, default=0)
    worker_id: Mapped[str | None] = mapped_column(String(200))
    progress_done: Mapped[int] = mapped_column(Integer, default=0)
    progress_total: Mapped[int | None] = mapped_column(Integer)

    created_at: Mapped[datetime] = mapped_column(Timestamp, default=utcnow)
    queued_at: Mapped[datetime | None] = mapped_column(Timestamp)
    started_at: Mapped[datetime | None] = mapped_column(Timestamp)
    finished_at: Mapped[datetime | None] = mapped_column(Timestamp)
    # When retention deleted the job's payload and results (NNQUEUE_RETENTION_DAYS); the row stays.
    purged_at: Mapped[datetime | None] = mapped_column(Timestamp)
    # The weights version the job must run on (null: any), and the one it ran on (nnqueue.workers.weights).
    weights_pin: Mapped[str | None] = mapped_column(String(200))
    weights_version: Mapped[str | None] = mapped_column(String(200))

    events: Mapped[list[JobEvent]] = relationship(
        back_populates="job", order_by="JobEvent.id", cascade="all, delete-orphan", passive_deletes=True
    )

    @property
    def has_safetensors(self) -> bool:
        """Whether a safetensors file sits beside the result: a trace's copy, or a steering job's activations.
        Jobs finished before its size was recorded (migration 0009) say so in their format only."""
        return self.result_safetensors_size is not None or "safetensors" in (self.result_format or "").split("+")


class DomainMember(Base):
    """An owner an admin put in a named trust domain with others (nnqueue.scheduler.trust_domains); an owner
    without a row is alone in a domain of their own."""

    __tablename__ = "domain_members"

    owner: Mapped[str] = mapped_column(String(200), primary_key=True)
    domain: Mapped[str] = mapped_column(String(DOMAIN_LENGTH), index=True)
    updated_at: Mapped[datetime] = mapped_column(Timestamp, default=utcnow)


class JobPayload(Base):
    """A small payload kept beside its job rather than in the object store (``Job.payload_key`` is then null)."""

    __tablename__ = "job_payloads"

    job_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), primary_key=True)
    data: Mapped[bytes] = mapped_column(LargeBinary)


class JobEvent(Base):
    """One status change of a job; rows are only ever appended."""

    __tablename__ = "job_events"

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    job_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("jobs.id", ondelete="CASCADE"), index=True)
    from_status: Mapped[JobStatus | None] = mapped_column(_enum_column(JobStatus, "job_event_from_status"))
    to_status: Mapped[JobStatus] = mapped_column(_enum_column(JobStatus, "job_event_to_status"))
    at: Mapped[datetime] = mapped_column(Timestamp, default=utcnow)
    detail: Mapped[dict[str, Any]] = mapped_column(JSON, default=dict)

    job: Mapped[Job] = relationship(back_populates="events")


class Worker(Base):
    """A worker process holding one engine: registered at start, kept alive by heartbeats."""

    __tablename__ = "workers"

    id: Mapped[str] = mapped_column(String(200), primary_key=True)
    model_key: Mapped[str] = mapped_column(String(500), index=True)
    queue: Mapped[str] = mapped_column(String(255))
    host: Mapped[str] = mapped_column(String(255))
    pid: Mapped[int] = mapped_column(Integer)
    capacity: Mapped[int] = mapped_column(Integer)
    # The kind of engine it holds (an EngineKind value): which traces it can run.
    engine: Mapped[str] = mapped_column(String(32), server_default=EngineKind.VLLM.value)
    # What its engine can capture for harvests ({"module", "io", "parts"} each), checked at submit; null for
    # engines that run no harvests.
    capture_points: Mapped[list[dict[str, Any]] | None] = mapped_column(JSON)
    # What its engine processes run under ({"engine_user", "note", "seccomp"}: nnqueue.isolation.Containment).
    containment: Mapped[dict[str, str] | None] = mapped_column(JSON)
    # The weights version its engine serves, since when, and where it came from ({"source", "update_id",
    # "error"}: nnqueue.workers.weights); null for workers registered before weights versions.
    weights_version: Mapped[str | None] = mapped_column(String(200))
    weights_since: Mapped[datetime | None] = mapped_column(Timestamp)
    weights_source: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # The trust domain whose traces its engine runs now, and since when (nnqueue.scheduler.domain_turns); null
    # until its first trace.
    domain: Mapped[str | None] = mapped_column(String(DOMAIN_LENGTH))
    domain_since: Mapped[datetime | None] = mapped_column(Timestamp)
    started_at: Mapped[datetime] = mapped_column(Timestamp, default=utcnow)
    heartbeat_at: Mapped[datetime] = mapped_column(Timestamp, default=utcnow)
    stopped_at: Mapped[datetime | None] = mapped_column(Timestamp)


class Harvest(Base):
    """A declarative activation harvest: a dataset through a model, chosen modules' activations out as shards.

    Its work is split into :class:`HarvestChunk` rows, each claimed and run by one worker of the model.
    The status uses the job statuses: QUEUED until a chunk starts, RUNNING, then COMPLETED (every chunk
    done and the manifest written), FAILED (a chunk ran out of attempts; the error names it) or CANCELLED.
    """

    __tablename__ = "harvests"
    __table_args__ = (Index("ix_harvests_owner_created_at", "owner", "created_at"),)

    id: Mapped[uuid.UUID] = mapped_column(primary_key=True, default=uuid.uuid4)
    owner: Mapped[str] = mapped_column(String(200))
    api_key_id: Mapped[int | None] = mapped_column(Integer)
    model_key: Mapped[str] = mapped_column(String(500), index=True)
    status: Mapped[JobStatus] = mapped_column(_enum_column(JobStatus, "harvest_status"), index=True)
    priority: Mapped[int] = mapped_column(Integer, default=0)
    # The validated spec (nnqueue.scheduler.harvest_spec.HarvestSpec) as JSON.
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    # The dataset as the chunks read it: one JSON line per example, after offset and limit.
    dataset_key: Mapped[str] = mapped_column(String(1024))
    dataset_digest: Mapped[str] = mapped_column(String(64))
    prompts: Mapped[int] = mapped_column(Integer)
    chunks_total: Mapped[int] = mapped_column(Integer)
    schedule_id: Mapped[int | None] = mapped_column(Integer, index=True)
    manifest_key: Mapped[str | None] = mapped_column(String(1024))
    error_type: Mapped[str | None] = mapped_column(String(200))
    error_message: Mapped[str | None] = mapped_column(Text)
    # The weights version its chunks must run on (null: any); each chunk records the version it ran on.
    weights_pin: Mapped[str | None] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(Timestamp, default=utcnow)
    started_at: Mapped[datetime | None] = mapped_column(Timestamp)
    finished_at: Mapped[datetime | None] = mapped_column(Timestamp)


class HarvestChunk(Base):
    """A slice of a harvest's prompts that one worker runs into one shard (``harvests/<id>/shard-NNNNN``)."""

    __tablename__ = "harvest_chunks"
    __table_args__ = (
        Index("ix_harvest_chunks_model_key_status", "model_key", "status"),
        Index("ix_harvest_chunks_harvest_id_index", "harvest_id", "index", unique=True),
    )

    id: Mapped[int] = mapped_column(BigInteger().with_variant(Integer, "sqlite"), primary_key=True)
    harvest_id: Mapped[uuid.UUID] = mapped_column(ForeignKey("harvests.id", ondelete="CASCADE"))
    index: Mapped[int] = mapped_column(Integer)
    # Copied from the harvest, so that claiming (fairness across owners, priority) reads one table.
    model_key: Mapped[str] = mapped_column(String(500))
    owner: Mapped[str] = mapped_column(String(200))
    priority: Mapped[int] = mapped_column(Integer, default=0)
    status: Mapped[JobStatus] = mapped_column(_enum_column(JobStatus, "harvest_chunk_status"))
    # Global indices [first_prompt, first_prompt + prompts) of the dataset, at these bytes of its object.
    first_prompt: Mapped[int] = mapped_column(Integer)
    prompts: Mapped[int] = mapped_column(Integer)
    dataset_start: Mapped[int] = mapped_column(BigInteger)
    dataset_end: Mapped[int] = mapped_column(BigInteger)
    shard_key: Mapped[str] = mapped_column(String(1024))
    attempts: Mapped[int] = mapped_column(Integer, default=0)
    worker_id: Mapped[str | None] = mapped_column(String(200))
    rows: Mapped[int | None] = mapped_column(BigInteger)
    bytes: Mapped[int | None] = mapped_column(BigInteger)
    sha256: Mapped[str | None] = mapped_column(String(64))
    tokens: Mapped[int | None] = mapped_column(BigInteger)
    # Row offset of each of its prompts in the shard, plus the end: prompt i's rows are [o[i], o[i+1]).
    offsets: Mapped[list[int] | None] = mapped_column(JSON)
    # Per capture, the shard's mergeable statistics (nnqueue.enginecore.harvest_stats); summed into the manifest.
    stats: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # The shard's rows of generated tokens; with the spec's outliers option, {"limits", "over", "dropped_rows"}.
    generated_rows: Mapped[int | None] = mapped_column(BigInteger)
    outliers: Mapped[dict[str, Any] | None] = mapped_column(JSON)
    # Copied from the harvest (claims read one table); the version the chunk ran on.
    weights_pin: Mapped[str | None] = mapped_column(String(200))
    weights_version: Mapped[str | None] = mapped_column(String(200))
    error: Mapped[str | None] = mapped_column(Text)
    queued_at: Mapped[datetime | None] = mapped_column(Timestamp)
    started_at: Mapped[datetime | None] = mapped_column(Timestamp)
    finished_at: Mapped[datetime | None] = mapped_column(Timestamp)


class HarvestSchedule(Base):
    """A recurring harvest: ``nnqueue beat`` creates a run from ``spec`` at each time ``cron`` names."""

    __tablename__ = "harvest_schedules"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    owner: Mapped[str] = mapped_column(String(200), index=True)
    api_key_id: Mapped[int | None] = mapped_column(Integer)
    name: Mapped[str] = mapped_column(String(200))
    cron: Mapped[str] = mapped_column(String(200))
    spec: Mapped[dict[str, Any]] = mapped_column(JSON)
    paused: Mapped[bool] = mapped_column(default=False)
    next_run_at: Mapped[datetime] = mapped_column(Timestamp, index=True)
    last_run_at: Mapped[datetime | None] = mapped_column(Timestamp)
    last_harvest_id: Mapped[uuid.UUID | None] = mapped_column()
    last_error: Mapped[str | None] = mapped_column(Text)
    runs: Mapped[int] = mapped_column(Integer, default=0)
    created_at: Mapped[datetime] = mapped_column(Timestamp, default=utcnow)


class WeightsUpdate(Base):
    """A checkpoint swap asked for a model key: every live worker of the model loads ``source`` (all its
    tensors, or the named ``tensors``) and then serves ``version``; a worker that starts later replays the
    model's updates in order (nnqueue.workers.weights). Rows are only ever appended."""

    __tablename__ = "weights_updates"

    id: Mapped[int] = mapped_column(Integer, primary_key=True)
    model_key: Mapped[str] = mapped_column(String(500), index=True)
    version: Mapped[str] = mapped_column(String(200))
    source: Mapped[str] = mapped_column(String(2048))  # s3://<bucket>/<key> of the store, or a path on the workers
    tensors: Mapped[list[str] | None] = mapped_column(JSON)
    owner: Mapped[str] = mapped_column(String(200))
    created_at: Mapped[datetime] = mapped_column(Timestamp, default=utcnow)


class StatusSession(Base):
    """A browser signed in to the status page: its cookie holds a random session id, never the API key; the
    database keeps the id's sha256, the key it was opened with, and when it ends (nnqueue.api.routers.status)."""

    __tablename__ = "status_sessions"

    id_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    api_key_id: Mapped[int] = mapped_column(ForeignKey("api_keys.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[datetime] = mapped_column(Timestamp, default=utcnow)
    expires_at: Mapped[datetime] = mapped_column(Timestamp)
