"""Writing a finished trace's saves from the engine process: host copies now, files and uploads on a thread.

`snapshot` runs on the model runner's thread, inside the finish RPC: it copies every saved tensor to host
memory (once per tensor, however often it is referenced), because the next engine step may overwrite the
buffers a saved view points into; nnsight's own collect pickles at the same moment for the same reason.
`ResultWriter` then does the slow part on its own threads, so the engine goes on stepping: ``torch.save`` of
the ``{name: value}`` dict (``saves.pt``), a safetensors copy when every value is a tensor, each written to
its sink (:mod:`nnqueue.enginecore.sink`), and an outbox entry for the frontend:

``{"id": trace id, "kind": "trace_result", "error": nnsight DeferredError | None, "load_failed": bool,
"objects": {"torch": {"size", "sha256"}, "safetensors": {...}}, "write_error": str | None}``; a failed trace
that saved nothing writes no object.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import queue
import threading
from dataclasses import dataclass
from typing import Any

import torch

from nnqueue.enginecore import outbox, sink
from nnqueue.enginecore.trace_collect import CollectedTrace

log = logging.getLogger(__name__)
TRACE_RESULT = "trace_result"
TORCH_OBJECT = "torch"
SAFETENSORS_OBJECT = "safetensors"


def snapshot(value: Any, memo: dict[int, Any] | None = None) -> Any:
    """``value`` with every tensor it holds (in containers, dataclasses and plain objects) copied to the CPU.

    Shared tensors stay shared; objects that hold no tensor are returned as they are.
    """
    memo = {} if memo is None else memo
    key = id(value)
    if key in memo:
        return memo[key]
    copied: Any
    if isinstance(value, torch.Tensor):
        copied = value.detach().to("cpu", copy=True)
    elif isinstance(value, (str, bytes, int, float, bool, type(None), torch.dtype, torch.device, torch.nn.Module)):
        return value
    elif isinstance(value, list):
        copied = [snapshot(item, memo) for item in value]
    elif isinstance(value, tuple):
        items = [snapshot(item, memo) for item in value]
        try:
            copied = type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        except TypeError:  # a tuple type that cannot be rebuilt from its items
            copied = tuple(items)
    elif isinstance(value, dict):
        copied = copy.copy(value)
        for name, item in value.items():
            copied[name] = snapshot(item, memo)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        copied = copy.copy(value)
        for item in dataclasses.fields(value):
            object.__setattr__(copied, item.name, snapshot(getattr(value, item.name), memo))
    elif hasattr(value, "__dict__") and not isinstance(value, type):
        copied = copy.copy(value)
        for name, item in vars(value).items():
            setattr(copied, name, snapshot(item, memo))
    else:
        return value
    memo[key] = copied
    return copied


@dataclass
class _Job:
    trace_id: str
    collected: CollectedTrace
    sinks: dict[str, Any]


# Writer threads per engine process. Each result is serialized, hashed, fsynced or uploaded: mostly waiting
# on the disk or the network, with the GIL released. One thread wrote one-prompt jobs' 4 MiB results more
# slowly than an H100 produced them (about 15 ms a job, two objects each, against 12 ms of prefill).
WRITER_THREADS = 4


class ResultWriter:
    """Background threads that write finished traces' results to their sinks (each result by one thread,
    results in parallel; each reports through the outbox when done)."""

    def __init__(self, threads: int = WRITER_THREADS) -> None:
        self._queue: queue.SimpleQueue[_Job] = queue.SimpleQueue()
        for index in range(threads):
            threading.Thread(target=self._run, name=f"nnqueue-result-writer-{index}", daemon=True).start()

    def submit(self, trace_id: str, collected: CollectedTrace, sinks: dict[str, Any]) -> None:
        self._queue.put(_Job(trace_id, collected, sinks))

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            entry: dict[str, Any] = {
                "id": job.trace_id,
                "kind": TRACE_RESULT,
                "error": job.collected.error,
                "load_failed": job.collected.load_failed,
                "objects": {},
                "write_error": None,
            }
            error = job.collected.error
            failed = error is not None and not error.get("is_control_flow")
            try:
                # A failed trace has a result only when its other invokes saved something.
                if job.collected.saves or not failed:
                    entry["objects"] = write_saves(job.collected.saves, job.sinks)
            except Exception as error:  # reported to the frontend, which fails the job with it
                log.exception("writing trace %s's result failed", job.trace_id)
                entry["write_error"] = f"{type(error).__name__}: {error}"
            outbox.post(entry)


def write_saves(saves: dict[str, Any], sinks: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``torch.save`` the saves (and safetensors when all are tensors) to the sinks; each object's size and sha256."""
    written = {TORCH_OBJECT: _write(sink.check(sinks.get(TORCH_OBJECT)), lambda path: torch.save(saves, path))}
    if saves and all(isinstance(value, torch.Tensor) for value in saves.values()) and SAFETENSORS_OBJECT in sinks:
        from safetensors.torch import save_file

        # safetensors refuses tensors that share memory: give each name its own.
        tensors, seen = {}, set()
        for name, value in saves.items():
            tensors[name] = value.contiguous() if id(value) not in seen else value.clone().contiguous()
            seen.add(id(value))
        written[SAFETENSORS_OBJECT] = _write(
            sink.check(sinks[SAFETENSORS_OBJECT]), lambda path: save_file(tensors, path)
        )
    return written


def _write(target: dict[str, str], save: Any) -> dict[str, Any]:
    staged = sink.staging_file(target)
    try:
        save(staged)
    except BaseException:
        os.unlink(staged)
        raise
    done = sink.deliver(target, staged)
    return {"size": done.size, "sha256": done.sha256}
