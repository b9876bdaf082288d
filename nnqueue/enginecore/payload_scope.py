"""Rebuilding a raw nnsight payload from its own source, inside a trace scope, with nothing left behind.

Used wherever a raw payload (``RequestModel.serialize``) is rebuilt in a long-lived process: the trace builders
(:mod:`nnqueue.engines.trace_builder`) and the transformers engine (:mod:`nnqueue.enginecore.transformers_engine`).

* Each payload reads its own source, never an earlier one's: nnsight caches a file's source and its parsed
  ``with`` blocks per process (``SOURCES`` / ``BLOCKS`` in ``nnsight.tracing.globals``), and
  ``RequestModel.deserialize`` registers the payload's source in ``linecache`` under the client's filename, so
  two users (or two versions of one script) with the same filename would otherwise share code. Both caches are
  cleared before and after, and the ``linecache`` entry is removed after.
* The body runs in a trace scope, as nnsight's ``Tracer.__exit__`` opens one around its backend: what lets
  trace-level code call ``nnsight.save(...)``, and what filters the values a trace pushes to its saved ones.
* The model's interleaver and nnsight's shared invoke locals are cleared after, also after a failure.
"""

from __future__ import annotations

import linecache
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


@contextmanager
def payload_scope(model: Any) -> Iterator[Callable[[str], None]]:
    """Around rebuilding and running one payload against ``model``; call what it yields with the payload's
    filename (``tracer.info.frame.f_code.co_filename``) once it is known."""
    from nnsight.intervention.util import clear_shared_locals
    from nnsight.tracing.tracer import dec, inc

    filenames: list[str] = []
    _forget_sources()
    inc()
    try:
        yield filenames.append
    finally:
        model.interleaver.cancel()
        clear_shared_locals()
        dec()
        _forget_sources()
        for filename in filenames:
            linecache.cache.pop(filename, None)


def deserialize(model: Any, payload: bytes) -> Any:
    """The tracer of raw payload ``payload`` (``RequestModel.deserialize``, zstd or not), against ``model``'s
    persistent objects, with the protected environment's strict unpickler when it is installed (nnsight's own when
    it is off: ``NNQUEUE_PROTECTED_ENVIRONMENT=false``, a trusted deployment). Call it in `payload_scope`, running
    user code (``protected.running_user_code``)."""
    from nnsight.schema.request import RequestModel

    from nnqueue import trace_payload
    from nnqueue.enginecore import protected

    strict = {"unpickler": protected.StrictUnpickler} if protected.installed() else {}
    return RequestModel.deserialize(
        payload,
        model._remoteable_persistent_objects(),
        compress=payload.startswith(trace_payload.ZSTD_MAGIC),
        **strict,
    )


def _forget_sources() -> None:
    from nnsight.tracing.globals import BLOCKS, SOURCES

    SOURCES.clear()
    BLOCKS.clear()
