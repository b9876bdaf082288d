"""The protected environment's pieces, without installing it in this process (install patches nnsight
process-wide; the worker tests run it installed, in real engines)."""

from __future__ import annotations

import functools
import io
import os
import pickle
import types
from typing import Any

import cloudpickle
import pytest

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


FAKE_PACKET = "class Fake:\n    _qualified_op_name = 'aten::from_file'\n    _dir = []"


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
        # A red-team round's file read: OpOverloadPacket.__getattr__ resolves the op a fake packet names.
        (f"import torch\n{FAKE_PACKET}\ntype(torch.ops.aten.add).__getattr__(Fake(), 'default')", "'__getattr__'"),
        (f"import torch\n{FAKE_PACKET}\ngetattr(type(torch.ops.aten.add), '__get' + 'attr__')", "'__getattr__'"),
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
    from nnsight.intervention.serialization import dumps

    data = payload if isinstance(payload, bytes) else dumps(payload)
    with pytest.raises(ProtectedEnvironmentError, match=named):
        load(data)


def test_bytecode_functions_are_refused_and_sourced_ones_get_the_protected_builtins() -> None:
    from nnsight.intervention.serialization import dumps

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
    from nnsight.intervention.serialization import dumps

    scope = run("import torch.nn.functional as F")
    assert isinstance(load(dumps(scope["F"])), protected.ProtectedModule)


def test_tensors_and_plain_data_load() -> None:
    import torch
    from nnsight.intervention.serialization import dumps

    value = load(dumps({"t": torch.arange(3), "x": [1, 2.5, "s"]}))
    assert torch.equal(value["t"], torch.arange(3)) and value["x"] == [1, 2.5, "s"]


# --- issue 21: the escapes found (typing's evaluators, str.format, native file readers, payload globals) ---


@pytest.mark.parametrize(
    ("source", "named"),
    [
        ("import typing\nr = typing.ForwardRef(\"__import__('os').getcwd()\")", "typing.ForwardRef"),
        ("from typing import get_type_hints", "typing.get_type_hints"),
        ("import typing\nclass P(typing.NamedTuple):\n    a: int", "typing.NamedTuple"),
        ("import collections\nP = collections.namedtuple('P', 'a b')", "collections.namedtuple"),
        ("import dataclasses\nD = dataclasses.make_dataclass('D', ['x'])", "dataclasses.make_dataclass"),
        ("from dataclasses import dataclass", "dataclasses.dataclass"),
        ("import string\nf = string.Formatter()", "string.Formatter"),
        ("import random\ns = '{0.__init__.__globals__[_os].environ}'.format(random.Random())", "'format'"),
        ("s = '{0.real}'.format_map({'0': 1})", "'format_map'"),
        ("f = str.format", "'format'"),
        ("f = getattr('{0.real}', 'form' + 'at')", "'format'"),
        ("import torch\ns = torch.UntypedStorage.from_file('/etc/hostname', False, 1)", "'from_file'"),
        ("import torch\nf = getattr(torch.UntypedStorage, 'from_' + 'file')", "'from_file'"),
        ("import torch\ntorch.ops.load_library('/x.so')", "'load_library'"),
        ("import numpy\nd = numpy.lib.npyio.DataSource(None)", "numpy.lib.npyio"),
        ("from numpy.lib._datasource import DataSource", "numpy.lib._datasource"),
        ("import numpy\nf = numpy.fromregex", "numpy.fromregex"),
        ("from numpy.lib.format import open_memmap", "numpy.lib.format"),
        ("import numpy\nf = numpy.lib.stride_tricks.as_strided", "as_strided"),
        ("import numpy\np = numpy.zeros(1).ctypes", "'ctypes'"),
        ("class A:\n    __array_interface__ = {}", "'__array_interface__'"),
    ],
)
def test_the_escapes_found_are_refused(source: str, named: str) -> None:
    with pytest.raises((ProtectedEnvironmentError, AttributeError), match=named.replace(".", r"\.")):
        run(source)


def test_format_builtin_and_f_strings_still_work() -> None:
    scope = run("x = 2.5\na = format(x, '.2f')\nb = f'{x:.1f} {x!r}'\nc = '%s' % x")
    assert (scope["a"], scope["b"], scope["c"]) == ("2.50", "2.5 2.5", "2.5")


def _marker_pickle(global_: str, path: Any) -> bytes:
    """A pickle that calls ``global_`` (module and name on two lines) with ``touch path``: it ran when it exists."""
    return b"c" + global_.encode() + b"\n(S'touch " + str(path).encode() + b"'\ntR."


@pytest.mark.parametrize(
    "global_",
    [
        "torch\nserialization.os.system",  # an attribute path through a module the payload may name
        "numpy\nlib.npyio.os.system",
        "collections\nabc.sys.modules",
    ],
)
def test_attribute_paths_do_not_lead_out_of_allowed_modules(global_: str, tmp_path: Any) -> None:
    with pytest.raises(ProtectedEnvironmentError, match="not allowed"):
        load(_marker_pickle(global_, tmp_path / "ran"))
    assert not (tmp_path / "ran").exists()


def test_a_payload_of_allowed_globals_cannot_evaluate_strings(tmp_path: Any) -> None:
    # typing.ForwardRef(code)._evaluate({}, {}, frozenset()): eval with the real builtins, as reported.
    marker = tmp_path / "ran"
    code = f"__import__('os').system('touch {marker}')"
    data = (
        b"cbuiltins\ngetattr\n(ctyping\nForwardRef\n(S" + repr(code).encode() + b"\ntRS'_evaluate'\ntR"
        b"(}}cbuiltins\nfrozenset\n)RtR."
    )
    with pytest.raises(ProtectedEnvironmentError, match=r"typing\.ForwardRef"):
        load(data)
    assert not marker.exists()


@pytest.mark.parametrize(
    ("module", "name"),
    [
        ("numpy.lib._datasource", "DataSource"),  # a private module
        ("torch._C", "_get_tracing_state"),
        ("typing", "get_type_hints"),
        ("dataclasses", "make_dataclass"),
        ("string", "Formatter"),
        ("torch", "serialization"),  # a module named as an attribute
        ("cloudpickle.cloudpickle", "dumps"),  # only classes from deserialization-only modules
        ("torch", "UntypedStorage.from_file"),
    ],
)
def test_payload_globals_outside_the_rules_are_refused(module: str, name: str) -> None:
    with pytest.raises(ProtectedEnvironmentError):
        protected.find_class(module, name)


def test_a_mediator_blob_must_be_an_nnsight_mediator() -> None:
    with pytest.raises(protected.InvalidMediator, match="holds a int, not an nnsight Mediator"):
        protected.load_mediator(pickle.dumps(1))


# --- issue 33: nnsight's own import and attribute helpers, native readers by identity, payloads that run code ---


@pytest.mark.parametrize(
    ("source", "named"),
    [
        ("from nnsight.util import from_import_path", "nnsight.util.from_import_path"),
        ("import nnsight.util\nf = getattr(nnsight.util, 'from_import' + '_path')", "nnsight.util.from_import_path"),
        ("import torch\nreader = torch.PyTorchFileReader", "torch.PyTorchFileReader"),  # by identity: no name rule
        ("import torch\nwriter = getattr(torch, 'PyTorch' + 'FileWriter')", "torch.PyTorchFileWriter"),
        ("import numpy\nf = getattr(numpy, 'from' + 'file')", "numpy.fromfile"),
        ("class A:\n    pass\nA.__del__ = print", "'__del__'"),  # an implicit hook planted on a class
        ("import torch\nsetattr(torch.Tensor, '__re' + 'pr__', print)", "'__repr__'"),
        # A third red-team round (E9): the interpreter's import falls back to sys.modules for a name the protected
        # module refuses, which handed over the real torch._utils and its _import_dotted_name.
        ("import torch._utils as U", "'_utils'"),
        ("from torch import _utils", "'_utils'"),
        ("from torch.ao.quantization.utils import getattr_from_fqn", "torch.ao.quantization.utils"),  # E15
        ("import torch\nf = torch.ops.import_module", "'import_module'"),
    ],
)
def test_helpers_that_reach_anything_and_planted_dunders_are_refused(source: str, named: str) -> None:
    with pytest.raises((ProtectedEnvironmentError, AttributeError), match=named.replace(".", r"\.")):
        run(source)


def test_a_payload_cannot_name_them_either() -> None:
    for module, name in (("nnsight.util", "from_import_path"), ("torch", "PyTorchFileReader")):
        with pytest.raises(ProtectedEnvironmentError, match=f"{module}.{name}".replace(".", r"\.")):
            protected.find_class(module, name)


def strict(data: bytes, persistent: dict[Any, Any] | None = None) -> Any:
    return protected.StrictUnpickler(io.BytesIO(data), persistent).load()


GADGETS = {
    # nnsight's _fill on a real module's function: its globals are that module's (``F.relu``'s: torch's functional)
    "fill_a_named_function": b"cnnsight.intervention.serialization\n_fill\n(ctorch.nn.functional\nrelu\n"
    b"(dS'torch'\nI1\nstR.",
    # torch's _rebuild_from_type_v2 calls its first argument and sets the state on what it returns
    "rebuild_with_getattr": b"ctorch._tensor\n_rebuild_from_type_v2\n(cbuiltins\ngetattr\nctorch\nTensor\n"
    b"(ctorch\nTensor\nS'add'\nt(S'x'\nI1\ndtR.",
}
STRICT_GADGETS = {
    # BUILD on a class the payload named: setattr(torch.Tensor, ...) for every later job
    "build_a_named_class": b"ctorch\nTensor\n(N(S'nnqueue_planted'\nI1\ndtb.",
    # a higher-order class calls what it is given when iterated: list(map(print, ['x']))
    "call_through_map": b"cbuiltins\nlist\n(cbuiltins\nmap\n(cbuiltins\nprint\n(S'x'\nltRtR.",
    # a function of an allowed module called while loading
    "call_a_function": b"ctorch\nzeros\n(I2\ntR.",
    # SETITEM on an object of the process (a persistent id: here a dict standing for a module's hook table)
    "change_a_process_object": b"Phooks\nS'k'\nI1\ns.",
}


@pytest.mark.parametrize("gadget", sorted(GADGETS))
def test_payload_gadgets_of_allowed_globals_are_refused_by_both_unpicklers(gadget: str) -> None:
    import torch

    for loader in (load, strict):
        with pytest.raises(ProtectedEnvironmentError):
            loader(GADGETS[gadget])
    assert "x" not in vars(torch.Tensor) and torch.nn.functional.relu.__globals__["torch"] is torch


@pytest.mark.parametrize("gadget", sorted(STRICT_GADGETS))
def test_the_strict_unpickler_refuses_calls_and_changes_by_opcode(gadget: str) -> None:
    import torch

    hooks: dict[str, Any] = {}
    with pytest.raises(ProtectedEnvironmentError):
        strict(STRICT_GADGETS[gadget], {"hooks": hooks})
    assert hooks == {} and "nnqueue_planted" not in vars(torch.Tensor)


def test_the_strict_unpickler_loads_real_mediators(client_model: Any) -> None:
    from nnqueue import trace_payload
    from nnqueue.enginecore.envoy_trees import EnvoyTrees
    from tests.utils.payloads import two_invoke_payload

    persistent = client_model._remoteable_persistent_objects()
    trace = trace_payload.decode(two_invoke_payload(client_model))
    assert trace.envoys is not None  # format 2: the envoy tree once, which the mediators refer to
    trees = EnvoyTrees(ahead=False, strict=True)
    assert trees.add(trace.envoys.sha256, trace.envoys.data, persistent)
    load = trees.loads(functools.partial(protected.load_mediator, strict=True))
    for invoke in trace.invokes:
        assert type(load(invoke.mediator, persistent)).__name__ == "Mediator"


# --- issue 33, the second red-team round: classes made past the class statement's checks ---

ARRAY_INTERFACE = "{'shape': (1,), 'typestr': '<u8', 'data': (0, False), 'version': 3}"


@pytest.mark.parametrize(
    ("source", "named"),
    [
        # E1: an object whose array interface numpy reads points an array at any address
        (f"X = type('X', (), {{'__array_' + 'interface__': {ARRAY_INTERFACE}}})", "'__array_interface__'"),
        (f"class X:\n    def __getattr__(self, name):\n        return {ARRAY_INTERFACE}", "'__getattr__'"),
        ("class X:\n    def __del__(self):\n        pass", "'__del__'"),  # run by the collector, in any step
        ("class X:\n    def __reduce__(self):\n        return (print, ())", "'__reduce__'"),  # by a result writer
        ("M = type(int)", "metaclass"),
        ("import abc\nM = abc.ABCMeta", "metaclass ABCMeta"),
        ("import enum\nM = getattr(enum, 'Enum' + 'Meta')", "metaclass EnumType"),
    ],
)
def test_classes_cannot_carry_raw_memory_or_code_run_outside_the_step(source: str, named: str) -> None:
    with pytest.raises(ProtectedEnvironmentError, match=named):
        run(source)


def test_ordinary_classes_and_type_still_work() -> None:
    scope = run(
        "class Point:\n    def __init__(self, x):\n        self.x = x\n    def __repr__(self):\n        return 'P'\n"
        "P = type('P', (Point,), {'y': 2})\nkinds = (type(P(1)), type(3))"
    )
    assert scope["kinds"][1] is int and scope["kinds"][0] is scope["P"]


def test_enums_functional_api_is_checked_once_installed() -> None:
    """Installing patches enum's functional API process-wide, so it is shown on a copy of the check here: the same
    ``check_class`` refuses a functional enum whose names plant an array interface."""
    import enum

    planted = enum.Enum("Planted", [("__array_interface__", {}), ("A", 1)])
    with pytest.raises(ProtectedEnvironmentError, match="'__array_interface__'"):
        protected.check_class(planted)
    protected.check_class(enum.Enum("Fine", ["A", "B"]))


# --- the library-function scan: helpers that reach any module, attribute or memory by a name they are given ---


@pytest.mark.parametrize(
    ("source", "named"),
    [
        # enum's _convert_: sys.modules[module].__dict__, read (the real builtins.getattr, raw sys) and overwritten
        ("import enum\nE = enum.Enum._convert_('E', 'typing', lambda n: n == 'sys')", "'_convert_'"),
        ("import enum\nf = getattr(enum.Enum, '_conv' + 'ert_')", "'_convert_'"),
        # enum.global_enum writes the members into the module the class names as its __module__ (protected's own)
        ("import enum\nf = enum.global_enum", "enum.global_enum"),
        ("import re\nf = re.enum.global_enum", "enum.global_enum"),
        # functools.update_wrapper copies any attribute by name: assigned=('__globals__',)
        ("import functools\nf = functools.update_wrapper", "functools.update_wrapper"),
        ("from functools import wraps", "functools.wraps"),
        # numpy's add_newdoc: __import__ of any module
        ("import numpy\nf = numpy.lib.add_newdoc", "numpy.lib.add_newdoc"),
        # torch.get_device_module("cpu"): the module torch.cpu unwrapped, whose torch is the real one (round 4, E17)
        ("import torch\nf = torch.get_device_module", "torch.get_device_module"),
        # a set of torch's functions that holds torch.from_file (round 4, E21)
        ("import torch\nf = torch.overrides.get_ignored_functions", "torch.overrides.get_ignored_functions"),
        # any attribute set, swapped or deleted by name: the protected module's own lookup (round 4, E25)
        ("import torch\nA = torch.nn.utils.stateless.NamedMemberAccessor", "NamedMemberAccessor"),
        ("from torch.nn.utils.stateless import NamedMemberAccessor", "NamedMemberAccessor"),
        # einops' backend object holds the real torch (round 4, E22)
        ("import einops\nf = einops.einops.get_backend", "einops.einops.get_backend"),
        # ctypes re-exported by torch.xpu: from_address reads and writes any address
        ("import torch\nP = torch.xpu.c_void_p", "ctypes"),
        ("import torch\nf = torch.xpu.cast", "ctypes"),
        ("def f(P):\n    return P.from_address(0)", "'from_address'"),
        # other modules' classes and functions re-exported by allowed modules
        ("from json.tool import Path", "pathlib"),
        ("from nnsight.schema.config import files", "importlib"),
        # the libraries' test suites (importlib's find_spec, subprocess, ctypes, tempfile...)
        ("from numpy.tests.test_lazyloading import find_spec", "numpy.tests.test_lazyloading"),
        ("import numpy.lib.tests.test_io", "numpy.lib.tests.test_io"),
        ("from einops.tests import run_tests", "einops.tests"),
        # the real pickle: pickle's find_class through super(), nnsight's and torch's unpicklers of any bytes
        ("from torch.utils.show_pickle import DumpUnpickler", "torch.utils.show_pickle"),
        ("def f(U, u):\n    return super(U, u).find_class('sys', 'modules')", "'find_class'"),
        ("from nnsight.modeling.vllm.engines.engine import merge_collected", "nnsight.modeling.vllm.engines"),
        ("from nnsight.modeling.vllm.workers import GPUWorker", "nnsight.modeling.vllm.workers"),
        ("from nnsight.schema.response import ResponseModel", "nnsight.schema.response"),
        # a raw module through a class attribute: numpy._core.umath, whose numpy is the unwrapped numpy
        ("import numpy\nraw = numpy.lib.mixins.NDArrayOperatorsMixin.um.numpy", "'um'"),
        ("import numpy\nf = numpy.test", "numpy.test"),
        ("import numpy\nf = numpy.linalg.test", "numpy.linalg.test"),
    ],
)
def test_library_helpers_that_reach_anything_by_name_are_refused(source: str, named: str) -> None:
    with pytest.raises((ProtectedEnvironmentError, AttributeError), match=named.replace(".", r"\.")):
        run(source)


def test_a_payload_cannot_name_the_scans_helpers_either() -> None:
    for module, name in (("enum", "global_enum"), ("functools", "update_wrapper"), ("torch.xpu", "c_void_p")):
        with pytest.raises(ProtectedEnvironmentError):
            protected.find_class(module, name)
    with pytest.raises(ProtectedEnvironmentError):
        protected.find_class("numpy.tests.test_lazyloading", "find_spec")


def test_enums_functools_and_numpy_ma_still_work() -> None:
    scope = run(
        "import enum, functools, numpy\n"
        "class Color(enum.Enum):\n    RED = 1\n    BLUE = 2\n"
        "m = numpy.ma.masked_array([1, 2, 3], mask=[0, 1, 0])\n"
        "result = (Color.RED.value, functools.reduce(lambda a, b: a + b, [1, 2]), int(numpy.ma.sum(m)))"
    )
    assert scope["result"] == (1, 3, 4)
