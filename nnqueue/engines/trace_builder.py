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
rebuilding, so it happens here too, never in the worker. Both load with the protected environment's strict
unpickler (``protected.StrictUnpickler``: nothing runs while a payload loads but its reconstructors, and nothing
it did not build is changed), so the bytes an engine loads were checked by opcode first.

Run as ``python -m nnqueue.engines.trace_builder --model M --engine-kwargs JSON``, by the worker's builder pool as its
zygote (:mod:`nnqueue.enginecore.zygote`): it loads the meta model once, then forks a builder for each the pool asks
for, which isolates itself and answers one request frame at a time (:mod:`nnqueue.enginecore.child_process`, which
also replaces builders for the worker): a raw payload is rebuilt (the answer is the prebuilt payload), a prebuilt
one checked (the answer is empty), a session run, its traces on the worker's engine (:mod:`nnqueue.engines.sessions`:
the answer is its result's report), and a failure is answered with its error. What the user's code prints goes
to stderr (the worker's log), never into the protocol.
"""

from __future__ import annotations

import argparse
import ast
import functools
import importlib
import json
import linecache
import socket
import sys
from typing import Any

from nnqueue import trace_payload
from nnqueue.enginecore import child_process, core_forks, envoy_trees, protected, zygote
from nnqueue.enginecore.payload_scope import deserialize, payload_scope
from nnqueue.enginecore.sandbox import enter_child_sandbox
from nnqueue.engines import sessions
from nnqueue.errors import NNqueueError

# What an engine core imports beyond the meta model's modules, by platform (the zygote forks the worker's engine cores).
CORE_MODULES = ("vllm.v1.engine.core", "vllm.v1.executor.uniproc_executor")
CPU_CORE_MODULES = (*CORE_MODULES, "nnqueue.enginecore.cpu_worker")
GPU_CORE_MODULES = (*CORE_MODULES, "nnqueue.enginecore.gpu_worker")


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
    trees = envoy_trees.EnvoyTrees(ahead=False, strict=True)  # a format 2 trace's envoy tree, checked strictly
    if trace.envoys is not None:
        trees.add(trace.envoys.sha256, trace.envoys.data, persistent)
    load = trees.loads(functools.partial(protected.load_mediator, strict=True))
    known = set(linecache.cache)
    try:
        for index, invoke in enumerate(trace.invokes):
            try:
                load(invoke.mediator, persistent)
            except Exception as error:  # noqa: BLE001 - whatever loading raised is the job's error
                raise MediatorRejected(index, error) from None
    finally:
        for filename in set(linecache.cache) - known:  # what Mediator.__setstate__ and _load_function registered
            linecache.cache.pop(filename, None)


def _build(model: Any, payload: bytes) -> bytes:
    with payload_scope(model) as registered, protected.running_user_code():
        tracer = deserialize(model, payload)
        if not hasattr(tracer, "prepare"):  # a session the worker did not recognize: only zstd hides one
            raise TypeError(
                f"the payload holds a {type(tracer).__name__} (a session?), not a vLLM trace: submit a session"
                " uncompressed to /v1/jobs (as the nnqueue client does), or through nnsight's remote=True"
            )
        filename = tracer.info.frame.f_code.co_filename
        registered(filename)
        # Deserialize drops the AST node, which `_attach_mediators` needs to serialize a direct-input
        # trace's mediator; parse it back from the source deserialize just registered.
        tracer.node = ast.parse("".join(linecache.getlines(filename)))
        _, (prompts, params, lora_requests), forward_kwargs = tracer.prepare(tracer.info.code)
        # The trace's code refers to the deserialized copy of the client's envoy tree (tracer.envoy), which
        # shares this model's interleaver and modules; the mediators are attached by this model (it serves edits).
        return trace_payload.encode(
            trace_payload.from_vllm_trace(model, prompts, params, lora_requests, forward_kwargs, tracer.envoy)
        )


def serve_engine_cores(cores: socket.socket, pool: socket.socket) -> None:
    """Import what an engine core runs that the meta model does not and fork the core server
    (:mod:`nnqueue.enginecore.core_forks`). On a GPU only while no CUDA context exists here (a context does not survive
    a fork: each forked core creates its own); should an import have made one, decline, and the worker spawns its
    engine core. The worker asks every zygote: which platform vLLM runs on is known once vLLM is imported, and a worker
    imports it in a thread that another import beside it can break."""
    import torch

    from nnqueue.engines.platform import is_cpu, prepare_process

    cpu = is_cpu()
    prepare_process()
    modules = CPU_CORE_MODULES if cpu else GPU_CORE_MODULES
    for name in modules:
        importlib.import_module(name)
    _hash_compiler_sources(cpu)
    if torch.cuda.is_initialized():
        print(f"engine cores are spawned: importing {', '.join(modules)} created a CUDA context", file=sys.stderr)
        cores.close()
        return
    core_forks.serve_aside(cores, pool)


def _hash_compiler_sources(cpu: bool) -> None:
    """What every engine core computes before its first compile (the logprobs kernel it builds at start): inductor's
    cache keys, hashes of torch's and Triton's sources (1.7 s of its 8 s of CPU, tiny model, two cores). Computed once
    here, each core forked from the server inherits them (``functools`` caches of ``torch._inductor.codecache``). The
    system's key only on the CPU: it reads the current CUDA device, which would create the context a fork cannot
    carry."""
    from torch._inductor.codecache import CacheBase, torch_key

    torch_key()
    if cpu:
        CacheBase.get_system()


def load_meta_model(model: str, engine_kwargs: dict[str, Any]) -> Any:
    """A meta ``VLLM`` of the worker's model, as a client builds one (no weights, no engine)."""
    from nnsight.modeling.vllm import VLLM

    from nnqueue.engines.platform import prepare_process

    prepare_process()
    meta = VLLM(model, **engine_kwargs)
    # Edits live on the worker's engine, not here: let the engine check the names a trace asks for.
    meta._serving = True
    return meta


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="nnqueue's sandboxed trace builder (started by a worker)")
    parser.add_argument("--model", required=True)
    parser.add_argument("--engine-kwargs", default="{}")
    args = parser.parse_args(argv)
    forks = zygote.channel()
    if (cores := core_forks.channel()) is not None:  # the worker's engine cores are forked aside, before the meta model
        serve_engine_cores(cores, forks)
    model = load_meta_model(args.model, json.loads(args.engine_kwargs))
    zygote.serve_forks(forks)  # returns in each builder the worker asks for: the rest is the builder's
    protocol = child_process.open_protocol()
    # Only now, with the model read: no secret in the environment, the engine user when root, and
    # payloads unpickled and run in the protected environment.
    enter_child_sandbox()
    import nnsight

    child_process.serve(protocol, {"nnsight": nnsight.__version__}, lambda payload: answer(model, payload))


def answer(model: Any, payload: bytes) -> bytes:
    """A request's answer: a raw payload's prebuilt one, nothing for a prebuilt payload that passed its check, or a
    session's report once it ran (:mod:`nnqueue.engines.sessions`)."""
    if payload.startswith(trace_payload.MAGIC):
        check_prebuilt(model, payload)
        return b""
    if payload.startswith(sessions.REQUEST_MAGIC):
        sinks, raw = sessions.parse_request(payload)
        return sessions.run_session(model, raw, sinks)
    return build_prebuilt(model, payload)


if __name__ == "__main__":
    main()
