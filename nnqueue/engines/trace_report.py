"""An engine's report of a finished trace, validated: what it wrote, the trace's first error, a failed write.

Both engines report a trace in this shape (:mod:`nnqueue.enginecore.trace_results`): a vLLM engine through
its outbox (:mod:`nnqueue.engines.trace_runner`), the transformers engine as its answer to a job
(:mod:`nnqueue.engines.transformers`). The engine runs users' code, so the report is untrusted: every field is
type-checked and its texts bounded before the worker acts on it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from nnqueue.errors import NNqueueError

MAX_ERROR_TEXT = 64 * 1024
SHA256 = re.compile(r"[0-9a-f]{64}")


class InvalidReport(NNqueueError, ValueError):
    """The engine's report of a trace's result was malformed."""


@dataclass(frozen=True)
class WrittenObject:
    size: int
    sha256: str


@dataclass(frozen=True)
class TraceReport:
    """What the engine reported about a finished trace."""

    error: dict[str, Any] | None  # nnsight's DeferredError: type_name, message, traceback, is_control_flow
    load_failed: bool  # the error is a mediator this engine could not load
    objects: dict[str, WrittenObject]  # written sinks by name ("torch", "safetensors")
    write_error: str | None


def parse_report(entry: Any) -> TraceReport:
    """Validate a ``trace_result`` report (see :mod:`nnqueue.enginecore.trace_results`)."""
    if not isinstance(entry, dict):
        raise InvalidReport("a report must be a dict")
    if entry.get("kind") != "trace_result":
        raise InvalidReport(f"expected a trace_result, got {entry.get('kind')!r}")
    objects = {}
    raw_objects = entry.get("objects")
    if not isinstance(raw_objects, dict):
        raise InvalidReport("objects must be a dict")
    for name, raw in raw_objects.items():
        if not (
            isinstance(raw, dict)
            and isinstance(raw.get("size"), int)
            and raw["size"] >= 0
            and isinstance(raw.get("sha256"), str)
            and SHA256.fullmatch(raw["sha256"])
        ):
            raise InvalidReport(f"object {name!r} must be {{size, sha256}}")
        objects[name] = WrittenObject(raw["size"], raw["sha256"])
    write_error = entry.get("write_error")
    if write_error is not None and not isinstance(write_error, str):
        raise InvalidReport("write_error must be a string or null")
    return TraceReport(
        error=_deferred_error(entry.get("error")),
        load_failed=entry.get("load_failed") is True,
        objects=objects,
        write_error=None if write_error is None else write_error[:MAX_ERROR_TEXT],
    )


def _deferred_error(raw: Any) -> dict[str, Any] | None:
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise InvalidReport("error must be a dict or null")
    error: dict[str, Any] = {"is_control_flow": raw.get("is_control_flow") is True}
    for name, default in (("type_name", "Exception"), ("message", ""), ("traceback", "")):
        value = raw.get(name, default)
        if not isinstance(value, str):
            raise InvalidReport(f"error.{name} must be a string")
        error[name] = value[:MAX_ERROR_TEXT]
    return error
