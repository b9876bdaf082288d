"""The Celery task that runs a job: a thin hand-off from a Celery pool thread to the engine loop."""

from __future__ import annotations

import uuid

from celery import Celery

from nnqueue.broker import RUN_JOB_TASK
from nnqueue.workers.engine_host import EngineHost
from nnqueue.workers.job_execution import JobRunner, Outcome


def register_run_job(app: Celery, host: EngineHost, runner: JobRunner) -> None:
    """Bind the ``run_job`` task to this process's engine. The message carries only the job id."""

    @app.task(name=RUN_JOB_TASK)
    def run_job(job_id: str) -> str:
        outcome: Outcome = host.call(runner.run(uuid.UUID(job_id)))
        return outcome.value
