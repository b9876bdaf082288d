"""Tokens pushed by :class:`nnqueue.broker.TokenPublisher` are the messages Celery's ``send_task`` writes, on a real
Redis: the same fields and values but the per-message ids, and kombu (what the Celery worker and the bulk consumer
read them with) decodes them into the task and its argument. Workers running jobs from such tokens are in
tests/workers."""

from __future__ import annotations

import json
import uuid
from typing import Any

import pytest
import redis
from kombu import Exchange, Queue
from kombu.exceptions import OperationalError

from nnqueue.broker import RUN_CHUNK_TASK, RUN_JOB_TASK, bulk_queue_name, create_celery_app, queue_name
from nnqueue.scheduler.enqueue import send_chunk_tokens, send_job_tokens
from nnqueue.settings import Settings
from tests.utils.servers import free_ports

# Fresh for every message (or for every sending process): compared for their shape only.
PER_MESSAGE = {("headers", "id"), ("headers", "root_id"), ("headers", "origin"), ("properties", "correlation_id")}
PER_MESSAGE |= {("properties", "delivery_tag"), ("properties", "reply_to")}


def _stored(client: redis.Redis, queue: str) -> list[dict[str, Any]]:
    return [json.loads(raw) for raw in client.lrange(queue, 0, -1)]


def _fixed(message: dict[str, Any]) -> dict[str, Any]:
    """The message without the values that differ between any two messages."""
    return {
        part: {k: v for k, v in value.items() if (part, k) not in PER_MESSAGE} if isinstance(value, dict) else value
        for part, value in message.items()
    }


@pytest.mark.parametrize("task", [RUN_JOB_TASK, RUN_CHUNK_TASK])
def test_a_token_is_the_message_celery_sends(redis_url: str, task: str) -> None:
    app = create_celery_app(Settings(_env_file=None, broker_url=redis_url))
    model = f"org/model-{uuid.uuid4().hex[:6]}"
    queue = queue_name(model) if task == RUN_JOB_TASK else bulk_queue_name(model)
    client = redis.Redis.from_url(redis_url)
    app.send_task(task, args=[model], queue=queue)
    [celerys] = _stored(client, queue)
    client.delete(queue)

    (send_job_tokens if task == RUN_JOB_TASK else send_chunk_tokens)(app, model, 3)
    ours = _stored(client, queue)
    client.delete(queue)

    assert len(ours) == 3 and all(_fixed(message) == _fixed(celerys) for message in ours)
    for part, key in PER_MESSAGE:
        assert {type(message[part][key]) for message in ours} == {type(celerys[part][key])}
    assert len({message["headers"]["id"] for message in ours}) == 3
    assert len({message["properties"]["delivery_tag"] for message in ours}) == 3
    assert all(message["headers"]["id"] == message["properties"]["correlation_id"] for message in ours)


def test_kombu_reads_a_token_as_the_task_and_its_model(redis_url: str) -> None:
    app = create_celery_app(Settings(_env_file=None, broker_url=redis_url))
    model = f"m-{uuid.uuid4().hex[:6]}"
    send_job_tokens(app, model)
    received: list[tuple[Any, dict[str, Any]]] = []
    queue = Queue(queue_name(model), Exchange(queue_name(model), type="direct"), routing_key=queue_name(model))
    with app.connection_for_read() as connection, connection.Consumer([queue], accept=["json"]) as consumer:
        consumer.register_callback(lambda body, message: (received.append((body, message.headers)), message.ack()))
        connection.drain_events(timeout=5)
    [(body, headers)] = received
    assert headers["task"] == RUN_JOB_TASK and body[0] == [model] and body[1] == {}


def test_an_unreachable_broker_raises_kombus_operational_error() -> None:
    [closed_port] = free_ports(1)
    app = create_celery_app(Settings(_env_file=None, broker_url=f"redis://127.0.0.1:{closed_port}/0"))
    with pytest.raises(OperationalError, match="cannot send to the broker"):
        send_job_tokens(app, "m")
