"""The Celery application: Redis broker, two queues per model, and messages that are *tokens*.

A message on model M's interactive queue means "there is interactive work (a trace job) for M"; one on
its bulk queue, "there is a harvest chunk for M". It names no job: the worker that receives it claims
the best QUEUED unit of M from the database (:mod:`nnqueue.scheduler.claim`), so the database, not the
order of messages, decides what runs next (priority, fairness), and a duplicate or stale token is
harmless: it finds no work and is dropped. Payloads and results live in the object store and state
in the database; a lost token is re-sent by the reconciler (:mod:`nnqueue.scheduler.reconciler`).

Tokens are sent by :class:`TokenPublisher`, not Celery's ``send_task``: a token is always the same task with the
same argument, so its message is built from a template and pushed with one Redis LPUSH on a pooled connection,
the exact message (Celery's task protocol 2, as kombu's Redis transport stores it) that ``send_task`` writes at
several times the CPU cost: the API sends one per submission.
"""

from __future__ import annotations

import base64
import hashlib
import json
import re
import uuid
from functools import lru_cache
from typing import Any
from weakref import WeakKeyDictionary

import redis
from celery import Celery
from celery.utils.nodenames import anon_nodename
from kombu.exceptions import OperationalError
from redis.backoff import ConstantBackoff
from redis.retry import Retry

from nnqueue.errors import NNqueueError
from nnqueue.settings import Settings

# The interactive token (a Celery task, run in Celery's pool) and the bulk token (read by the worker's
# own bulk consumer, :mod:`nnqueue.workers.bulk`). Both carry the model key, for logs only.
RUN_JOB_TASK = "nnqueue.run_job"
RUN_CHUNK_TASK = "nnqueue.run_chunk"


def queue_name(model_key: str) -> str:
    """The queue that carries ``model_key``'s jobs; a readable slug plus a hash so distinct keys never share one."""
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", model_key).strip("-")[-60:]
    digest = hashlib.sha256(model_key.encode()).hexdigest()[:10]
    return f"nnqueue.model.{slug}.{digest}"


def bulk_queue_name(model_key: str) -> str:
    """The queue that carries tokens for ``model_key``'s harvest chunks."""
    return f"{queue_name(model_key)}.bulk"


def ready_messages(app: Celery, queue: str) -> int:
    """Messages waiting on ``queue``, not counting those a worker holds unacknowledged."""
    with app.connection_for_read() as connection:
        return int(connection.default_channel.queue_declare(queue=queue, durable=True, auto_delete=False).message_count)


class BrokerNotConfigured(NNqueueError, ValueError):
    """``NNQUEUE_BROKER_URL`` is not set, and the process needs the broker."""


def broker_url(settings: Settings) -> str:
    """The broker's URL; :class:`BrokerNotConfigured`, saying what to set, if there is none."""
    if not settings.broker_url:
        raise BrokerNotConfigured(
            "NNQUEUE_BROKER_URL is not set: the API, workers and beat need a Redis broker (redis://...); "
            "`nnqueue up` runs all of them on this machine with one of its own"
        )
    return settings.broker_url


def create_celery_app(settings: Settings, *, prefetch: int = 1) -> Celery:
    app = Celery("nnqueue", broker=broker_url(settings), set_as_current=False)
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
        # sys.stdout stays the process's own (the worker's log file): vLLM 0.24, the GPU build, calls
        # sys.stdout.fileno() whenever an engine starts, and Celery's LoggingProxy has none, so an engine restarted
        # in a running worker failed on a GPU (and the whole worker restarted instead: a minute more).
        worker_redirect_stdouts=False,
        # No remote control: a worker would otherwise obey any broker client's broadcast (``shutdown``,
        # ``pool_restart``, ...), and nnqueue never sends one. With mingle and gossip off too
        # (nnqueue.workers.main), a worker reads nothing from the broker but its own queues.
        worker_enable_remote_control=False,
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


class TokenPublisher:
    """Sends tokens to one Redis broker: one LPUSH per batch of tokens, on a connection pool its threads share.

    Like ``send_task`` (Celery's default publish retry policy), a lost connection is retried three times,
    0.2 s apart; a broker still unreachable raises kombu's :class:`~kombu.exceptions.OperationalError`.
    """

    def __init__(self, broker_url: str) -> None:
        retry = Retry(ConstantBackoff(0.2), retries=3)
        self._redis = redis.Redis.from_url(broker_url, retry=retry, socket_connect_timeout=4, socket_timeout=10)
        # Celery's defaults: the sending node's anonymous name, and a reply queue nobody reads (results are off).
        self._origin, self._reply_to = anon_nodename(), str(uuid.uuid4())

    def send(self, task: str, model_key: str, queue: str, count: int = 1) -> None:
        """Push ``count`` tokens of ``task`` for ``model_key`` onto ``queue``."""
        if count <= 0:
            return
        messages = [self.message(task, model_key, queue) for _ in range(count)]
        try:
            self._redis.lpush(queue, *messages)
        except redis.RedisError as error:
            raise OperationalError(f"cannot send to the broker: {error}") from error

    def message(self, task: str, model_key: str, queue: str) -> str:
        """One token's message as stored on ``queue``: fresh task id and delivery tag, everything else fixed."""
        task_id, headers = str(uuid.uuid4()), _task_headers(task, model_key)
        return json.dumps(
            {
                "body": _task_body(model_key),
                "content-encoding": "utf-8",
                "content-type": "application/json",
                "headers": {**headers, "id": task_id, "root_id": task_id, "origin": self._origin},
                "properties": {
                    "correlation_id": task_id,
                    "reply_to": self._reply_to,
                    "delivery_mode": 2,
                    "delivery_info": {"exchange": "", "routing_key": queue},
                    "priority": 0,
                    "body_encoding": "base64",
                    "delivery_tag": str(uuid.uuid4()),
                },
            }
        )


_publishers: WeakKeyDictionary[Celery, TokenPublisher] = WeakKeyDictionary()


def token_publisher(app: Celery) -> TokenPublisher:
    """``app``'s publisher, made on first use (one per app, so its connections are pooled across requests)."""
    publisher = _publishers.get(app)
    if publisher is None:
        publisher = _publishers.setdefault(app, TokenPublisher(app.conf.broker_url))
    return publisher


@lru_cache(maxsize=1024)
def _task_body(model_key: str) -> str:
    """The task's arguments ``([model_key], {}, embed)`` in Celery's protocol 2, JSON then base64 (kombu's body
    encoding on Redis)."""
    embed = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
    return base64.b64encode(json.dumps([[model_key], {}, embed]).encode()).decode()


@lru_cache(maxsize=1024)
def _task_headers(task: str, model_key: str) -> dict[str, Any]:
    """Celery's protocol 2 headers of ``task(model_key)`` sent with no options, less the per-message ones."""
    return {
        "lang": "py",
        "task": task,
        "shadow": None,
        "eta": None,
        "expires": None,
        "group": None,
        "group_index": None,
        "retries": 0,
        "timelimit": [None, None],
        "parent_id": None,
        "argsrepr": repr([model_key]),
        "kwargsrepr": "{}",
        "ignore_result": None,
        "replaced_task_nesting": 0,
        "stamped_headers": None,
        "stamps": {},
    }
