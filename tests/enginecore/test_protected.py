"""The protected environment's pieces, without installing it in this process (install patches nnsight
process-wide; the worker tests run it installed, in real engines)."""

from __future__ import annotations

import io
import os
import pickle
import types
from typing import Any

import cloudpickle
import pytest
import torch
from nnsight.intervention.serialization import dumps

from nnqueue.enginecore import protected
from nnqueue.enginecore.protected import ProtectedEnvironmentError, RestrictedUnpickler


def run(source: str) -> dict[str, Any]:
    """Run ``source`` as intervention code runs once installed: with the protected builtins."""
    scope: dict[str, Any] = {"__builtins__": protected.SAFE_BUILTINS}
    code = compile(source, "<intervention>", "exec")
    protected.check_code(code)
    exec(code, scope)
    return scope


def load(data: bytes) -> Any:
    return RestrictedUnpickler(io.BytesIO(data)).load()


def test_allowed_modules_work_and_come_back_protected() -> None:
    scope = run(
        "import torch\nimport torch.nn.functional as F\nfrom math import sqrt\ny = F.relu(torch.tensor([-1.0, 4.0])).sum().item()"
    )
    assert scope["y"] == 4.0
    assert isinstance(scope["torch"], protected.ProtectedModule) and isinstance(scope["F"], types.ModuleType)


@pytest.mark.parametrize(
    ("source", "named"),
    [
        ("import os", "'os'"),
        ("import subprocess", "'subprocess'"),
        ("from torch import multiprocessing", "torch.multiprocessing"),
        ("import torch\ntorch.load", "torch.load"),
        ("import torch\ntorch.os", "'os'"),
        ("import operator\noperator.attrgetter", "operator.attrgetter"),
        ("f = (lambda: 0).__globals__", "'__globals__'"),
        ("import torch\ng = torch.nn.Module.__init__.__globals__", "'__globals__'"),
        ("def f():\n    yield 1\nf().gi_frame", "'gi_frame'"),
        ("from . import x", "relative import"),
    ],
)
def test_refused_imports_and_attributes_name_what_was_refused(source: str, named: str) -> None:
    with pytest.raises((ProtectedEnvironmentError, AttributeError), match=named.replace(".", r"\.")):
        run(source)


@pytest.mark.parametrize("name", ["open", "exec", "eval", "compile", "globals", "vars", "breakpoint", "input"])
def test_dangerous_builtins_do_not_exist(name: str) -> None:
    with pytest.raises(NameError):
        run(f"{name}")


def test_getattr_refuses_what_the_syntax_check_would() -> None:
    with pytest.raises(AttributeError, match="__globals__"):
        run("f = getattr(print, '__glo' + 'bals__')")
    assert run("n = getattr([], 'append').__name__")["n"] == "append"


class _System:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("true",))


@pytest.mark.parametrize(
    ("payload", "named"),
    [
        (_System(), "posix.system"),
        (os, "'os'"),
        ({"open": open}, "io.open"),
        (pickle.dumps(eval), "'eval'"),
    ],
)
def test_payloads_referencing_other_globals_are_refused(payload: Any, named: str) -> None:
    data = payload if isinstance(payload, bytes) else dumps(payload)
    with pytest.raises(ProtectedEnvironmentError, match=named):
        load(data)


def test_bytecode_functions_are_refused_and_sourced_ones_get_the_protected_builtins() -> None:
    with pytest.raises(ProtectedEnvironmentError, match="bytecode"):
        load(cloudpickle.dumps(types.FunctionType(compile("0", "<none>", "eval"), {})))

    def double(x: int) -> int:  # a local function: sent by value, from its source
        return 2 * x

    function = load(dumps(double))
    assert function(3) == 6 and function.__builtins__ is protected.SAFE_BUILTINS


def test_module_attributes_come_from_the_module() -> None:
    # nnsight mounts a `save` method on every object: on a wrapper it would shadow nnsight.save.
    import nnsight

    assert run("import nnsight\nsave = nnsight.save")["save"] is nnsight.save
    assert run("import torch\nname = torch.__name__")["name"] == "torch"


def test_a_protected_module_is_sent_on_as_a_module() -> None:
    scope = run("import torch.nn.functional as F")
    assert isinstance(load(dumps(scope["F"])), protected.ProtectedModule)


def test_tensors_and_plain_data_load() -> None:
    value = load(dumps({"t": torch.arange(3), "x": [1, 2.5, "s"]}))
    assert torch.equal(value["t"], torch.arange(3)) and value["x"] == [1, 2.5, "s"]
