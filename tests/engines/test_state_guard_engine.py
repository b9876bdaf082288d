"""Issue 33's silent changes of other users' results, on the CPU engine with nnqueue's worker class: each trace that
made them fails (``StateModified``/``WeightsModified``), what it changed is put back before any other step, and
the next job, of anyone, gets the results of an untouched engine (nnqueue.enginecore.state_guard,
weights_guard).

Without an escape, on the shared engine (the protected environment on): a plain attribute, a buffer, a hook left
behind. After an escape, on an engine without the protected environment (what a trace that escaped has, as in
the issue): the result writer wrapped, and the weights guard's check replaced with a weight zeroed."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from tests.utils.engines import InProcessEngine, run, run_prebuilt, running_engine
from tests.utils.payloads import PROMPTS, PrebuiltBackend
from tests.utils.tiny_model import TINY_ENGINE_KWARGS

if TYPE_CHECKING:
    import torch
    from nnsight.modeling.vllm import VLLM


@pytest.fixture(scope="module")
def unprotected_engine(tiny_model_path: Path) -> Iterator[InProcessEngine]:
    """An engine whose traces run without the protected environment: what a trace that escaped it can do."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setitem(os.environ, "NNQUEUE_PROTECTED_ENVIRONMENT", "false")
        with running_engine(tiny_model_path, **TINY_ENGINE_KWARGS) as engine:
            yield engine


def innocent(engine: InProcessEngine, client: VLLM, tmp_path: Path, name: str) -> torch.Tensor:
    """The innocent user's job: the logits of three decoded tokens (a hook or an attribute changes them)."""
    import torch

    backend = PrebuiltBackend()
    with client.trace(PROMPTS[1], temperature=0.0, max_tokens=3, ignore_eos=True, backend=backend) as tracer:
        logits = list().save()
        for _ in tracer.iter[:]:
            logits.append(client.logits)
    report, saves = run_prebuilt(engine, backend.payload, tmp_path, name)
    assert report.error is None, report.error
    return torch.stack(saves["logits"])


def plain_attribute(client: VLLM) -> bytes:
    backend = PrebuiltBackend()
    with client.trace(PROMPTS[0], temperature=0.0, max_tokens=1, backend=backend):
        client.model.norm._module.variance_epsilon = 1e4
        logits = client.logits.save()
    return backend.payload


def buffer(client: VLLM) -> bytes:
    backend = PrebuiltBackend()
    with client.trace(PROMPTS[0], temperature=0.0, max_tokens=1, backend=backend):
        client.model.layers[0].self_attn.rotary_emb.cos_sin_cache.mul_(0.0)
        logits = client.logits.save()
    return backend.payload


def hook(client: VLLM) -> bytes:
    backend = PrebuiltBackend()
    with client.trace(PROMPTS[0], temperature=0.0, max_tokens=1, backend=backend):

        def halve(module: Any, args: Any, output: Any) -> None:  # in place, for every later forward
            output[0].mul_(0.5)  # vLLM's final norm returns (hidden states, residual)

        client.model.norm.register_forward_hook(halve)
        logits = client.logits.save()
    return backend.payload


def torch_mode(client: VLLM) -> bytes:
    """A red-team round's finding: a torch function mode entered and left active sees every later torch call on the
    engine's thread (here it scales every float result: the next jobs' logits change)."""
    backend = PrebuiltBackend()
    with client.trace(PROMPTS[0], temperature=0.0, max_tokens=1, backend=backend):
        import torch as t

        class Scale(t.overrides.TorchFunctionMode):
            def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
                result = func(*args, **(kwargs or {}))
                return result * 1.25 if isinstance(result, t.Tensor) and result.is_floating_point() else result

        Scale().__enter__()
        logits = client.logits.save()
    return backend.payload


def seed(client: VLLM) -> bytes:
    """A red-team round's finding: a seed set in a trace outlived it, and the later jobs' sampling without a seed of
    their own drew from a sequence the trace knew."""
    backend = PrebuiltBackend()
    with client.trace(PROMPTS[0], temperature=0.0, max_tokens=1, backend=backend):
        import torch as t

        t.manual_seed(1234)
        logits = client.logits.save()
    return backend.payload


def matmul_precision(client: VLLM) -> bytes:
    """A red-team round's finding: torch's global settings outlive the trace: a float32 model's later matmuls in TF32
    (GPUs) or bfloat16 (CPUs with AMX); deterministic algorithms would fail later steps whose ops have none."""
    backend = PrebuiltBackend()
    with client.trace(PROMPTS[0], temperature=0.0, max_tokens=1, backend=backend):
        import torch as t

        t.set_float32_matmul_precision("medium")
        t.use_deterministic_algorithms(True)
        logits = client.logits.save()
    return backend.payload


def interleaver_handle(client: VLLM) -> bytes:
    """The second red-team round (E2): a function bound over the engine's interleaver's ``handle`` sees every module
    of every later request, other domains' too (it halved their final norm's output)."""
    backend = PrebuiltBackend()
    with client.trace(PROMPTS[0], temperature=0.0, max_tokens=1, backend=backend):
        interleaver = client.interleaver
        original = interleaver.handle

        def handle(provider: str, value: Any) -> Any:
            out = original(provider, value)
            if provider.endswith("norm.output") and "layers" not in provider:
                return (out[0] * 0.5, *out[1:])
            return out

        interleaver.handle = handle
        logits = client.logits.save()
    return backend.payload


def tokenizer_attribute(client: VLLM) -> bytes:
    """A third red-team round (E10): a function left on the engine's tokenizer, which every request shares and the
    engine calls after every step (``eos_token_id``), ran in every later step of every domain."""
    backend = PrebuiltBackend()
    with client.trace(PROMPTS[0], temperature=0.0, max_tokens=1, backend=backend):
        tokenizer = client.tokenizer
        original = tokenizer.convert_tokens_to_ids

        def convert(*args: Any, **kwargs: Any) -> Any:
            return original(*args, **kwargs)

        tokenizer.convert_tokens_to_ids = convert
        logits = client.logits.save()
    return backend.payload


def tokenizer_class(client: VLLM) -> bytes:
    """A fourth red-team round (E19): the same function on the tokenizer's class (vLLM's ``CachedTokenizer``), which
    the third round's fix (the tokenizer's own attributes) did not hold: it read and zeroed later domains' KV cache."""
    backend = PrebuiltBackend()
    with client.trace(PROMPTS[0], temperature=0.0, max_tokens=1, backend=backend):
        cls = type(client.tokenizer)
        original = cls.convert_tokens_to_ids

        def convert(self: Any, *args: Any, **kwargs: Any) -> Any:
            return original(self, *args, **kwargs)

        cls.convert_tokens_to_ids = convert
        logits = client.logits.save()
    return backend.payload


def logger_class(client: VLLM) -> bytes:
    """A fourth red-team round (E20): a method on ``logging.Logger``, a library logger's class reached from an allowed
    module, runs at every log line of the engine, a trust-domain switch's own included."""
    backend = PrebuiltBackend()
    with client.trace(PROMPTS[0], temperature=0.0, max_tokens=1, backend=backend):
        import torch as t

        cls = type(t.autograd.graph.log)
        original = cls.handle

        def handle(self: Any, record: Any) -> Any:
            return original(self, record)

        cls.handle = handle
        logits = client.logits.save()
    return backend.payload


def reducer(client: VLLM) -> bytes:
    """The second red-team round (E3): a reducer for tensors in copyreg's dispatch table, which the result writers'
    pickling consults for every later result (it zeroed them, digests valid)."""
    backend = PrebuiltBackend()
    with client.trace(PROMPTS[0], temperature=0.0, max_tokens=1, backend=backend):
        import copy

        import torch as t

        copy.dispatch_table[t.Tensor] = lambda tensor: (t.zeros, (tuple(tensor.shape),))
        logits = client.logits.save()
    return backend.payload


@pytest.mark.parametrize(
    ("hostile", "named"),
    [
        (plain_attribute, "model.norm"),
        (interleaver_handle, "VLLMInterleaver (the engine's)"),
        (tokenizer_attribute, "Tokenizer (the engine's)"),
        (tokenizer_class, "CachedTokenizer"),
        (logger_class, "class logging.Logger"),
        (reducer, "copyreg.dispatch_table"),
        (buffer, "model.layers.0.self_attn.rotary_emb.cos_sin_cache (buffer)"),
        (hook, "model.norm._forward_hooks"),
        (torch_mode, "torch's function and dispatch modes on the engine's thread"),
        (seed, "torch's random seed (torch.manual_seed"),
        (matmul_precision, "torch's global settings (float32_matmul_precision, cuda.matmul.allow_tf32, deterministic"),
    ],
)
def test_a_change_without_escape_fails_its_trace_and_the_next_job_is_untouched(
    inprocess_engine: InProcessEngine, client_model: VLLM, tmp_path: Path, hostile: Any, named: str
) -> None:
    import torch

    before = innocent(inprocess_engine, client_model, tmp_path, "before")
    report, _ = run_prebuilt(inprocess_engine, hostile(client_model), tmp_path, "hostile")
    assert report.error is not None and report.error["type_name"] == "StateModified", report.error
    assert named in report.error["message"]
    for attempt in range(2):  # the next jobs: as on an untouched engine
        assert torch.equal(innocent(inprocess_engine, client_model, tmp_path, f"after-{attempt}"), before)


def test_after_an_escape_the_result_writer_wrapped_is_put_back(
    unprotected_engine: InProcessEngine, client_model: VLLM, tmp_path: Path
) -> None:
    import torch

    before = innocent(unprotected_engine, client_model, tmp_path, "before")

    backend = PrebuiltBackend()
    with client_model.trace(PROMPTS[0], temperature=0.0, max_tokens=1, backend=backend):
        from nnsight.util import from_import_path

        results = from_import_path("nnqueue.enginecore.trace_results")
        original = results.write_saves
        results.write_saves = lambda saves, sinks: original({name: 42.0 for name in saves}, sinks)
        logits = client_model.logits.save()
    report, _ = run_prebuilt(unprotected_engine, backend.payload, tmp_path, "hostile")
    assert report.error is not None and report.error["type_name"] == "StateModified", report.error
    assert "nnqueue.enginecore.trace_results (globals)" in report.error["message"]
    after = innocent(unprotected_engine, client_model, tmp_path, "after")  # its saves were not rewritten to 42.0
    assert torch.equal(after, before)


def test_after_an_escape_a_replaced_weights_check_and_a_zeroed_weight_are_both_put_back(
    unprotected_engine: InProcessEngine, client_model: VLLM, tmp_path: Path
) -> None:
    import torch

    before = innocent(unprotected_engine, client_model, tmp_path, "before")

    backend = PrebuiltBackend()
    with client_model.trace(PROMPTS[0], temperature=0.0, max_tokens=1, backend=backend):
        from nnsight.util import from_import_path

        guard = from_import_path("nnqueue.enginecore.weights_guard.WeightsGuard")
        guard.check = lambda self, content=True: []
        client_model.model.norm.weight.zero_()
        logits = client_model.logits.save()
    report, _ = run_prebuilt(unprotected_engine, backend.payload, tmp_path, "hostile")
    assert report.error is not None and report.error["type_name"] == "WeightsModified", report.error
    message = report.error["message"]
    assert "model.norm.weight" in message and "class nnqueue.enginecore.weights_guard.WeightsGuard" in message
    for attempt in range(2):
        assert torch.equal(innocent(unprotected_engine, client_model, tmp_path, f"after-{attempt}"), before)


def engine_seed(engine: InProcessEngine, client: VLLM, tmp_path: Path, name: str) -> int:
    """The seed of the engine's default CPU generator, as a trace reads it."""
    backend = PrebuiltBackend()
    with client.trace(PROMPTS[0], temperature=0.0, max_tokens=1, backend=backend):
        import torch as t

        seed = t.tensor(t.initial_seed()).save()
    report, saves = run_prebuilt(engine, backend.payload, tmp_path, name)
    assert report.error is None, report.error
    return int(saves["seed"])


def test_a_trust_domain_switch_seeds_the_generators_afresh(
    inprocess_engine: InProcessEngine, client_model: VLLM, tmp_path: Path
) -> None:
    """What the worker's switch calls (``nnqueue_verify_state`` with one fresh seed for every rank): a domain before
    could read the seed and restart its sequence, which no check sees; the next domain's draws are unknown to it."""
    started = engine_seed(inprocess_engine, client_model, tmp_path, "before")
    switch = inprocess_engine.model.vllm_entrypoint.collective_rpc
    [answer] = run(inprocess_engine, switch("nnqueue_verify_state", args=(4321,)))
    assert answer == {"weights": [], "state": [], "lazy": [], "zeroed": answer["zeroed"]}
    assert engine_seed(inprocess_engine, client_model, tmp_path, "after") == 4321 != started
    run(inprocess_engine, switch("nnqueue_verify_state", args=(started,)))  # as the module's other tests found it
