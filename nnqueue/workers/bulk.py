"""The worker's bulk consumer: a thread that takes harvest-chunk tokens from the model's bulk queue.

Why not Celery's own pool: a worker consuming both queues in one pool would fill its slots with long chunks,
and a trace submitted meanwhile would wait for a slot (Celery has no per-queue concurrency). So Celery's
pool serves only the interactive queue, and this kombu consumer, beside it in the same process, holds at
most ``slots`` bulk tokens (the channel's prefetch count) and runs each one's chunk on the engine loop.
Both kinds of work then share the engine, where vLLM batches them together.

A token is acknowledged when its chunk has run (acks happen on this thread, the channel's owner). If the
worker dies, its unacknowledged tokens come back after the broker's visibility timeout, and the chunks it
held are requeued with fresh tokens by live workers' heartbeats; either way a duplicate token is harmless.
The consumer reconnects after broker failures (a Redis restart): the reconciler re-sends lost tokens.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Future
from typing import Any

from celery import Celery
from kombu import Exchange, Message, Queue

log = logging.getLogger(__name__)
DRAIN_TIMEOUT_S = 0.5
RECONNECT_DELAY_S = 2.0


class BulkConsumer(threading.Thread):
    def __init__(
        self,
        app: Celery,
        queue: str,
        slots: int,
        loop: asyncio.AbstractEventLoop,
        run_one: Callable[[], Coroutine[Any, Any, Any]],
    ) -> None:
        super().__init__(name="nnqueue-bulk-consumer", daemon=True)
        self._app, self._slots, self._loop, self._run_one = app, slots, loop, run_one
        # Declared as Celery declares a queue it creates (a direct exchange of the same name).
        self._queue = Queue(queue, Exchange(queue, type="direct"), routing_key=queue)
        self._pending: list[tuple[Future[Any], Message]] = []
        self._stopping = threading.Event()

    def run(self) -> None:
        while not self._stopping.is_set():
            try:
                self._consume()
            except Exception:  # the broker went away: tokens held are lost with it, or come back
                log.exception("bulk consumer lost the broker; reconnecting in %.0f s", RECONNECT_DELAY_S)
                self._pending.clear()
                self._stopping.wait(RECONNECT_DELAY_S)

    def _consume(self) -> None:
        with (
            self._app.connection_for_read() as connection,
            connection.Consumer([self._queue], callbacks=[self._received], accept=["json"], prefetch_count=self._slots),
        ):
            while not self._stopping.is_set():
                self._ack_finished()
                try:
                    connection.drain_events(timeout=DRAIN_TIMEOUT_S)
                except TimeoutError:
                    pass
                connection.heartbeat_check()

    def _received(self, _body: Any, message: Message) -> None:
        self._pending.append((asyncio.run_coroutine_threadsafe(self._run_one(), self._loop), message))

    def _ack_finished(self) -> None:
        still = []
        for future, message in self._pending:
            if not future.done():
                still.append((future, message))
                continue
            if not future.cancelled() and future.exception() is not None:
                log.error("a bulk token's chunk raised", exc_info=future.exception())
            message.ack()
        self._pending = still

    def stop(self) -> None:
        self._stopping.set()
