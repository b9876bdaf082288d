"""The protected environment: what intervention code may import and call, where it is unpickled and run.

Modelled on NDIF's sandbox (ndif-team/ndif, ``services/ray/nn/security``): an allow-list of modules and
builtins, enforced at the places a trace's code enters a process:

* **Deserialization.** nnsight payloads are cloudpickle, and a pickle can call whatever global it names.
  :func:`find_class` (:class:`RestrictedUnpickler`'s, and nnsight's ``CustomCloudUnpickler``'s once
  :func:`install` ran) resolves only globals of allow-listed modules, with no private part but
  :data:`PRIVATE_GLOBALS`, no module reached through an attribute path (``torch.serialization.os.system``),
  nothing defined outside the allowed modules, and none of the stdlib's code generators; it hands back
  guarded versions of the few loaders that can reach anything (cloudpickle's ``subimport``,
  ``builtins.getattr``, nnsight's ``_load_function``, torch's ``_load_from_bytes``) and refuses bytecode
  functions (nnsight serializes code by source). A mediator must load as an nnsight ``Mediator``
  (:func:`load_mediator`, also what nnsight's vLLM runner loads requests with once installed).
* **Execution.** Every captured block nnsight runs executes in a ``nnsight.tracing.util.Scope``
  (``Mediator._run``, ``VLLMTracer.prepare``, ``tracer.iter``); :func:`install` puts
  :data:`SAFE_BUILTINS` in each scope, so the block's ``import`` goes through :func:`guarded_import` and
  only allow-listed builtins resolve (no ``open``, ``exec``, ``eval``, ``compile``...). Modules reach user
  code wrapped in :class:`ProtectedModule` (no non-allow-listed submodules, no private attributes, no
  file I/O such as ``torch.load``, no ``operator.attrgetter``, no code generators such as
  ``typing.ForwardRef``, read-only). Before a block or a deserialized function first runs, its code is
  refused if it names attributes that lead out of the sandbox (``__globals__``, ``f_back``, ``from_file``,
  ``ctypes``...) or reads ``.format``/``.format_map`` (format strings follow attribute paths).
* **The audit hook** (:func:`install`, process-wide). While intervention code runs (a mediator's greenlet,
  a payload being unpickled or rebuilt (:func:`running_user_code`), or any frame of users' code on the
  stack, which also finds hooks and callbacks it left behind), it refuses :data:`USER_EVENTS` (processes,
  sockets, ctypes, signals, the file system), any ``open`` but reading the Python installation, and
  ``compile``/``exec`` from anywhere but nnsight and the import system (typing's, dataclasses' and
  namedtuple's ``eval`` of strings with the real builtins); intervention code cannot start threads.
  Once :func:`lock_down` ran (the engine is up), :data:`LOCKDOWN_EVENTS` are refused in every thread.

A refused import fails the job with ``ImportError: module 'os' is not allowed in intervention code...``.

This is defence in depth, not a security boundary: Python cannot be sandboxed from inside (C
extensions, bugs in the allow-listed libraries, native code that opens files without an audit event).
The boundary is the process isolation of :mod:`nnqueue.isolation`: no secrets in the process, an
unprivileged user. docs/operator/protected-environment.md says what each layer stops.

nnsight internals relied on (0.8.1): ``serialization.CustomCloudUnpickler`` and ``_load_function``,
``tracing.util.Scope``, ``intervention.interleaver.Mediator._run`` (checked, then run), the
``mediator`` attribute nnsight sets on a mediator's greenlet, and ``loads`` as the name
``modeling.vllm.model_runners.GPUModelRunner`` loads requests' mediators with (``Requests.add``).

Use in a process that unpickles or runs payloads (an engine, a trace builder)::

    protected.install(extra_modules)          # once, before the first payload
    protected.lock_down()                     # once the process is up
    RequestModel.deserialize(payload, objects, unpickler=protected.RestrictedUnpickler)
"""

from __future__ import annotations

import ast
import builtins
import dis
import functools
import io
import os
import pickle
import symtable
import sys
import threading
import types
import weakref
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar

from greenlet import getcurrent

from nnqueue.errors import NNqueueError

# Modules (with their submodules) that intervention code may import and payloads may reference.
ALLOWED_MODULES = frozenset(
    {
        "torch",
        "numpy",
        "einops",
        "nnsight",
        "math",
        "cmath",
        "operator",
        "_operator",
        "functools",
        "_functools",
        "collections",
        "itertools",
        "typing",
        "dataclasses",
        "enum",
        "abc",
        "re",
        "random",
        "string",
        "heapq",
        "bisect",
        "statistics",
        "numbers",
        "fractions",
        "decimal",
        "copy",
        "time",
        "datetime",
        "json",
        "warnings",
        "contextlib",
        "__future__",
    }
)
# Submodules of allowed packages that reach processes, files, the network or native code.
BLOCKED_SUBMODULES = frozenset(
    {
        "torch.multiprocessing",
        "torch.distributed",
        "torch.hub",
        "torch.package",
        "torch.utils.cpp_extension",
        "torch.utils.model_zoo",
        "torch.utils.data",
        "torch._dynamo",
        "torch._inductor",
        "torch.compiler",
        "torch.jit",
        "torch.fx",
        "torch.ao",  # quantization's getattr_from_fqn follows any attribute path with the real getattr
        "torch.quantization",
        "torch.export",
        "torch.onnx",
        "torch.profiler",
        "torch.autograd.profiler",
        "torch.serialization",
        "torch.library",
        "torch.utils.tensorboard",
        "torch.utils.benchmark",
        "torch.cuda.memory",
        "numpy.ctypeslib",
        "numpy.distutils",
        "numpy.f2py",
        "numpy.testing",
        "numpy.lib.npyio",
        "numpy.lib.format",
        "numpy.lib._datasource",
        "nnsight.ndif",
        "nnsight.intervention.backends",
        "nnsight.modeling.vllm.serve",
        # Helpers that unpickle their argument with the real pickle (any global, any call): the engine's
        # ``merge_collected`` and the worker's ``collect_nnsight`` (``pickle.loads``), ``ResponseModel.unpickle``
        # (``torch.load(weights_only=False)``), torch's pickle inspectors (``DumpUnpickler`` subclasses pickle's
        # ``_Unpickler``, whose ``find_class``, reached with ``super()``, imports any module).
        "nnsight.modeling.vllm.engines",
        "nnsight.modeling.vllm.workers",
        "nnsight.schema.response",
        "torch.utils.show_pickle",
        "torch.utils.model_dump",
    }
)
# Package names that are never importable, in any allowed package: the libraries' own test suites, which import
# what intervention code may not (``numpy.tests.test_lazyloading.find_spec`` is importlib's: its loaders return
# any module; ``einops.tests.run_tests.Popen``, ``numpy.tests.test_ctypeslib``...).
BLOCKED_PACKAGE_PARTS = frozenset({"tests", "conftest"})
# Only for unpickling: what nnsight's payloads are built from, beside the allowed modules.
DESERIALIZATION_MODULES = frozenset(
    {"copyreg", "collections", "cloudpickle", "_codecs", "vllm.sampling_params", "vllm.model_executor.layers"}
)
# Single globals a payload may name (the engine's model class: a trace's model call is its bound method).
DESERIALIZATION_GLOBALS = frozenset({("nnqueue.engines.platform", "EngineVLLM")})
# numpy's functions that read or write files by name.
NUMPY_FILE_FUNCTIONS = (
    "load",
    "save",
    "savez",
    "savez_compressed",
    "savetxt",
    "loadtxt",
    "genfromtxt",
    "fromfile",
    "fromregex",
    "memmap",
)
# Attributes of allowed modules that read or write files, reach any attribute by name, or read raw memory.
HIDDEN_ATTRIBUTES = {
    "operator": frozenset({"attrgetter", "methodcaller"}),
    "_operator": frozenset({"attrgetter", "methodcaller"}),
    "torch": frozenset({"load", "save", "from_file", "load_library"}),
    # ``test``: each numpy package's pytest runner (``numpy.test()`` imports and runs the test suites)
    "numpy": frozenset({*NUMPY_FILE_FUNCTIONS, "open_memmap", "DataSource", "as_strided", "test"}),
}
# Attribute names refused wherever intervention code names them (code, getattr, unpickled references), on any
# object: native constructors that open a file by name, which no audit event reports (torch's
# ``UntypedStorage.from_file``, ``torch.ops.load_library``), raw memory (numpy's array interfaces, an array's
# ``ctypes``), and typing's evaluators (``ForwardRef._evaluate``: ``eval`` with the real builtins).
NATIVE_ATTRIBUTES = frozenset(
    {
        "from_file",
        "load_library",
        "_new_shared_filename_cpu",
        "_new_using_filename_cpu",
        "_share_filename_cpu_",
        "_new_with_file",
        "_set_from_file",
        "__array_interface__",
        "__array_struct__",
        "__cuda_array_interface__",
        "ctypes",
        "_ctypes",
        "_evaluate",
        "_eval_type",
        "import_module",  # torch.ops.import_module: importlib.import_module of any module
        # enum's _convert_: any module's globals by name (``sys.modules[module].__dict__``), read and overwritten
        "_convert_",
        # ctypes' raw-memory constructors (any ctypes type, however reached: ``torch.xpu.c_void_p``)
        "from_address",
        "from_buffer",
        "from_buffer_copy",
        "in_dll",
        # an unpickler's find_class (pickle's own, reached with ``super()`` from a subclass): any module's global
        "find_class",
        # numpy's NDArrayOperatorsMixin.um: the raw module numpy._core.umath, a class attribute (a module reached
        # through a class is not wrapped): its ``numpy`` is the real numpy (``load``, private modules, their ``os``)
        "um",
    }
)
# Modules whose classes and functions intervention code may not hold, whatever allowed module re-exports them
# (ProtectedModule refuses other packages' modules, not what they define): ``torch.xpu.c_void_p`` is ctypes' (raw
# memory), ``json.tool.Path`` pathlib's, ``nnsight.schema.config.files`` importlib's (imports any package).
REFUSED_ORIGINS = frozenset(
    {
        "ctypes",
        "_ctypes",
        "pathlib",
        "os",
        "posix",
        "io",
        "_io",
        "subprocess",
        "importlib",
        "pickle",
        "_pickle",
        "marshal",
        "tempfile",
        "shutil",
        "socket",
        "_socket",
        "sys",
        "gc",
        "inspect",
        "multiprocessing",
        "mmap",
        "zipfile",
        "tarfile",
        "urllib",
        "http",
        "pkgutil",
        "pydoc",
        "runpy",
        "code",
        "codeop",
        "zipimport",
        "signal",
    }
)
# Attribute names refused when intervention code reads them as attributes (not as names): ``str.format`` and
# ``format_map`` follow ``{0.attr[key]}`` paths with the real ``getattr``, so a format string reaches what the
# attribute checks refuse (``"{0.__init__.__globals__}".format(x)``). f-strings and ``format()`` do not.
FORMAT_ATTRIBUTES = frozenset({"format", "format_map", "vformat"})
# Names that lead to a tensor's memory past its version counter (nnqueue.enginecore.weights_guard, which reads the
# weights in full after a step in which a trace naming one ran): ``.data``, storages, ``set_``, numpy (which
# aliases a CPU tensor), DLPack, the unsafe splits, ``view`` (``view(dtype)`` keeps no shared counter inside
# ``torch.inference_mode``), ``torch.ops`` (every ATen op by its own name) and descriptors called directly.
# Allowed, not refused: noted where code names them (`check_code`) or reaches them (``getattr``, ``__import__``).
ROAD_NAMES = frozenset(
    {
        "data",
        "untyped_storage",
        "storage",
        "_typed_storage",
        "set_",
        "numpy",
        "__array__",
        "__dlpack__",
        "from_dlpack",
        "to_dlpack",
        "frombuffer",
        "unsafe_split",
        "unsafe_chunk",
        "unsafe_split_with_sizes",
        "view",
        "ops",
        "__get__",
        "__set__",
    }
)
# Attribute names that lead from an object to interpreter internals (globals of other modules,
# frames, code): refused in intervention code, in getattr/setattr and in unpickled references.
BLOCKED_ATTRIBUTES = frozenset(
    {
        "__class__",
        "__bases__",
        "__base__",
        "__mro__",
        "__subclasses__",
        "__globals__",
        "__code__",
        "__closure__",
        "__func__",
        "__self__",
        "__dict__",
        "__builtins__",
        "__import__",
        "__loader__",
        "__spec__",
        "__reduce__",
        "__reduce_ex__",
        "__getstate__",
        "__setstate__",
        "__getattribute__",
        # A class's own __getattr__, called on another object: OpOverloadPacket's resolves any ATen op, by the name
        # in that object's _qualified_op_name ("aten::from_file": a native file reader), past every name check.
        "__getattr__",
        "__setattr__",
        "__delattr__",
        "__init_subclass__",
        "__set_name__",
        "__traceback__",
        "__defaults__",
        "__kwdefaults__",
        "__wrapped__",
        "__objclass__",
        "f_globals",
        "f_locals",
        "f_builtins",
        "f_back",
        "f_code",
        "tb_frame",
        "tb_next",
        "gi_frame",
        "gi_code",
        "gi_yieldfrom",
        "cr_frame",
        "cr_code",
        "cr_await",
        "ag_frame",
        "ag_code",
        "co_code",
    }
)
# Builtins intervention code may call. Not: open, exec, eval, compile, input, breakpoint, help,
# vars, globals, locals, exit, quit (and __import__, getattr & co. are guarded versions).
ALLOWED_BUILTINS = frozenset(
    {
        *(
            name
            for name, value in vars(builtins).items()
            if isinstance(value, type) and issubclass(value, BaseException)
        ),
        "None",
        "True",
        "False",
        "Ellipsis",
        "NotImplemented",
        "__build_class__",
        "__name__",
        "abs",
        "aiter",
        "all",
        "anext",
        "any",
        "ascii",
        "bin",
        "bool",
        "bytearray",
        "bytes",
        "callable",
        "chr",
        "classmethod",
        "complex",
        "dict",
        "dir",
        "divmod",
        "enumerate",
        "filter",
        "float",
        "format",
        "frozenset",
        "hash",
        "hex",
        "id",
        "int",
        "isinstance",
        "issubclass",
        "iter",
        "len",
        "list",
        "map",
        "max",
        "memoryview",
        "min",
        "next",
        "object",
        "oct",
        "ord",
        "pow",
        "print",
        "property",
        "range",
        "repr",
        "reversed",
        "round",
        "set",
        "slice",
        "sorted",
        "staticmethod",
        "str",
        "sum",
        "super",
        "tuple",
        "type",
        "zip",
    }
)
# Audit events refused in every thread once `lock_down` ran (the engine is up, users' code may run): a thread
# or callback that intervention code left behind must not start programs, load native code or reach the
# network. Sockets of the AF_UNIX family stay allowed (vLLM's and torch's local IPC); so is what the compilers
# torch and Triton run (a kernel first compiled for a new shape) do, when no intervention code is on the stack
# (`_trusted_code`). Results leave the engine through files the worker uploads (nnqueue.workers.sinks).
SOCKET_EVENTS = frozenset({"socket.connect", "socket.bind", "socket.sendto", "socket.sendmsg"})
LOCKDOWN_EVENTS = SOCKET_EVENTS | frozenset(
    {
        "os.system",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "os.fork",
        "os.forkpty",
        "pty.spawn",
        "subprocess.Popen",
        "ctypes.dlopen",
    }
)
# Audit events refused while intervention code runs (see `_in_user_code`): those of the lockdown, and the
# environment, signals, the file system beyond reading the Python installation, native memory, other threads'
# frames.
USER_EVENTS = LOCKDOWN_EVENTS | frozenset(
    {
        "os.kill",
        "os.killpg",
        "os.putenv",
        "os.unsetenv",
        "os.chmod",
        "os.chown",
        "os.remove",
        "os.rename",
        "os.listdir",
        "os.scandir",
        "os.mkdir",
        "os.rmdir",
        "os.symlink",
        "os.link",
        "os.truncate",
        "os.utime",
        "os.chdir",
        "os.setxattr",
        "os.removexattr",
        "os.listxattr",
        "os.getxattr",
        "shutil.copyfile",
        "shutil.copymode",
        "shutil.copystat",
        "shutil.copytree",
        "shutil.rmtree",
        "shutil.move",
        "shutil.chown",
        "shutil.make_archive",
        "shutil.unpack_archive",
        "glob.glob",
        "glob.glob/2",
        "tempfile.mkstemp",
        "tempfile.mkdtemp",
        "mmap.__new__",
        "socket.getaddrinfo",
        "socket.gethostbyname",
        "socket.gethostbyaddr",
        "urllib.Request",
        "http.client.connect",
        "ctypes.dlsym",
        "ctypes.call_function",
        "ctypes.string_at",
        "ctypes.wstring_at",
        "ctypes.PyObj_FromPtr",
        "ctypes.addressof",
        "sys._current_frames",
        "sys._current_exceptions",
        "sys.addaudithook",
        "gc.get_objects",
        "gc.get_referrers",
        "gc.get_referents",
    }
)
# Audit events refused when raised directly by intervention code (its innermost frame): CPython raises
# these for the introspection attributes (``__code__``, ``f_back``, ``tb_frame``...), which nnsight's
# own code may use, so they are refused only when the user's code asks, e.g. through operator.attrgetter.
INTROSPECTION_EVENTS = frozenset(
    {
        "object.__getattr__",
        "object.__setattr__",
        "object.__delattr__",
        "sys._getframe",
        "function.__new__",
        "code.__new__",
    }
)
# ``compile`` and ``exec`` (of source or code objects) while intervention code runs: allowed only from nnsight
# (which compiles the user's blocks, run with the protected builtins), ``ast``/``symtable`` (trees, never code)
# and the import system. Refused from
# anywhere else: the stdlib's code generators (typing's ``ForwardRef``/``get_type_hints``, ``dataclasses``,
# ``collections.namedtuple``) ``eval`` strings with the real builtins.
CODE_EVENTS = frozenset({"compile", "exec"})
_WATCHED_EVENTS = USER_EVENTS | LOCKDOWN_EVENTS | INTROSPECTION_EVENTS | CODE_EVENTS | {"open"}


class ProtectedEnvironmentError(NNqueueError, ImportError):
    """Intervention code asked for something the protected environment does not allow."""


_extra_modules: set[str] = set()


def is_allowed_module(name: str, deserializing: bool = False) -> bool:
    """Whether module ``name`` (or its package) is allow-listed and not a blocked submodule."""
    parts = name.split(".")
    prefixes = {".".join(parts[: index + 1]) for index in range(len(parts))}
    if prefixes & BLOCKED_SUBMODULES or not BLOCKED_PACKAGE_PARTS.isdisjoint(parts[1:]):
        return False
    allowed = ALLOWED_MODULES | _extra_modules
    if deserializing:
        allowed = allowed | DESERIALIZATION_MODULES
    return bool(prefixes & allowed)


def is_blocked_attribute(name: str) -> bool:
    return name in BLOCKED_ATTRIBUTES or name in NATIVE_ATTRIBUTES


def is_refused_attribute(name: str) -> bool:
    """Whether ``getattr(x, name)`` is refused to intervention code (and to a payload's references)."""
    return is_blocked_attribute(name) or name in FORMAT_ATTRIBUTES


def _code_generators() -> dict[str, Any]:
    """The callables of allowed modules that ``eval``/``exec`` strings with the real builtins (or format them
    with the real ``getattr``). enum's functional API and functools do not generate code (Python 3.11)."""
    import collections
    import dataclasses
    import string
    import typing

    return {
        "typing.ForwardRef": typing.ForwardRef,
        "typing.get_type_hints": typing.get_type_hints,
        "typing.NamedTuple": typing.NamedTuple,
        "typing.TypedDict": typing.TypedDict,
        "collections.namedtuple": collections.namedtuple,
        "dataclasses.dataclass": dataclasses.dataclass,
        "dataclasses.make_dataclass": dataclasses.make_dataclass,
        "string.Formatter": string.Formatter,
        "str.format": str.format,
        "str.format_map": str.format_map,
    }


def _reachers() -> dict[str, Any]:
    """Helpers of allowed modules that import any module or follow any attribute path with the real ``getattr``
    (nnsight's ``from_import_path``: ``from_import_path("builtins.exec")``, torch's ``_import_dotted_name``) or set
    any attribute by name (``_set_obj_state``), or read and write files natively,
    where no audit event reports it (``torch.from_file`` and every storage class's ``from_file``, torch's zip
    archive reader and writer); with the Python-level file readers hidden by name (:data:`HIDDEN_ATTRIBUTES`)."""
    import enum
    import functools
    import operator

    import einops.einops
    import numpy
    import torch
    import torch.nn.utils._named_member_accessor
    import torch.nn.utils.stateless
    from nnsight import util

    found: dict[str, Any] = {
        "nnsight.util.from_import_path": util.from_import_path,
        "operator.attrgetter": operator.attrgetter,
        "operator.methodcaller": operator.methodcaller,
        "torch.from_file": torch.from_file,
        "torch._utils._import_dotted_name": torch._utils._import_dotted_name,
        "torch._utils._set_obj_state": torch._utils._set_obj_state,
        "torch.load": torch.load,
        "torch.save": torch.save,
        "torch.PyTorchFileReader": torch.PyTorchFileReader,
        "torch.PyTorchFileWriter": torch.PyTorchFileWriter,
        # copy any attribute by name with the real getattr/setattr (``assigned=('__globals__',)``)
        "functools.update_wrapper": functools.update_wrapper,
        "functools.wraps": functools.wraps,
        # writes its members into ``sys.modules[cls.__module__]``, a module the class names itself
        "enum.global_enum": enum.global_enum,
        # ``__import__`` of any module by name
        "numpy.lib.add_newdoc": numpy.lib.add_newdoc,
        # the module torch.<device> by name, unwrapped: its ``torch`` is the real torch (private modules and all)
        "torch.get_device_module": torch.get_device_module,
        # torch's tables of its own functions, which hold the file readers refused here (``torch.from_file``)
        "torch.overrides.get_ignored_functions": torch.overrides.get_ignored_functions,
        "torch.overrides.get_testing_overrides": torch.overrides.get_testing_overrides,
        "torch.overrides.get_overridable_functions": torch.overrides.get_overridable_functions,
        # set, swap and delete any attribute by name on any object (``NamedMemberAccessor(type(torch)).del_tensor(
        # "__getattribute__")`` took the protected module's own lookup away: round 4, E25)
        "torch.nn.utils.stateless.NamedMemberAccessor": torch.nn.utils.stateless.NamedMemberAccessor,
        "torch.nn.utils._named_member_accessor.set_tensor": torch.nn.utils._named_member_accessor.set_tensor,
        "torch.nn.utils._named_member_accessor.swap_tensor": torch.nn.utils._named_member_accessor.swap_tensor,
        "torch.nn.utils._named_member_accessor.swap_submodule": torch.nn.utils._named_member_accessor.swap_submodule,
        # einops' backend for a tensor, which holds the real module it wraps (``get_backend(x).torch``)
        "einops.einops.get_backend": einops.einops.get_backend,
    }
    for name in NUMPY_FILE_FUNCTIONS:
        found[f"numpy.{name}"] = getattr(numpy, name)
    # The real pickle, where another module imported them (their own modules are BLOCKED_SUBMODULES).
    for module, name in (
        ("nnsight.modeling.vllm.engines.engine", "merge_collected"),
        ("nnsight.modeling.vllm.workers.GPUWorker", "NNsightGPUWorker.collect_nnsight"),
        ("nnsight.schema.response", "ResponseModel.unpickle"),
    ):
        value: Any = sys.modules.get(module)
        for part in name.split(".") if value is not None else ():
            value = getattr(value, part, None)
        if value is not None:
            found[f"{module}.{name}"] = value
    storages: list[Any] = [torch.UntypedStorage, torch.TypedStorage] + [
        value for name, value in vars(torch).items() if name.endswith("Storage") and isinstance(value, type)
    ]
    for storage in storages:
        found[f"torch.{storage.__name__}.from_file"] = storage.from_file
    return found


_unsafe: dict[Any, str] = {}  # a value refused to intervention code whatever it is reached as -> what it is
_unsafe_kept: list[Any] = []  # the values themselves: their ids stay theirs


def _unsafe_values() -> dict[Any, str]:
    """:func:`_code_generators` and :func:`_reachers`, keyed by identity (``id``) and, for methods (a storage
    class's ``from_file`` is a new bound method at each access), by what they are bound to and their name."""
    if not _unsafe:
        for kind, values in (("code", _code_generators()), ("reach", _reachers())):
            for name, value in values.items():
                _unsafe[_identity(value)] = f"{kind}:{name}"
                _unsafe_kept.append(value)
    return _unsafe


def _identity(value: Any) -> Any:
    owner = getattr(value, "__self__", None) if isinstance(value, (types.MethodType, types.BuiltinMethodType)) else None
    if owner is None or isinstance(owner, types.ModuleType):
        return id(value)
    return (id(owner), getattr(value, "__name__", None))


def refuse_unsafe(value: Any) -> None:
    """Refuse ``value`` if it is one of the callables intervention code may never hold (see `_unsafe_values`),
    compared by identity, not by name: it is refused however it was reached (a module's attribute, ``getattr``,
    a payload's global, ``Envoy.get``)."""
    if _refused_origin(value):
        raise refused(f"{_short(value)} of {_origin(value)} (re-exported by an allowed module)")
    if not callable(value):
        return
    if isinstance(value, type) and issubclass(value, type):
        raise refused(f"the metaclass {value.__qualname__} (it makes classes past their checks)")
    kind = _unsafe_values().get(_identity(value))
    if kind is None:
        return
    what, name = kind.split(":", 1)
    if what == "code":
        raise refused(f"{name} (it evaluates or formats strings outside the protected environment)")
    raise refused(f"{name} (it reaches any module, attribute or file outside the protected environment's checks)")


def _origin(value: Any) -> Any:
    """The module that defined ``value`` (a class or function), or its class (anything else)."""
    defining = value if isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType)) else type(value)
    return getattr(defining, "__module__", None)


def _refused_origin(value: Any) -> bool:
    if isinstance(value, types.ModuleType):
        return False  # modules have their own rule (`protect`)
    origin = _origin(value)
    return isinstance(origin, str) and origin.split(".", 1)[0] in REFUSED_ORIGINS


def refused(what: str) -> ProtectedEnvironmentError:
    allowed = ", ".join(sorted(ALLOWED_MODULES | _extra_modules))
    return ProtectedEnvironmentError(
        f"{what} is not allowed in intervention code on this server (nnqueue's protected environment;"
        f" importable modules: {allowed}; the operator can add more with NNQUEUE_ALLOWED_MODULES)"
    )


# --- modules -----------------------------------------------------------------------------------


class ProtectedModule(types.ModuleType):
    """A read-only view of an allowed module: submodules must be allowed too, private names and
    file I/O are hidden.

    Every attribute read goes to the module (``__getattribute__``, not ``__getattr__``): nnsight mounts
    a ``save`` method on every object, which would otherwise shadow ``nnsight.save``.
    """

    def __init__(self, module: types.ModuleType) -> None:
        super().__init__(module.__name__, module.__doc__)
        object.__setattr__(self, "_nnqueue_module", module)

    def __getattribute__(self, name: str) -> Any:
        if name in _WRAPPER_ATTRIBUTES:
            return object.__getattribute__(self, name)
        module: types.ModuleType = object.__getattribute__(self, "_nnqueue_module")
        package = module.__name__.split(".", 1)[0]
        if (name.startswith("_") and name not in _PUBLIC_DUNDERS) or is_blocked_attribute(name):
            raise AttributeError(f"{module.__name__}.{name} is not available in intervention code")
        if name in HIDDEN_ATTRIBUTES.get(package, ()):
            raise refused(f"{module.__name__}.{name}")
        value = getattr(module, name)
        refuse_unsafe(value)
        return protect(value) if isinstance(value, types.ModuleType) else value

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError(f"modules are read-only in intervention code (setting {name})")

    def __delattr__(self, name: str) -> None:
        raise AttributeError(f"modules are read-only in intervention code (deleting {name})")

    def __dir__(self) -> list[str]:
        module = object.__getattribute__(self, "_nnqueue_module")
        return [name for name in dir(module) if not name.startswith("_")]

    def __repr__(self) -> str:
        return f"<protected module {object.__getattribute__(self, '_nnqueue_module').__name__!r}>"

    def __reduce__(self) -> tuple[Any, ...]:
        # Re-serialized (a trace builder sends mediators on) as cloudpickle sends any module.
        from cloudpickle.cloudpickle import subimport

        return (subimport, (object.__getattribute__(self, "_nnqueue_module").__name__,))


# Read from the wrapper itself (the interpreter and pickle ask for them), and the module's public dunders.
_WRAPPER_ATTRIBUTES = frozenset(
    {"__class__", "__reduce__", "__reduce_ex__", "__repr__", "__dir__", "__setattr__", "__delattr__", "__init__"}
)
_PUBLIC_DUNDERS = frozenset({"__name__", "__doc__", "__version__", "__all__"})


_wrappers: dict[int, ProtectedModule] = {}


def protect(module: types.ModuleType) -> ProtectedModule:
    """``module`` wrapped for user code, or :class:`ProtectedEnvironmentError` if it is not allowed.

    One wrapper per module for the life of the process: nnsight's vLLM runner tells saved values by
    ``id()``, so short-lived wrappers would reuse the addresses of freed saved values and be taken for
    saves themselves.
    """
    if isinstance(module, ProtectedModule):
        return module
    if not is_allowed_module(module.__name__):
        raise refused(f"module {module.__name__!r}")
    wrapper = _wrappers.get(id(module))
    if wrapper is None:
        wrapper = _wrappers.setdefault(id(module), ProtectedModule(module))
    return wrapper


def guarded_import(
    name: str,
    globals: dict[str, Any] | None = None,  # noqa: A002 - __import__'s signature
    locals: dict[str, Any] | None = None,  # noqa: A002
    fromlist: Sequence[str] | None = (),
    level: int = 0,
) -> types.ModuleType:
    """``__import__`` for intervention code: allowed modules only, returned protected, and no private name in the
    path or the ``from`` list: the interpreter's ``import a._b as c`` and ``from a import _b`` fall back to
    ``sys.modules`` when the protected module refuses ``_b``, which would hand over the real, unwrapped module
    (``torch._utils``, whose ``_import_dotted_name`` imports anything)."""
    if level:
        raise refused(f"relative import of {name!r}")
    if not is_allowed_module(name):
        raise refused(f"module {name!r}")
    for part in [*name.split("."), *(fromlist or ())]:
        if part.startswith("_") and not _is_dunder(part):
            raise refused(f"the private name {part!r} in an import of {name!r}")
        note_road(part)
    module = builtins.__import__(name, None, None, fromlist, 0)
    return protect(module)


# --- builtins ----------------------------------------------------------------------------------


def guarded_getattr(obj: Any, name: str, *default: Any) -> Any:
    if isinstance(name, str) and is_refused_attribute(name):
        raise AttributeError(f"attribute {name!r} is not available in intervention code")
    note_road(name)
    value = getattr(obj, name, *default)
    refuse_unsafe(value)
    return protect(value) if isinstance(value, types.ModuleType) else value


def guarded_hasattr(obj: Any, name: str) -> bool:
    try:
        guarded_getattr(obj, name)
    except AttributeError:
        return False
    return True


def guarded_setattr(obj: Any, name: str, value: Any) -> None:
    if isinstance(name, str) and (is_blocked_attribute(name) or (_is_dunder(name) and name not in SETTABLE_DUNDERS)):
        raise AttributeError(f"attribute {name!r} cannot be set in intervention code")
    note_road(name)
    setattr(obj, name, value)


def guarded_delattr(obj: Any, name: str) -> None:
    if isinstance(name, str) and (is_blocked_attribute(name) or (_is_dunder(name) and name not in SETTABLE_DUNDERS)):
        raise AttributeError(f"attribute {name!r} cannot be deleted in intervention code")
    delattr(obj, name)


# A class that intervention code makes, however it makes it (a class statement, ``type()``, enum's functional API, a
# class sent by value), may not carry a refused attribute, whatever its value: ``__array_interface__`` (raw memory by
# address), ``__getattr__`` (through which numpy finds it too), reducers (run by the result writers' pickling,
# outside the step). Nor these, when they are the trace's own functions: a finalizer (run by the garbage collector,
# in any step) and DLPack's export.
CLASS_PROTOCOLS = frozenset({"__del__", "__dlpack__"})


_CLASS_SLOTS = frozenset({"__dict__", "__weakref__"})  # the interpreter's descriptors in every class's dict


def check_class(cls: type) -> type:
    """``cls``, unless it has an attribute that intervention code may not give a class (see `CLASS_PROTOCOLS`)."""
    for name, value in list(vars(cls).items()):
        if not isinstance(name, str) or (name in _CLASS_SLOTS and isinstance(value, types.GetSetDescriptorType)):
            continue
        if is_refused_attribute(name) or (name in CLASS_PROTOCOLS and not is_library_function(value)):
            raise refused(f"a class with the attribute {name!r}")
    return cls


def is_library_function(value: Any) -> bool:
    """Whether ``value`` is a builtin or a function whose source is the installation's (not intervention code's)."""
    code = getattr(value, "__code__", None)
    return isinstance(value, types.BuiltinFunctionType) or (
        isinstance(code, types.CodeType) and _is_installed_code(code.co_filename)
    )


def guarded_type(*args: Any, **kwargs: Any) -> Any:
    """``type(x)``, but not of a class (its metaclass would make classes unchecked), and ``type(name, bases,
    namespace)`` checked as a class statement's class is (`check_class`)."""
    if len(args) == 1 and not kwargs:
        found = type(args[0])
        if issubclass(found, type):
            raise refused("type() of a class (its metaclass makes classes)")
        return found
    return check_class(type(*args, **kwargs))


def guarded_build_class(*args: Any, **kwargs: Any) -> Any:
    """The ``class`` statement, its class checked (`check_class`)."""
    return check_class(builtins.__build_class__(*args, **kwargs))


SAFE_BUILTINS: dict[str, Any] = {
    **{name: value for name, value in vars(builtins).items() if name in ALLOWED_BUILTINS},
    "type": guarded_type,
    "__build_class__": guarded_build_class,
    "__import__": guarded_import,
    "getattr": guarded_getattr,
    "hasattr": guarded_hasattr,
    "setattr": guarded_setattr,
    "delattr": guarded_delattr,
}


# --- code --------------------------------------------------------------------------------------


def _code_objects(code: types.CodeType) -> Iterator[types.CodeType]:
    yield code
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            yield from _code_objects(const)


_ATTRIBUTE_OPS = frozenset({"LOAD_ATTR", "LOAD_METHOD", "STORE_ATTR", "DELETE_ATTR"})
_STORE_OPS = frozenset({"STORE_ATTR", "DELETE_ATTR"})
# Dunder attributes intervention code may set or delete. Any other (``type(x).__del__ = f``,
# ``torch.Tensor.__repr__ = f``) would plant its code where the interpreter calls it implicitly, in any thread
# (a result writer's pickling, the garbage collector), outside the step that set it.
SETTABLE_DUNDERS = frozenset({"__doc__", "__name__", "__qualname__"})


def _is_dunder(name: Any) -> bool:
    return isinstance(name, str) and len(name) > 4 and name.startswith("__") and name.endswith("__")


def check_code(code: types.CodeType) -> bool:
    """Refuse code that names an attribute leading out of the sandbox (``x.__globals__``, ``f.f_back``,
    ``s.format``). Names that are refused only as attributes are looked for in the bytecode's attribute
    instructions (``dis``), so the ``format()`` builtin stays allowed. Returns whether the code names one of
    :data:`ROAD_NAMES`."""
    roads = False
    for each in _code_objects(code):
        for name in each.co_names:
            if is_blocked_attribute(name):
                raise refused(f"the attribute {name!r}")
            roads = roads or name in ROAD_NAMES
        if FORMAT_ATTRIBUTES.isdisjoint(each.co_names) and not any(map(_is_dunder, each.co_names)):
            continue
        for instruction in dis.get_instructions(each):
            if instruction.opname in _ATTRIBUTE_OPS and instruction.argval in FORMAT_ATTRIBUTES:
                raise refused(f"the attribute {instruction.argval!r} (use an f-string)")
            if (
                instruction.opname in _STORE_OPS
                and _is_dunder(instruction.argval)
                and instruction.argval not in SETTABLE_DUNDERS
            ):
                raise refused(f"setting or deleting the attribute {instruction.argval!r}")
    return roads


# --- deserialization ---------------------------------------------------------------------------


def _guarded_subimport(name: str) -> types.ModuleType:
    if not is_allowed_module(name):
        raise refused(f"module {name!r}")
    __import__(name)
    return protect(sys.modules[name])


def _guarded_load_function(*args: Any) -> types.FunctionType:
    from nnsight.intervention.serialization import _load_function

    function = _load_function(*args)
    if check_code(function.__code__):
        _region.roads = True  # the mediator being loaded sent it (`load_mediator`)
    safe = types.FunctionType(
        function.__code__, {"__builtins__": SAFE_BUILTINS}, function.__name__, function.__defaults__
    )
    safe.__kwdefaults__, safe.__annotations__ = function.__kwdefaults__, function.__annotations__
    _made_here(safe)
    return safe


# Functions and classes a payload's own reconstructors built (by id, with a weak reference to tell a reused id):
# the only objects nnsight's ``_fill`` and cloudpickle's ``_class_setstate`` may then change. Named globals
# (a real module's function, torch.Tensor) and the process's own objects are not theirs to change.
_made: dict[int, weakref.ref[Any]] = {}


def _made_here(value: Any) -> None:
    if len(_made) > 100_000:  # dead references; a live one is wanted only while its payload loads
        for key in [key for key, ref in _made.items() if ref() is None]:
            del _made[key]
    _made[id(value)] = weakref.ref(value)


def _require_made_here(value: Any, what: str) -> None:
    ref = _made.get(id(value))
    if ref is None or ref() is not value:
        raise refused(f"{what} on an object the payload did not build ({type(value).__name__})")


def _guarded_fill(function: Any, names: dict[str, Any]) -> None:
    """nnsight's ``_fill`` (a sent function's globals) on a function this payload sent, never a named one (whose
    globals are a real module's)."""
    from nnsight.intervention.serialization import _fill

    _require_made_here(function, "nnsight's _fill")
    _fill(function, names)


def _guarded_skeleton_class(
    type_constructor: Any, name: str, bases: tuple[Any, ...], type_kwargs: dict[str, Any], tracker: Any, extra: Any
) -> type:
    """cloudpickle's ``_make_skeleton_class`` with a metaclass for a constructor (never any callable), and never
    an earlier payload's class (cloudpickle's class tracker, whose ids a payload chooses, is not consulted)."""
    from cloudpickle.cloudpickle import _make_skeleton_class

    if type_constructor is guarded_type:  # builtins.type, as a payload names it
        type_constructor = type
    if not (isinstance(type_constructor, type) and issubclass(type_constructor, type)):
        raise refused(f"a class built by {type(type_constructor).__name__} (only metaclasses build classes)")
    made = check_class(_make_skeleton_class(type_constructor, name, bases, type_kwargs, None, extra))
    _made_here(made)
    return made


def _guarded_skeleton_enum(
    bases: tuple[Any, ...], name: str, qualname: str, members: dict[str, Any], module: str, tracker: Any, extra: Any
) -> type:
    import enum

    from cloudpickle.cloudpickle import _make_skeleton_enum

    if not bases or not isinstance(bases[-1], type) or not issubclass(type(bases[-1]), enum.EnumMeta):
        raise refused("an enum whose last base is not an Enum")
    made = _make_skeleton_enum(bases, name, qualname, members, module, None, extra)
    _made_here(made)
    return made


def _guarded_class_setstate(obj: Any, state: Any) -> Any:
    from cloudpickle.cloudpickle import _class_setstate

    _require_made_here(obj, "cloudpickle's _class_setstate")
    return check_class(_class_setstate(obj, state))


def _tensor_rebuilders() -> frozenset[int]:
    import torch._utils

    return frozenset(id(getattr(torch._utils, name)) for module, name in PRIVATE_GLOBALS if module == "torch._utils")


def _guarded_rebuild_from_type(func: Any, new_type: Any, args: Any, state: Any, *, v2: bool = True) -> Any:
    """torch's ``_rebuild_from_type(_v2)`` (a tensor subclass): it calls ``func`` and sets ``state`` on what it
    returns, so ``func`` must be one of torch's tensor rebuilders and the type a tensor class."""
    import torch
    from torch import _tensor

    if id(func) not in _tensor_rebuilders() or not (isinstance(new_type, type) and issubclass(new_type, torch.Tensor)):
        raise refused("torch's _rebuild_from_type with anything but a tensor rebuilder and a tensor class")
    rebuild = _tensor._rebuild_from_type_v2 if v2 else _tensor._rebuild_from_type
    return rebuild(func, new_type, args, state)


def _storage_from_bytes(data: bytes) -> Any:
    import torch

    return torch.load(io.BytesIO(data), weights_only=True)


def _guarded_builtin_type(name: str) -> type:
    # A bound method (a trace's model call) or a namespace; never code objects, cells or functions.
    if name not in ("MethodType", "SimpleNamespace"):
        _refuse_bytecode()
    return getattr(types, name)


def _refuse_bytecode(*_: Any) -> None:
    raise refused("a function serialized as bytecode (only functions with source code can be sent)")


# Globals a payload may name that would reach anything: replaced by guarded versions.
_REPLACED: dict[tuple[str, str], Any] = {
    ("cloudpickle.cloudpickle", "subimport"): _guarded_subimport,
    ("cloudpickle.cloudpickle", "dynamic_subimport"): _refuse_bytecode,
    ("cloudpickle.cloudpickle", "_make_function"): _refuse_bytecode,
    ("cloudpickle.cloudpickle", "_builtin_type"): _guarded_builtin_type,
    ("nnsight.intervention.serialization", "_load_function"): _guarded_load_function,
    ("torch.storage", "_load_from_bytes"): _storage_from_bytes,
    ("builtins", "getattr"): guarded_getattr,
    ("builtins", "setattr"): guarded_setattr,
    ("builtins", "__import__"): guarded_import,
    ("nnsight.intervention.serialization", "_fill"): _guarded_fill,
    ("cloudpickle.cloudpickle", "_make_skeleton_class"): _guarded_skeleton_class,
    ("cloudpickle.cloudpickle", "_make_skeleton_enum"): _guarded_skeleton_enum,
    ("cloudpickle.cloudpickle", "_class_setstate"): _guarded_class_setstate,
    ("torch._tensor", "_rebuild_from_type_v2"): _guarded_rebuild_from_type,
    ("torch._tensor", "_rebuild_from_type"): lambda func, new_type, args, state: _guarded_rebuild_from_type(
        func, new_type, args, state, v2=False
    ),
}


# Globals with a private part (``torch._utils``, ``VLLM._call``) a payload may name: torch's and numpy's rebuild
# functions, pickle's and cloudpickle's reconstructors, nnsight's own. Any other private name is refused.
PRIVATE_GLOBALS = frozenset(
    {
        *(
            ("torch._utils", name)
            for name in (
                "_rebuild_tensor",
                "_rebuild_tensor_v2",
                "_rebuild_parameter",
                "_rebuild_parameter_with_state",
                "_rebuild_device_tensor_from_numpy",
                "_rebuild_meta_tensor_no_storage",
                "_rebuild_wrapper_subclass",
                "_rebuild_sparse_tensor",
                "_rebuild_nested_tensor",
                "_rebuild_qtensor",
            )
        ),
        ("torch._tensor", "_rebuild_from_type"),
        ("torch._tensor", "_rebuild_from_type_v2"),
        *(
            (package, name)
            for package in ("numpy._core.multiarray", "numpy.core.multiarray")
            for name in ("_reconstruct", "scalar")
        ),
        ("copyreg", "_reconstructor"),
        ("copyreg", "__newobj__"),
        ("copyreg", "__newobj_ex__"),
        ("_codecs", "encode"),
        *(
            ("cloudpickle.cloudpickle", name)
            for name in (
                "_make_skeleton_class",
                "_make_skeleton_enum",
                "_class_setstate",
                "_enum_setstate",
                "_make_cell",
                "_make_empty_cell",
                "_make_dict_keys",
                "_make_dict_values",
                "_make_dict_items",
            )
        ),
        ("enum", "Enum.__new__"),
        ("nnsight.intervention.serialization", "_fill"),
        ("nnsight.modeling.vllm.vllm", "VLLM._call"),  # the function a trace calls, by reference
        ("nnsight.modeling.vllm.vllm", "VLLM._generate"),
        ("nnsight.modeling.transformers", "TransformersModel._call"),
    }
)


def find_class(module: str, name: str) -> Any:
    """The global a payload names, if the protected environment allows it (see the module doc).

    A payload can call whatever it names (pickle's REDUCE), so besides the module's allow-list: no private
    part but :data:`PRIVATE_GLOBALS`, no refused attribute on the way, no module reached through attributes
    (``torch.serialization.os.system``), the value defined in an allowed module (re-exported callables of
    other modules are refused), only classes from the deserialization-only modules (vLLM's, copyreg's,
    cloudpickle's), and none of typing's, dataclasses' or collections' code generators.
    """
    replaced = _REPLACED.get((module, name))
    if replaced is not None:
        return replaced
    if module == "builtins":
        if name not in SAFE_BUILTINS:
            raise refused(f"the builtin {name!r}")
        return SAFE_BUILTINS[name]
    parts = name.split(".")
    package = module.split(".", 1)[0]
    explicit = (module, name) in PRIVATE_GLOBALS or (module, parts[0]) in DESERIALIZATION_GLOBALS
    private = any(part.startswith("_") for part in module.split(".")[1:] + parts)
    if not explicit and (private or not is_allowed_module(module, deserializing=True)):
        raise refused(f"{module}.{name}")
    if any(is_refused_attribute(part) or part in HIDDEN_ATTRIBUTES.get(package, ()) for part in parts):
        raise refused(f"{module}.{name}")
    __import__(module)
    value: Any = sys.modules[module]
    for part in parts:
        value = getattr(value, part)
        if isinstance(value, types.ModuleType):
            raise refused(f"{module}.{name} (a module reached through attributes)")
    refuse_unsafe(value)
    if not explicit:
        defined_in = getattr(value, "__module__", None)
        if isinstance(defined_in, str) and not is_allowed_module(defined_in, deserializing=True):
            raise refused(f"{module}.{name} (defined in {defined_in})")
        if not is_allowed_module(module) and not isinstance(value, type):
            raise refused(f"{module}.{name} (only classes of {module} may be named)")
    return value


class RestrictedUnpickler(pickle.Unpickler):
    """nnsight's unpickler (persistent ids from a map) with the protected environment's globals; what it runs
    while loading counts as intervention code (`running_user_code`)."""

    def __init__(self, file: Any, persistent_objects: dict[Any, Any] | None = None) -> None:
        super().__init__(file)
        self.persistent_objects = persistent_objects or {}

    def persistent_load(self, pid: Any) -> Any:
        from nnsight.intervention.serialization import UnknownPersistentIdError

        if pid in self.persistent_objects:
            return self.persistent_objects[pid]
        raise UnknownPersistentIdError(pid)

    def find_class(self, module: str, name: str) -> Any:
        return find_class(module, name)

    def load(self) -> Any:
        with running_user_code():
            return super().load()


# PRIVATE_GLOBALS a payload may name but never call while it loads (a trace's model call, by reference).
NAMED_ONLY_GLOBALS = frozenset(
    {
        ("nnsight.modeling.vllm.vllm", "VLLM._call"),
        ("nnsight.modeling.vllm.vllm", "VLLM._generate"),
        ("nnsight.modeling.transformers", "TransformersModel._call"),
    }
)
_reconstructors: dict[int, Any] = {}


def _reconstructor_ids() -> dict[int, Any]:
    """What a payload may call while it loads (by id): :data:`PRIVATE_GLOBALS` but :data:`NAMED_ONLY_GLOBALS`,
    and the guarded replacements (:data:`_REPLACED`)."""
    if not _reconstructors:
        values = list(_REPLACED.values())
        for module, name in PRIVATE_GLOBALS - NAMED_ONLY_GLOBALS:
            try:
                values.append(find_class(module, name))
            except (ImportError, AttributeError, ProtectedEnvironmentError):
                continue  # numpy's old or new module name, a helper this cloudpickle lacks
        _reconstructors.update((id(value), value) for value in values)
    return _reconstructors


def _higher_order_classes() -> frozenset[type]:
    """Classes that call what they are given (when iterated, called or read): a payload may not call them, so that
    nothing it loads calls anything but a reconstructor."""
    import functools
    import itertools
    import operator

    found = {map, filter, zip, enumerate, reversed, type, super, property, functools.partial, functools.partialmethod}
    found |= {value for value in vars(itertools).values() if isinstance(value, type)}
    found |= {operator.attrgetter, operator.itemgetter, operator.methodcaller}
    return frozenset(found)


_PythonUnpickler: Any = pickle._Unpickler  # pickle's pure-Python unpickler


class StrictUnpickler(_PythonUnpickler):
    """The protected environment's unpickler where a payload is first loaded (a trace builder's rebuild and check
    of every mediator, before any reaches an engine): :func:`find_class`'s globals, and by opcode what a global's
    name cannot show, that nothing in a payload runs but rebuilding:

    * REDUCE, OBJ and INST call only a reconstructor (`_reconstructor_ids`) or a class that does not call what it
      is given (`_higher_order_classes`, metaclasses): no function of an allowed module (``from_import_path``,
      ``functools.reduce``), no function the payload sent, no object it built (a ``partial``);
    * NEWOBJ builds only instances of classes;
    * BUILD, SETITEM(S), APPEND(S) and ADDITEMS change only objects the payload built: never a global it named (a
      class, a module, a function), an object of this process (a persistent id: the model's modules) or what
      ``getattr`` handed back.

    Pure Python, about 5x the C unpickler's time (a few ms for a mediator): engines load the same bytes with the C
    one (`load_mediator`) after a builder checked them with this one.
    """

    dispatch: ClassVar[dict[int, Any]] = dict(_PythonUnpickler.dispatch)

    def __init__(self, file: Any, persistent_objects: dict[Any, Any] | None = None) -> None:
        super().__init__(file)
        self.persistent_objects = persistent_objects or {}
        self._foreign: dict[int, Any] = {}  # objects the payload did not build, by id (kept alive)

    def persistent_load(self, pid: Any) -> Any:
        from nnsight.intervention.serialization import UnknownPersistentIdError

        if pid not in self.persistent_objects:
            raise UnknownPersistentIdError(pid)
        return self._foreign_value(self.persistent_objects[pid])

    def find_class(self, module: str, name: str) -> Any:
        return self._foreign_value(find_class(module, name))

    def load(self) -> Any:
        with running_user_code():
            return super().load()

    def _foreign_value(self, value: Any) -> Any:
        self._foreign[id(value)] = value
        return value

    def _called(self, function: Any, value: Any) -> Any:
        """``value``, which calling ``function`` returned, noted foreign unless the payload built it."""
        import enum

        if (
            function is guarded_getattr
            or id(value) in self._foreign
            or isinstance(value, (types.ModuleType, types.BuiltinFunctionType, types.MethodType, enum.Enum))
            or (isinstance(value, (type, types.FunctionType)) and id(function) not in _MAKERS)
        ):
            self._foreign[id(value)] = value
        return value

    def _check_callable(self, function: Any) -> None:
        if id(function) in _reconstructor_ids():
            return
        if isinstance(function, type) and not issubclass(function, type) and function not in _higher_order_classes():
            return
        raise refused(f"calling {getattr(function, '__qualname__', type(function).__name__)} while a payload loads")

    def _check_changed(self, target: Any) -> None:
        if id(target) in self._foreign:
            raise refused(f"changing {type(target).__name__} {_short(target)} while a payload loads (not built by it)")

    def _load_reduce(self) -> None:
        args = self.stack.pop()
        function = self.stack[-1]
        self._check_callable(function)
        self.stack[-1] = self._called(function, function(*args))

    def _instantiate(self, klass: Any, args: list[Any]) -> None:
        self._check_callable(klass)
        super()._instantiate(klass, args)
        self.stack[-1] = self._called(klass, self.stack[-1])

    def _load_newobj(self, kwargs: dict[str, Any] | None = None) -> None:
        args = self.stack.pop()
        cls = self.stack.pop()
        if not isinstance(cls, type) or issubclass(cls, type):
            raise refused(f"NEWOBJ of {type(cls).__name__} (only instances of classes are built)")
        self.append(self._called(cls, cls.__new__(cls, *args, **(kwargs or {}))))

    def _load_newobj_ex(self) -> None:
        kwargs = self.stack.pop()
        self._load_newobj(kwargs)

    def _changing(opcode: bytes, depth: int) -> Any:
        original = _PythonUnpickler.dispatch[opcode[0]]

        def load(self: StrictUnpickler) -> None:
            # The target: below the value (and key) on the stack, or below the mark of a batch.
            target = self.stack[-depth] if depth else self.metastack[-1][-1] if self.metastack else None
            self._check_changed(target)
            original(self)

        return load

    dispatch[pickle.REDUCE[0]] = _load_reduce
    dispatch[pickle.NEWOBJ[0]] = _load_newobj
    dispatch[pickle.NEWOBJ_EX[0]] = _load_newobj_ex
    dispatch[pickle.BUILD[0]] = _changing(pickle.BUILD, 2)
    dispatch[pickle.SETITEM[0]] = _changing(pickle.SETITEM, 3)
    dispatch[pickle.APPEND[0]] = _changing(pickle.APPEND, 2)
    dispatch[pickle.SETITEMS[0]] = _changing(pickle.SETITEMS, 0)
    dispatch[pickle.APPENDS[0]] = _changing(pickle.APPENDS, 0)
    dispatch[pickle.ADDITEMS[0]] = _changing(pickle.ADDITEMS, 0)
    del _changing


def _short(value: Any) -> str:
    return repr(getattr(value, "__qualname__", getattr(value, "__name__", "")))[:80]


# Reconstructors whose result is the payload's own (a function it sent, a class it defined).
_MAKERS = frozenset(id(value) for value in (_guarded_load_function, _guarded_skeleton_class, _guarded_skeleton_enum))


class InvalidMediator(NNqueueError, TypeError):
    """A request's mediator bytes loaded, but not as an nnsight ``Mediator``."""


def load_mediator(data: bytes, persistent_objects: dict[Any, Any] | None = None, strict: bool = False) -> Any:
    """A request's mediator bytes (``extra_args["nnsight_mediator"]``) loaded as nnsight's runner loads them
    (``Requests.add``: nnsight's ``loads``), checked: an nnsight ``Mediator``, whose code passes `check_code`
    when the protected environment is installed. ``strict``: with :class:`StrictUnpickler` (a trace builder's
    check of every mediator before it reaches an engine) when the protected environment is installed, else
    nnsight's C unpickler (with `find_class` when installed).

    Anything else (``pickle.dumps(1)``) would be taken for a mediator by the runner and fail inside
    ``execute_model``, which kills the engine every job shares."""
    from nnsight.intervention.interleaver import Mediator
    from nnsight.intervention.serialization import loads

    _region.roads = False
    if strict and _done:
        mediator = loads(data, persistent_objects=persistent_objects, unpickler=StrictUnpickler)
    else:
        mediator = loads(data, persistent_objects=persistent_objects)
    if type(mediator) is not Mediator:
        raise InvalidMediator(
            f"the request's nnsight_mediator holds a {type(mediator).__name__}, not an nnsight Mediator"
        )
    if _done and (check_code(mediator.code) or _region.roads):  # the protected environment is on here
        mediator.nnqueue_roads = True
    return mediator


# --- roads past a tensor's version counter (for nnqueue.enginecore.weights_guard) -------------------------------

_roads_reached = [False]  # a road was reached at run time since `take_roads_reached` last looked


def note_road(name: Any) -> None:
    """Intervention code reached ``name`` by ``getattr``, ``setattr`` or ``__import__``: if it is one of
    :data:`ROAD_NAMES`, mark its mediator (when it runs in one) and the process (`take_roads_reached`)."""
    if name not in ROAD_NAMES:
        return
    _roads_reached[0] = True
    _region.roads = True  # a payload being loaded (its getattr references)
    mediator = getattr(getcurrent(), "mediator", None)  # nnsight sets a weak reference to it
    if isinstance(mediator, weakref.ref):
        mediator = mediator()
    if mediator is not None:
        mediator.nnqueue_roads = True


def opens_roads(mediator: Any) -> bool:
    """Whether this mediator's trace named or reached one of :data:`ROAD_NAMES` (noted only where the protected
    environment is installed: see `installed`)."""
    return bool(getattr(mediator, "nnqueue_roads", False))


def installed() -> bool:
    """Whether :func:`install` ran in this process (roads are noted only then)."""
    return bool(_done)


def take_roads_reached() -> bool:
    """Whether a road was reached at run time since the last call (by any trace, in a step or a finish)."""
    reached, _roads_reached[0] = _roads_reached[0], False
    return reached


# --- installing it in a process ----------------------------------------------------------------

_installed = threading.Lock()
_done: list[bool] = []
_region = threading.local()  # depth: how many `running_user_code` blocks this thread is in
_auditing = threading.local()  # active: the hook is looking at the stack (its own events pass)
_locked: list[bool] = []
_code_roots: list[str] = []  # what intervention code may read: the Python installation's folders
_trusted_code: list[str] = []  # code allowed what `lock_down` refuses: compilers, nnqueue's result upload
_nnsight_roots: list[str] = []  # nnsight's code, which compiles and runs users' blocks, and ast.parse


@contextmanager
def running_user_code() -> Iterator[None]:
    """Mark this thread as running a payload's code (unpickling it, rebuilding it): the audit hook then refuses
    what intervention code may not do (:data:`USER_EVENTS`), whatever greenlet or frame it is in."""
    _region.depth = getattr(_region, "depth", 0) + 1
    try:
        yield
    finally:
        _region.depth -= 1


def install(extra_modules: Iterable[str] = ()) -> None:
    """Protect every nnsight payload this process unpickles and every block it runs; idempotent.

    For processes that run only users' code besides vLLM's and nnsight's own (the engine, a trace
    builder): it changes nnsight's classes process-wide, checks every mediator nnsight's vLLM runner loads
    (`load_mediator`), refuses threads started by intervention code, and adds the audit hook.
    """
    with _installed:
        _extra_modules.update(name.strip() for name in extra_modules if name.strip())
        if _done:
            return
        _done.append(True)
        from nnsight.intervention.interleaver import Mediator
        from nnsight.intervention.serialization import CustomCloudUnpickler
        from nnsight.tracing.util import Scope

        CustomCloudUnpickler.find_class = lambda self, module, name: find_class(module, name)
        unpickler_load = pickle.Unpickler.load

        def load(self: CustomCloudUnpickler) -> Any:
            with running_user_code():
                return unpickler_load(self)

        CustomCloudUnpickler.load = load

        runner = sys.modules.get("nnsight.modeling.vllm.model_runners.GPUModelRunner")
        if runner is not None:  # an engine: the module that loads requests' mediators (Requests.add)
            runner.loads = lambda data, persistent_objects=None: load_mediator(data, persistent_objects)  # type: ignore[attr-defined]

        scope_init = Scope.__init__

        def protected_scope(self: Scope, own: dict[str, Any], shared: dict[str, Any], glbls: dict[str, Any]) -> None:
            scope_init(self, own, shared, glbls)
            dict.__setitem__(self, "__builtins__", SAFE_BUILTINS)  # what exec takes builtins from

        Scope.__init__ = protected_scope

        run = Mediator._run

        def checked_run(self: Mediator) -> None:
            if check_code(self.code):
                self.nnqueue_roads = True
            run(self)

        Mediator._run = checked_run
        _guard_envoy_lookups()
        _guard_attribute_walkers()
        _guard_enum_api()
        _unsafe_values()  # built now, so that the engine's state guard takes them for its reference
        _reconstructor_ids()
        _code_roots.extend(_installation_folders())
        _nnsight_roots.append(os.path.dirname(os.path.realpath(sys.modules["nnsight"].__file__ or "")))
        # ast.parse and symtable.symtable compile to a tree or a symbol table, never to code.
        _nnsight_roots.extend(os.path.realpath(module.__file__ or "") for module in (ast, symtable))
        _guard_threads()
        sys.addaudithook(_audit)


def lock_down() -> None:
    """From now on, refuse :data:`LOCKDOWN_EVENTS` in every thread of this process, not only while intervention
    code runs. Call it once the process is up (an engine: model loaded, sockets connected, graphs compiled)
    and before the first payload; :func:`install` must have run."""
    import importlib.util

    for name in ("triton", "torch._inductor", "torch.utils.cpp_extension"):
        spec = importlib.util.find_spec(name)
        if spec is not None:
            paths = spec.submodule_search_locations or ([spec.origin] if spec.origin else [])
            _trusted_code.extend(os.path.realpath(path) for path in paths)
    # A trainer's NCCL channel (reached only through nnqueue's RPC) loads libnccl with ctypes when it opens.
    _trusted_code.append(os.path.realpath(os.path.join(os.path.dirname(__file__), "weights_update.py")))
    _locked.append(True)


def _installation_folders() -> list[str]:
    """The folders of the Python installation, its packages and nnqueue's: code, which imports read."""
    import sysconfig

    import nnqueue

    folders = {sys.prefix, sys.exec_prefix, sys.base_prefix, sys.base_exec_prefix, os.path.dirname(nnqueue.__file__)}
    folders.update(sysconfig.get_paths().get(key, sys.prefix) for key in ("stdlib", "platstdlib", "purelib", "platlib"))
    return sorted({os.path.realpath(folder) for folder in folders})


def _is_installed_code(filename: str) -> bool:
    """Whether ``filename`` (a code object's) is under the Python installation's folders (a library's source)."""
    return _under(os.path.realpath(filename), _installation_roots())


@functools.cache
def _installation_roots() -> tuple[str, ...]:
    return tuple(_installation_folders())


def _guard_envoy_lookups() -> None:
    """nnsight's ``Envoy.get(path)`` walks a dotted path with the real ``getattr``
    (``model.get("__class__.__init__.__globals__")``), and ``Envoy.__getitem__`` looks a key up with it
    (``model.norm["__class__"]``): each step goes through :func:`guarded_getattr` instead."""
    from nnsight.intervention.envoy import Envoy

    def get(self: Envoy, path: str) -> Any:
        value: Any = self
        for part in str(path).split("."):
            value = guarded_getattr(value, part)
        return value

    original_getitem = Envoy.__getitem__

    def getitem(self: Envoy, key: Any) -> Any:
        if isinstance(key, slice):
            return original_getitem(self, key)
        if isinstance(key, int) and key < 0:
            key += len(self)
        return guarded_getattr(self, str(key))

    get.__doc__, getitem.__doc__ = Envoy.get.__doc__, original_getitem.__doc__
    Envoy.get = get
    Envoy.__getitem__ = getitem


def _guard_attribute_walkers() -> None:
    """Library classes that look attributes up by a name they are given, with the real ``getattr``, each step
    through :func:`guarded_getattr` instead: nnsight's ``CacheView`` walks a dotted key (``cache["a.__globals__"]``,
    the object reached kept as its ``_envoy``), numpy.ma's function wrappers take any numpy attribute by name
    (``type(numpy.ma.arange)("load", "", "")._func``: ``numpy.load``, or a private module)."""
    from nnsight.intervention.cache import CacheView
    from numpy.ma import core

    def child(self: CacheView, name: str) -> Any:
        if self._envoy is None:
            model = self._cache.model
            if name == model.path:
                return model
            return guarded_getattr(model, name)
        if name.lstrip("-").isdigit():
            return self._envoy[int(name)]
        return guarded_getattr(self._envoy, name)

    child.__doc__ = CacheView._child.__doc__
    CacheView._child = child

    from numpy.ma import extras

    # numpy.ma's wrappers of numpy functions by name: _convert2ma keeps getattr(numpy, name) as its _func;
    # _frommethod and the _fromnxfunction classes look the name up (on numpy, or the array's class) when called.
    # Which classes define the constructor differs between numpy's versions (2.3: the _fromnxfunction base; the
    # GPU images' numpy: not that name): each that defines one is checked.
    for module in (core, extras):
        for name, wrapper in list(vars(module).items()):
            if (
                isinstance(wrapper, type)
                and name.startswith(("_convert2ma", "_frommethod", "_fromnxfunction"))
                and "__init__" in vars(wrapper)
            ):
                wrapper.__init__ = _checked_numpy_name(wrapper.__init__)  # type: ignore[misc]


def _checked_numpy_name(init: Any) -> Any:
    def __init__(self: Any, funcname: Any, *args: Any, **kwargs: Any) -> None:
        if (
            not isinstance(funcname, str)
            or funcname.startswith("_")
            or is_refused_attribute(funcname)
            or funcname in HIDDEN_ATTRIBUTES["numpy"]
        ):
            raise refused(f"numpy.ma's wrapper of numpy.{funcname}")
        init(self, funcname, *args, **kwargs)
        function = getattr(self, "_func", None)
        if isinstance(function, types.ModuleType):
            raise refused(f"numpy.ma's wrapper of the module numpy.{funcname}")
        refuse_unsafe(function)

    __init__.__doc__ = init.__doc__
    return __init__


def _guard_enum_api() -> None:
    """enum's functional API (``Enum("E", [("__array_interface__", d)])``) makes dunder names class attributes:
    its classes are checked as a class statement's are (`check_class`)."""
    import enum

    create = getattr(enum.EnumType, "_create_")  # noqa: B009 - private to enum, not in its stubs

    def _create_(cls: Any, *args: Any, **kwargs: Any) -> Any:
        return check_class(create(cls, *args, **kwargs))

    setattr(enum.EnumType, "_create_", _create_)  # noqa: B010


def _guard_threads() -> None:
    """Refuse to start a thread from intervention code: the thread would run outside the mediator's greenlet
    and the frames the audit hook recognises. ``threading``, ``concurrent.futures`` and ``_thread`` all start
    threads through ``_thread.start_new_thread``."""
    import _thread

    start = _thread.start_new_thread

    def start_new_thread(function: Any, args: tuple[Any, ...], kwargs: dict[str, Any] | None = None) -> int:
        if _in_user_code():
            raise refused("starting a thread")
        return start(function, args) if kwargs is None else start(function, args, kwargs)

    _thread.start_new_thread = _thread.start_new = start_new_thread
    threading._start_new_thread = start_new_thread  # type: ignore[attr-defined]


def _stack_holds(test: Any) -> bool:
    """Whether a frame of this thread's stack (above the caller) passes ``test``; audit events of its own pass."""
    _auditing.active = True
    try:
        frame: types.FrameType | None = sys._getframe(2)
        while frame is not None:
            if test(frame):
                return True
            frame = frame.f_back
        return False
    finally:
        _auditing.active = False


def _in_user_code() -> bool:
    """Whether intervention code is running: a mediator's greenlet, a payload being unpickled or rebuilt, or a
    frame of users' code (its builtins are :data:`SAFE_BUILTINS`) anywhere on this thread's stack, which also
    finds a hook or callback the user's code left to be called later."""
    if getattr(getcurrent(), "mediator", None) is not None or getattr(_region, "depth", 0) > 0:
        return True
    return _stack_holds(lambda frame: frame.f_builtins is SAFE_BUILTINS)


def _importing() -> bool:
    """Whether the import system is loading a module for intervention code (an allowed import, or one torch
    makes lazily): its frames are more recent on the stack than any frame of users' code. What the module's own
    code does then (read its files, define namedtuples and dataclasses) is the installed module's, not the user's."""
    _auditing.active = True
    try:
        frame: types.FrameType | None = sys._getframe(2)
        while frame is not None:
            if frame.f_builtins is SAFE_BUILTINS:
                return False
            if frame.f_code.co_filename.startswith("<frozen importlib._bootstrap"):
                return True
            frame = frame.f_back
        return False
    finally:
        _auditing.active = False


def _under(path: str, roots: Iterable[str]) -> bool:
    return any(path == root or path.startswith(root + os.sep) for root in roots)


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event not in _WATCHED_EVENTS or getattr(_auditing, "active", False):
        return
    if event in INTROSPECTION_EVENTS:
        if _caller().f_builtins is SAFE_BUILTINS:
            raise refused(f"the operation {event!r}")
        return
    user = _in_user_code()
    if (
        _locked
        and event in LOCKDOWN_EVENTS
        and not user
        and not _unix_socket(event, args)
        and not _stack_holds(lambda frame: _under(frame.f_code.co_filename, _trusted_code))
    ):
        raise refused(f"the operation {event!r} in this process (it runs users' code)")
    if not user:
        return
    if _importing():
        return  # an installed module being imported (its own code generators included)
    caller = _caller().f_code.co_filename
    if event in CODE_EVENTS:
        if not _under(caller, _nnsight_roots):
            raise refused(f"{event} from {caller} (code generated from strings runs with the real builtins)")
    elif event == "open":
        if not _readable_code(*args):
            raise refused(f"opening {args[0]!r}")
    elif event in USER_EVENTS:
        raise refused(f"the operation {event!r}")


def _caller() -> Any:
    """The frame that raised the audit event being handled."""
    _auditing.active = True
    try:
        return sys._getframe(2)
    finally:
        _auditing.active = False


def _unix_socket(event: str, args: tuple[Any, ...]) -> bool:
    import socket

    return event in SOCKET_EVENTS and getattr(args[0], "family", None) == socket.AF_UNIX


def _readable_code(path: Any, mode: Any, flags: Any) -> bool:
    """Whether an ``open`` (builtin, ``os.open`` or ``io.open_code``) only reads a file of the Python installation."""
    writes = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    if (isinstance(flags, int) and flags & writes) or (isinstance(mode, str) and set(mode) & set("wax+")):
        return False
    if not isinstance(path, (str, bytes)):
        return False  # a file descriptor
    return _under(os.path.realpath(os.fsdecode(path)), _code_roots)
