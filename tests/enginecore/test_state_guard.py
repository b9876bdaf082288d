"""The state guard (nnqueue.enginecore.state_guard) on a module in this process, with the engine's own code: each
change a trace made in issue 33 (a plain attribute, a hook left behind, the result writer wrapped, the weights
guard's check replaced, the audit hook's events emptied) is found, named and put back; the engine's own lazy
work is not blamed; the worker mixin fails a trace alone in its step and has traces that shared it run again."""

from __future__ import annotations

import importlib
import sys
import time
import types
from collections.abc import Iterator
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import pytest

from nnqueue.enginecore import protected

if TYPE_CHECKING:
    import torch

    from nnqueue.enginecore.state_guard import StateGuard


@pytest.fixture
def model() -> torch.nn.Module:
    """A small module with a buffer and plain attributes (a number, a list)."""
    import torch

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.norm = torch.nn.LayerNorm(8)
            self.head = torch.nn.Linear(8, 4)
            self.register_buffer("cache", torch.arange(8.0), persistent=False)
            self.scale = 0.5
            self.sizes = [8, 4]

    return Tiny()


@pytest.fixture
def guard(model: torch.nn.Module) -> Iterator[StateGuard]:
    from nnqueue.enginecore.state_guard import StateGuard

    # The guard holds what is loaded when it is made: nnsight, as an engine has it, and the engine's modules these
    # tests change (which collecting the tests does not load).
    for name in ("nnsight", "nnqueue.enginecore.trace_results", "nnqueue.enginecore.weights_guard"):
        importlib.import_module(name)
    guard = StateGuard(model)
    yield guard
    guard.check()  # whatever a failed test left is put back for the next


def test_an_unchanged_state_passes_and_a_check_is_cheap(guard: StateGuard) -> None:
    assert not guard.check()
    start = time.perf_counter()
    for _ in range(10):
        assert not guard.check()
    entries = len(guard._saved.items)
    print(f"state check: {(time.perf_counter() - start) / 10 * 1e3:.2f} ms for {entries} entries")
    assert entries > 10_000  # the engine's code is held, not only the module


def test_a_rebound_attribute_is_put_back(model: torch.nn.Module, guard: StateGuard) -> None:
    epsilon, scale = model.norm.eps, model.scale
    model.norm.eps = 1e4  # issue 33: model.model.norm._module.variance_epsilon = 1e4
    model.scale = 2.0
    model.sizes[0] = 9
    found = guard.check()
    assert {"norm", "model", "model.sizes"} <= set(found.strict) and not found.lazy, found
    assert (model.norm.eps, model.scale, model.sizes) == (epsilon, scale, [8, 4])


def test_hooks_left_behind_are_removed(model: torch.nn.Module, guard: StateGuard) -> None:
    import torch

    calls: list[int] = []
    model.norm.register_forward_hook(lambda *_: calls.append(1))
    torch.nn.modules.module.register_module_forward_pre_hook(lambda *_: calls.append(2))
    found = guard.check()
    assert "norm._forward_hooks" in found.strict, found
    assert "torch.nn.modules.module._global_forward_pre_hooks" in found.strict, found
    model.head(model.norm(torch.zeros(1, 8)))
    assert calls == []


def test_torch_modes_left_active_are_put_back(model: torch.nn.Module, guard: StateGuard) -> None:
    """A red-team round's finding: a ``TorchFunctionMode`` entered and left active in a trace saw every later torch
    call on the engine's thread, other owners' steps included (it rewrote their logits and collected their token
    ids), and ``torch.device("meta")`` entered so broke the next step. The guard held neither."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from nnqueue.enginecore import state_guard

    seen: list[str] = []

    class Spy(TorchFunctionMode):
        def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            seen.append(getattr(func, "__name__", "?"))
            return func(*args, **(kwargs or {}))

    class Doubler(TorchDispatchMode):
        def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
            return func(*args, **(kwargs or {})) * 2

    expected = model.head(torch.ones(1, 8))
    Spy().__enter__()
    torch.device("meta").__enter__()
    Doubler().__enter__()
    found = guard.check()
    assert found.strict == [state_guard._MODES], found
    assert (torch._C._len_torch_function_stack(), torch._C._len_torch_dispatch_stack()) == (0, 0)
    seen.clear()
    after = model.head(torch.ones(1, 8))
    assert after.device.type == "cpu" and torch.equal(after, expected) and seen == []
    assert not guard.check()


def test_a_seed_the_warnings_filters_and_nnsights_configuration_are_put_back(guard: StateGuard) -> None:
    """The red-team round's lesser findings on an in-process engine: ``torch.manual_seed(1234)`` in a trace made
    later jobs' sampling without a seed of their own predictable; ``warnings.simplefilter("error")`` and
    ``nnsight.CONFIG.APP.DEBUG`` outlived the step. A trust-domain switch seeds the generators afresh."""
    import warnings

    import nnsight
    import torch

    from nnqueue.enginecore import state_guard

    guard.accept_current()  # with nnsight loaded
    seed, debug, filters = torch.initial_seed(), nnsight.CONFIG.APP.DEBUG, list(warnings.filters)
    torch.manual_seed(1234)
    warnings.simplefilter("error")
    nnsight.CONFIG.APP.DEBUG = not debug
    found = guard.check()
    assert state_guard._SEEDS in found.strict and "nnsight.CONFIG.APP" in found.strict, found
    assert "warnings.filters" in found.lazy, found
    assert (torch.initial_seed(), nnsight.CONFIG.APP.DEBUG, warnings.filters) == (seed, debug, filters)
    with pytest.warns(UserWarning):
        warnings.warn("a warning, not an error, once the filter is gone", stacklevel=1)

    guard.reseed(99)  # a domain switch's fresh seed becomes the reference
    assert torch.initial_seed() == 99 and not guard.check()
    guard.reseed(seed)


def test_torch_settings_that_change_other_jobs_numbers_are_put_back(guard: StateGuard) -> None:
    """Settings a trace can change without an escape, which no module attribute holds: a float32 model's matmuls in
    TF32 or bfloat16, deterministic algorithms (later steps whose ops have none raise), autocast left on (every later
    op recast), the default dtype; flush-to-zero of denormals (no getter) is set back on every check."""
    import torch

    before = (torch.get_float32_matmul_precision(), torch.are_deterministic_algorithms_enabled())
    torch.set_float32_matmul_precision("medium")
    torch.use_deterministic_algorithms(True)
    torch.set_autocast_enabled("cpu", True)
    torch.set_default_dtype(torch.float64)
    changes = guard.check()
    assert len(changes.strict) == 1 and changes.strict[0].startswith("torch's global settings (")
    for name in ("float32_matmul_precision", "deterministic_algorithms", "default_dtype", "autocast"):
        assert name in changes.strict[0]
    assert (torch.get_float32_matmul_precision(), torch.are_deterministic_algorithms_enabled()) == before
    assert not torch.is_autocast_enabled("cpu") and torch.get_default_dtype() is torch.float32
    if torch.set_flush_denormal(True):  # False where the CPU cannot
        assert torch.tensor([1e-39]).item() == 0.0
        assert not guard.check()
        assert torch.tensor([1e-39]).item() != 0.0


def test_a_replaced_class_method_and_a_swapped_class_are_put_back(model: torch.nn.Module, guard: StateGuard) -> None:
    import torch

    forward = torch.nn.LayerNorm.forward
    torch.nn.LayerNorm.forward = lambda self, x: x * 0  # type: ignore[method-assign]
    model.norm.__class__ = type("Evil", (torch.nn.LayerNorm,), {})
    found = guard.check()
    assert "class torch.nn.modules.normalization.LayerNorm" in found.strict, found
    assert torch.nn.LayerNorm.forward is forward and type(model.norm) is torch.nn.LayerNorm


def test_the_engines_own_code_is_put_back(guard: StateGuard) -> None:
    """What issue 33's trace did once it had escaped: the result writer wrapped, the weights guard's check replaced,
    the audit hook told to watch nothing, the protected builtins given ``open``, its switch set on this thread."""
    import torch

    from nnqueue.enginecore import state_guard, trace_results
    from nnqueue.enginecore.weights_guard import WeightsGuard

    write_saves, check, events = trace_results.write_saves, WeightsGuard.check, protected._WATCHED_EVENTS
    try:
        trace_results.write_saves = lambda saves, sinks: write_saves({"x": torch.tensor(42.0)}, sinks)
        WeightsGuard.check = lambda self, content=True: []  # type: ignore[method-assign]
        protected._WATCHED_EVENTS = frozenset()
        protected.SAFE_BUILTINS["open"] = open
        protected._auditing.active = True
        found = guard.check()
    finally:
        protected._auditing.active = False
    assert {
        "nnqueue.enginecore.trace_results (globals)",
        "class nnqueue.enginecore.weights_guard.WeightsGuard",
        "nnqueue.enginecore.protected (globals)",
        "nnqueue.enginecore.protected.SAFE_BUILTINS",
        state_guard._SWITCHES,
    } <= set(found.strict), found
    assert trace_results.write_saves is write_saves and WeightsGuard.check is check
    assert protected._WATCHED_EVENTS is events and "open" not in protected.SAFE_BUILTINS
    assert not getattr(protected._auditing, "active", False)


def test_the_interpreters_and_nnsights_own_lazy_work_is_not_blamed(model: torch.nn.Module, guard: StateGuard) -> None:
    import torch
    from nnsight import NNsight
    from nnsight.intervention import source
    from nnsight.intervention.serialization import dumps

    envoys = NNsight(model)  # as the engine's model is, before the reference
    guard.accept_current()
    package = sys.modules["nnqueue.enginecore"]
    module = types.ModuleType("nnqueue.enginecore._imported_meanwhile")
    sys.modules[module.__name__] = module
    try:
        package._imported_meanwhile = module  # type: ignore[attr-defined]  # as the import system does
        torch.nn.Linear.__slotnames__ = []  # type: ignore[attr-defined]  # as copyreg does
        source.FORWARD_CACHE[compile("0", "<x>", "eval")] = None  # type: ignore[index]  # a module's .source
        dumps(envoys)  # a result holding envoys (a tracer.cache() view): nnsight tags every module
        assert model.norm.__dict__["_persistent_id"] == "Module:model.norm"
        found = guard.check()
        model.norm._persistent_id = "Interleaver"  # type: ignore[assignment]  # not nnsight's tag for a module
        assert guard.check().strict == ["norm"]
    finally:
        del sys.modules[module.__name__]
    assert found.strict == [] and found.lazy == ["nnsight.intervention.source.FORWARD_CACHE"], found
    assert package._imported_meanwhile is module  # type: ignore[attr-defined]  # kept: the import system's
    del package._imported_meanwhile  # type: ignore[attr-defined]
    guard.accept_current()


def test_buffers_and_tensor_attributes_are_kept_as_parameters_are(model: torch.nn.Module) -> None:
    import torch

    from nnqueue.enginecore.weights_guard import WeightsGuard

    model.lookup = torch.ones(3)  # a tensor held as a plain attribute (an attention layer's scales)
    tensors = WeightsGuard(model)
    before = model.cache.clone()
    model.cache.mul_(0.0)  # issue 33: rotary_emb.cos_sin_cache.mul_(0.0)
    model.lookup.add_(1.0)
    assert tensors.check() == ["cache (buffer)", "lookup (attribute)"]
    assert torch.equal(model.cache, before) and torch.equal(model.lookup, torch.ones(3))


def request(trace: str) -> Any:
    return SimpleNamespace(engine_id=f"{trace}-0", error=None, mediator=SimpleNamespace())


def test_a_trace_alone_fails_for_a_change_and_traces_sharing_a_step_run_again() -> None:
    from nnqueue.enginecore import weights_guard
    from nnqueue.enginecore.weights_guard import Verified, fail_step

    alone = [request("job-a"), request("job-a")]  # two invokes of one trace
    fail_step(alone, Verified(state=["model.norm"]))
    assert [each.error["type_name"] for each in alone] == ["StateModified", "StateModified"]
    lazy = [request("job-b")]
    fail_step(lazy, Verified(lazy=["model.layers.0.mlp.__nnsight__ (slots)"]))  # its .source: not its fault
    assert lazy[0].error is None
    shared = [request("job-c"), request("job-d")]
    fail_step(shared, Verified(lazy=["nnsight.intervention.source.FORWARD_CACHE"]))
    assert {each.error["type_name"] for each in shared} == {weights_guard.SHARED_STEP_ERROR}


def test_a_reducer_a_trace_registers_is_removed_and_a_librarys_is_kept(guard: StateGuard) -> None:
    """Red team, issue 33 (E3, E7): ``copy.dispatch_table[torch.Tensor] = f`` made every later ``torch.save`` of a
    result, other domains' too, call the trace's function (it read and replaced them); so did a class in its place
    (a class's ``__new__`` is a reducer too), and a library's class would break every later result. A library
    imported during a step registers its own reducers for its own types, which stay."""
    import copy
    import copyreg

    import torch

    class Reducer:  # what a trace could make
        def __new__(cls, tensor: torch.Tensor) -> Any:
            return (torch.zeros, (tuple(tensor.shape),))

    for reducer in (lambda tensor: (torch.zeros, (tuple(tensor.shape),)), Reducer, list):
        copy.dispatch_table[torch.Tensor] = reducer
        found = guard.check()
        assert found.strict == ["copyreg.dispatch_table"], (reducer, found)
        assert torch.Tensor not in copyreg.dispatch_table

    imported = sys.modules.pop("fractions", None)  # imported afresh below, as a library a step first imports
    guard.accept_current()
    try:
        fractions = importlib.import_module("fractions")
        copyreg.dispatch_table[fractions.Fraction] = Reducer  # a new type, but the trace's class (its __new__)
        assert guard.check().strict == ["copyreg.dispatch_table"]
        copyreg.pickle(fractions.Fraction, fractions.Fraction.__reduce__)  # its own type, its own function: kept
        assert not guard.check()
        assert fractions.Fraction in copyreg.dispatch_table
    finally:
        copyreg.dispatch_table.pop(sys.modules["fractions"].Fraction, None)
        if imported is not None:
            sys.modules["fractions"] = imported
        guard.accept_current()


def test_an_object_the_engine_rebinds_keeps_its_attributes_and_their_kinds(model: torch.nn.Module) -> None:
    """Red team, issue 33 (E2): ``client.interleaver.handle = f`` (an instance attribute over nnsight's method) ran
    the trace's function at every module of every later request, other domains' too, and a stash attribute carried
    what it read to the trace's next job. The engine's interleaver keeps its attribute names, the types of what each
    step rebinds and the identity of the rest."""
    from nnsight.intervention.interleaver import Interleaver

    from nnqueue.enginecore.state_guard import StateGuard

    interleaver = Interleaver()
    guard = StateGuard(model, shaped=(interleaver,))
    interleaver.mediators = [object()]  # what a step does: rebound, same kinds
    interleaver.busy = True
    interleaver._persistent_id = "Interleaver"  # nnsight's serializer, pickling a result that holds envoys
    assert not guard.check()

    handle = interleaver.handle
    interleaver.handle = lambda provider, value: value
    interleaver.stash = []
    interleaver.counts = type("Counts", (dict,), {})()
    found = guard.check()
    assert found.strict == ["nnsight.intervention.interleaver.Interleaver (the engine's)"], found
    assert "handle" not in vars(interleaver) and "stash" not in vars(interleaver)
    assert interleaver.handle == handle and type(interleaver.counts) is dict
    assert not guard.check()
