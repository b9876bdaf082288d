"""nnqueue's RPC methods on the engine's worker class, reached by name through ``collective_rpc``.

Mixed into both worker classes (:mod:`nnqueue.enginecore.cpu_worker`, :mod:`nnqueue.enginecore.gpu_worker`).
Every rank runs each call (each holds its own workers for the requests); only the first rank reports and
writes trace results, and the others return None, as nnsight's ``collect_nnsight`` does under tensor
parallelism. Harvest calls and the outbox are answered by each pipeline stage's first tensor-parallel
rank (`stage_reporting`): a harvest chunk is captured and written by the stage that holds its captures.

* ``nnqueue_finish_trace``: once per job, after all its requests finished. Collects and merges the saves in
  this process (:mod:`nnqueue.enginecore.trace_collect`), starts their copies to host memory (without
  waiting on the GPU: `trace_results.HostCopies`), and hands them to the result writer threads; returns at
  once. The outcome arrives through the outbox.
  A trace's code runs here too (``tracer.result``, a block's unwinding): the guards then check the weights
  (:mod:`nnqueue.enginecore.weights_guard`) and, when the trace's code ran, the rest of the engine's state
  (:mod:`nnqueue.enginecore.state_guard`); a trace that changed them fails with ``WeightsModified`` or
  ``StateModified``.
* ``nnqueue_discard_trace``: frees the state of requests that were aborted, cancelled or timed out (and checks
  as above after their blocks' unwinding).
* ``nnqueue_verify_state`` (the guards' mixin): verify and put back every tensor, read in full, and the rest of
  the state, with nothing in flight, then seed torch's generators with the seed given (a trust-domain switch).
* ``nnqueue_calls``: several of the per-job calls (`GROUPED`) in one RPC, each answered as it would be alone (a call
  that raises answers ``{outbox.CALL_FAILED: "Type: message"}``), and the outbox's queued completions
  (:mod:`nnqueue.enginecore.outbox`): the frontend sends the calls made in one turn of its loop in one such RPC
  (:mod:`nnqueue.engines.outbox`), so that hundreds of jobs' finishes and polls cost the engine's thread few rounds.
* ``nnqueue_harvest_begin`` / ``nnqueue_harvest_abort``: start or drop a harvest chunk
  (:mod:`nnqueue.enginecore.harvest_capture`); ``nnqueue_harvest_stats``: what the capture path holds;
  ``nnqueue_capture_points``: the model's capturable points (:mod:`nnqueue.enginecore.capture_points`).
  ``nnqueue_steer_begin`` / ``nnqueue_steer_end``: start or drop a steering job on every rank
  (:mod:`nnqueue.enginecore.steering`).
  A refusal comes back as ``{"error": reason}``, not as an exception in the engine.
* ``nnqueue_load_weights``: load a safetensors checkpoint through vLLM's loader
  (:mod:`nnqueue.enginecore.weights_update`), then refresh the weights guard's reference; a failed load is put
  back from the guard's copy. ``nnqueue_trainer_open`` / ``_receive`` / ``_close``: a trainer's NCCL channel
  (TRL's protocol) and one tensor received and loaded; ``nnqueue_weights_commit`` / ``_rollback``: end a
  trainer's update (refresh the guard, or put the previous weights back). Every rank runs them (each loads its
  shard); all answer ``{"error": ...}`` rather than raise, so an update never kills the engine.
"""

from __future__ import annotations

import logging
import pickle
from collections.abc import Callable
from typing import Any

import torch

from nnqueue.enginecore import outbox, pipeline_stages, trace_collect, trace_results, weights_guard, weights_update

log = logging.getLogger(__name__)
_writer: list[trace_results.ResultWriter] = []
# The per-job calls `nnqueue_calls` runs.
GROUPED = frozenset({"nnqueue_finish_trace", "nnqueue_discard_trace", "nnqueue_steer_begin", "nnqueue_steer_end"})


def reporting_rank() -> bool:
    """Whether this process reports for the engine: global rank 0 (nnsight's ``collect_nnsight`` test)."""
    from vllm.distributed.parallel_state import get_pp_group

    return bool(get_pp_group().rank == 0)


def stage_reporting() -> bool:
    """Whether this process reports for its pipeline stage: its tensor-parallel rank 0 (all of them without PP)."""
    from vllm.distributed.parallel_state import get_tp_group

    return bool(get_tp_group().rank_in_group == 0)


class NNqueueRPC:
    """RPC methods for a vLLM worker whose ``model_runner`` is nnsight's runner with `HarvestRunnerMixin`."""

    model_runner: Any
    # weights_guard.WeightsGuardWorker's:
    nnqueue_check_due: Callable[[list[str]], weights_guard.Due]
    nnqueue_check_after: Callable[[weights_guard.Due], weights_guard.Verified]
    nnqueue_weights_loaded: Callable[[], None]
    nnqueue_restore_weights: Callable[[], bool]
    nnqueue_accept_hooks: Callable[[], None]
    _nnqueue_trainer: weights_update.TrainerChannel | None = None

    def nnqueue_finish_trace(
        self, trace_id: str, request_ids: list[str], outputs: bytes | None, sinks: dict[str, Any]
    ) -> bool | None:
        """Collect the finished trace ``request_ids`` (its invokes, in order) and write its result to ``sinks``.

        ``outputs``: the pickled ``{request id: finished RequestOutput}`` (pickled by the frontend: the
        engine's RPC transport carries bytes), which serves ``tracer.result``.
        """
        reporting = reporting_rank()
        across = pipeline_stages.staged() and stage_reporting()  # this stage's saves go to rank 0, merged there
        copies = trace_results.HostCopies()
        try:
            finished = pickle.loads(outputs) if outputs else None
            due = self.nnqueue_check_due(list(request_ids))
            collected = trace_collect.collect_trace(self.model_runner, list(request_ids), finished)
            changed = self.nnqueue_check_after(due)
            if across:
                report = pipeline_stages.StageReport(
                    pipeline_stages.strip(collected.saves),
                    collected.error,
                    collected.load_failed,
                    changed.weights,
                    changed.state,
                )
                across = False  # sent or received: never twice for one trace
                merged = pipeline_stages.gather(report)
                if merged is None:
                    return None
                collected = trace_collect.CollectedTrace(merged.saves, merged.error, merged.load_failed)
                changed = weights_guard.Verified(merged.changed, merged.state)
            if not reporting:
                return None
            if changed.blames and (collected.error is None or collected.error.get("is_control_flow")):
                collected.error = weights_guard.error(changed.weights, changed.state)
            collected.saves = trace_results.snapshot(collected.saves, copies)
            copies.seal()
            _result_writer().submit(trace_id, collected, sinks, copies)
        except Exception as error:  # a bug here must fail the job, not the engine every job shares
            copies.release()
            log.exception("finishing trace %s failed", trace_id)
            trace_collect.release(self.model_runner, list(request_ids))
            if across:  # the other stages' reporting ranks wait on this one's send or receive
                pipeline_stages.gather(pipeline_stages.failed(error))
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
        due = self.nnqueue_check_due(list(request_ids))
        trace_collect.release(self.model_runner, list(request_ids))
        self.nnqueue_check_after(due)

    def nnqueue_calls(self, calls: list[tuple[str, list[Any]]]) -> dict[str, Any]:
        """Run ``calls`` (method name, arguments) in order; their answers, and the outbox's completions (this stage's
        reporting rank's; None on the others)."""
        answers: list[Any] = []
        for method, args in calls:
            if method not in GROUPED:
                answers.append({outbox.CALL_FAILED: f"{method!r} is not a call nnqueue_calls makes"})
                continue
            try:
                answers.append(getattr(self, method)(*args))
            except Exception as error:  # that call's failure, answered to its caller: not the engine's
                log.exception("%s failed", method)
                answers.append({outbox.CALL_FAILED: f"{type(error).__name__}: {error}"})
        return {"answers": answers, "outbox": outbox.drain() if stage_reporting() else None}

    def nnqueue_harvest_begin(self, spec: dict[str, Any]) -> dict[str, Any] | None:
        """Begin a harvest chunk (`HarvestCapture.begin`): ``{"chunk": key}``, ``{"error": reason}``, or None
        (not this stage's chunk, or not a reporting rank)."""
        if not stage_reporting():
            return None
        try:
            return self.model_runner.nnqueue_harvest().begin(spec)
        except (ValueError, KeyError, TypeError) as error:
            return {"error": str(error)}
        finally:
            self.nnqueue_accept_hooks()  # the capture hooks it installed are nnqueue's own

    def nnqueue_harvest_abort(self, chunk: str) -> bool | None:
        """Drop a chunk's requests, buffers and pending write; whether there was anything to drop."""
        capture = self.model_runner.nnqueue_capture
        return capture.abort(chunk) if stage_reporting() and capture is not None else None

    def nnqueue_harvest_stats(self) -> dict[str, int] | None:
        """What the capture path holds now (chunks, requests, buffered bytes, writes): a leak gauge."""
        return self.model_runner.nnqueue_harvest().stats() if stage_reporting() else None

    def nnqueue_capture_points(self) -> list[dict[str, Any]] | None:
        """This stage's capturable points, for validating harvest specs (empty where harvests can't run)."""
        if not stage_reporting():
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
        finally:
            self.nnqueue_accept_hooks()  # the steering hooks it installed are nnqueue's own

    def nnqueue_steer_end(self, job: str) -> dict[str, Any]:
        """Drop a steering job's requests and vectors on this rank (`Steering.end`)."""
        steering = self.model_runner.nnqueue_steering
        return steering.end(job) if steering is not None else {"ended": False, "error": None}

    def nnqueue_load_weights(self, files: list[str], tensors: list[str] | None) -> dict[str, Any]:
        """Load the safetensors ``files`` (every tensor, or ``tensors``): ``{"loaded": n}`` or ``{"error", "restored"}``."""
        try:
            loaded = weights_update.load_checkpoint(self.model_runner, list(files), tensors)
        except Exception as error:  # answered to the worker, which records it
            log.exception("loading weights from %s failed", files)
            return {"error": f"{type(error).__name__}: {error}", "restored": self.nnqueue_restore_weights()}
        self.nnqueue_weights_loaded()
        return {"loaded": loaded}

    def nnqueue_trainer_open(self, host: str, port: int, world_size: int, timeout_s: float) -> dict[str, Any]:
        """Join a trainer's NCCL group as this engine rank (TRL's ``init_communicator``)."""
        from vllm.distributed.parallel_state import get_world_group

        self.nnqueue_trainer_close()
        try:
            rank = get_world_group().rank
            device = getattr(self, "device", None)
            if device is None or getattr(device, "type", "cpu") != "cuda":
                return {"error": "a trainer's NCCL weight updates need a CUDA engine"}
            self._nnqueue_trainer = weights_update.TrainerChannel(host, port, rank, world_size, device, timeout_s)
        except Exception as error:  # answered to the trainer's request
            log.exception("joining the trainer's NCCL group at %s:%d failed", host, port)
            return {"error": f"{type(error).__name__}: {error}"}
        return {"rank": rank}

    def nnqueue_trainer_receive(self, name: str, dtype: str, shape: list[int]) -> dict[str, Any]:
        """Receive one tensor from the trainer and load it (TRL's ``update_named_param``)."""
        channel = self._nnqueue_trainer
        if channel is None:
            return {"error": "no trainer channel: call init_communicator first"}
        try:
            tensor = channel.receive(name, dtype, list(shape))
            with torch.no_grad():
                self.model_runner.get_model().load_weights([(name, tensor)])
        except Exception as error:  # answered to the worker, which rolls back
            log.exception("receiving %s from the trainer failed", name)
            return {"error": f"{type(error).__name__}: {error}"}
        return {"loaded": 1}

    def nnqueue_trainer_close(self) -> None:
        channel, self._nnqueue_trainer = self._nnqueue_trainer, None
        if channel is not None:
            channel.close()

    def nnqueue_weights_commit(self) -> None:
        """A trainer's update is complete: the weights guard's reference becomes the new weights."""
        self.nnqueue_weights_loaded()

    def nnqueue_weights_rollback(self) -> bool:
        """A trainer's update was cut off: put the previous weights back; whether that was possible (a guard)."""
        return self.nnqueue_restore_weights()


def _result_writer() -> trace_results.ResultWriter:
    if not _writer:
        _writer.append(trace_results.ResultWriter())
    return _writer[0]
