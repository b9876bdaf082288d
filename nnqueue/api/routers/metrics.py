"""``/metrics``: Prometheus metrics of the API processes and of the queue as the database sees it.

The counters and histograms are the API's own (:mod:`nnqueue.metrics`; all of its processes' together
when it runs several). The gauges are read from the database at each scrape, so every API process reports
the same queue, whichever answers: queue depth, running jobs and the oldest queued job's age per model,
and the live workers and their capacity. Like ``/healthz`` it needs no key: scrape it from inside your
network, and do not route it to the outside.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator
from typing import Annotated

from fastapi import APIRouter, Depends, Response
from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from nnqueue import metrics
from nnqueue.api.deps import Resources, get_resources
from nnqueue.db.models import utcnow
from nnqueue.scheduler.overview import model_loads

router = APIRouter(tags=["health"])
log = logging.getLogger(__name__)


class QueueCollector(Collector):
    """The queue's gauges, read from the database when collected. The models in ``always`` (the scale-to-zero
    ones) have every gauge even while idle: an autoscaler reading them tells "nothing to do" (0) from "these
    metrics are not scraped" (no series), which must not leave a model at zero workers."""

    def __init__(self, sessions: sessionmaker[Session], stale_after_s: float, always: Iterable[str] = ()) -> None:
        self.sessions, self.stale_after_s, self.always = sessions, stale_after_s, tuple(always)

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("nnqueue_queue_stats_up", "1 if the queue's gauges could be read from the database.")
        try:
            with self.sessions() as session:
                loads = model_loads(session, self.stale_after_s, self.always)
        except SQLAlchemyError:
            log.exception("metrics: could not read the queue from the database")
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        now = utcnow()
        gauges = {
            "nnqueue_queue_depth": ("Jobs queued, per model.", lambda load: load.queued),
            "nnqueue_jobs_running": ("Jobs running, per model.", lambda load: load.running),
            "nnqueue_queue_oldest_age_seconds": (
                "Age of the oldest queued job, per model (0 when none is queued).",
                lambda load: load.oldest_queued_age_s(now),
            ),
            "nnqueue_live_workers": ("Workers with a fresh heartbeat, per model.", lambda load: load.workers),
            "nnqueue_worker_capacity": ("Jobs the live workers run at once, per model.", lambda load: load.capacity),
            "nnqueue_harvest_chunks_queued": ("Harvest chunks queued, per model.", lambda load: load.chunks_queued),
            "nnqueue_harvest_chunks_running": ("Harvest chunks running, per model.", lambda load: load.chunks_running),
        }
        for name, (documentation, value) in gauges.items():
            family = GaugeMetricFamily(name, documentation, labels=["model"])
            for load in loads:
                family.add_metric([load.model_key], value(load))
            yield family


@router.get("/metrics", response_class=Response, responses={200: {"content": {metrics.CONTENT_TYPE: {}}}})
def prometheus_metrics(resources: Annotated[Resources, Depends(get_resources)]) -> Response:
    queue = CollectorRegistry(auto_describe=False)
    settings = resources.settings
    queue.register(QueueCollector(resources.sessions, settings.worker_stale_after_s, settings.scale_to_zero_models))
    return Response(metrics.exposition(metrics.process_registry(), queue), media_type=metrics.CONTENT_TYPE)
