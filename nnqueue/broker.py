"""The Celery application: Redis broker, two queues per model, and messages that are *tokens*.

A message on model M's interactive queue means "there is interactive work (a trace job) for M"; one on
its bulk queue, "there is a harvest chunk for M". It names no job: the worker that receives it claims
the best QUEUED unit of M from the database (:mod:`nnqueue.scheduler.claim`), so the database, not the
order of messages, decides what runs next (priority, fairness), and a duplicate or stale token is
harmless: it finds no work and is dropped. Payloads and results live in the object store and state
in the database; a lost token is re-sent by the reconciler (:mod:`nnqueue.scheduler.reconciler`).
"""

from __future__ import annotations

import hashlib
import re

from celery import Celery

from nnqueue.settings import Settings

# The interactive token (a Celery task, run in Celery's pool) and the bulk token (read by the worker's
# own bulk consumer, :mod:`nnqueue.workers.bulk`). Both carry the model key, for logs only.
RUN_JOB_TASK = "nnqueue.run_job"
RUN_CHUNK_TASK = "nnqueue.run_chunk"


def queue_name(model_key: str) -> str:
    """The queue that carries ``model_key``'s jobs; a readable slug plus a hash so distinct keys never share one."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", model_key).strip("-")[-60:]
    digest = hashlib.sha256(model_key.encode()).hexdigest()[:10]
    return f"nnqueue.model.{slug}.{digest}"


def bulk_queue_name(model_key: str) -> str:
    """The queue that carries tokens for ``model_key``'s harvest chunks."""
    return f"{queue_name(model_key)}.bulk"


def ready_messages(app: Celery, queue: str) -> int:
    """Messages waiting on ``queue``, not counting those a worker holds unacknowledged."""
    with app.connection_for_read() as connection:
        return int(connection.default_channel.queue_declare(queue=queue, durable=True, auto_delete=False).message_count)


def create_celery_app(settings: Settings, *, prefetch: int = 1) -> Celery:
    if not settings.broker_url:
        raise ValueError("NNQUEUE_BROKER_URL is not set: workers and the API need a Redis broker")
    app = Celery("nnqueue", broker=settings.broker_url, set_as_current=False)
    app.conf.update(
        task_serializer="json",
        accept_content=["json"],
        # Acknowledge after the job ran, and give the message back if the worker process dies
        # mid-job, so a SIGKILLed worker's job is redelivered rather than lost.
        task_acks_late=True,
        task_reject_on_worker_lost=True,
        # The engine host runs `prefetch` jobs at once; reserving more would starve other workers.
        worker_prefetch_multiplier=1,
        worker_concurrency=prefetch,
        task_default_queue="nnqueue.default",
        task_create_missing_queues=True,
        broker_transport_options=_redis_redelivery(settings.broker_visibility_timeout_s),
        broker_connection_retry_on_startup=True,
        result_backend=None,
        task_ignore_result=True,
        worker_hijack_root_logger=False,
    )
    return app


def _redis_redelivery(visibility_timeout_s: float) -> dict[str, float]:
    """Redis transport options under which a dead worker's message comes back about
    ``visibility_timeout_s`` after it was taken (kombu sweeps every interval x throttle seconds)."""
    return {
        "visibility_timeout": visibility_timeout_s,
        "unacked_restore_interval": max(1.0, min(10.0, visibility_timeout_s / 4)),
        "unacked_restore_throttle": 1,
    }
