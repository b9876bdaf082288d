"""How many of nnsight's ``/ndif/subscribe`` websockets may be open: per API key and in all, per API process.

A subscription holds a socket (a file descriptor) and a waiter on the job watcher for as long as its job runs,
so an unbounded number of them exhausts the API's descriptors. nnsight's client sends its key on the socket's
handshake (``ndif-api-key``, :mod:`nnqueue.api.routers.ndif`), so each open socket is counted against its key
(``NNQUEUE_NDIF_SUBSCRIPTIONS_PER_KEY``) and against the process (``NNQUEUE_NDIF_SUBSCRIPTIONS_MAX``); one over
either is refused at the handshake with 429 and the reason. A socket whose request never arrives is closed
after :data:`nnqueue.api.routers.ndif.ARRIVAL_TIMEOUT_S`. The counts live in the process (the event loop's
thread alone changes them): with ``--workers N`` the limits are per API process.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager


class Subscriptions:
    def __init__(self, per_key: int, total: int) -> None:
        self.per_key, self.total = per_key, total
        self._open: Counter[int] = Counter()

    @contextmanager
    def hold(self, key_id: int) -> Iterator[str | None]:
        """Count one open socket of ``key_id`` while the block runs; yields why it is refused (None: it is not,
        and it is counted)."""
        if self._open[key_id] >= self.per_key:
            yield (
                f"this API key already has {self._open[key_id]} subscriptions open, its limit "
                "(NNQUEUE_NDIF_SUBSCRIPTIONS_PER_KEY): wait for some of its traces to end"
            )
            return
        if self._open.total() >= self.total:
            yield "the server has as many subscriptions open as it takes (NNQUEUE_NDIF_SUBSCRIPTIONS_MAX); try again"
            return
        self._open[key_id] += 1
        try:
            yield None
        finally:
            self._open[key_id] -= 1
            if not self._open[key_id]:
                del self._open[key_id]
