"""``nnqueue beat``: the process that fires recurring harvests (:mod:`nnqueue.scheduler.schedules`).

A small loop over the ``harvest_schedules`` table rather than Celery beat: schedules are rows that the
API creates, pauses and deletes, and Celery beat would need a database scheduler of its own (a third-party
one, or celery-redbeat keeping them in Redis, which a restart empties) and a restart to see a change.
The loop reads the table every ``NNQUEUE_BEAT_INTERVAL_S``; each due time fires once even with several
beat processes (a compare-and-set on the schedule's next run time), so running two for availability is safe.
"""

from __future__ import annotations

import logging
import threading

from nnqueue.broker import create_celery_app
from nnqueue.db.session import make_engine, session_factory
from nnqueue.scheduler.harvest_dataset import Limits
from nnqueue.scheduler.schedules import fire_due
from nnqueue.settings import Settings
from nnqueue.storage import log_store, object_store_from_settings

log = logging.getLogger(__name__)


def run_beat(settings: Settings, stop: threading.Event | None = None) -> None:
    """Fire due schedules until ``stop`` is set (or forever)."""
    stop = stop or threading.Event()
    engine = make_engine(settings.resolved_database_url)
    sessions = session_factory(engine)
    store = object_store_from_settings(settings)
    log_store(settings, log)
    app = create_celery_app(settings)
    log.info("beat: firing due harvest schedules every %.1f s", settings.beat_interval_s)
    try:
        while not stop.is_set():
            try:
                fire_due(
                    sessions,
                    store,
                    app,
                    limits=Limits.of(settings),
                    stale_after_s=settings.worker_stale_after_s,
                    restart_grace_s=settings.worker_restart_grace_s,
                    scale_to_zero_models=tuple(settings.scale_to_zero_models),
                )
            except Exception:  # a database or broker blip: try again at the next tick
                log.exception("beat: firing schedules failed")
            stop.wait(settings.beat_interval_s)
    finally:
        engine.dispose()
