"""The Celery task behind an interactive token: a thin hand-off from a Celery pool thread to the engine loop."""

from __future__ import annotations

from celery import Celery

from nnqueue.broker import RUN_JOB_TASK
from nnqueue.workers.engine_host import EngineHost
from nnqueue.workers.job_execution import JobRunner, Outcome


def register_run_job(app: Celery, host: EngineHost, runner: JobRunner) -> None:
    """Bind the ``run_job`` task to this process's engine: each token claims and runs the model's best queued job.
    The message carries the model key (for the log); the runner serves its own model whatever it says (a message
    of an older nnqueue, which named a job, is a token too)."""

    @app.task(name=RUN_JOB_TASK)
    def run_job(model_key: str) -> str:
        outcome: Outcome = host.call(runner.run_next())
        return outcome.value
