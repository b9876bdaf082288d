"""The engine says which requests were in the step that killed it.

An exception in a forward that nnsight cannot defer to one request (a ``.skip()`` value of the wrong
shape makes vLLM's own code fail, say) kills vLLM's engine core: every request on it ends with
``EngineDeadError``, and nothing says whose trace did it. This mixin, in both engine worker classes,
remembers the request ids of the step being run (``scheduler_output.num_scheduled_tokens``, vLLM 0.32
and 0.24) and, when ``execute_model`` or ``sample_tokens`` raises, writes them with the error to a small
JSON file in ``$NNQUEUE_CRASH_REPORT_DIR`` before the exception goes on to kill the engine. The worker
process reads it (:mod:`nnqueue.workers.engine_health`) to fail the job that crashed the engine and
no other.

The report comes from a process that runs users' code, so the worker treats it as a claim, not a fact:
it only narrows down which of the worker's own running jobs were in the step.
"""

from __future__ import annotations

import json
import os
import traceback
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the mixin goes before a vLLM worker class in the bases
    from vllm.v1.worker.worker_base import WorkerBase as _Worker
else:
    _Worker = object

CRASH_DIR_ENV = "NNQUEUE_CRASH_REPORT_DIR"


def write_report(request_ids: list[str], error: BaseException) -> None:
    """Write ``crash-<pid>.json`` (atomically) into the crash report directory, if one is configured."""
    directory = os.environ.get(CRASH_DIR_ENV)
    if not directory:
        return
    report = {
        "request_ids": request_ids,
        "error": f"{type(error).__name__}: {error}"[:2000],
        "traceback": "".join(traceback.format_exception(error))[-8000:],
    }
    path = Path(directory) / f"crash-{os.getpid()}.json"
    staging = path.with_suffix(".tmp")
    staging.write_text(json.dumps(report))
    staging.replace(path)


class CrashReportingWorker(_Worker):
    """Mixin for vLLM worker classes; see the module doc."""

    _nnqueue_step: tuple[str, ...] = ()

    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        self._nnqueue_step = tuple(getattr(scheduler_output, "num_scheduled_tokens", {}) or {})
        try:
            return super().execute_model(scheduler_output, *args, **kwargs)
        except Exception as error:
            write_report(list(self._nnqueue_step), error)
            raise

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().sample_tokens(*args, **kwargs)
        except Exception as error:
            write_report(list(self._nnqueue_step), error)
            raise
