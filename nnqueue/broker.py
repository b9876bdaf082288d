"""The Celery application: Redis broker, one queue per model, task messages that carry only job ids.

Payloads and results live in the object store and state in the database, so a message is a pointer
and redelivering it is harmless: the task re-reads the job and the status machine decides whether
it may run (see :mod:`nnqueue.workers.tasks`).
"""

from __future__ import annotations

import hashlib
import re

from celery import Celery

from nnqueue.settings import Settings

RUN_JOB_TASK = "nnqueue.run_job"


def queue_name(model_key: str) -> str:
    """The queue that carries ``model_key``'s jobs; a readable slug plus a hash so distinct keys never share one."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", model_key).strip("-")[-60:]
    digest = hashlib.sha256(model_key.encode()).hexdigest()[:10]
    return f"nnqueue.model.{slug}.{digest}"


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
