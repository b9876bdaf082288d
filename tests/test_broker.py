"""The Celery app a worker runs (nnqueue.broker)."""

from __future__ import annotations

import warnings

from nnqueue.broker import create_celery_app
from nnqueue.settings import Settings


def test_a_worker_leaves_sys_stdout_alone() -> None:
    # vLLM 0.24 (the GPU build) calls sys.stdout.fileno() at every engine start; Celery's worker replaces
    # sys.stdout with a LoggingProxy that has none unless told not to: an engine restarted in place on an H200
    # failed so ("'LoggingProxy' object has no attribute 'fileno'").
    app = create_celery_app(Settings(_env_file=None, broker_url="redis://127.0.0.1:1/0"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Celery's warning about a root worker
        worker = app.Worker(pool="threads", concurrency=1, without_gossip=True, without_mingle=True)
    assert worker.redirect_stdouts is False
