"""Sending tokens: one message on a model's queue per unit of work made QUEUED (see :mod:`nnqueue.broker`)."""

from __future__ import annotations

from celery import Celery

from nnqueue.broker import RUN_CHUNK_TASK, RUN_JOB_TASK, bulk_queue_name, queue_name, token_publisher


def send_job_tokens(app: Celery, model_key: str, count: int = 1) -> None:
    """Tell ``model_key``'s workers that ``count`` more interactive jobs wait."""
    token_publisher(app).send(RUN_JOB_TASK, model_key, queue_name(model_key), count)


def send_chunk_tokens(app: Celery, model_key: str, count: int = 1) -> None:
    """Tell ``model_key``'s workers that ``count`` more harvest chunks wait."""
    token_publisher(app).send(RUN_CHUNK_TASK, model_key, bulk_queue_name(model_key), count)
