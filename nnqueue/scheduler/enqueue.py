"""Putting a job on its model's queue: the message names only the job; everything else is in the database."""

from __future__ import annotations

from celery import Celery

from nnqueue.broker import RUN_JOB_TASK, queue_name
from nnqueue.db.models import Job


def enqueue(app: Celery, job: Job) -> None:
    app.send_task(RUN_JOB_TASK, args=[str(job.id)], queue=queue_name(job.model_key))
