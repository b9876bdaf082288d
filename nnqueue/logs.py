"""Log lines as text or as JSON objects (``NNQUEUE_LOG_FORMAT=json``), each naming the job it is about.

Code that works on one job runs inside :func:`job_context` (the worker does so for each job's asyncio task,
so the threads it hands database and store calls to inherit it too); every record logged meanwhile gets a
``job_id`` attribute, and a call outside such a context may pass ``extra={"job_id": ...}`` itself. The JSON
formatter writes one object per line with ``ts``, ``level``, ``logger``, ``message``, ``job_id`` (when
there is one) and ``exc_info``; text lines end with ``[job <id>]``.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from datetime import UTC, datetime
from typing import Any, Literal

LogFormat = Literal["text", "json"]
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s%(job_suffix)s"
_current_job: ContextVar[str | None] = ContextVar("nnqueue_job_id", default=None)


@contextmanager
def job_context(job_id: uuid.UUID | str) -> Iterator[None]:
    """Records logged inside (in this thread or task, and the threads and tasks it starts) name ``job_id``."""
    token = _current_job.set(str(job_id))
    try:
        yield
    finally:
        _current_job.reset(token)


class JobIdFilter(logging.Filter):
    """Sets ``record.job_id`` from an explicit ``extra`` or the current :func:`job_context` (else None)."""

    def filter(self, record: logging.LogRecord) -> bool:
        job_id = getattr(record, "job_id", None) or _current_job.get()
        record.job_id = str(job_id) if job_id else None
        record.job_suffix = f" [job {job_id}]" if job_id else ""
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per record."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "ts": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if job_id := getattr(record, "job_id", None):
            entry["job_id"] = job_id
        if record.exc_info:
            entry["exc_info"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def formatter(log_format: LogFormat) -> logging.Formatter:
    return JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT)


def _stderr_handler(log_format: LogFormat) -> logging.Handler:
    """A handler writing records to stderr in ``log_format``, each naming its job."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(formatter(log_format))
    handler.addFilter(JobIdFilter())
    return handler


def configure(log_format: LogFormat, level: int = logging.INFO) -> None:
    """Send every logger's records to stderr in ``log_format``, replacing the root logger's handlers."""
    root = logging.getLogger()
    root.handlers[:] = [_stderr_handler(log_format)]
    root.setLevel(level)


def configure_engine_process(level: int = logging.INFO) -> None:
    """In an engine process a worker started (vLLM's engine core and its model-runner workers): nnqueue's own records
    to stderr, the worker's log, in the worker's format (``NNQUEUE_LOG_FORMAT`` in the environment it exported).
    Nothing there configures logging otherwise, so only warnings reached the log: not the engine's user and seccomp
    filter, nor its guards' sizes. Other libraries' loggers (vLLM's own) are left as they are."""
    log_format: LogFormat = "json" if os.environ.get("NNQUEUE_LOG_FORMAT", "").lower() == "json" else "text"
    ours = logging.getLogger("nnqueue")
    ours.handlers[:] = [_stderr_handler(log_format)]
    ours.setLevel(level)
    ours.propagate = False


def uvicorn_log_config(log_format: LogFormat) -> dict[str, Any]:
    """A ``logging.config.dictConfig`` for uvicorn: its loggers and the root logger, in ``log_format``."""
    formatter_config: dict[str, Any] = (
        {"()": f"{__name__}.JsonFormatter"} if log_format == "json" else {"format": TEXT_FORMAT}
    )
    handler = {
        "class": "logging.StreamHandler",
        "formatter": "nnqueue",
        "filters": ["job"],
        "stream": "ext://sys.stderr",
    }
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"job": {"()": f"{__name__}.JobIdFilter"}},
        "formatters": {"nnqueue": formatter_config},
        "handlers": {"default": handler},
        "root": {"handlers": ["default"], "level": "INFO"},
        "loggers": {
            "uvicorn": {"handlers": [], "level": "INFO", "propagate": True},
            "uvicorn.error": {"handlers": [], "level": "INFO", "propagate": True},
            "uvicorn.access": {"handlers": [], "level": "INFO", "propagate": True},
        },
    }
