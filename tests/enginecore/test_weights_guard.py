"""WeightsGuard (nnqueue.enginecore.weights_guard) puts back every way a trace can change a parameter, and only
what changed; its cost on the CPU is printed (one read of the weights per check)."""

from __future__ import annotations

import time

import pytest
import torch

from nnqueue.enginecore.weights_guard import WeightsGuard, error


class Tiny(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(32, 8)
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 32, bias=False)
        self.head.weight = self.embed.weight  # tied, as many language models' are
        for parameter in self.parameters():
            parameter.requires_grad_(False)  # as vLLM's are


def state(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in module.state_dict().items()}


def assert_as_before(module: torch.nn.Module, before: dict[str, torch.Tensor]) -> None:
    now = module.state_dict()
    assert set(now) == set(before)
    for name, value in before.items():
        assert torch.equal(now[name], value), name


WRITES = {
    "in place": lambda m: m.norm.weight.zero_(),
    "setitem": lambda m: m.norm.weight.__setitem__(slice(0, 1), 7.0),
    "through .data": lambda m: m.norm.bias.data.add_(1),
    "one element of a tied weight": lambda m: m.head.weight.data[3, 1].fill_(1e-3),
    ".data swapped": lambda m: setattr(m.norm.weight, "data", torch.zeros(8)),
    "the parameter replaced": lambda m: setattr(m.norm, "weight", torch.nn.Parameter(torch.zeros(8))),
    "through its storage": lambda m: (
        torch.tensor([], dtype=torch.float32).set_(m.norm.weight.untyped_storage()).fill_(2)
    ),
}


@pytest.mark.parametrize("write", list(WRITES))
def test_a_write_is_put_back_and_named(write: str) -> None:
    module = Tiny()
    before = state(module)
    guard = WeightsGuard(module)
    assert guard.check() == []
    WRITES[write](module)
    changed = guard.check()
    assert changed and all(name.startswith(("norm.", "embed.", "head.")) for name in changed), changed
    assert_as_before(module, before)
    assert guard.check() == []  # put back for good: the next check finds nothing
    out = module.head(module.norm(module.embed(torch.tensor([1, 2]))))
    assert torch.isfinite(out).all()


def test_only_the_changed_parameters_are_named() -> None:
    module = Tiny()
    guard = WeightsGuard(module)
    module.norm.bias.data[0] += 1
    assert guard.check() == ["norm.bias"]


def test_gradients_and_requires_grad_left_by_a_job_are_dropped() -> None:
    module = Tiny()
    guard = WeightsGuard(module)
    module.norm.weight.requires_grad_(True)
    module.norm(torch.ones(2, 8)).sum().backward()
    assert module.norm.weight.grad is not None
    assert guard.check() == []
    assert module.norm.weight.grad is None and not module.norm.weight.requires_grad


def test_the_error_says_whether_the_job_is_known_to_have_written() -> None:
    alone = error(["model.norm.weight"], 1)
    shared = error(["model.norm.weight"], 3)
    assert alone["type_name"] == shared["type_name"] == "WeightsModified"
    assert "this trace changed the model's parameters (model.norm.weight)" in alone["message"]
    assert "2 other trace(s)" in shared["message"] and "cannot be told" in shared["message"]


def test_cost_of_a_check_on_the_cpu() -> None:
    """About 135M float32 parameters (SmolLM2-135M's count) in 30 tensors: the time of a clean check."""
    module = torch.nn.ModuleList([torch.nn.Linear(2048, 2200, bias=False) for _ in range(30)])
    start = time.perf_counter()
    guard = WeightsGuard(module)
    built = time.perf_counter() - start
    runs = []
    for _ in range(5):
        start = time.perf_counter()
        assert guard.check() == []
        runs.append(time.perf_counter() - start)
    gib = guard.bytes / 2**30
    best = min(runs)
    print(
        f"\nweights guard on the CPU: {gib:.2f} GiB, built in {built * 1000:.0f} ms, check {best * 1000:.1f} ms"
        f" ({gib / best:.1f} GiB/s)"
    )
    assert best < 10.0
