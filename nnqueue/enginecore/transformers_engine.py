"""The transformers engine's process: one Hugging Face model, nnsight ``LanguageModel`` traces run on it one at a time.

What NDIF runs: a trace written against a meta ``LanguageModel`` (or a ``model.session``), serialized by the
client (``RequestModel.serialize``), rebuilt here against the loaded model (``RequestModel.deserialize``) and
executed the way nnsight executes it locally (``tracer.execute`` inside a trace scope), so everything nnsight
does on transformers works, gradients and ``backward()`` included. The saves are the values the trace
marked (``push_result``'s filter), copied to the CPU and written here (``torch.save``, and safetensors when the
worker gave a sink for it and all are tensors: :func:`nnqueue.enginecore.trace_results.write_saves`) to the sinks the worker handed over
(:mod:`nnqueue.enginecore.sink`: files the worker reads and uploads itself); the worker never loads them.

Jobs run one at a time: nnsight's local interleaver runs one trace's invokes as one batch, and putting
different users' traces in one forward would make them share it (one trace's ``tracer.stop()`` or error
ends everyone's forward, and a ``backward()`` walks the others' graph).

Each job reads its own payload's source, never an earlier job's, in a trace scope of its own
(:mod:`nnqueue.enginecore.payload_scope`). A job may edit the weights (weight-editing research runs here:
the job runs alone, so its edits reach only its own forward passes), but not the next job's: after each job
the weights guard (:mod:`nnqueue.enginecore.weights_guard`) puts back every parameter it changed, from a
copy kept in host memory, and drops the gradients it left; the state guard (:mod:`nnqueue.enginecore.state_guard`)
puts back the rest of what it changed (a module's attribute, a hook, a class's method, the engine's code), taken
once the engine is sandboxed (`Engine.take_state`). So the next job, of any owner and any trust domain, runs on
the model as it was loaded. Intervention code that runs ``NNQUEUE_ENGINE_STALL_TIMEOUT_S``
without handing control back to the model is stopped by the stall watchdog
(:mod:`nnqueue.enginecore.stall_watchdog`), failing the job; a job the worker gives up on (timeout, cancel)
is ended by killing this process.

This process runs users' code: the worker starts it with the secrets removed from its environment, it
imports nothing that holds credentials, and once the model is loaded it enters the same sandbox as vLLM's
engine processes (:mod:`nnqueue.isolation`: the engine user when root; :mod:`nnqueue.enginecore.protected`).

Run as ``python -m nnqueue.enginecore.transformers_engine --model M``; it loads the model, then answers one job
per request frame (:mod:`nnqueue.enginecore.child_process`, which also starts and replaces it for the worker;
what user code prints goes to stderr, the worker's log). A job's body is a 4-byte header length, the JSON
header ``{"job", "env", "sinks": {"torch"[, "safetensors"]}}`` and the payload; its answer is the JSON report a
vLLM engine posts for a trace (``{"kind": "trace_result", "objects": {name: {"size", "sha256"}}, "error":
DeferredError | None, "load_failed": bool}``), or, when writing the result failed, that error.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING, Any

from nnqueue.enginecore import child_process, protected
from nnqueue.enginecore.payload_scope import payload_scope
from nnqueue.enginecore.sandbox import enter_child_sandbox

if TYPE_CHECKING:
    from nnqueue.enginecore.state_guard import StateGuard

JSON_HEADER = 4


def job_frame(header: dict[str, Any], payload: bytes) -> bytes:
    encoded = json.dumps(header).encode()
    return len(encoded).to_bytes(JSON_HEADER, "big") + encoded + payload


def split_job(body: bytes) -> tuple[dict[str, Any], bytes]:
    size = int.from_bytes(body[:JSON_HEADER], "big")
    return json.loads(body[JSON_HEADER : JSON_HEADER + size]), body[JSON_HEADER + size :]


def load_model(path: str, model_kwargs: dict[str, Any]) -> Any:
    """The model, dispatched (weights loaded) and ready to trace: what a client's ``LanguageModel`` names
    (its remote key is ``TransformersModel``'s with the text-generation task)."""
    from nnsight.modeling.transformers import TransformersModel

    return TransformersModel(path, task="text-generation", dispatch=True, **model_kwargs)


class Engine:
    """The loaded model and what running one job on it takes."""

    def __init__(self, model: Any) -> None:
        from nnqueue.enginecore.state_guard import StateGuard
        from nnqueue.enginecore.weights_guard import WeightsGuard

        self.model = model
        self.guard = WeightsGuard(model._module)
        self.state: StateGuard | None = None
        self._check_state, self._check_weights = StateGuard.check, WeightsGuard.check  # as loaded, before any job
        self.persistent = model._remoteable_persistent_objects()
        self.default_attention = model.attn_implementation
        self.loaded = False  # whether the current job's payload was rebuilt (else its error is a rebuild error)

    def run(self, header: dict[str, Any], payload: bytes) -> dict[str, Any]:
        """Run one job's payload; write its saves to ``header["sinks"]``; the answer for the worker: the report
        vLLM engines post for a trace (:mod:`nnqueue.enginecore.trace_results`). Writing the result raises (the
        worker fails the job with that error)."""
        from nnsight.intervention.errors import capture_exception
        from nnsight.tracing.util import clean_traceback

        from nnqueue.enginecore.trace_results import TRACE_RESULT, snapshot, write_saves

        report: dict[str, Any] = {"kind": TRACE_RESULT, "objects": {}, "error": None, "load_failed": False}
        self.loaded = False
        try:
            saves = snapshot(self.execute(payload, header.get("env") or {}))  # copied before the weights go back
        except Exception as error:  # noqa: BLE001 - the trace's error, whatever it is, is the job's
            # As a local trace re-raises it: the user's frames, not nnsight's (Tracer.__exit__).
            cleaned = clean_traceback(getattr(error, "__intervention_tb__", None) or error.__traceback__)
            setattr(error, "__intervention_tb__", cleaned)  # noqa: B010 - nnsight's attribute, not the class's
            report.update(error=capture_exception(error), load_failed=not self.loaded)
        else:
            report["objects"] = write_saves(saves, header["sinks"])
        finally:
            self.restore(header.get("job"))
        return report

    def take_state(self) -> None:
        """Take the model's and the engine's state as it is now for what every job starts from: once the sandbox is
        entered (which changes the protected environment's switches), before the first job."""
        from nnqueue.enginecore.state_guard import StateGuard

        self.state = StateGuard(self.model._module, roots=(self.model,))

    def restore(self, job: Any) -> None:
        """Put back what the job changed (its edits lasted for its own run only): the state first, as the vLLM
        engine's guards do (it holds the weights guard's own code), then the weights."""
        state = self._check_state(self.state).strict if self.state is not None else []
        weights = self._check_weights(self.guard)
        for what, changed in (("parameter(s)", weights), ("other state", state)):
            if changed:
                print(
                    f"nnqueue: job {job}'s changes to {len(changed)} {what} {changed[:10]} were undone", file=sys.stderr
                )

    def execute(self, payload: bytes, env: dict[str, Any]) -> dict[str, Any]:
        """Rebuild and run the trace; its saved values by name (what a local run pushes into the caller's frame)."""
        from nnsight.schema.request import RequestModel
        from nnsight.tracing.tracer import _saves

        self.model._remoteable_set_env({"attn_implementation": self.default_attention, **env})
        with payload_scope(self.model) as registered, protected.running_user_code():
            tracer = RequestModel.deserialize(payload, self.persistent)
            self.loaded = True
            registered(tracer.info.frame.f_code.co_filename)
            frame = tracer.info.frame
            tracer.execute(tracer.info.code)
            # The frame's locals are the captured variables plus what the trace pushed: its saved values.
            saved = _saves()
            return {name: value for name, value in frame.f_locals.items() if id(value) in saved}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="nnqueue's transformers engine process (started by a worker)")
    parser.add_argument("--model", required=True)
    parser.add_argument("--model-kwargs", default="{}")
    parser.add_argument("--stall-timeout-s", type=float, default=60.0)
    args = parser.parse_args(argv)
    protocol = child_process.open_protocol()
    from nnqueue.enginecore import stall_watchdog  # imports nnsight: after open_protocol's single-threaded steps

    engine = Engine(load_model(args.model, json.loads(args.model_kwargs)))
    # Only now, with the model loaded: no secret in the environment, the engine user when root, and
    # payloads unpickled and run in the protected environment (what vLLM's engine processes do).
    enter_child_sandbox()
    stall_watchdog.install(args.stall_timeout_s)
    engine.take_state()
    import nnsight

    ready = {"nnsight": nnsight.__version__, "device": str(engine.model.device)}
    child_process.serve(protocol, ready, lambda body: json.dumps(engine.run(*split_job(body))).encode())


if __name__ == "__main__":
    main()
