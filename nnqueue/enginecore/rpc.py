"""nnqueue's RPC methods on the engine's worker class, reached by name through ``collective_rpc``.

Mixed into both worker classes (:mod:`nnqueue.enginecore.cpu_worker`, :mod:`nnqueue.enginecore.gpu_worker`).
Every rank runs each call (each holds its own workers for the requests); only the first rank reports and
writes, and the others return None, as nnsight's ``collect_nnsight`` does under tensor parallelism.

* ``nnqueue_finish_trace``: once per job, after all its requests finished. Collects and merges the saves in
  this process (:mod:`nnqueue.enginecore.trace_collect`), starts their copies to host memory (without
  waiting on the GPU: `trace_results.HostCopies`), and hands them to the result writer threads; returns at
  once. The outcome arrives through the outbox.
  A trace's code runs here too (``tracer.result``, a block's unwinding): the weights guard then checks the
  weights (:mod:`nnqueue.enginecore.weights_guard`), and a trace that changed them fails with ``WeightsModified``.
* ``nnqueue_discard_trace``: frees the state of requests that were aborted, cancelled or timed out (and checks
  the weights after their blocks' unwinding).
* ``nnqueue_outbox``: the queued completions (:mod:`nnqueue.enginecore.outbox`).
* ``nnqueue_harvest_begin`` / ``nnqueue_harvest_abort``: start or drop a harvest chunk
  (:mod:`nnqueue.enginecore.harvest_capture`); ``nnqueue_harvest_stats``: what the capture path holds;
  ``nnqueue_capture_points``: the model's capturable points (:mod:`nnqueue.enginecore.capture_points`).
  ``nnqueue_steer_begin`` / ``nnqueue_steer_end``: start or drop a steering job on every rank
  (:mod:`nnqueue.enginecore.steering`).
  A refusal comes back as ``{"error": reason}``, not as an exception in the engine.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable
from typing import Any

from nnqueue.enginecore import outbox, trace_collect, trace_results, weights_guard

log = logging.getLogger(__name__)
_writer: list[trace_results.ResultWriter] = []


def reporting_rank() -> bool:
    """Whether this process reports for the engine: global rank 0 (nnsight's ``collect_nnsight`` test)."""
    from vllm.distributed.parallel_state import get_pp_group

    return bool(get_pp_group().rank == 0)


class NNqueueRPC:
    """RPC methods for a vLLM worker whose ``model_runner`` is nnsight's runner with `HarvestRunnerMixin`."""

    model_runner: Any
    nnqueue_check_weights: Callable[[], list[str]]  # weights_guard.WeightsGuardWorker's

    def nnqueue_finish_trace(
        self, trace_id: str, request_ids: list[str], outputs: bytes | None, sinks: dict[str, Any]
    ) -> bool | None:
        """Collect the finished trace ``request_ids`` (its invokes, in order) and write its result to ``sinks``.

        ``outputs``: the pickled ``{request id: finished RequestOutput}`` (pickled by the frontend: the
        engine's RPC transport carries bytes), which serves ``tracer.result``.
        """
        reporting = reporting_rank()
        copies = trace_results.HostCopies()
        try:
            finished = pickle.loads(outputs) if outputs else None
            collected = trace_collect.collect_trace(self.model_runner, list(request_ids), finished)
            changed = self.nnqueue_check_weights()
            if not reporting:
                return None
            if changed and (collected.error is None or collected.error.get("is_control_flow")):
                collected.error = weights_guard.error(changed, 1)
            collected.saves = trace_results.snapshot(collected.saves, copies)
            copies.seal()
            _result_writer().submit(trace_id, collected, sinks, copies)
        except Exception as error:  # a bug here must fail the job, not the engine every job shares
            copies.release()
            log.exception("finishing trace %s failed", trace_id)
            trace_collect.release(self.model_runner, list(request_ids))
            if reporting:
                outbox.post(
                    {
                        "id": trace_id,
                        "kind": trace_results.TRACE_RESULT,
                        "error": None,
                        "load_failed": False,
                        "objects": {},
                        "write_error": f"{type(error).__name__}: {error}",
                    }
                )
        return True if reporting else None

    def nnqueue_discard_trace(self, request_ids: list[str]) -> None:
        trace_collect.release(self.model_runner, list(request_ids))
        self.nnqueue_check_weights()

    def nnqueue_outbox(self) -> list[dict[str, Any]] | None:
        return outbox.drain() if reporting_rank() else None

    def nnqueue_harvest_begin(self, spec: dict[str, Any]) -> dict[str, Any] | None:
        """Begin a harvest chunk (`HarvestCapture.begin`): ``{"chunk": key}`` or ``{"error": reason}``."""
        if not reporting_rank():
            return None
        try:
            return self.model_runner.nnqueue_harvest().begin(spec)
        except (ValueError, KeyError, TypeError) as error:
            return {"error": str(error)}

    def nnqueue_harvest_abort(self, chunk: str) -> bool | None:
        """Drop a chunk's requests, buffers and pending write; whether there was anything to drop."""
        capture = self.model_runner.nnqueue_capture
        return capture.abort(chunk) if reporting_rank() and capture is not None else None

    def nnqueue_harvest_stats(self) -> dict[str, int] | None:
        """What the capture path holds now (chunks, requests, buffered bytes, writes): a leak gauge."""
        return self.model_runner.nnqueue_harvest().stats() if reporting_rank() else None

    def nnqueue_capture_points(self) -> list[dict[str, Any]] | None:
        """The model's capturable points, for validating harvest specs (empty where harvests can't run)."""
        if not reporting_rank():
            return None
        try:
            return self.model_runner.nnqueue_harvest().points
        except ValueError:
            return []

    def nnqueue_steer_begin(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Begin a steering job on this rank (`Steering.begin`): ``{"job": key}`` or ``{"error": reason}``."""
        try:
            return self.model_runner.nnqueue_steer().begin(spec)
        except (ValueError, KeyError, TypeError) as error:
            return {"error": str(error)}

    def nnqueue_steer_end(self, job: str) -> dict[str, Any]:
        """Drop a steering job's requests and vectors on this rank (`Steering.end`)."""
        steering = self.model_runner.nnqueue_steering
        return steering.end(job) if steering is not None else {"ended": False, "error": None}


def _result_writer() -> trace_results.ResultWriter:
    if not _writer:
        _writer.append(trace_results.ResultWriter())
    return _writer[0]
