"""An nnsight session (``with model.session():`` around several traces) run as one job, its body in a trace builder.

A session's body is ordinary Python around several ``with model.trace(...)`` blocks, and a later trace uses what an
earlier one saved (a patching experiment: the clean run's activations written into the corrupted run). nnsight runs
the body where the session was written and each trace on the engine in turn; here the body runs in a sandboxed trace
builder (:mod:`nnqueue.engines.trace_builder`, where a raw payload's top-level code runs anyway), which holds a meta
model and no engine. Each trace the body reaches is prepared there as nnsight prepares a local one
(``VLLMTracer.prepare``) and sent to the worker as a prebuilt payload over the builder's protocol (an ``ASK`` frame,
:func:`nnqueue.enginecore.child_process.ask`). The worker checks it in another builder, as a client's prebuilt trace
is checked, runs it on its engine like any trace, on the session job's behalf, and replies with what the trace saved
(the engine's ``saves.pt``) and its error (`reply`). The builder loads the saves (``torch.load``: the output of this
domain's own trace, in a builder that serves only this domain), marks them saved and pushes them into the body's
scope, as nnsight's ``VLLM._collect`` does locally, and the body goes on. A trace's error is then raised in the body
as :class:`SessionTraceFailed`, reported under the error's own type and naming the trace (its number in the session
and its line).

When the body ends, what it saved (``nnsight.save``, and every value a trace saved, which nnsight also counts as
saved) is the job's result: ``torch.save`` of ``{name: value}`` and, when the job asked, a safetensors copy when every
value is a tensor, written to the job's handoff sinks as the engine writes a trace's (``trace_results.write_saves``),
and reported the same way. Locally too only saved values leave a vLLM trace: the engine returns nothing else.

The job's limits are the session's: its timeout covers the whole body, and each of its traces runs under the
engine's stall timeout, state verification and result bound, one at a time, on an engine held for the job's trust
domain for as long as the job runs. The body's own Python between traces has the builder's bound
(``NNQUEUE_TRACE_BUILDER_TIMEOUT_S``, :mod:`nnqueue.engines.builders`): other domains wait meanwhile. nnsight
internals relied on (0.8.1): ``VLLMTracer.execute`` and ``prepare``, ``tracing.tracer.mark`` / ``push_result`` /
``_saves``, ``Tracer.execute``.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import json
from collections.abc import Iterator
from typing import Any

from nnqueue import trace_payload
from nnqueue.enginecore import child_process, protected, sink
from nnqueue.enginecore.payload_scope import deserialize, payload_scope
from nnqueue.errors import NNqueueError

# A builder request to run a session: this, a 4-byte length, JSON {"sinks": ...}, then the raw payload.
REQUEST_MAGIC = b"NNQSESS1"


class SessionTraceFailed(NNqueueError):
    """One of a session's traces failed; reported under that error's type (``type_name``), with the engine's
    traceback (``traceback_text``)."""

    def __init__(self, index: int, where: str, error: dict[str, Any]) -> None:
        super().__init__(f"the session's trace {index} ({where}) failed: {error['type_name']}: {error['message']}")
        self.type_name = str(error["type_name"])
        self.traceback_text = str(error.get("traceback", ""))


def is_session(payload: bytes) -> bool:
    """Whether a raw nnsight payload holds a session (its tracer is nnsight's plain ``Tracer``)."""
    return trace_payload.tracer_class(payload) == trace_payload.SESSION_TRACER


def request(payload: bytes, sinks: dict[str, Any]) -> bytes:
    """The builder request that runs the session ``payload`` and writes its result to ``sinks``."""
    header = json.dumps({"sinks": sinks}).encode()
    return REQUEST_MAGIC + len(header).to_bytes(4, "big") + header + payload


def parse_request(body: bytes) -> tuple[dict[str, Any], bytes]:
    """`request`'s sinks and payload (the worker's request: trusted)."""
    size = int.from_bytes(body[len(REQUEST_MAGIC) : len(REQUEST_MAGIC) + 4], "big")
    start = len(REQUEST_MAGIC) + 4
    return json.loads(body[start : start + size])["sinks"], body[start + size :]


def reply(saves: bytes, error: dict[str, Any] | None) -> bytes:
    """The worker's reply to a session's trace: its error (a deferred error's fields, or None) and its ``saves.pt``
    (empty when it wrote none)."""
    header = json.dumps({"error": error}).encode()
    return len(header).to_bytes(4, "big") + header + saves


def _parse_reply(body: bytes) -> tuple[dict[str, Any] | None, bytes]:
    size = int.from_bytes(body[:4], "big")
    return json.loads(body[4 : 4 + size])["error"], body[4 + size :]


def run_session(model: Any, payload: bytes, sinks: dict[str, Any]) -> bytes:
    """Run the session ``payload`` against meta model ``model``, each trace on the worker's engine; write what it
    saved to ``sinks`` and answer with the report the worker reads (``trace_report.parse_report``)."""
    from nnsight.tracing.tracer import Tracer, _saves

    from nnqueue.enginecore import trace_results  # torch: imported once the builder is in its view (open_protocol)

    with payload_scope(model) as registered, protected.running_user_code():
        tracer = deserialize(model, payload)
        if type(tracer) is not Tracer:
            raise TypeError(f"the payload holds a {type(tracer).__name__}, not an nnsight session")
        frame = tracer.info.frame
        registered(frame.f_code.co_filename)
        with _traces_run_by_the_worker(model):
            tracer.execute(tracer.info.code)  # nnsight's: the body in a scope, what it saved pushed into `frame`
        saved = _saves()
        saves = {name: value for name, value in frame.f_locals.items() if id(value) in saved}
        # Pickling may run the session's own reducers: still its code, still protected; the files are ours to write.
        data = _saved_bytes(saves, trace_results.SAFETENSORS_OBJECT in sinks)
    written = {
        trace_results.TORCH_OBJECT: sink.write_stream(sinks[trace_results.TORCH_OBJECT], len(data[0]), [data[0]])
    }
    if data[1] is not None:
        target = sinks[trace_results.SAFETENSORS_OBJECT]
        written[trace_results.SAFETENSORS_OBJECT] = sink.write_stream(target, len(data[1]), [data[1]])
    objects = {name: {"size": done.size, "sha256": done.sha256} for name, done in written.items()}
    return json.dumps({"kind": trace_results.TRACE_RESULT, "objects": objects, "error": None}).encode()


def _saved_bytes(saves: dict[str, Any], safetensors: bool) -> tuple[bytes, bytes | None]:
    """``torch.save`` of the saves, and with ``safetensors`` their safetensors form when every value is a tensor
    (as the engine writes a trace's: `trace_results.write_saves`)."""
    import torch

    from nnqueue.enginecore.trace_results import safetensors_bytes

    buffer = io.BytesIO()
    torch.save(saves, buffer)
    return buffer.getvalue(), safetensors_bytes(saves) if safetensors else None


@contextlib.contextmanager
def _traces_run_by_the_worker(model: Any) -> Iterator[None]:
    """While a session's body runs, each vLLM trace it reaches runs on the worker's engine (`_run_on_worker`)
    instead of nnsight's local path (``VLLMTracer.execute``, which would need an engine here)."""
    from nnsight.modeling.vllm.tracer import VLLMTracer

    counter = itertools.count(1)
    local = VLLMTracer.execute

    def execute(tracer: Any, code: Any) -> None:
        _run_on_worker(model, tracer, code, next(counter))

    VLLMTracer.execute = execute
    try:
        yield
    finally:
        VLLMTracer.execute = local


def _run_on_worker(model: Any, tracer: Any, code: Any, index: int) -> None:
    """Trace ``index`` of the session: prepared here, run by the worker (which checks it in another builder first),
    its saves pushed into the session's scope, then its error (if any) raised there, as nnsight's
    ``VLLMTracer.execute`` pushes what the other invokes saved before it raises."""
    from nnsight.intervention.util import clear_shared_locals
    from nnsight.tracing.tracer import mark, push_result

    try:
        _, (prompts, params, lora_requests), forward_kwargs = tracer.prepare(code)
        built = trace_payload.from_vllm_trace(model, prompts, params, lora_requests, forward_kwargs, tracer.envoy)
    finally:
        tracer.envoy.interleaver.cancel()
        clear_shared_locals()
    error, data = _parse_reply(child_process.ask(trace_payload.encode(built)))
    if data:
        from nnqueue.storage.results import load_result

        saves = load_result(data)  # the engine's output for this domain's own trace, in this domain's builder
        for value in saves.values():
            mark(value)
        push_result(tracer.info.frame, saves)
    if error is not None and not error.get("is_control_flow"):
        where = f"{tracer.info.frame.f_code.co_filename}, line {tracer.node.lineno}"
        raise SessionTraceFailed(index, where, error)
