"""An nnsight backend that runs a trace as an nnqueue job, so ordinary nnsight code goes through the queue::

    model = VLLM("HuggingFaceTB/SmolLM2-135M")               # meta model: no weights, no GPU
    with model.trace("The Eiffel Tower is in", backend=client.backend(), max_tokens=3):
        hidden = model.model.layers[-1].output.save()
        logits = model.logits.save()
    hidden, logits                                           # the worker's values, here

For a vLLM model the client builds the trace's requests itself, exactly as nnsight does before it submits
them to a local engine (``VLLMTracer.prepare``, then ``VLLM._attach_mediators``, which serializes each
invoke's mediator), and submits them as a prebuilt payload (:mod:`nnqueue.trace_payload`) that the worker
reads without unpickling. Other models' traces are submitted as nnsight serializes them for its own
remote clients (``RequestModel.serialize``).

A session (``with model.session(backend=client.backend()):`` around several traces that pass values) is one job:
it is submitted as nnsight serializes it for its own remote clients, and the worker runs its body in a trace
builder and each of its traces on its engine (:mod:`nnqueue.engines.sessions`); what the session saved lands here
as a trace's saves do. Its model key is its body's model's.

A model built with taps (``VLLM(path, taps=client.taps(key))``, for workers that serve CUDA-graph taps) has
them checked against the ones its workers serve before the trace is submitted (`check_taps`).

The job is waited for (with a progress display) and its saves are marked and pushed into the caller's
frame, as nnsight's ``VLLM._collect`` and ``VLLMTracer.execute`` do for a local run (the worker merged them
the same way). A job that failed pushes what the other invokes saved, then raises the worker's error as a
local run of the model raises it (:mod:`nnqueue.client.errors`), always a
:class:`~nnqueue.client.errors.JobFailed` too: for a vLLM model, vLLM's own errors (``VLLMValidationError``) as
they are, and the engine's others as nnsight's ``raise_deferred`` does, a ``RuntimeError`` reading
``"<Type>: <message>"`` and the worker-side traceback, that is also an instance of the worker's class
(``except IndexError`` works); for other models, the worker's class alone.

Non-blocking (``client.backend(blocking=False)``), the trace only submits: the trace's variables stay
unset, and ``backend.job`` is the :class:`~nnqueue.client.job.Job` to wait on and read ``.result()`` from.
"""

from __future__ import annotations

import ast
from typing import TYPE_CHECKING, Any, Protocol

from nnsight.tracing.backend import Backend

from nnqueue.client.errors import JobFailed

if TYPE_CHECKING:
    from nnsight.tracing.tracer import Tracer

    from nnqueue.client.job import Job


class Submitter(Protocol):
    """What the backend needs of :class:`~nnqueue.client.client.Client` (which builds it with
    ``client.backend()``): a protocol, so that this module does not import the client back."""

    url: str

    def submit(
        self,
        model_key: str,
        payload: bytes,
        *,
        timeout_s: float | None = ...,
        priority: int = ...,
        metadata: dict[str, Any] | None = ...,
        kind: str = ...,
        weights_version: str | None = ...,
        safetensors: bool = ...,
    ) -> Job: ...

    def taps(self, model_key: str) -> list[str] | None: ...


class NNqueueBackend(Backend):
    """Submit the captured trace as a job; blocking, bring its saves home. Reusable: each trace is a new job."""

    def __init__(
        self,
        client: Submitter,
        model_key: str | None = None,
        blocking: bool = True,
        *,
        progress: bool = True,
        wait_timeout: float | None = None,
        **submit_options: Any,
    ) -> None:
        self.client = client
        self.model_key = model_key
        self.blocking = blocking
        self.progress = progress
        self.wait_timeout = wait_timeout
        self.submit_options = submit_options
        self.job: Job | None = None
        self.jobs: list[Job] = []

    def __call__(self, tracer: Tracer) -> dict[str, Any] | None:
        session = getattr(tracer, "envoy", None) is None  # model.session(backend=...): its traces in one job
        model_key = self.model_key or default_model_key(tracer)
        check_taps(tracer, self.client, model_key)
        if session:
            from nnsight.schema.request import RequestModel

            payload = RequestModel.serialize(tracer, compress=False)
        else:
            payload = build_payload(tracer)
        self.job = self.client.submit(model_key, payload, **self.submit_options)
        self.jobs.append(self.job)
        if not self.blocking:
            return None
        try:
            saves = self.job.result(timeout=self.wait_timeout, progress=self.progress)
        except KeyboardInterrupt:
            # The trace was abandoned, so its values can never land: don't leave the job running.
            self.job.cancel_quietly()
            raise
        except JobFailed as failure:
            # As a local run does: the values the other invokes saved land, then the error is raised.
            if failure.saves is not None:
                push_saves(failure.saves, tracer)
            if not (is_vllm_trace(tracer) or is_vllm_session(tracer)) or failure.job is None:
                raise
            # As a local vLLM run raises it: nnsight's raise_deferred's RuntimeError, but for vLLM's own errors.
            deferred = JobFailed.from_job(failure.job, deferred=True)
            deferred.saves = failure.saves
            raise deferred from None
        push_saves(saves, tracer)
        return saves

    def __repr__(self) -> str:
        mode = "blocking" if self.blocking else "non-blocking"
        return f"<NNqueueBackend {self.client.url} model={self.model_key or '<traced model>'} {mode}>"


def build_payload(tracer: Any) -> bytes:
    """The payload for a captured trace: prebuilt for a vLLM model, nnsight's serialization otherwise."""
    if not is_vllm_trace(tracer):
        from nnsight.schema.request import RequestModel

        return RequestModel.serialize(tracer, compress=False)

    from nnsight.intervention.util import clear_shared_locals

    from nnqueue import trace_payload

    model = tracer.envoy
    try:
        # What VLLMTracer.execute + VLLM._call do before they submit to a local engine (the mediators attached
        # with the model's envoy tree once for the trace, not in each of them: trace_payload.from_vllm_trace).
        _, (prompts, params, lora_requests), forward_kwargs = tracer.prepare(tracer.info.code)
        trace = trace_payload.from_vllm_trace(model, prompts, params, lora_requests, forward_kwargs)
    finally:
        model.interleaver.cancel()
        clear_shared_locals()
    return trace_payload.encode(trace)


def is_vllm_trace(tracer: Any) -> bool:
    """Whether ``tracer`` traces an nnsight ``VLLM`` model (the others are nnsight's remote traces)."""
    from nnsight.modeling.vllm import VLLM

    return isinstance(getattr(tracer, "envoy", None), VLLM) and hasattr(tracer, "prepare")


def is_vllm_session(tracer: Any) -> bool:
    """Whether ``tracer`` is a session (``model.session()``) around an nnsight ``VLLM`` model's traces."""
    from nnsight.modeling.vllm import VLLM

    return getattr(tracer, "envoy", None) is None and isinstance(session_model(tracer), VLLM)


def session_model(tracer: Any) -> Any:
    """The one nnsight model a session's body names (a model, not one of its modules), or None when it names
    none or several."""
    from nnsight.modeling.mixins.remotable import Remotable

    frame = getattr(getattr(tracer, "info", None), "frame", None)
    node = getattr(tracer, "node", None)
    if frame is None or node is None:
        return None
    names = {found.id for found in ast.walk(node) if isinstance(found, ast.Name)}
    values = (frame.f_locals.get(name, frame.f_globals.get(name)) for name in names)
    models = {id(value): value for value in values if isinstance(value, Remotable)}
    return next(iter(models.values())) if len(models) == 1 else None


def check_taps(tracer: Any, client: Submitter, model_key: str) -> None:
    """Refuse, before submitting, a trace (or session) whose model declares taps (``VLLM(..., taps=[...])``) that the
    model's workers do not all serve: a location outside a worker's taps is never reached there. A trace on an
    untapped meta model is checked by the engine instead (its job fails naming the location and the taps served)."""
    model: Any = getattr(tracer, "envoy", None) or session_model(tracer)
    if not getattr(model, "taps", ()):
        return
    served = client.taps(model_key)
    if served is None:
        return  # eager workers: every location is served
    # nnsight's own resolution (patterns -> full locations under the root envoy, "model.model.layers.0.output").
    wanted = {tap.removeprefix("model.") for tap in model._resolve_taps(model._module)}
    missing = sorted(wanted - set(served))
    if missing:
        raise ValueError(
            f"the workers of {model_key!r} serve the taps {served}, not {missing} that this model declares:"
            f" build it with VLLM(..., taps=client.taps({model_key!r})), and touch only those in its traces"
        )


def default_model_key(tracer: Any) -> str:
    """The key a traced model is served under by default: the repo id or path it was built from (a session's: its
    body's model's)."""
    model = getattr(tracer, "envoy", None) or getattr(tracer, "model", None) or session_model(tracer)
    if isinstance(repo_id := getattr(model, "repo_id", None), str) and repo_id:  # transformers models
        return repo_id
    key = getattr(model, "_remoteable_model_key", None)
    if callable(key):
        return str(key())
    raise ValueError("cannot tell which model this trace or session is for: pass client.backend(model_key=...)")


def push_saves(saves: dict[str, Any], tracer: Any) -> None:
    """Mark each value saved (so an enclosing trace keeps it) and write the names into the caller's frame."""
    from nnsight.tracing.tracer import mark
    from nnsight.tracing.util import push

    for value in saves.values():
        mark(value)
    frame = getattr(getattr(tracer, "info", None), "frame", None)
    if frame is not None:
        push(frame, saves)
