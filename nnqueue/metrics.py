"""Prometheus metrics that nnqueue's processes record where things happen (prometheus-client).

The API counts submissions (jobs and harvests), cancellations and the payload bytes it stores; workers count the
jobs and harvest chunks they finish, observe queue waits and run times, and count the result and shard bytes
they store and the tokens harvested. Each process exports its
own numbers (the API at ``/metrics``, a worker on ``NNQUEUE_WORKER_METRICS_PORT``), and PromQL sums them.
What is a property of the whole queue rather than of one process (queue depth, the oldest queued job's age,
live workers) is read from the database at scrape time by :mod:`nnqueue.api.metrics`.

Several API processes (``nnqueue serve-api --workers N``) share their numbers through prometheus-client's
multiprocess mode: ``PROMETHEUS_MULTIPROC_DIR`` set before the processes start (serve-api does it), and
:func:`process_registry` then merges every process's files at scrape time.
"""

from __future__ import annotations

import os

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client import multiprocess as prometheus_multiprocess
from prometheus_client.registry import REGISTRY

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# Seconds: from a 10 ms queue hop to a day-long harvest.
DURATION_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600, 4 * 3600, 86400)

JOBS_SUBMITTED = Counter("nnqueue_jobs_submitted", "Jobs accepted by the API.", ["model", "kind"])
JOBS_FINISHED = Counter(
    "nnqueue_jobs_finished",
    "Jobs that ended, by how: completed, failed or cancelled.",
    ["model", "kind", "status"],
)
QUEUE_WAIT = Histogram(
    "nnqueue_job_queue_wait_seconds",
    "From a job's (latest) queueing to a worker starting it.",
    ["model", "kind"],
    buckets=DURATION_BUCKETS,
)
RUN_TIME = Histogram(
    "nnqueue_job_run_seconds",
    "From a worker starting a job to the job's end, by how it ended.",
    ["model", "kind", "status"],
    buckets=DURATION_BUCKETS,
)
STORE_BYTES_WRITTEN = Counter(
    "nnqueue_store_bytes_written",
    "Bytes written to the object store, by what: payload, result or shard (a harvest's).",
    ["what"],
)
HARVESTS_SUBMITTED = Counter("nnqueue_harvests_submitted", "Harvests accepted by the API.", ["model"])
HARVEST_CHUNKS_FINISHED = Counter(
    "nnqueue_harvest_chunks_finished",
    "Harvest chunks a worker ran to an end, by how: completed, failed (retried or not) or cancelled.",
    ["model", "status"],
)
HARVEST_CHUNK_TIME = Histogram(
    "nnqueue_harvest_chunk_seconds",
    "From a worker claiming a harvest chunk to its shard recorded.",
    ["model"],
    buckets=DURATION_BUCKETS,
)
HARVEST_TOKENS = Counter(
    "nnqueue_harvest_tokens", "Prompt tokens run through the model by completed chunks.", ["model"]
)
DOMAIN_SWITCHES = Counter(
    "nnqueue_worker_domain_switches",
    "Times a worker's engine moved from one trust domain's traces to another's (each verified the engine's state).",
    ["model"],
)
DOMAIN_SWITCH_TIME = Histogram(
    "nnqueue_worker_domain_switch_seconds",
    "How long verifying the engine's state took at a trust domain switch (the drain before it not counted).",
    ["model"],
    buckets=DURATION_BUCKETS,
)


def process_registry() -> CollectorRegistry:
    """The registry holding this process's metrics: in multiprocess mode, every API process's merged."""
    if not os.environ.get(MULTIPROC_ENV):
        return REGISTRY
    registry = CollectorRegistry()
    prometheus_multiprocess.MultiProcessCollector(registry)
    return registry


def exposition(*registries: CollectorRegistry) -> bytes:
    """The text exposition of ``registries`` (their metric names must not overlap)."""
    return b"".join(generate_latest(registry) for registry in registries)
