"""Trace payloads built the way clients build them: a meta ``VLLM`` traces the block and a backend builds the
payload instead of running it: prebuilt as the nnqueue client sends it, or raw as nnsight's own clients do.

The backends are not subclasses of nnsight's ``Backend``: a tracer only calls its backend with itself when its block
ends (``Tracer.__exit__``), and nothing checks the class, so this module, which test modules import at their top,
does not import nnsight (6 s of collecting the tests: docs/development.md)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

PROMPTS = ["The Eiffel Tower is in", "A job queue runs many traces"]
# A trace's backend as nnsight uses one: called with the tracer, in place of running the block.
TraceBackend = Callable[[Any], None]


class PayloadBackend:
    """Serialize the trace instead of running it, as nnsight's own remote clients do (a raw payload)."""

    payload: bytes

    def __call__(self, tracer: Any) -> None:
        from nnsight.schema.request import RequestModel

        self.payload = RequestModel.serialize(tracer)


class PrebuiltBackend:
    """Build the trace's requests instead of running them, as the nnqueue client does (a prebuilt payload)."""

    payload: bytes

    def __call__(self, tracer: Any) -> None:
        from nnqueue.client.backend import build_payload

        self.payload = build_payload(tracer)


def two_invoke_trace(client: Any, backend: TraceBackend) -> None:
    """One trace, an invoke per prompt of PROMPTS, saving layer 0's output (HF's hidden state) and the logits."""
    with client.trace(temperature=0.0, max_tokens=1, backend=backend) as tracer:
        with tracer.invoke(PROMPTS[0]):
            out = client.model.layers[0].output
            h0 = (out[0] + out[1]).save()  # vLLM's Llama layer returns (mlp_out, residual)
            logits0 = client.logits.save()
        with tracer.invoke(PROMPTS[1]):
            out = client.model.layers[0].output
            h1 = (out[0] + out[1]).save()
            logits1 = client.logits.save()


def two_invoke_payload(client: Any, raw: bool = False) -> bytes:
    """`two_invoke_trace` as a payload: prebuilt by the nnqueue client, or ``raw`` as nnsight serializes it."""
    backend = PayloadBackend() if raw else PrebuiltBackend()
    two_invoke_trace(client, backend)
    return backend.payload


def slow_payload(client: Any, steps: int) -> bytes:
    """A job that decodes ``steps`` tokens and sleeps 0.1 s in its intervention at each: slow, never stalled."""
    backend = PrebuiltBackend()
    with client.trace(PROMPTS[0], temperature=0.0, max_tokens=steps, ignore_eos=True, backend=backend) as tracer:
        for _ in tracer.iter[:]:
            time.sleep(0.1)
            client.logits
        last = client.logits.save()
    return backend.payload


def fake_trace(body: bytes = b"serialized trace") -> bytes:
    """Bytes that start like an nnsight serialized trace (a pickle's protocol-4 header), which the API takes
    without unpickling, and are none: for tests that never run the job."""
    from nnqueue import trace_payload

    return trace_payload.PICKLE_PROTOCOL_4 + len(body).to_bytes(8, "little") + body
