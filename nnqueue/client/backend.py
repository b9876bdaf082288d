"""An nnsight backend that runs a trace as an nnqueue job, so ordinary nnsight code goes through the queue::

    model = VLLM("HuggingFaceTB/SmolLM2-135M")               # meta model: no weights, no GPU
    with model.trace("The Eiffel Tower is in", backend=client.backend(), max_tokens=3):
        hidden = model.model.layers[-1].output.save()
        logits = model.logits.save()
    hidden, logits                                           # the worker's values, here

The block is serialized the way nnsight's own serve client does it (``RequestModel.serialize``), submitted
through the HTTP API, waited for (with a progress display), and its saves are marked and pushed into the
caller's frame exactly as a local run's are (``mark`` + ``push``, like ``LocalServeBackend``). A job that
failed re-raises here as :class:`~nnqueue.client.errors.JobFailed`, a ``RuntimeError`` shaped like
nnsight's ``raise_deferred``: ``"<Type>: <message>"`` plus the worker-side traceback.

Non-blocking (``client.backend(blocking=False)``), the trace only submits: the trace's variables stay
unset, and ``backend.job`` is the :class:`~nnqueue.client.job.Job` to wait on and read ``.result()`` from.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from nnsight.tracing.backend import Backend

if TYPE_CHECKING:
    from nnsight.tracing.tracer import Tracer

    from nnqueue.client.client import Client
    from nnqueue.client.job import Job


class NNqueueBackend(Backend):
    """Submit the captured trace as a job; blocking, bring its saves home. Reusable: each trace is a new job."""

    def __init__(
        self,
        client: Client,
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
        from nnsight.schema.request import RequestModel

        model_key = self.model_key or default_model_key(tracer)
        payload = RequestModel.serialize(tracer, compress=False)
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
        push_saves(saves, tracer)
        return saves

    def __repr__(self) -> str:
        mode = "blocking" if self.blocking else "non-blocking"
        return f"<NNqueueBackend {self.client.url} model={self.model_key or '<traced model>'} {mode}>"


def default_model_key(tracer: Any) -> str:
    """The key a traced model is served under by default: the repo id or path it was built from."""
    model = getattr(tracer, "envoy", None) or getattr(tracer, "model", None)
    if isinstance(repo_id := getattr(model, "repo_id", None), str) and repo_id:  # transformers models
        return repo_id
    key = getattr(model, "_remoteable_model_key", None)
    if callable(key):
        return str(key())
    raise ValueError("cannot tell which model this trace is for: pass client.backend(model_key=...)")


def push_saves(saves: dict[str, Any], tracer: Any) -> None:
    """Mark each value saved (so an enclosing trace keeps it) and write the names into the caller's frame."""
    from nnsight.tracing.tracer import mark
    from nnsight.tracing.util import push

    for value in saves.values():
        mark(value)
    frame = getattr(getattr(tracer, "info", None), "frame", None)
    if frame is not None:
        push(frame, saves)
