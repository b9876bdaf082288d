"""``nnqueue worker``: load one engine (vLLM, or transformers), register, and consume the model's queues until stopped.

Interactive tokens come through Celery's pool (``--max-concurrent-jobs`` slots; on a vLLM worker the default is
the engine's own ``max_num_seqs``, so one-prompt jobs fill the batches vLLM would form); on a vLLM worker, bulk tokens
(harvest chunks) come through the worker's own consumer with ``--bulk-slots`` slots (:mod:`nnqueue.workers.bulk`),
so a trace never waits for a slot behind long chunks. Each heartbeat also aborts the work cancelled while
running here, requeues the model's work that a dead worker left RUNNING (:mod:`nnqueue.scheduler.recovery`,
:func:`nnqueue.scheduler.chunks.requeue_orphan_chunks`) and, every ``NNQUEUE_RECONCILE_INTERVAL_S``, re-sends
the tokens the broker lost (:mod:`nnqueue.scheduler.reconciler`). If the engine dies, the worker settles its
jobs and starts a fresh engine (:mod:`nnqueue.workers.engine_health`, :mod:`nnqueue.workers.engine_restart`);
where it cannot, it exits with EXIT_ENGINE_DIED, and ``nnqueue worker`` runs this under a supervisor that starts it
again (:mod:`nnqueue.workers.supervisor`). SIGTERM is a warm shutdown whose wait
for running work is bounded by ``NNQUEUE_WORKER_DRAIN_S``; what is still held then goes back to the queue
(:mod:`nnqueue.workers.drain`).

The worker reports the weights version its engine serves and applies the model's checkpoint swaps between
requests (:mod:`nnqueue.workers.weights`): a worker that starts after some replays them before it registers.

The worker reads its settings, then isolates itself before it starts the engine
(:mod:`nnqueue.workers.containment`): the engine's processes run users' code (traces) and capture harvests, and
must find no secret in their environment or their parent, no network but their own loopback and no file but
theirs; they hand results and shards to this process through files it reads and uploads itself
(:mod:`nnqueue.workers.sinks`). A worker whose engine cannot be isolated runs only its operator's traces.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import importlib
import logging
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import prometheus_client
from sqlalchemy.orm import Session, sessionmaker

from nnqueue import cgroups, isolation, mountns, probe_memo
from nnqueue.broker import bulk_queue_name, create_celery_app, queue_name
from nnqueue.db.models import EngineKind
from nnqueue.db.session import make_engine, session_factory
from nnqueue.enginecore import spawning
from nnqueue.enginecore.crash_report import CRASH_DIR_ENV
from nnqueue.enginecore.lifetime import WORKER_PID_ENV
from nnqueue.enginecore.taps import UnservableTaps, mark_taps, served_taps
from nnqueue.engines.builders import BuilderPool
from nnqueue.engines.harvest_runner import capture_points
from nnqueue.engines.outbox import poller
from nnqueue.scheduler import registry
from nnqueue.scheduler.chunks import requeue_orphan_chunks, retry_or_fail_chunk
from nnqueue.scheduler.domain_turns import DomainTurns
from nnqueue.scheduler.reconciler import reconcile
from nnqueue.scheduler.recovery import requeue_held, requeue_orphans
from nnqueue.settings import Settings
from nnqueue.storage import log_store, object_store_from_settings
from nnqueue.storage.object_store import ObjectStore
from nnqueue.workers import engine_liveness, trl_server
from nnqueue.workers.bulk import BulkConsumer
from nnqueue.workers.chunk_execution import ChunkRunner, engine_info
from nnqueue.workers.containment import engine_core_kwargs, engine_view, isolate, warn_if_degraded
from nnqueue.workers.drain import Drain
from nnqueue.workers.engine_folders import FolderWatchdog
from nnqueue.workers.engine_health import EXIT_ENGINE_DIED, EngineHealth
from nnqueue.workers.engine_host import EngineHost
from nnqueue.workers.engine_processes import engine_processes
from nnqueue.workers.engine_restart import EngineRestart
from nnqueue.workers.heartbeat import HeartbeatThread
from nnqueue.workers.job_execution import Executor, JobRunner
from nnqueue.workers.sinks import ResultSinks
from nnqueue.workers.stall_deadline import StallDeadline
from nnqueue.workers.supervisor import report_ready
from nnqueue.workers.tasks import register_run_job
from nnqueue.workers.upload_budget import UploadBudget
from nnqueue.workers.weights import CheckpointUpdater, WeightsGate, base_version

if TYPE_CHECKING:  # imported where vLLM may be (_start_executor): a transformers worker never imports it
    from nnqueue.workers.trace_execution import VLLMTraceExecutor

log = logging.getLogger(__name__)
# How long the engine's start waits for the builders' zygote to have imported what its engine core runs.
CORE_FORKS_READY_S = 120.0
RUNNING_JOBS = prometheus_client.Gauge("nnqueue_worker_running_jobs", "Jobs this worker is running now.", ["model"])
RUNNING_CHUNKS = prometheus_client.Gauge(
    "nnqueue_worker_running_chunks", "Harvest chunks this worker is running now.", ["model"]
)
UPLOADS_HELD = prometheus_client.Gauge(
    "nnqueue_worker_upload_bytes_held",
    "Bytes of harvest shards this worker's engine handed off that are not yet in the store (its upload budget used).",
    ["model"],
)


def run_worker(
    model: str,
    model_key: str,
    max_concurrent_jobs: int | None,
    engine_kwargs: dict[str, Any],
    engine_kind: EngineKind = EngineKind.VLLM,
    bulk_slots: int | None = None,
) -> None:
    """``engine_kind``: a vLLM engine (``engine_kwargs`` go to vLLM's engine arguments; it also runs harvest
    chunks, ``bulk_slots`` at once, default ``NNQUEUE_WORKER_BULK_SLOTS``) or the transformers engine (one job at
    a time; ``engine_kwargs`` go to the model's ``from_pretrained``). ``max_concurrent_jobs`` None: the vLLM
    engine's ``max_num_seqs`` once it is up (one job at a time on the transformers engine)."""
    settings = Settings()
    bulk_slots = bulk_slots or settings.worker_bulk_slots
    # vLLM's import (8-12 s of one core) runs beside the containment's probe, a subprocess (8-9 s).
    with _vllm_imported_aside(engine_kind is EngineKind.VLLM):
        containment = isolate(
            settings,
            model,
            engine_kwargs,
            ray=engine_kwargs.get("distributed_executor_backend") == "ray",
            nccl=settings.trainer_port is not None and settings.trainer_nccl_port is not None,
        )
        sessions = session_factory(make_engine(settings.resolved_database_url))
        store = object_store_from_settings(settings)
        log_store(settings, log)
        queue = queue_name(model_key)

        if settings.worker_metrics_port is not None:
            # Before the engine loads (minutes): a taken port fails the worker at once. vLLM's AsyncLLM adds its
            # own series (vllm:generation_tokens_total, ...) to the same default registry when it starts.
            prometheus_client.start_http_server(settings.worker_metrics_port)
            log.info("serving metrics on port %d", settings.worker_metrics_port)
        # The engine's processes watch this pid and exit with us, even if we are SIGKILLed.
        os.environ[WORKER_PID_ENV] = str(os.getpid())
        crash_dir = isolation.engine_writable_dir("nnqueue-crash-", containment.engine_user or "")
        os.environ[CRASH_DIR_ENV] = str(crash_dir)
        # Where weights updates wait for the engine: the worker's, readable by the engine, never writable by it (root
        # writes there: a folder the engine user could change would take the worker's writes where it links them).
        staging = Path(tempfile.mkdtemp(prefix="nnqueue-weights-"))
        staging.chmod(0o755)
        sinks = ResultSinks(
            store, settings.resolved_store_dir / ".handoff", settings.worker_handoff_dir, settings.max_result_bytes
        )
        view = (
            engine_view(model, engine_kwargs, [crash_dir, sinks.handoff_dir()], readable=[staging])
            if containment.filesystem_private
            else None
        )
        host = EngineHost(blocking_threads=min(2 * ((max_concurrent_jobs or 32) + bulk_slots) + 2, 64))
        with sessions() as session:  # fail before loading a model that would then not register
            registry.check_engine(session, model_key, engine_kind, settings.worker_stale_after_s)
    started = time.monotonic()
    try:
        executor = host.call(
            _start_executor(engine_kind, model, engine_kwargs, settings, sessions, store, sinks, containment, view)
        )
    except BaseException:
        if containment.probe is not None:  # if a remembered probe misled us, the next start probes
            probe_memo.forget(probe_memo.DEFAULT_FOLDER, containment.probe)
        raise
    log.info("%s engine for %s ready in %.1f s", engine_kind.value, model, time.monotonic() - started)
    freeze_startup_heap()
    vllm_executor = cast("VLLMTraceExecutor", executor) if engine_kind is EngineKind.VLLM else None
    entrypoint = vllm_executor.model.vllm_entrypoint if vllm_executor is not None else None  # vLLM's AsyncLLM
    # The AsyncLLM serving now: a fresh engine replaces a dead one (nnqueue.workers.engine_restart).
    serving = (lambda: vllm_executor.model.vllm_entrypoint) if vllm_executor is not None else None
    if max_concurrent_jobs is None:
        max_concurrent_jobs = default_concurrency(entrypoint)
    log.info("running up to %d jobs at once", max_concurrent_jobs)
    app = create_celery_app(settings, prefetch=max_concurrent_jobs)

    worker_id = registry.new_worker_id()
    # Whether the vLLM engine has died (its AsyncLLM's ``errored``); never, on the transformers engine.
    health = EngineHealth(
        sessions,
        app,
        worker_id,
        model_key,
        crash_dir,
        lambda: serving is not None and bool(serving().errored),
    )
    base = base_version(model, engine_kwargs.get("revision"))
    gate = WeightsGate(*base)
    turns = DomainTurns(settings.resolved_domain_hold_s)
    runner = JobRunner(sessions, executor, model_key, worker_id, health, gate, containment, turns)
    register_run_job(app, host, runner)
    chunks, points, updater, taps = None, None, None, ()
    if vllm_executor is not None:  # harvests run on vLLM engines (the in-engine capture path)
        updater = CheckpointUpdater(
            sessions,
            store,
            entrypoint,
            gate,
            model_key,
            worker_id,
            staging,
            broken=lambda: _restart_for_weights(health),
            staged=view is not None,
        )
        host.call(updater.catch_up())  # the model's checkpoint swaps so far: serve the newest version
        uploads = UploadBudget(settings.worker_upload_budget_bytes)
        UPLOADS_HELD.labels(model_key).set_function(lambda: uploads.held)
        chunks = ChunkRunner(
            sessions,
            store,
            app,
            vllm_executor.model,
            vllm_executor.sinks,
            model_key,
            worker_id,
            settings.harvest_chunk_attempts,
            engine_info(model, entrypoint, vllm_executor.model.tokenizer),
            uploads,
            health,
            gate,
            runner,
        )
        points = host.call(capture_points(entrypoint))
        taps = vllm_executor.model.taps  # resolved by nnsight (VLLM._resolve_taps); empty on an eager engine
    try:
        if taps:  # published with the capture points (enginecore.taps); none published: none servable
            points = mark_taps(points or [], taps)
            log.info("serving taps %s with CUDA graphs on", served_taps(points))
        registry.register(
            sessions,
            worker_id,
            model_key,
            queue,
            max_concurrent_jobs,
            engine=engine_kind,
            stale_after_s=settings.worker_stale_after_s,
            capture_points=points,
            containment=containment.report(),
            weights=(gate.version, gate.source),
        )
    except (registry.EngineConflict, UnservableTaps):
        host.call(executor.close())
        host.stop()
        raise
    report_ready()  # the supervisor's healthy interval starts
    warn_if_degraded(containment)  # again, below the engine's start-up lines
    RUNNING_JOBS.labels(model_key).set_function(lambda: len(runner.running_jobs()))
    probe = engine_liveness.keep_probing(model_key, serving, health if serving is not None else None)
    probing = asyncio.run_coroutine_threadsafe(probe, host.loop)
    trainer = None
    if settings.trainer_port is not None and vllm_executor is not None:
        trainer = host.call(
            trl_server.serve(
                entrypoint,
                gate,
                settings,
                sessions,
                worker_id,
                model_key,
                broken=lambda: _restart_for_weights(health),
            )
        )
    if vllm_executor is not None:  # its engine publishes its switches (enginecore.stall_beacon)
        StallDeadline(
            crash_dir, settings.engine_stall_timeout_s, functools.partial(_engine_cores, vllm_executor)
        ).start()
    bulk = None
    if chunks is not None:
        RUNNING_CHUNKS.labels(model_key).set_function(lambda: len(chunks.running_chunks()))
        bulk = BulkConsumer(app, bulk_queue_name(model_key), bulk_slots, host.loop, chunks.run_next)

    def hand_back(reason: str) -> None:
        jobs = requeue_held(sessions, app, model_key, worker_id, runner.jobs_on_engine(), reason)
        runner.reap_lost()  # aborts the jobs just requeued
        held = chunks.running_chunks() if chunks is not None else []
        for chunk_id in held:
            cause = f"worker {worker_id} stopped: {reason}"
            retry_or_fail_chunk(sessions, app, chunk_id, worker_id, cause, settings.harvest_chunk_attempts)
        if chunks is not None:
            chunks.reap_lost()
        log.info("handed back %d jobs and %d harvest chunks: %s", len(jobs), len(held), reason)

    drain = Drain(
        settings.worker_drain_s,
        stop_taking=bulk.stop if bulk is not None else lambda: None,
        # A dead engine's work is settled by EngineHealth (jobs) and by live workers (chunks): nothing to wait for.
        running=lambda: (
            0
            if health.dead.is_set()
            else len(runner.running_jobs()) + (len(chunks.running_chunks()) if chunks is not None else 0)
        ),
        hand_back=hand_back,
    )
    drain.connect()
    if vllm_executor is not None and chunks is not None and updater is not None and trainer is None:
        load = functools.partial(_load_vllm, model, engine_kwargs, containment, view, vllm_executor.builders)
        health.restart = EngineRestart(load, vllm_executor, chunks, updater, base, crash_dir, hand_back)
    runner.fresh_engine_at_switch = settings.domain_switch == "restart" and health.restart is not None
    # Such an engine runs no other domain's steering job or chunk after a domain's trace (nnqueue.scheduler.domain_turns).
    turns.all_work = runner.fresh_engine_at_switch and settings.trust_domains == "owner"
    if bulk is not None:  # once the turns know what they cover
        bulk.start()
    if settings.domain_switch == "restart" and health.restart is None:
        log.info("trust-domain switches verify the live engine: this engine has no in-place restart")

    next_reconcile = 0.0

    def on_beat() -> None:
        nonlocal next_reconcile
        runner.reap_lost()
        requeue_orphans(sessions, app, model_key, settings.worker_stale_after_s)
        if chunks is not None:
            chunks.reap_lost()
            chunks.complete_finished()
            requeue_orphan_chunks(
                sessions, app, model_key, settings.worker_stale_after_s, settings.harvest_chunk_attempts
            )
        if updater is not None:
            updater.poll(host.loop)  # the model's new checkpoint swaps, applied on the engine loop
        if time.monotonic() >= next_reconcile:
            # A failure (broker down) is retried at the next beat.
            reconcile(sessions, app, model_key, settings.worker_stale_after_s)
            next_reconcile = time.monotonic() + settings.reconcile_interval_s

    beat = HeartbeatThread(sessions, worker_id, settings.worker_heartbeat_s, on_beat)
    beat.start()
    cores = functools.partial(_engine_cores, vllm_executor) if vllm_executor is not None else tuple
    FolderWatchdog(sinks, crash_dir, health, cores).start()  # the host folders the engine writes, bounded
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
        drain.finish()  # the heartbeat goes on meanwhile: the chunks still running here are not taken as lost
        if trainer is not None:
            trainer.should_exit = True
        if bulk is not None:
            bulk.stop()
        beat.stop()
        registry.mark_stopped(sessions, worker_id)
        probing.cancel()  # before the engine's shutdown, which it would take for a death to heal
        host.call(executor.close())
        host.stop()
        if (group := cgroups.asked()) is not None:  # what is left of the engine's processes, and the group
            group.remove()
        shutil.rmtree(crash_dir, ignore_errors=True)
        sinks.close()
        shutil.rmtree(staging, ignore_errors=True)
        if view is not None and view.sockets_kept:
            shutil.rmtree(view.sockets_kept, ignore_errors=True)
    if health.dead.is_set():
        sys.exit(EXIT_ENGINE_DIED)  # the supervisor starts a fresh worker


def _engine_cores(executor: VLLMTraceExecutor) -> list[int]:
    """The pids of the engine core processes of ``executor``'s engine now (a fresh one's after a restart)."""
    return [process.pid for process in engine_processes(executor.model.vllm_entrypoint)]


def _restart_for_weights(health: EngineHealth) -> None:
    """A failed weights update left the engine's weights changed with no copy to put back: stop this worker as if
    its engine died (exit 75), so that the supervisor starts a fresh one, which replays the model's updates."""
    health.dead.set()
    health.stop()


def default_concurrency(entrypoint: Any) -> int:
    """Jobs to run at once when ``--max-concurrent-jobs`` is not given: as many as the vLLM engine (``entrypoint``,
    its AsyncLLM) schedules in one step (its ``max_num_seqs``: vLLM's default for the device, or the
    ``--max-num-seqs`` given). Fewer leave its batches short: one-prompt trace jobs ran at 0.45x raw vLLM on the H100
    with 8 at once, 0.80x with 256. The transformers engine (None) runs one job at a time."""
    return 1 if entrypoint is None else engine_max_num_seqs(entrypoint)


def engine_max_num_seqs(entrypoint: Any) -> int:
    """The most sequences a vLLM engine (an ``AsyncLLM``, or an ``LLM``) schedules in one step."""
    config = getattr(entrypoint, "vllm_config", None) or entrypoint.llm_engine.vllm_config
    return int(config.scheduler_config.max_num_seqs)


def freeze_startup_heap() -> None:
    """Move every object made so far (the engine client, the model's meta copy, the libraries) out of the
    garbage collector's reach, as vLLM's engine core does after it starts. Otherwise each full collection
    walks them all, holding the GIL that the engine loop and every job thread share: a full collection took
    0.5-0.7 s in each run of 256 one-prompt jobs (tiny model on a 2-core CPU machine), 0.03-0.15 s frozen."""
    gc.collect()
    gc.freeze()


@contextlib.contextmanager
def _vllm_imported_aside(enabled: bool) -> Iterator[None]:
    """Import vLLM on a thread (:func:`_import_vllm`) while the body runs. A body that raises waits for the import
    first: a worker that exited while the import ran in torch's C++ code aborted (glibc's "FATAL: exception not
    rethrown", status -6), which its supervisor restarts, where a refused start (status 2) is final."""
    importing = threading.Thread(target=_import_vllm, name="nnqueue-import-vllm", daemon=True)
    if enabled:
        importing.start()
    try:
        yield
    except BaseException:
        if enabled:
            importing.join()
        raise


def _import_vllm() -> None:
    """Import what :func:`_start_executor` imports of vLLM, ahead of it. A failure is left to that import, which
    then raises it where the worker reports it."""
    with contextlib.suppress(Exception):
        for name in ("nnqueue.engines.platform", "nnqueue.workers.trace_execution"):
            importlib.import_module(name)


async def _start_executor(
    engine_kind: EngineKind,
    model: str,
    engine_kwargs: dict[str, Any],
    settings: Settings,
    sessions: sessionmaker[Session],
    store: ObjectStore,
    sinks: ResultSinks,
    containment: isolation.Containment,
    view: mountns.View | None,
) -> Executor:
    """The engine, loaded, and its executor. Built on the engine loop: vLLM's AsyncLLM binds to the loop it
    first runs on, and the transformers engine's process pipes to the loop that started it. The vLLM engine
    core is spawned in the engine's network namespace and filesystem ``view`` (:mod:`nnqueue.enginecore.spawning`;
    the other engine processes enter them themselves, told by their environment). The trace builders start before
    the engine and load beside it: the worker registers with them ready, so its first trace job runs as fast as
    the next ones."""
    if engine_kind is EngineKind.TRANSFORMERS:
        from nnqueue.engines.transformers import TransformersEngine
        from nnqueue.workers.transformers_execution import TransformersExecutor

        engine = TransformersEngine(model, engine_kwargs, settings.engine_stall_timeout_s)
        await engine.start()
        return TransformersExecutor(sessions, store, engine, sinks)
    builders = BuilderPool(
        model, engine_kwargs, settings.trace_builders, 4 * settings.max_payload_bytes, settings.trace_builder_timeout_s
    )
    builders_ready = await builders.launch()
    try:
        # vLLM's import, begun beside the containment's probe (_import_vllm), ends here if it has not yet.
        from nnqueue.workers.trace_execution import VLLMTraceExecutor

        vllm = _load_vllm(model, engine_kwargs, containment, view, builders)  # blocks this loop; builders load aside
        await builders_ready
    except BaseException:
        await builders.close()
        raise
    # The engine's one poller, shared with harvest chunks.
    return VLLMTraceExecutor(sessions, store, vllm, sinks, poller(vllm.vllm_entrypoint), builders)


def _load_vllm(
    model: str,
    engine_kwargs: dict[str, Any],
    containment: isolation.Containment,
    view: mountns.View | None,
    builders: BuilderPool,
) -> Any:
    """A dispatched async nnsight ``VLLM`` of ``model``, its engine core forked by the builders' zygote
    (:mod:`nnqueue.enginecore.core_forks`) or else spawned, in the engine's network namespace and filesystem
    ``view`` (:mod:`nnqueue.enginecore.spawning`); on the engine loop."""
    from nnqueue.engines.platform import load_engine

    forks = builders.core_forks
    if forks is not None and not forks.ready(CORE_FORKS_READY_S):
        log.info("the engine core is spawned: the trace builders' zygote forks none (it did not load or declined)")
        forks = None
    with spawning.engine_core_contained(network=containment.network_isolated, view=view, forks=forks):
        return load_engine(model, **engine_core_kwargs(engine_kwargs))
