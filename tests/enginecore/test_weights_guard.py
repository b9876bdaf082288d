"""WeightsGuard (nnqueue.enginecore.weights_guard) puts back every way a trace can change a parameter, and only
what changed: the writes that go through a parameter's version counter (or replace its object or storage) without
reading the weights, the others with the content check, which the protected environment asks for wherever a
trace's code names the road they take; the cost of both checks on the CPU is printed."""

from __future__ import annotations

import time
from types import SimpleNamespace
from typing import TYPE_CHECKING

import pytest

from nnqueue.enginecore import protected

if TYPE_CHECKING:
    import torch


def tiny() -> torch.nn.Module:
    """A small model whose head is tied to its embedding, as many language models' are."""
    import torch

    class Tiny(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = torch.nn.Embedding(32, 8)
            self.norm = torch.nn.LayerNorm(8)
            self.head = torch.nn.Linear(8, 32, bias=False)
            self.head.weight = self.embed.weight  # tied, as many language models' are
            for parameter in self.parameters():
                parameter.requires_grad_(False)  # as vLLM's are

    return Tiny()


def state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in module.state_dict().items()}


def assert_as_before(module: torch.nn.Module, before: dict[str, torch.Tensor]) -> None:
    import torch

    now = module.state_dict()
    assert set(now) == set(before)
    for name, value in before.items():
        assert torch.equal(now[name], value), name


# Writes the version counters and the objects show: caught without reading the weights, as traces make them
# (inside torch.inference_mode) and outside it.
COUNTED_WRITES = {
    "in place": "m.norm.weight.zero_()",
    "setitem": "m.norm.weight[0:1] = 7.0",
    "through a view": "m.norm.weight.reshape(2, 4)[1].add_(1)",
    "through detach()": "m.norm.bias.detach().add_(1)",
    "one element of a tied weight": "m.head.weight[3, 1] = 1e-3",
    "out=": "torch.add(m.norm.weight, 1, out=m.norm.weight)",
    "copy_": "m.norm.weight.copy_(torch.zeros(8))",
    "torch.nn.init": "torch.nn.init.ones_(m.norm.bias)",
    "load_state_dict": "m.norm.load_state_dict({'weight': torch.zeros(8), 'bias': torch.zeros(8)})",
    ".data swapped": "setattr(m.norm.weight, 'data', torch.zeros(8))",
    "the parameter replaced": "setattr(m.norm, 'weight', torch.nn.Parameter(torch.zeros(8)))",
    "set_ on the parameter": "m.norm.weight.set_(torch.zeros(8))",
    "swap_tensors": "torch.utils.swap_tensors(m.norm.weight, torch.nn.Parameter(torch.zeros(8)))",
    "a permutation that keeps every sum": "m.embed.weight[[0, 1]] = m.embed.weight[[1, 0]].clone()",
}
# Writes past the version counter: the protected environment notes the road in the trace's code, and the
# step's check then reads the weights.
ROAD_WRITES = {
    "through .data": "m.norm.bias.data.add_(1)",
    "one element of a tied weight through .data": "m.head.weight.data[3, 1].fill_(1e-3)",
    "through its storage": "torch.tensor([], dtype=torch.float32).set_(m.norm.weight.untyped_storage()).fill_(2)",
    "another tensor set_ to it": "torch.empty(0).set_(m.norm.weight).add_(1)",
    "its storage filled": "m.norm.weight.untyped_storage().fill_(0)",
    "numpy": "numpy.add(m.norm.weight.numpy(), 1, out=m.norm.weight.numpy())",
    "DLPack": "torch.from_dlpack(m.norm.weight).add_(1)",
    "unsafe_split": "m.norm.weight.unsafe_split(4)[0].add_(1)",
    "a view as another dtype": "m.norm.weight.view(torch.int32).add_(1)",
    "an ATen op by name": "torch.ops.aten.set_.source_Tensor(torch.empty(0), m.norm.weight).add_(1)",
    "the descriptor": "torch.Tensor.data.__get__(m.norm.weight).add_(1)",
}


def write(module: torch.nn.Module, source: str) -> None:
    import numpy
    import torch

    with torch.inference_mode():  # where a trace's code runs
        exec(source, {"m": module, "torch": torch, "numpy": numpy})


@pytest.mark.parametrize("name", list(COUNTED_WRITES))
def test_a_counted_write_is_put_back_without_reading_the_weights(name: str) -> None:
    import torch

    from nnqueue.enginecore.weights_guard import WeightsGuard

    module = tiny()
    before = state(module)
    guard = WeightsGuard(module)
    assert guard.check(content=False) == []
    write(module, COUNTED_WRITES[name])
    changed = guard.check(content=False)
    assert changed and all(name.startswith(("norm.", "embed.", "head.")) for name in changed), changed
    assert_as_before(module, before)
    assert guard.check() == []  # put back for good: the next check, reading the weights, finds nothing
    out = module.head(module.norm(module.embed(torch.tensor([1, 2]))))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("name", list(ROAD_WRITES))
def test_a_write_past_the_version_counter_is_noted_and_put_back_by_the_content_check(name: str) -> None:
    from nnqueue.enginecore.weights_guard import WeightsGuard

    source = ROAD_WRITES[name]
    assert protected.check_code(compile(source, "<trace>", "exec")), f"the protected environment misses {source}"
    module = tiny()
    before = state(module)
    guard = WeightsGuard(module)
    write(module, source)
    changed = guard.check(content=True)
    assert changed, f"{source} was not seen"
    assert_as_before(module, before)
    assert guard.check() == []


def test_a_write_that_keeps_every_element_is_not_a_change() -> None:
    """vLLM's own writes (or a trace's) that leave the values as they were fail nobody."""
    from nnqueue.enginecore.weights_guard import WeightsGuard

    module = tiny()
    guard = WeightsGuard(module)
    write(module, "m.norm.weight.copy_(m.norm.weight.clone())")
    assert guard.check(content=False) == []
    assert guard.check(content=False) == []  # the new count is taken as the reference


def test_code_that_names_no_road_is_not_noted() -> None:
    source = "m.model.layers[0].output[0][:] = 0\nsaved = m.logits.save()\nx = m.norm.weight.sum().item()"
    assert not protected.check_code(compile(source, "<trace>", "exec"))


def test_a_road_reached_through_getattr_or_import_is_noted() -> None:
    import torch

    protected.take_roads_reached()
    protected.guarded_getattr(torch.zeros(1), "shape")
    assert not protected.take_roads_reached()
    protected.guarded_getattr(torch.zeros(1), "da" + "ta")
    assert protected.take_roads_reached()
    protected.guarded_import("numpy")
    assert protected.take_roads_reached()
    assert not protected.take_roads_reached()  # taken once


def test_accept_current_takes_a_legitimate_update_for_the_reference() -> None:
    import torch

    from nnqueue.enginecore.weights_guard import WeightsGuard

    module = tiny()
    guard = WeightsGuard(module)
    with torch.no_grad():
        module.norm.weight.fill_(3.0)
    guard.accept_current()
    assert guard.check() == [] and guard.check(content=False) == []
    assert torch.equal(module.norm.weight, torch.full((8,), 3.0))
    module.norm.weight.data.zero_()
    assert guard.check() == ["norm.weight"]
    assert torch.equal(module.norm.weight, torch.full((8,), 3.0))  # put back to the accepted weights


def test_only_the_changed_parameters_are_named() -> None:
    from nnqueue.enginecore.weights_guard import WeightsGuard

    module = tiny()
    guard = WeightsGuard(module)
    module.norm.bias.data[0] += 1
    assert guard.check() == ["norm.bias"]


def test_gradients_and_requires_grad_left_by_a_job_are_dropped() -> None:
    import torch

    from nnqueue.enginecore.weights_guard import WeightsGuard

    module = tiny()
    guard = WeightsGuard(module)
    module.norm.weight.requires_grad_(True)
    module.norm(torch.ones(2, 8)).sum().backward()
    assert module.norm.weight.grad is not None
    assert guard.check() == []
    assert module.norm.weight.grad is None and not module.norm.weight.requires_grad


def test_the_error_says_whether_the_job_is_known_to_have_written() -> None:
    from nnqueue.enginecore.weights_guard import Verified, error, shared_error

    alone = error(["model.norm.weight"], [])
    state = error([], ["model.norm"])
    shared = shared_error(Verified(["model.norm.weight"]), 3)
    assert (alone["type_name"], state["type_name"]) == ("WeightsModified", "StateModified")
    assert shared["type_name"] == "StateModifiedInSharedStep"
    assert "this trace changed the model's parameters (model.norm.weight)" in alone["message"]
    assert "this trace changed the engine's state (model.norm)" in state["message"]
    assert "2 other trace(s)" in shared["message"] and "runs again alone" in shared["message"]


def test_cost_of_a_check_on_the_cpu() -> None:
    """About 135M float32 parameters (SmolLM2-135M's count) in 30 tensors: the time of a clean check, with and
    without reading the weights."""
    import torch

    from nnqueue.enginecore.weights_guard import WeightsGuard

    module = torch.nn.ModuleList([torch.nn.Linear(2048, 2200, bias=False) for _ in range(30)])
    start = time.perf_counter()
    guard = WeightsGuard(module)
    built = time.perf_counter() - start
    runs: dict[bool, list[float]] = {True: [], False: []}
    for content in (True, False) * 5:
        start = time.perf_counter()
        assert guard.check(content=content) == []
        runs[content].append(time.perf_counter() - start)
    gib = guard.bytes / 2**30
    full, cheap = min(runs[True]), min(runs[False])
    print(
        f"\nweights guard on the CPU: {gib:.2f} GiB, built in {built * 1000:.0f} ms, content check "
        f"{full * 1000:.1f} ms ({gib / full:.1f} GiB/s), version check {cheap * 1e6:.0f} us"
    )
    assert full < 10.0
    assert cheap < full / 10


class Runner:
    """What `WeightsGuardWorker` reads of nnsight's model runner: the model and the runner's requests."""

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        self.nnsight_requests = SimpleNamespace(requests={})

    def get_model(self) -> torch.nn.Module:
        return self.module


def test_a_write_no_trace_named_is_put_back_by_the_periodic_full_check(monkeypatch: pytest.MonkeyPatch) -> None:
    """An alias made by an earlier trace and written by an unmarked one: the version counter misses it, the
    periodic full check puts it back and fails that step's traces."""
    import torch

    from nnqueue.enginecore.weights_guard import WeightsGuardWorker

    monkeypatch.setattr(protected, "_done", [True])  # as in an engine: roads are noted
    module = tiny()
    before = state(module)
    worker = WeightsGuardWorker()
    worker.model_runner = Runner(module)
    worker._nnqueue_build_guard()
    protected.take_roads_reached()
    alias = module.norm.weight.data  # left behind by an earlier trace
    traced = SimpleNamespace(mediator=SimpleNamespace(), error=None, engine_id="job-1-0")
    alias.add_(1)
    worker._nnqueue_traced = (traced,)
    worker._nnqueue_step_ended()
    assert traced.error is None and not torch.equal(module.norm.weight, before["norm.weight"])  # not seen yet
    worker._nnqueue_full_check_at = 0.0  # the period is over
    worker._nnqueue_traced = (traced,)
    worker._nnqueue_step_ended()
    assert traced.error is not None and traced.error["type_name"] == "WeightsModified"
    assert_as_before(module, before)


def test_a_step_of_a_marked_trace_reads_the_weights(monkeypatch: pytest.MonkeyPatch) -> None:
    from nnqueue.enginecore.weights_guard import WeightsGuardWorker

    monkeypatch.setattr(protected, "_done", [True])
    module = tiny()
    before = state(module)
    worker = WeightsGuardWorker()
    worker.model_runner = Runner(module)
    worker._nnqueue_build_guard()
    protected.take_roads_reached()
    module.norm.bias.data.add_(1)  # what a trace whose code names .data does
    traced = SimpleNamespace(mediator=SimpleNamespace(nnqueue_roads=True), error=None, engine_id="job-2-0")
    worker._nnqueue_traced = (traced,)
    worker._nnqueue_step_ended()
    assert traced.error is not None and "this trace changed" in traced.error["message"]
    assert_as_before(module, before)
