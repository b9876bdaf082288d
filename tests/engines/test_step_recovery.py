"""A malformed intervention fails its trace, not the engine (nnqueue.enginecore.step_recovery), on the CPU engine
with nnqueue's worker class: issue 34's wrong-shape ``.skip()`` alone in its step fails with vLLM's error while the
engine goes on serving the same results; in a step shared with another trace, both are to run again alone."""

from __future__ import annotations

import asyncio
import tempfile
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nnqueue import trace_payload
from nnqueue.engines.trace_report import TraceReport
from tests.utils.engines import InProcessEngine, run, run_prebuilt
from tests.utils.payloads import PROMPTS, PrebuiltBackend

if TYPE_CHECKING:
    from nnsight.modeling.vllm import VLLM


def wrong_skip(client: VLLM) -> bytes:
    """Issue 34's: layer 0 skipped with a value of the wrong shape, which vLLM's next layer fails on."""
    import torch

    backend = PrebuiltBackend()
    with client.trace(PROMPTS[0], temperature=0.0, max_tokens=1, backend=backend):
        client.model.layers[0].skip((torch.zeros(6, 6), torch.zeros(6, 6)))
        logits = client.logits.save()
    return backend.payload


def decoding(client: VLLM, steps: int) -> bytes:
    backend = PrebuiltBackend()
    with client.trace(PROMPTS[1], temperature=0.0, max_tokens=steps, ignore_eos=True, backend=backend) as tracer:
        logits = list().save()
        for _ in tracer.iter[:]:
            logits.append(client.logits)
    return backend.payload


def test_a_wrong_shape_skip_alone_fails_its_job_and_the_engine_serves_on(
    inprocess_engine: InProcessEngine, client_model: VLLM, tmp_path: Path
) -> None:
    import torch

    clean = decoding(client_model, 3)
    report, before = run_prebuilt(inprocess_engine, clean, tmp_path, "recovery-before")
    assert report.error is None, report.error
    report, _ = run_prebuilt(inprocess_engine, wrong_skip(client_model), tmp_path, "recovery-skip")
    assert report.error is not None and report.error["type_name"] == "RuntimeError", report.error
    assert "must match" in report.error["message"] and "ran the step again without the trace" in report.error["message"]
    report, after = run_prebuilt(inprocess_engine, clean, tmp_path, "recovery-after")
    assert report.error is None, report.error
    assert torch.equal(torch.stack(after["logits"]), torch.stack(before["logits"]))


def test_in_a_step_shared_with_another_trace_both_are_to_run_again_alone(
    inprocess_engine: InProcessEngine, client_model: VLLM
) -> None:
    llm = inprocess_engine.model.vllm_entrypoint

    from nnqueue.engines.outbox import poller  # vLLM: only when a test runs
    from nnqueue.engines.prebuilt import to_requests
    from nnqueue.engines.trace_runner import run_trace

    async def one(payload: bytes, name: str, directory: str) -> TraceReport:
        sinks = {"torch": {"kind": "handoff", "path": f"{directory}/{name}"}}
        requests = to_requests(trace_payload.decode(payload), name)
        return await run_trace(inprocess_engine.model, requests, trace_id=name, sinks=sinks, outbox=poller(llm))

    innocent, malformed = decoding(client_model, 24), wrong_skip(client_model)

    async def both(directory: str) -> list[Any]:
        # The innocent trace decodes for many steps, so the malformed one, right behind it, shares a step with it.
        first = asyncio.ensure_future(one(innocent, "recovery-innocent", directory))
        await asyncio.sleep(0.05)
        second = await one(malformed, "recovery-malformed", directory)
        return [await first, second]

    with tempfile.TemporaryDirectory() as directory:
        reports = run(inprocess_engine, both(directory))
    for report in reports:
        assert report.error is not None and report.error["type_name"] == "StateModifiedInSharedStep", report.error
        assert "runs again alone" in report.error["message"]
