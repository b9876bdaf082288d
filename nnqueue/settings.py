"""Settings for every nnqueue process, read from the environment (``NNQUEUE_*``) and an optional ``.env``.

With nothing set, nnqueue runs on the *embedded default*: a SQLite file and a local object-store
directory under ``NNQUEUE_DATA_DIR`` (default ``./.nnqueue``). Production points the same settings at
Postgres, Redis and an S3-compatible store. Nested values use ``__``: ``NNQUEUE_S3__ENDPOINT_URL``.

The model checks itself when it is built: every value in range, the rules between values (a worker's
heartbeat comes more often than the silence that marks it dead), and the defaults that depend on other
settings filled in (``database_url`` and ``store_dir`` are never None afterwards), so a bad configuration
fails at start with the names of the variables to fix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal, Self

from pydantic import BaseModel, Field, PrivateAttr, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

# NNQUEUE_DOMAIN_HOLD_S's default for each NNQUEUE_DOMAIN_SWITCH: a switch that starts a fresh engine (17-19 s on one
# H200 with an 8B model, 9-11 s on a 2-core CPU) is worth a longer turn than one that checks the live engine (60 ms).
DOMAIN_HOLD_S: dict[str, float] = {"verify": 1.0, "restart": 30.0}


class S3Settings(BaseModel):
    """An S3-compatible object store. Credentials may also come from boto3's usual chain when unset."""

    # The store's S3 endpoint (MinIO, SeaweedFS, ...). Unset: AWS S3 itself.
    endpoint_url: str | None = None
    # The address that clients reach the store at, when it differs from ``endpoint_url`` (the API and workers
    # behind a Docker network, say): presigned download URLs name it. Unset: ``endpoint_url``.
    public_endpoint_url: str | None = None
    # The bucket that holds payloads, results, datasets and shards.
    bucket: str = "nnqueue"
    # The region requests are signed for.
    region: str = "us-east-1"
    # The store's credentials; unset: boto3's usual chain (environment, instance profile, ...).
    access_key_id: str | None = None
    # The secret key that goes with ``access_key_id``.
    secret_access_key: SecretStr | None = None
    # Parts of multipart uploads that one process sends at once, all its uploads together (each part, 8 MiB or more,
    # is read into memory while it is sent). A worker's harvest shards go up at the store's rate when this covers
    # the store's latency; a store with several volume servers (or a remote one) may take more.
    upload_parts_in_flight: int = Field(16, ge=1, le=256)


class Settings(BaseSettings):
    # Validation errors leave the values out: they may hold passwords (a database URL, S3 secrets).
    model_config = SettingsConfigDict(
        env_prefix="NNQUEUE_", env_nested_delimiter="__", env_file=".env", extra="ignore", hide_input_in_errors=True
    )

    # Where the embedded defaults live (the SQLite file, the local object-store folder).
    data_dir: Path = Path(".nnqueue")
    # SQLAlchemy URL; Postgres in production (postgresql+psycopg://...). Unset: the embedded SQLite file
    # <data_dir>/nnqueue.db (filled in when the settings are built).
    database_url: str | None = None
    # Celery broker URL (redis://...).
    broker_url: str | None = None
    # The object store: S3 as soon as any ``NNQUEUE_S3__*`` variable is set (``s3`` is then not None; without
    # ``s3.endpoint_url`` that is AWS itself, with boto3's usual credential chain), otherwise the local folder
    # ``store_dir`` (default ``<data_dir>/objects``, filled in when the settings are built).
    s3: S3Settings | None = None
    # The local object-store folder (when no S3 is set). With a Postgres database the default folder makes
    # ``/readyz`` 503 (each host would have its own): set S3, or this to a folder every process mounts.
    store_dir: Path | None = None

    # Workers. A job's task message stays unacknowledged while it runs; Redis hands it to another
    # worker once this long has passed, so it must exceed the longest job timeout.
    broker_visibility_timeout_s: float = Field(7200.0, gt=0)
    # How often each worker reports that it is alive (its row in the database).
    worker_heartbeat_s: float = Field(5.0, gt=0)
    # A worker silent for this long is taken for dead: its RUNNING jobs may be taken over.
    worker_stale_after_s: float = Field(30.0, gt=0)
    # A model still accepts jobs (they queue) this long after its last live worker stopped or went silent: long
    # enough for the supervisor to restart a crashed worker and its engine to load. 0: refuse at once (400).
    worker_restart_grace_s: float = Field(300.0, ge=0)
    # Model keys whose vLLM workers an autoscaler starts on demand (KEDA, deploy/kubernetes): their jobs are
    # accepted and queued even while no worker runs (JSON list). Harvests still need a live worker.
    scale_to_zero_models: list[str] = Field(default_factory=list)
    # A job's run-time limit when its submission names none.
    default_job_timeout_s: float = Field(600.0, gt=0)
    # How long a SIGTERMed worker lets its running jobs and harvest chunks finish before it hands them back to
    # the queue (nnqueue.workers.drain). Unset: until they end. Keep it below the orchestrator's kill grace
    # (Kubernetes' terminationGracePeriodSeconds, Slurm's --signal lead) less the engine's shutdown.
    worker_drain_s: float | None = Field(None, ge=0)
    # How often each worker compares the broker's tokens with the database's queued work and re-sends the
    # missing ones (after Redis restarted empty, say). Its first heartbeat always does.
    reconcile_interval_s: float = Field(30.0, gt=0)
    # How long a worker must have served (from its engine being up) before it exits for its supervisor's restart
    # backoff (1 s, doubling up to 60 s) to start again from 1 s (nnqueue.workers.supervisor).
    supervisor_healthy_after_s: float = Field(120.0, gt=0)
    # Intervention code that runs this long without handing control back to the model (a user's
    # endless loop) is stopped inside the engine, so that the jobs batched with it go on.
    engine_stall_timeout_s: float = Field(60.0, gt=0)
    # Sandboxed processes per worker that rebuild raw nnsight payloads (nnsight's own clients, old nnqueue
    # clients) into prebuilt ones and run sessions' bodies (a session needs two: at most this many less one run
    # at once); started with the engine. 0: the worker runs only client-prebuilt payloads, and no sessions.
    trace_builders: int = Field(2, ge=0)
    # The longest a trace builder may run a job's own Python without answering: a raw payload's top-level code, or
    # a session's body between two of its traces. The job holds the engine for its trust domain meanwhile, so
    # other domains' jobs wait; past it the builder is killed and the job fails (TraceBuilderTimedOut).
    trace_builder_timeout_s: float = Field(60.0, gt=0)
    # Locations a vLLM worker serves with CUDA graphs on (``nnqueue worker --taps``, comma-separated nnsight tap
    # patterns, e.g. ``model.layers.*.output``); a trace touching any other fails. Empty: eager, every location.
    engine_taps: Annotated[list[str], NoDecode] = []

    # Harvests. A chunk that fails (or whose worker dies) is tried again until it has run this many times;
    # then its harvest fails, naming it.
    harvest_chunk_attempts: int = Field(3, ge=1)
    # Harvest chunks one vLLM worker runs at once, beside its interactive jobs (``nnqueue worker --bulk-slots``).
    worker_bulk_slots: int = Field(1, ge=1)
    # Bytes of harvest shards a worker may hold handed off by its engine and not yet in the store. A chunk's slot is
    # freed once its shard is written and fits here, so the engine goes on while the store takes the shards; a
    # chunk whose shard does not fit waits (its slot held, so the engine slows to the store's pace).
    worker_upload_budget_bytes: int = Field(1 << 30, ge=1)
    # The folder in which a worker's engine leaves results and shards for the worker to upload (in a private folder
    # made inside, which a root worker's engine user must be able to reach). Unset: ``<store_dir>/.handoff``, or the
    # temp folder for a root worker. A tmpfs (/dev/shm) keeps the handoff in memory: it needs room for the upload
    # budget plus a shard per bulk slot.
    worker_handoff_dir: Path | None = None
    # The largest dataset (its source files together, or an upload) and the most prompts one harvest may have.
    harvest_max_dataset_bytes: int = Field(256 * 1024 * 1024, gt=0)
    # The most prompts one harvest may have (413 beyond).
    harvest_max_prompts: int = Field(1_000_000, gt=0)
    # The largest harvest output (its shards' estimated bytes, as `nnqueue harvest submit --dry-run` answers) one
    # harvest may have; unset: no limit. A bigger one is refused (413) with its estimate.
    harvest_max_output_bytes: int | None = Field(None, gt=0)
    # The most prompts one steering job (``POST /v1/steering``) may have (413 beyond).
    steer_max_prompts: int = Field(10_000, gt=0)
    # The largest vectors file (safetensors) a steering job may send (413 beyond).
    steer_max_vector_bytes: int = Field(16 * 1024 * 1024, gt=0)
    # How often ``nnqueue beat`` looks for schedules that are due.
    beat_interval_s: float = Field(5.0, gt=0)

    # Isolation of users' code (see nnqueue.isolation, docs/operator/engine-isolation.md). When the worker runs
    # as root, its engine processes switch to this user once they are up, before any user code runs, if a probe
    # run as it at start-up can use this Python; else they keep root behind the other layers. The default
    # account is dedicated (created if missing); no other process may run as it. Empty: they stay root.
    engine_user: str = "nnqueue-engine"
    # Refuse to start (saying what to change) rather than keep the engine's processes root.
    engine_user_required: bool = False
    # The seccomp filter of engine and builder processes (no exec, no non-unix sockets, no ptrace).
    engine_seccomp: bool = True
    # The most memory (bytes) the engine's processes (engine core, model runners, trace builders) may take together,
    # tmpfs and memfd pages included: past it the kernel kills one of them, not another process of the host (a root
    # worker's cgroup, nnqueue.cgroups). Unset: three quarters of the host's memory.
    engine_memory_max: int | None = Field(None, gt=0)
    # The most tasks (processes and threads) those processes may have together (the same cgroup's pids controller): an
    # engine that starts threads without end would leave the host no pid to give.
    engine_tasks_max: int = Field(8192, gt=0)
    # More environment variables (fnmatch patterns, comma-separated) to remove before the engine
    # starts, beside the built-in NNQUEUE_DATABASE_URL, NNQUEUE_BROKER_URL, NNQUEUE_S3__* and AWS_*.
    secret_env_patterns: Annotated[list[str], NoDecode] = []
    # The protected environment: intervention code may import only allow-listed modules and call only
    # allow-listed builtins (nnqueue.enginecore.protected). Off only for trusted deployments.
    protected_environment: bool = True
    # Modules (and their submodules) allowed beside the built-in list, comma-separated.
    allowed_modules: Annotated[list[str], NoDecode] = []
    # The weights guard: a trace's write to a parameter is put back and fails the job (nnqueue.enginecore.weights_guard).
    # Off only for a private engine whose traces may change the weights for every later job.
    weights_guard: bool = True
    # Whose traces may share an engine (nnqueue.scheduler.trust_domains, docs/operator/trust-domains.md): "owner"
    # (each owner alone, and the groups an admin makes with `nnqueue domains join`) or "deployment" (everyone
    # trusts everyone: a single researcher's box). Applies to jobs accepted after it changes.
    trust_domains: Literal["owner", "deployment"] = "owner"
    # How long an engine keeps serving one trust domain's traces once another domain's traces wait; then it takes
    # none of them, and switches when they have ended (nnqueue.scheduler.domain_turns). Longer: fewer switches
    # (each costs a drain and a check of the weights, and with "restart" a fresh engine), longer waits for the other
    # domain. Default: DOMAIN_HOLD_S of the domain_switch.
    domain_hold_s: float | None = Field(None, gt=0)
    # What a worker does when its engine moves to another trust domain: "restart" replaces the engine's process with
    # a fresh one, then verifies it, so nothing a domain's code did inside the old process, seen by the guards or
    # not, can reach the next domain (seconds a switch: docs/operator/trust-domains.md); "verify" puts back and
    # verifies the engine's state in the live process (milliseconds), which trusts the protected environment and the
    # guards to hold against the earlier domain's code. Engines without an in-place restart (the transformers
    # engine, whose processes are per domain already; a TRL trainer's) verify.
    domain_switch: Literal["verify", "restart"] = "restart"
    # The engine's network (nnqueue.netns): "isolated" (a namespace of its own, loopback only; needs a root
    # worker), "host", or "auto" (isolated when the worker is root and the executor is not Ray).
    engine_network: Literal["auto", "isolated", "host"] = "auto"
    # The engine's filesystem (nnqueue.mountns): "private" (a read-only view of only what it needs, with a private
    # /tmp and no host socket; needs a root worker with CAP_SYS_ADMIN), "host", or "auto" (private where it can).
    engine_filesystem: Literal["auto", "private", "host"] = "auto"
    # Owners (comma-separated) whose traces a worker still runs when its engine cannot be isolated (it keeps
    # root or the worker's user, the host's network or filesystem: /readyz says "degraded"): its operator's.
    # Such a worker runs harvests and steering for everyone, and no other owner's trace. "*": every owner's
    # (only where every owner may do what the worker's user can).
    operator_owners: Annotated[list[str], NoDecode] = []

    # The HTTP API (``nnqueue serve-api``).
    api_host: str = "127.0.0.1"
    # The port ``nnqueue serve-api`` listens on (``api_host`` above: its address).
    api_port: int = Field(8000, ge=0, le=65535)
    # API processes that `nnqueue serve-api` starts on that port (uvicorn workers).
    api_workers: int = Field(1, ge=1)
    # The largest serialized trace a client may submit, in bytes (larger uploads get 413).
    max_payload_bytes: int = Field(64 * 1024 * 1024, gt=0)
    # The largest result one job may store, in bytes (its saves.pt; a safetensors copy counts apart): a job that
    # saves more fails with ResultTooLarge, naming this limit, and nothing of its result is stored. Unset: no limit.
    max_result_bytes: int | None = Field(512 * 1024 * 1024, gt=0)
    # Payloads up to this many bytes are kept in the database with their job instead of the object store: one
    # object-store round trip less per submission (0: every payload goes to the store).
    inline_payload_max_bytes: int = Field(256 * 1024, ge=0)
    # How long the API remembers a key it found valid (no database lookup meanwhile): a revoked key is refused
    # within this many seconds. 0: look every key up on every request.
    auth_cache_s: float = Field(5.0, ge=0)
    # Jobs one API key may have queued or running at once (more submissions get 429).
    max_jobs_in_flight_per_key: int = Field(64, ge=1)
    # Jobs one owner may have queued or running at once through all of its API keys together (more get 429), so that
    # a second key does not double an owner's load.
    max_jobs_in_flight_per_owner: int = Field(128, ge=1)
    # The crash cool-down: an owner whose traces crashed an engine, or changed an engine's weights or state (put
    # back, the job failed), this many times within the window gets 429 for new traces on every one of its keys
    # until the cool-down has passed since the last of them (each costs other users a restart or a rerun).
    engine_crash_limit: int = Field(3, ge=1)
    # The window in which NNQUEUE_ENGINE_CRASH_LIMIT charged jobs of one owner start its cool-down.
    engine_crash_window_s: float = Field(3600.0, gt=0)
    # How long, after its last charged job, an owner in cool-down gets 429 for its new traces.
    engine_crash_cooldown_s: float = Field(1800.0, ge=0)
    # nnsight's /ndif/subscribe websockets one API key may hold open at once, per API process (more: 429).
    ndif_subscriptions_per_key: int = Field(64, ge=1)
    # nnsight's /ndif/subscribe websockets all keys together may hold open at once, per API process (more: 429).
    ndif_subscriptions_max: int = Field(1000, ge=1)
    # Harvests one API key may have queued or running at once (more get 429).
    max_harvests_in_flight_per_key: int = Field(16, ge=1)
    # Schedules one API key may keep (more get 429).
    max_schedules_per_key: int = Field(32, ge=1)
    # How long the presigned result URLs that the API redirects to stay valid (SigV4 allows up to 7 days).
    result_url_expiry_s: int = Field(3600, ge=1, le=7 * 24 * 3600)

    # Days after a job ends that ``nnqueue gc`` deletes its payload and results (the job's row stays, and
    # its result answers 410). Unset: everything is kept; deleting users' results is the operator's choice.
    retention_days: float | None = Field(None, gt=0)

    # Operations. Log lines as text, or as one JSON object per line (with ``job_id`` on every line about a job).
    log_format: Literal["text", "json"] = "text"
    # The port on which each worker serves Prometheus metrics (its jobs and its vLLM engine's own ``vllm:*``
    # series); unset: none. The API serves its metrics at ``/metrics`` on its own port.
    worker_metrics_port: int | None = Field(None, ge=0, le=65535)
    # The port of TRL's vLLM server protocol on a worker (a trainer's generations and weight pushes:
    # nnqueue.workers.trl_server, docs/user/weights.md); unset: off.
    trainer_port: int | None = Field(None, ge=0, le=65535)
    # The address that protocol's HTTP server listens on.
    trainer_host: str = "127.0.0.1"
    # The one port the engine's NCCL group with a trainer listens on (its rank 0's store); unset: no NCCL updates.
    trainer_nccl_port: int | None = Field(None, ge=1, le=65535)
    # The address that NCCL group's store listens on (the trainer connects to the worker's URL's host).
    trainer_nccl_host: str = "127.0.0.1"
    # The deadline of every wait on the trainer (its store, broadcasts, barriers), in seconds.
    trainer_timeout_s: float = Field(300.0, gt=0)
    # An update left without a call from its trainer this long is rolled back.
    trainer_update_idle_s: float = Field(120.0, gt=0)
    # How long the status page's sign-in cookie lasts.
    status_session_s: int = Field(8 * 3600, ge=1)

    _store_dir_defaulted: bool = PrivateAttr(default=False)

    @field_validator("secret_env_patterns", "allowed_modules", "engine_taps", "operator_owners", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        if isinstance(value, str):
            return [item.strip() for item in value.split(",") if item.strip()]
        return value

    @model_validator(mode="after")
    def _check_and_fill_in(self) -> Self:
        if self.worker_stale_after_s <= self.worker_heartbeat_s:
            raise ValueError(
                f"NNQUEUE_WORKER_STALE_AFTER_S ({self.worker_stale_after_s:g}) must be greater than "
                f"NNQUEUE_WORKER_HEARTBEAT_S ({self.worker_heartbeat_s:g}): otherwise a live worker looks dead "
                "between two of its heartbeats and its jobs are taken from it"
            )
        if self.broker_visibility_timeout_s <= self.default_job_timeout_s:
            raise ValueError(
                f"NNQUEUE_BROKER_VISIBILITY_TIMEOUT_S ({self.broker_visibility_timeout_s:g}) must be greater than "
                f"NNQUEUE_DEFAULT_JOB_TIMEOUT_S ({self.default_job_timeout_s:g}): otherwise Redis hands a job that "
                "is still running to another worker"
            )
        if self.domain_hold_s is None:
            self.domain_hold_s = DOMAIN_HOLD_S[self.domain_switch]
        if not self.database_url:
            self.database_url = f"sqlite:///{(self.data_dir / 'nnqueue.db').resolve()}"
        self._store_dir_defaulted = self.store_dir is None
        self.store_dir = (self.store_dir or self.data_dir / "objects").resolve()
        return self

    def engine_environment(self) -> dict[str, str]:
        """The settings engine processes read, as environment variables for them to inherit.

        Engine processes run users' code: they read these from the environment alone (see
        ``nnqueue.enginecore.sandbox.EngineConfig``), never from ``.env``, which may hold the secrets.
        """
        return {
            "NNQUEUE_ENGINE_STALL_TIMEOUT_S": str(self.engine_stall_timeout_s),
            "NNQUEUE_ENGINE_USER": self.engine_user,
            "NNQUEUE_ENGINE_SECCOMP": "true" if self.engine_seccomp else "false",
            "NNQUEUE_SECRET_ENV_PATTERNS": ",".join(self.secret_env_patterns),
            "NNQUEUE_PROTECTED_ENVIRONMENT": "true" if self.protected_environment else "false",
            "NNQUEUE_ALLOWED_MODULES": ",".join(self.allowed_modules),
            "NNQUEUE_WEIGHTS_GUARD": "true" if self.weights_guard else "false",
            "NNQUEUE_LOG_FORMAT": self.log_format,
        }

    @property
    def resolved_database_url(self) -> str:
        """``database_url``, never None (the settings fill it in)."""
        assert self.database_url is not None
        return self.database_url

    @property
    def resolved_domain_hold_s(self) -> float:
        """``domain_hold_s``, never None (the settings fill it in from ``domain_switch``)."""
        assert self.domain_hold_s is not None
        return self.domain_hold_s

    @property
    def resolved_store_dir(self) -> Path:
        """``store_dir``, never None (the settings fill it in)."""
        assert self.store_dir is not None
        return self.store_dir

    @property
    def store_dir_defaulted(self) -> bool:
        """Whether ``store_dir`` is the default under ``data_dir`` rather than set."""
        return self._store_dir_defaulted
