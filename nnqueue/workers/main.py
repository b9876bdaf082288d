"""``nnqueue worker``: load one engine (vLLM, or transformers), register, and consume the model's queue until stopped.

Each heartbeat also aborts the jobs cancelled while running here, requeues the model's jobs that a dead
worker left RUNNING (:mod:`nnqueue.scheduler.recovery`) and, every ``NNQUEUE_RECONCILE_INTERVAL_S``, re-sends
the tokens the broker lost (:mod:`nnqueue.scheduler.reconciler`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import prometheus_client
from sqlalchemy.orm import Session, sessionmaker

from nnqueue.broker import create_celery_app, queue_name
from nnqueue.db.models import EngineKind
from nnqueue.db.session import make_engine, session_factory
from nnqueue.enginecore.lifetime import WORKER_PID_ENV
from nnqueue.engines.builders import BuilderPool
from nnqueue.engines.outbox import poller
from nnqueue.scheduler import registry
from nnqueue.scheduler.reconciler import reconcile
from nnqueue.scheduler.recovery import requeue_orphans
from nnqueue.settings import Settings
from nnqueue.storage import log_store, object_store_from_settings
from nnqueue.storage.object_store import ObjectStore
from nnqueue.workers.engine_host import EngineHost
from nnqueue.workers.heartbeat import HeartbeatThread
from nnqueue.workers.job_execution import Executor, JobRunner
from nnqueue.workers.sinks import ResultSinks
from nnqueue.workers.tasks import register_run_job
from nnqueue.workers.trace_execution import VLLMTraceExecutor

log = logging.getLogger(__name__)
RUNNING_JOBS = prometheus_client.Gauge("nnqueue_worker_running_jobs", "Jobs this worker is running now.", ["model"])


def run_worker(
    model: str,
    model_key: str,
    max_concurrent_jobs: int,
    engine_kwargs: dict[str, Any],
    engine_kind: EngineKind = EngineKind.VLLM,
) -> None:
    """``engine_kind``: a vLLM engine (``engine_kwargs`` go to vLLM's engine arguments) or the transformers
    engine (one job at a time; ``engine_kwargs`` go to the model's ``from_pretrained``)."""
    settings = Settings()
    sessions = session_factory(make_engine(settings.resolved_database_url))
    store = object_store_from_settings(settings)
    log_store(settings, log)
    app = create_celery_app(settings, prefetch=max_concurrent_jobs)
    queue = queue_name(model_key)

    if settings.worker_metrics_port is not None:
        # Before the engine loads (minutes): a taken port fails the worker at once. vLLM's AsyncLLM adds its
        # own series (vllm:generation_tokens_total, ...) to the same default registry when it starts.
        prometheus_client.start_http_server(settings.worker_metrics_port)
        log.info("serving metrics on port %d", settings.worker_metrics_port)
    # The engine's processes watch this pid and exit with us, even if we are SIGKILLed.
    os.environ[WORKER_PID_ENV] = str(os.getpid())
    host = EngineHost(blocking_threads=min(2 * max_concurrent_jobs + 2, 64))
    with sessions() as session:  # fail before loading a model that would then not register
        registry.check_engine(session, model_key, engine_kind, settings.worker_stale_after_s)
    started = time.monotonic()
    executor = host.call(_start_executor(engine_kind, model, engine_kwargs, settings, sessions, store))
    log.info("%s engine for %s ready in %.1f s", engine_kind.value, model, time.monotonic() - started)

    worker_id = registry.new_worker_id()
    runner = JobRunner(sessions, executor, model_key, worker_id)
    register_run_job(app, host, runner)
    try:
        registry.register(
            sessions,
            worker_id,
            model_key,
            queue,
            max_concurrent_jobs,
            engine=engine_kind,
            stale_after_s=settings.worker_stale_after_s,
        )
    except registry.EngineConflict:
        host.call(executor.close())
        host.stop()
        raise
    RUNNING_JOBS.labels(model_key).set_function(lambda: len(runner.running_jobs()))

    next_reconcile = 0.0

    def on_beat() -> None:
        nonlocal next_reconcile
        runner.reap_lost()
        requeue_orphans(sessions, app, model_key, settings.worker_stale_after_s)
        if time.monotonic() >= next_reconcile:
            reconcile(sessions, app, model_key)  # a failure (broker down) is retried at the next beat
            next_reconcile = time.monotonic() + settings.reconcile_interval_s

    beat = HeartbeatThread(sessions, worker_id, settings.worker_heartbeat_s, on_beat)
    beat.start()
    try:
        app.worker_main(
            [
                "worker",
                f"--queues={queue}",
                "--pool=threads",
                f"--concurrency={max_concurrent_jobs}",
                f"--hostname=nnqueue-{worker_id.rsplit(':', 1)[1]}@%h",
                "--without-gossip",
                "--without-mingle",
                "--loglevel=INFO",
            ]
        )
    finally:
        beat.stop()
        registry.mark_stopped(sessions, worker_id)
        host.call(executor.close())
        host.stop()


async def _start_executor(
    engine_kind: EngineKind,
    model: str,
    engine_kwargs: dict[str, Any],
    settings: Settings,
    sessions: sessionmaker[Session],
    store: ObjectStore,
) -> Executor:
    """The engine, loaded, and its executor. Built on the engine loop: vLLM's AsyncLLM binds to the loop it
    first runs on, and the transformers engine's process pipes to the loop that started it."""
    sinks = ResultSinks(store, settings.resolved_store_dir / ".handoff")
    if engine_kind is EngineKind.TRANSFORMERS:
        from nnqueue.engines.transformers import TransformersEngine
        from nnqueue.workers.transformers_execution import TransformersExecutor

        engine = TransformersEngine(model, engine_kwargs, settings.engine_stall_timeout_s)
        await engine.start()
        return TransformersExecutor(sessions, store, engine, sinks)
    from nnqueue.engines.platform import load_engine

    vllm = load_engine(model, **engine_kwargs)
    return VLLMTraceExecutor(
        sessions,
        store,
        vllm,
        sinks,
        poller(vllm.vllm_entrypoint),  # the engine's one poller, shared with harvest chunks
        BuilderPool(model, engine_kwargs, settings.trace_builders, 4 * settings.max_payload_bytes),
    )
