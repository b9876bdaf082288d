"""Turn a raw nnsight payload (``RequestModel.serialize``) into a prebuilt one, inside a sandboxed builder process.

Raw payloads are what nnsight's own clients (``remote=True``, ``serve=``) and older nnqueue clients send.
Rebuilding one unpickles it and runs the trace's top-level code, so it happens only in a builder process
(:mod:`nnqueue.engines.builders` starts them with a scrubbed environment; once its meta model is loaded the
builder enters the sandbox, :func:`nnqueue.enginecore.sandbox.enter_child_sandbox`), never in the worker. The steps
are nnsight 0.8.1's serve server's (``nnsight.modeling.vllm.serve.server``): ``RequestModel.deserialize``
against a meta ``VLLM`` of the worker's model, ``tracer.prepare`` to build each invoke's mediator, and
``VLLM._attach_mediators`` to serialize them into the requests, which :mod:`nnqueue.trace_payload` then
writes out. The worker parses the result like any client's (it is untrusted: user code ran here).

Each build reads its own payload's source, never an earlier build's: nnsight caches a file's source and
its parsed ``with`` blocks per process (``SOURCES`` / ``BLOCKS`` in ``nnsight.tracing.globals``), and
``RequestModel.deserialize`` registers the payload's source in ``linecache`` under the client's filename,
so two users (or two versions of one script) with the same filename would otherwise share code. Both
caches and the ``linecache`` entry are cleared around every build.

A builder also checks prebuilt payloads (`check_prebuilt`): it loads each mediator as the engine will, so a
malformed one fails its job at claim instead of reaching the engine. Loading user pickles is as unsafe as
rebuilding, so it happens here too, never in the worker.

Run as ``python -m nnqueue.engines.trace_builder --model M --engine-kwargs JSON``: it loads the meta model,
writes a ready frame, then answers one request frame at a time on its stdin/stdout (see `main`): a raw
payload is rebuilt (the answer is the prebuilt payload), a prebuilt one checked (the answer is empty). What the
user's code prints goes to stderr (the worker's log), never into the protocol.
"""

from __future__ import annotations

import argparse
import ast
import json
import linecache
import os
import sys
import traceback
from typing import Any, BinaryIO

from nnqueue import netns, trace_payload
from nnqueue.enginecore import protected
from nnqueue.enginecore.payload_scope import payload_scope
from nnqueue.enginecore.sandbox import enter_child_sandbox
from nnqueue.errors import NNqueueError

FRAME_HEADER = 8
OK, FAILED, READY = 0, 1, 2


class MediatorRejected(NNqueueError):
    """An invoke's mediator could not be loaded; reported under the type of the error that loading raised."""

    def __init__(self, index: int, error: Exception) -> None:
        super().__init__(f"invoke {index}'s mediator cannot be loaded: {error}")
        self.type_name = type(error).__name__


def build_prebuilt(model: Any, payload: bytes) -> bytes:
    """The prebuilt payload for the raw nnsight payload ``payload``, built against meta model ``model``, and
    checked as a client's prebuilt payload is (`check_prebuilt`)."""
    built = _build(model, payload)
    check_prebuilt(model, built)
    return built


def check_prebuilt(model: Any, payload: bytes) -> None:
    """Load each of a prebuilt payload's mediators as the engine will (``protected.load_mediator``), so that
    one the engine cannot load, or that is no nnsight ``Mediator`` (``pickle.dumps(1)``), fails its job here
    instead of reaching the engine. Raises what the load raised, naming the invoke."""
    trace = trace_payload.decode(payload)
    persistent = model._remoteable_persistent_objects()
    known = set(linecache.cache)
    try:
        for index, invoke in enumerate(trace.invokes):
            try:
                protected.load_mediator(invoke.mediator, persistent)
            except Exception as error:  # noqa: BLE001 - whatever loading raised is the job's error
                raise MediatorRejected(index, error) from None
    finally:
        for filename in set(linecache.cache) - known:  # what Mediator.__setstate__ and _load_function registered
            linecache.cache.pop(filename, None)


def _build(model: Any, payload: bytes) -> bytes:
    from nnsight.schema.request import RequestModel

    with payload_scope(model) as registered, protected.running_user_code():
        tracer = RequestModel.deserialize(
            payload, model._remoteable_persistent_objects(), compress=payload.startswith(trace_payload.ZSTD_MAGIC)
        )
        filename = tracer.info.frame.f_code.co_filename
        registered(filename)
        # Deserialize drops the AST node, which `_attach_mediators` needs to serialize a direct-input
        # trace's mediator; parse it back from the source deserialize just registered.
        tracer.node = ast.parse("".join(linecache.getlines(filename)))
        _, (prompts, params, lora_requests), forward_kwargs = tracer.prepare(tracer.info.code)
        model._attach_mediators(params, **forward_kwargs)
        return trace_payload.encode(trace_payload.from_vllm_requests(prompts, params, lora_requests))


def load_meta_model(model: str, engine_kwargs: dict[str, Any]) -> Any:
    """A meta ``VLLM`` of the worker's model, as a client builds one (no weights, no engine)."""
    from nnsight.modeling.vllm import VLLM

    from nnqueue.engines.platform import prepare_process

    prepare_process()
    meta = VLLM(model, **engine_kwargs)
    # Edits live on the worker's engine, not here: let the engine check the names a trace asks for.
    meta._serving = True
    return meta


def write_frame(out: BinaryIO, status: int, body: bytes) -> None:
    out.write((len(body) + 1).to_bytes(FRAME_HEADER, "big") + bytes([status]) + body)
    out.flush()


def read_frame(source: BinaryIO) -> bytes | None:
    """One frame's body from ``source``, or None at end of input."""
    header = source.read(FRAME_HEADER)
    if len(header) < FRAME_HEADER:
        return None
    size = int.from_bytes(header, "big")
    body = source.read(size)
    return body if len(body) == size else None


def failure(error: BaseException) -> bytes:
    return json.dumps(
        {
            "type_name": getattr(error, "type_name", type(error).__name__),
            "message": str(error),
            "traceback": "".join(traceback.format_exception(error)),
        }
    ).encode()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="nnqueue's sandboxed trace builder (started by a worker)")
    parser.add_argument("--model", required=True)
    parser.add_argument("--engine-kwargs", default="{}")
    args = parser.parse_args(argv)
    # First, while this process has one thread: no network but its own loopback (nnqueue.netns).
    netns.isolate_if_asked()

    # The protocol owns the original stdout; anything else printed (user code) goes to stderr.
    protocol = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    from nnqueue.enginecore.lifetime import exit_with_worker

    exit_with_worker()
    model = load_meta_model(args.model, json.loads(args.engine_kwargs))
    # Only now, with the model read: no secret in the environment, the engine user when root, and
    # payloads unpickled and run in the protected environment.
    enter_child_sandbox()
    import nnsight

    write_frame(protocol, READY, json.dumps({"nnsight": nnsight.__version__}).encode())
    requests = sys.stdin.buffer
    while (payload := read_frame(requests)) is not None:
        try:
            if payload.startswith(trace_payload.MAGIC):
                check_prebuilt(model, payload)
                built = b""
            else:
                built = build_prebuilt(model, payload)
        except Exception as error:  # noqa: BLE001 - the build's error, whatever it is, goes to the worker
            write_frame(protocol, FAILED, failure(error))
        else:
            write_frame(protocol, OK, built)


if __name__ == "__main__":
    main()
