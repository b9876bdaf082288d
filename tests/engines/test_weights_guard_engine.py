"""A trace that writes to the engine's weights (nnqueue.enginecore.weights_guard, on the CPU engine with nnqueue's
worker class): the job fails with ``WeightsModified`` and the next job, of anyone, runs on the original weights,
whether the write went through the parameter's version counter or past it (``.data``, named in the code or
reached with ``getattr``); in a step shared by several traces each of them is to run again alone; a write made
while a trace is finished is that trace's. The first holds on an engine serving
CUDA-graph taps too (nnqueue.enginecore.taps: graphs keep the parameters' pointers, and the guard puts content back
in place)."""

from __future__ import annotations

import asyncio
import tempfile
from collections.abc import Awaitable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import pytest

from nnqueue import trace_payload
from nnqueue.engines.outbox import OutboxPoller
from nnqueue.engines.trace_report import TraceReport
from nnqueue.storage.results import load_result
from tests.utils.engines import InProcessEngine
from tests.utils.payloads import PROMPTS, PrebuiltBackend

if TYPE_CHECKING:
    import torch
    from nnsight.modeling.vllm import VLLM

T = TypeVar("T")


@pytest.fixture(scope="module")
def outbox(inprocess_engine: InProcessEngine) -> OutboxPoller:
    return OutboxPoller(inprocess_engine.model.vllm_entrypoint)


def run(engine: InProcessEngine, awaitable: Awaitable[T]) -> T:
    async def wrap() -> T:
        return await awaitable

    return engine.run(wrap())


async def run_prebuilt(engine: InProcessEngine, outbox: OutboxPoller, payload: bytes, trace_id: str) -> dict[str, Any]:
    from nnqueue.engines.prebuilt import to_requests  # imports vLLM: only when a test runs (fast collection)
    from nnqueue.engines.trace_runner import run_trace

    with tempfile.TemporaryDirectory() as directory:
        sinks = {name: {"kind": "handoff", "path": f"{directory}/{name}"} for name in ("torch", "safetensors")}
        requests = to_requests(trace_payload.decode(payload), trace_id)
        report = await run_trace(engine.model, requests, trace_id=trace_id, sinks=sinks, outbox=outbox)
        written = Path(sinks["torch"]["path"])
        return {"report": report, "saves": load_result(written.read_bytes()) if written.exists() else {}}


def logits_payload(client: VLLM) -> bytes:
    backend = PrebuiltBackend()
    with client.trace(PROMPTS[1], temperature=0.0, max_tokens=1, backend=backend):
        logits = client.logits.save()
    return backend.payload


def zeroing_payload(client: VLLM, **sampling: Any) -> bytes:
    """Zeroes the final norm's weight at the start of its step (what the issue's hostile trace did)."""
    backend = PrebuiltBackend()
    with client.trace(PROMPTS[0], temperature=0.0, backend=backend, **{"max_tokens": 1, **sampling}):
        client.model.norm.weight.zero_()
        logits = client.logits.save()
    return backend.payload


def clean(engine: InProcessEngine, outbox: OutboxPoller, client: VLLM, name: str) -> torch.Tensor:
    result = run(engine, run_prebuilt(engine, outbox, logits_payload(client), name))
    assert result["report"].error is None
    return result["saves"]["logits"]


def assert_weights_modified(report: TraceReport, says: str) -> None:
    assert report.error is not None, "the trace that changed the weights did not fail"
    assert report.error["type_name"] == "WeightsModified", report.error
    assert "model.norm.weight" in report.error["message"] and says in report.error["message"], report.error


@pytest.mark.parametrize("served", ["eager", "taps"])
def test_a_trace_that_zeroes_a_weight_fails_and_the_next_job_runs_on_the_original_weights(
    served: str,
    inprocess_engine: InProcessEngine,
    outbox: OutboxPoller,
    taps_engine: InProcessEngine,
    client_model: VLLM,
) -> None:
    import torch

    if served == "eager":
        engine = inprocess_engine
    else:
        engine, outbox = taps_engine, OutboxPoller(taps_engine.model.vllm_entrypoint)
    before = clean(engine, outbox, client_model, "guard-before")
    assert before.abs().sum() > 0
    zeroing = run(engine, run_prebuilt(engine, outbox, zeroing_payload(client_model), "guard-0"))
    assert_weights_modified(zeroing["report"], "this trace changed")
    after = clean(engine, outbox, client_model, "guard-after")
    assert torch.equal(after, before), "a later job ran on the changed weights"


def test_a_write_made_while_the_trace_is_finished_is_put_back(
    inprocess_engine: InProcessEngine, outbox: OutboxPoller, client_model: VLLM
) -> None:
    import torch

    before = clean(inprocess_engine, outbox, client_model, "guard-finish-before")
    backend = PrebuiltBackend()
    with client_model.trace(PROMPTS[0], temperature=0.0, max_tokens=1, backend=backend) as tracer:
        result = tracer.result  # served in the finish RPC, after the last step
        client_model.model.norm.weight.data.mul_(0.5)  # outside the step: not under inference mode
    finished = run(inprocess_engine, run_prebuilt(inprocess_engine, outbox, backend.payload, "guard-finish"))
    assert_weights_modified(finished["report"], "this trace changed")
    assert torch.equal(clean(inprocess_engine, outbox, client_model, "guard-finish-after"), before)


def test_in_a_step_shared_by_two_traces_both_are_to_run_again_alone(
    inprocess_engine: InProcessEngine, outbox: OutboxPoller, client_model: VLLM
) -> None:
    import torch

    before = clean(inprocess_engine, outbox, client_model, "guard-shared-before")
    backend = PrebuiltBackend()
    with client_model.trace(PROMPTS[1], temperature=0.0, max_tokens=24, ignore_eos=True, backend=backend):
        logits = client_model.logits.save()
    innocent = backend.payload
    writer = zeroing_payload(client_model)

    async def both() -> list[dict[str, Any]]:
        # The innocent trace decodes for many steps, so the writer, right behind it, shares a step with it.
        first = asyncio.ensure_future(run_prebuilt(inprocess_engine, outbox, innocent, "guard-innocent"))
        await asyncio.sleep(0.05)
        second = await run_prebuilt(inprocess_engine, outbox, writer, "guard-writer")
        return [await first, second]

    innocent_result, writer_result = run(inprocess_engine, both())
    for result in (innocent_result, writer_result):  # the worker runs each again alone (tests/workers)
        error = result["report"].error
        assert error is not None and error["type_name"] == "StateModifiedInSharedStep", error
        assert "model.norm.weight" in error["message"] and "runs again alone" in error["message"]
    assert torch.equal(clean(inprocess_engine, outbox, client_model, "guard-shared-after"), before)


def test_a_write_past_the_version_counter_in_a_step_fails_and_is_put_back(
    inprocess_engine: InProcessEngine, outbox: OutboxPoller, client_model: VLLM
) -> None:
    import torch

    before = clean(inprocess_engine, outbox, client_model, "guard-road-before")
    named, reached = PrebuiltBackend(), PrebuiltBackend()
    with client_model.trace(PROMPTS[0], temperature=0.0, max_tokens=1, backend=named):
        client_model.model.norm.weight.data.zero_()  # .data keeps a version counter of its own
        logits = client_model.logits.save()
    with client_model.trace(PROMPTS[0], temperature=0.0, max_tokens=1, backend=reached):
        getattr(client_model.model.norm.weight, "da" + "ta").mul_(0.5)  # the road reached at run time
        logits = client_model.logits.save()
    for index, payload in enumerate((named.payload, reached.payload)):
        result = run(inprocess_engine, run_prebuilt(inprocess_engine, outbox, payload, f"guard-road-{index}"))
        assert_weights_modified(result["report"], "this trace changed")
        after = clean(inprocess_engine, outbox, client_model, f"guard-road-after-{index}")
        assert torch.equal(after, before), "a later job ran on the changed weights"


def test_a_checkpoint_that_fails_inside_vllms_reload_leaves_the_weights_and_the_next_load_works(
    inprocess_engine: InProcessEngine, outbox: OutboxPoller, client_model: VLLM, tiny_model_path: Path, tmp_path: Path
) -> None:
    """A tensor of the wrong shape fails inside vLLM's in-place reload, which had moved every layer's parameters to
    the meta device (nnqueue.enginecore.weights_update): the load fails saying so, the layers get their tensors back
    and the guard their values, traces give the same logits, and the next load works (it used to fail on the
    parameters left on the meta device)."""
    import torch
    from safetensors.torch import load_file, save_file

    before = clean(inprocess_engine, outbox, client_model, "reload-before")
    norm = load_file(tiny_model_path / "model.safetensors")["model.norm.weight"]
    save_file({"model.norm.weight": torch.zeros(3)}, tmp_path / "bad.safetensors")
    save_file({"model.norm.weight": norm}, tmp_path / "good.safetensors")
    llm = inprocess_engine.model.vllm_entrypoint
    for name, expected in (("bad", "error"), ("good", "loaded")):
        answers = run(
            inprocess_engine,
            llm.collective_rpc("nnqueue_load_weights", args=([str(tmp_path / f"{name}.safetensors")], None)),
        )
        assert expected in answers[0] and answers[0].get("restored", True) is True, answers
        assert torch.equal(clean(inprocess_engine, outbox, client_model, f"reload-{name}"), before), name
    assert answers[0]["loaded"] == 1
