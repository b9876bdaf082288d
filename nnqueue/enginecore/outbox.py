"""The engine side of the outbox: completions of engine-side writes, waiting for the frontend to fetch them.

Work the engine finishes in the background (a trace's result written to its sink, later a harvest shard)
is reported here as a small JSON-able dict ``{"id": str, "kind": str, ...}``. The frontend drains the
queue with every RPC of its grouped calls, ``collective_rpc("nnqueue_calls")``
(:class:`nnqueue.enginecore.rpc.NNqueueRPC`), which works the same under every vLLM executor (in-process,
multiprocessing, Ray, multi-node); a grouped call that raised is answered as ``{CALL_FAILED: "Type: message"}``.
The frontend treats entries as untrusted input: this process runs users' code.
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any

MAX_DRAIN = 4096
CALL_FAILED = "nnqueue_call_failed"

_lock = threading.Lock()
_entries: deque[dict[str, Any]] = deque()


def post(entry: dict[str, Any]) -> None:
    """Queue one completion; ``entry`` needs an ``id`` and a ``kind``, and only JSON types."""
    with _lock:
        _entries.append(entry)


def drain(limit: int = MAX_DRAIN) -> list[dict[str, Any]]:
    """Take up to ``limit`` queued completions, oldest first."""
    with _lock:
        return [_entries.popleft() for _ in range(min(limit, len(_entries)))]
