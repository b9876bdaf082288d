"""Sending tokens: one message on a model's queue per unit of work made QUEUED (see :mod:`nnqueue.broker`)."""

from __future__ import annotations

from celery import Celery

from nnqueue.broker import RUN_CHUNK_TASK, RUN_JOB_TASK, bulk_queue_name, queue_name


def send_job_tokens(app: Celery, model_key: str, count: int = 1) -> None:
    """Tell ``model_key``'s workers that ``count`` more interactive jobs wait."""
    _send(app, RUN_JOB_TASK, model_key, queue_name(model_key), count)


def send_chunk_tokens(app: Celery, model_key: str, count: int = 1) -> None:
    """Tell ``model_key``'s workers that ``count`` more harvest chunks wait."""
    _send(app, RUN_CHUNK_TASK, model_key, bulk_queue_name(model_key), count)


def _send(app: Celery, task: str, model_key: str, queue: str, count: int) -> None:
    if count <= 0:
        return
    with app.producer_or_acquire() as producer:
        for _ in range(count):
            app.send_task(task, args=[model_key], queue=queue, producer=producer)
