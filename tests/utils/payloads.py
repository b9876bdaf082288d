"""Trace payloads built the way clients build them: a meta ``VLLM`` traces the block and a backend
serializes it instead of running it."""

from __future__ import annotations

import time
from typing import Any

from nnsight.schema.request import RequestModel
from nnsight.tracing.backend import Backend

PROMPTS = ["The Eiffel Tower is in", "A job queue runs many traces"]


class PayloadBackend(Backend):
    """Serialize the trace instead of running it, as a client does before submitting it."""

    payload: bytes

    def __call__(self, tracer: Any) -> None:
        self.payload = RequestModel.serialize(tracer)


def two_invoke_payload(client: Any) -> bytes:
    """One trace, an invoke per prompt of PROMPTS, saving layer 0's output (HF's hidden state) and the logits."""
    backend = PayloadBackend()
    with client.trace(temperature=0.0, max_tokens=1, backend=backend) as tracer:
        with tracer.invoke(PROMPTS[0]):
            out = client.model.layers[0].output
            h0 = (out[0] + out[1]).save()  # vLLM's Llama layer returns (mlp_out, residual)
            logits0 = client.logits.save()
        with tracer.invoke(PROMPTS[1]):
            out = client.model.layers[0].output
            h1 = (out[0] + out[1]).save()
            logits1 = client.logits.save()
    return backend.payload


def slow_payload(client: Any, steps: int) -> bytes:
    """A job that decodes ``steps`` tokens and sleeps 0.1 s in its intervention at each: slow, never stalled."""
    backend = PayloadBackend()
    with client.trace(PROMPTS[0], temperature=0.0, max_tokens=steps, ignore_eos=True, backend=backend) as tracer:
        for _ in tracer.iter[:]:
            time.sleep(0.1)
            client.logits
        last = client.logits.save()
    return backend.payload
