"""Writing a finished trace's saves from the engine process: host copies now, files and uploads on a thread.

`snapshot` runs on the model runner's thread, inside the finish RPC: it copies every saved tensor to host
memory (once per tensor, however often it is referenced), because a later engine step may overwrite the
buffers a saved view points into; nnsight's own collect pickles at the same moment for the same reason.
A CUDA tensor is copied without blocking that thread (`HostCopies`): under vLLM's async scheduling the next
step is already queued on the GPU when the RPC runs, and a plain ``.to("cpu")`` waited for it, holding the
engine's thread until that step ended (17.5% of its samples on an H100, 6.5-8.6% with `HostCopies`),
during which it could not schedule the step after. `ResultWriter` then does the slow part on its own
threads, so the engine goes on stepping: it waits for the copies, then ``torch.save`` of the
``{name: value}`` dict (``saves.pt``), a safetensors copy when the worker gave a sink for it (the job asked) and
every value is a tensor, each written to its
sink (:mod:`nnqueue.enginecore.sink`), and an outbox entry for the frontend. A saved value of a class the trace
defined is refused in `snapshot` (its pickling would run the trace's code in a writer thread, outside the steps
the engine's guards check):

``{"id": trace id, "kind": "trace_result", "error": nnsight DeferredError | None, "load_failed": bool,
"objects": {"torch": {"size", "sha256"}, "safetensors": {...}}, "write_error": str | None}``; a failed trace
that saved nothing writes no object.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import logging
import os
import queue
import sys
import threading
import types
from dataclasses import dataclass
from typing import Any, BinaryIO, cast

import torch

from nnqueue.enginecore import outbox, protected, sink
from nnqueue.enginecore.trace_collect import CollectedTrace

log = logging.getLogger(__name__)
TRACE_RESULT = "trace_result"
TORCH_OBJECT = "torch"
SAFETENSORS_OBJECT = "safetensors"


# Pinned host memory this process may hold for result copies not yet written (each tensor counted as the
# power-of-two block PyTorch's pinned cache gives it); past it, tensors are copied the blocking way.
PINNED_MAX_BYTES = 2 << 30
_pinned_lock = threading.Lock()
_pinned_in_use = [0]
_side_streams: dict[Any, Any] = {}


class HostCopies:
    """Copies one result's tensors to host memory. A CUDA tensor goes into pinned memory on a side stream.
    That stream first waits for the work queued on the tensor's device so far (finishing a trace may have
    queued kernels that compute a save), and at `seal` the device's stream waits for the copies, so that the
    steps queued later, which may overwrite a buffer a save is a view of, run after them: ordering on the GPU
    only, the engine's thread goes on at once. The result's writer thread calls `wait` before it reads the
    values and `release` once it has written them. Other tensors are copied at once."""

    def __init__(self) -> None:
        self._pinned = 0
        self._streams: dict[Any, Any] = {}
        self._done: list[tuple[torch.device, Any]] = []

    def copy(self, tensor: torch.Tensor) -> torch.Tensor:
        tensor = tensor.detach()
        if not tensor.is_cuda or tensor.numel() == 0:  # an empty one has no memory to order
            return tensor.to("cpu", copy=True)
        block = 1 << (tensor.numel() * tensor.element_size() - 1).bit_length()
        if not _take_pinned(block):
            return tensor.to("cpu", copy=True)
        try:
            host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        except RuntimeError:  # no pinned memory to be had: the blocking way
            _give_pinned(block)
            return tensor.to("cpu", copy=True)
        self._pinned += block
        stream = self._streams.get(tensor.device)
        if stream is None:
            stream = self._streams[tensor.device] = _side_stream(tensor.device)
            stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream):
            host.copy_(tensor, non_blocking=True)
        tensor.record_stream(stream)  # freed before the copy ran, its memory waits for it
        return host

    def seal(self) -> None:
        """End the copies (on the thread that made them): later work on their devices runs after them."""
        for device, stream in self._streams.items():
            event = stream.record_event()
            torch.cuda.current_stream(device).wait_event(event)
            self._done.append((device, event))
        self._streams.clear()

    def wait(self) -> None:
        """Block until the sealed copies are done."""
        for device, event in self._done:
            with torch.cuda.device(device):
                event.synchronize()
        self._done.clear()

    def release(self) -> None:
        """The copies are written (or dropped): give their pinned memory's share back."""
        _give_pinned(self._pinned)
        self._pinned = 0


def _take_pinned(size: int) -> bool:
    with _pinned_lock:
        if _pinned_in_use[0] + size > PINNED_MAX_BYTES:
            return False
        _pinned_in_use[0] += size
        return True


def _give_pinned(size: int) -> None:
    with _pinned_lock:
        _pinned_in_use[0] -= size


def _side_stream(device: torch.device) -> Any:
    """The stream this process copies results on, one per device."""
    if device not in _side_streams:
        _side_streams[device] = torch.cuda.Stream(device)
    return _side_streams[device]


def snapshot(value: Any, copies: HostCopies | None = None, memo: dict[int, Any] | None = None) -> Any:
    """``value`` with every tensor it holds (in containers, dataclasses and plain objects) copied to the CPU.

    Shared tensors stay shared; objects that hold no tensor are returned as they are. With ``copies``, CUDA
    tensors are copied without blocking (seal it, and wait for it before reading the values); without, each
    copy is done when this returns.
    """
    memo = {} if memo is None else memo
    key = id(value)
    if key in memo:
        return memo[key]
    _refuse_unimportable(type(value))
    copied: Any
    if isinstance(value, torch.Tensor):
        copied = value.detach().to("cpu", copy=True) if copies is None else copies.copy(value)
    elif isinstance(value, (str, bytes, int, float, bool, type(None), torch.dtype, torch.device, torch.nn.Module)):
        return value
    elif isinstance(value, list):
        copied = [snapshot(item, copies, memo) for item in value]
    elif isinstance(value, tuple):
        items = [snapshot(item, copies, memo) for item in value]
        try:
            copied = type(value)(*items) if hasattr(value, "_fields") else type(value)(items)
        except TypeError:  # a tuple type that cannot be rebuilt from its items
            copied = tuple(items)
    elif isinstance(value, dict):
        copied = copy.copy(value)
        for name, item in value.items():
            copied[name] = snapshot(item, copies, memo)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        copied = copy.copy(value)
        for item in dataclasses.fields(value):
            object.__setattr__(copied, item.name, snapshot(getattr(value, item.name), copies, memo))
    elif hasattr(value, "__dict__") and not isinstance(value, type):
        copied = copy.copy(value)
        for name, item in vars(value).items():
            setattr(copied, name, snapshot(item, copies, memo))
    else:
        return value
    memo[key] = copied
    return copied


@functools.cache
def _installation() -> tuple[str, ...]:
    return tuple(protected._installation_folders())


def _library_local(cls: type) -> bool:
    """A class a library defines inside a function (vLLM's ``get_cached_tokenizer.<locals>.CachedTokenizer``, which a
    saved cache reaches): its module is a file of the Python installation, and every function of its own was
    compiled from that file. A trace's class has the trace's code. (A payload that forged its code objects'
    file names could pass; the builder's strict unpickler and the audit hook stand before that.)"""
    module = sys.modules.get(cls.__module__)
    path = getattr(module, "__file__", None)
    if "<locals>" not in cls.__qualname__ or not path or cls.__module__ == "__main__":
        return False
    path = os.path.realpath(path)
    if not protected._under(path, _installation()):
        return False
    functions = [value for value in vars(cls).values() if isinstance(value, types.FunctionType)]
    return bool(functions) and all(os.path.realpath(f.__code__.co_filename) == path for f in functions)


_importable: dict[int, type] = {}  # classes found importable by module and name (kept: their ids stay theirs)
_HEAP_TYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE: set on every class a class statement (or type()) made; not on NoneType


def _refuse_unimportable(cls: type) -> None:
    """Refuse a saved value whose class the trace defined: pickling it in a writer thread would run the trace's code
    (``__getnewargs__``, a dict subclass's ``items``) there, outside the engine steps the guards check; and a class
    that cannot be imported by its module and name cannot be unpickled by the client anyway."""
    if id(cls) in _importable or not cls.__flags__ & _HEAP_TYPE:  # a static type is C's: no trace defined it
        return
    found: Any = sys.modules.get(cls.__module__)
    for part in cls.__qualname__.split("."):
        found = getattr(found, part, None) if "<" not in part else None
    if found is not cls and not _library_local(cls):
        raise TypeError(
            f"a saved value is a {cls.__qualname__!r}, a class the trace defined: save tensors, numbers, strings and "
            "containers of them instead (a class defined in the trace cannot be unpickled by the client either)"
        )
    _importable[id(cls)] = cls


@dataclass
class _Job:
    trace_id: str
    collected: CollectedTrace
    sinks: dict[str, Any]
    copies: HostCopies | None


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

    def submit(
        self, trace_id: str, collected: CollectedTrace, sinks: dict[str, Any], copies: HostCopies | None = None
    ) -> None:
        """Write ``collected`` (whose saves are host copies: made by ``copies``, sealed, when given)."""
        self._queue.put(_Job(trace_id, collected, sinks, copies))

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
                if job.copies is not None:
                    job.copies.wait()
                # A failed trace has a result only when its other invokes saved something.
                if job.collected.saves or not failed:
                    entry["objects"] = write_saves(job.collected.saves, job.sinks)
            except Exception as error:  # reported to the frontend, which fails the job with it
                log.exception("writing trace %s's result failed", job.trace_id)
                entry["write_error"] = f"{type(error).__name__}: {error}"
            finally:
                if job.copies is not None:
                    job.copies.release()
            outbox.post(entry)


def write_saves(saves: dict[str, Any], sinks: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``torch.save`` the saves (and safetensors, when ``sinks`` has a sink for it and all are tensors) to the
    sinks; each object's size and sha256, hashed as written."""
    torch_sink = sink.check(sinks.get(TORCH_OBJECT))

    def save_torch(file: sink.HashingFile) -> None:
        torch.save(saves, cast(BinaryIO, file))  # it calls write() (and flush()) alone

    written = {TORCH_OBJECT: _reported(sink.write_file(torch_sink, save_torch))}
    if SAFETENSORS_OBJECT in sinks and (data := safetensors_bytes(saves)) is not None:
        target = sink.check(sinks[SAFETENSORS_OBJECT])
        written[SAFETENSORS_OBJECT] = _reported(sink.write_file(target, lambda file: file.write(data)))
    return written


def safetensors_bytes(saves: dict[str, Any]) -> bytes | None:
    """The saves in safetensors form when every value is a tensor, else None. safetensors refuses tensors that share
    memory: a tensor whose storage an earlier one uses (the same tensor under two names, a view of another) is
    written as a copy."""
    if not saves or not all(isinstance(value, torch.Tensor) for value in saves.values()):
        return None
    from safetensors.torch import save

    tensors, storages = {}, set()
    for name, value in saves.items():
        storage = value.untyped_storage().data_ptr()
        tensors[name] = value.contiguous() if storage not in storages else value.clone().contiguous()
        storages.add(storage)
    return save(tensors)


def _reported(done: sink.Written) -> dict[str, Any]:
    return {"size": done.size, "sha256": done.sha256}
