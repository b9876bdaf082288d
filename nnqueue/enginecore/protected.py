"""The protected environment: what intervention code may import and call, where it is unpickled and run.

Modelled on NDIF's sandbox (ndif-team/ndif, ``services/ray/nn/security``): an allow-list of modules and
builtins, enforced at the two places a trace's code enters a process:

* **Deserialization.** nnsight payloads are cloudpickle. :class:`RestrictedUnpickler` (also installed
  as ``find_class`` of nnsight's ``CustomCloudUnpickler`` by :func:`install`) resolves only globals of
  allow-listed modules, hands back guarded versions of the few loaders that can reach anything
  (cloudpickle's ``subimport``, ``builtins.getattr``, nnsight's ``_load_function``, torch's
  ``_load_from_bytes``), and refuses bytecode functions (nnsight serializes code by source).
* **Execution.** Every captured block nnsight runs executes in a ``nnsight.tracing.util.Scope``
  (``Mediator._run``, ``VLLMTracer.prepare``, ``tracer.iter``); :func:`install` puts
  :data:`SAFE_BUILTINS` in each scope, so the block's ``import`` goes through :func:`guarded_import` and
  only allow-listed builtins resolve (no ``open``, ``exec``, ``eval``, ``compile``...). Modules reach user
  code wrapped in :class:`ProtectedModule` (no non-allow-listed submodules, no private attributes, no
  file I/O such as ``torch.load``, no ``operator.attrgetter``, read-only). Before a block or a deserialized function first runs, its
  code is refused if it names introspection attributes that lead out of the sandbox (``__globals__``,
  ``__subclasses__``, ``f_back``, ...). While intervention code runs (a mediator's greenlet), an audit
  hook refuses process creation, sockets, ctypes and signals.

A refused import fails the job with ``ImportError: module 'os' is not allowed in intervention code...``.

This is defence in depth, not a security boundary: Python cannot be sandboxed from inside (C
extensions, ``str.format`` reaching attributes, bugs in the allow-listed libraries). The boundary is
the process isolation of :mod:`nnqueue.isolation`: no secrets in the process, an unprivileged user.

nnsight internals relied on (0.8.1): ``serialization.CustomCloudUnpickler`` and ``_load_function``,
``tracing.util.Scope``, ``intervention.interleaver.Mediator._run`` (checked, then run) and the
``mediator`` attribute nnsight sets on a mediator's greenlet.

Use in a process that unpickles or runs payloads (an engine, a trace builder)::

    protected.install(extra_modules)          # once, before the first payload
    RequestModel.deserialize(payload, objects, unpickler=protected.RestrictedUnpickler)
"""

from __future__ import annotations

import builtins
import io
import pickle
import sys
import threading
import types
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

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
        "numpy.ctypeslib",
        "numpy.distutils",
        "numpy.f2py",
        "numpy.testing",
        "nnsight.ndif",
        "nnsight.intervention.backends",
        "nnsight.modeling.vllm.serve",
    }
)
# Only for unpickling: what nnsight's payloads are built from, beside the allowed modules.
DESERIALIZATION_MODULES = frozenset(
    {"copyreg", "collections", "cloudpickle", "_codecs", "vllm.sampling_params", "vllm.model_executor.layers"}
)
# Single globals a payload may name (the engine's model class: a trace's model call is its bound method).
DESERIALIZATION_GLOBALS = frozenset({("nnqueue.engines.platform", "EngineVLLM")})
# Attributes of allowed modules that read or write files, or reach any attribute by name.
HIDDEN_ATTRIBUTES = {
    "operator": frozenset({"attrgetter", "methodcaller"}),
    "_operator": frozenset({"attrgetter", "methodcaller"}),
    "torch": frozenset({"load", "save", "from_file"}),
    "numpy": frozenset(
        {"load", "save", "savez", "savez_compressed", "savetxt", "loadtxt", "genfromtxt", "fromfile", "memmap"}
    ),
}
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
# Audit events refused anywhere in a mediator's greenlet (intervention code and what it calls).
PROCESS_EVENTS = frozenset(
    {
        "os.system",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "os.fork",
        "os.forkpty",
        "os.kill",
        "os.killpg",
        "os.putenv",
        "os.unsetenv",
        "os.chmod",
        "os.chown",
        "os.remove",
        "os.rename",
        "subprocess.Popen",
        "pty.spawn",
        "socket.connect",
        "socket.bind",
        "socket.sendto",
        "socket.sendmsg",
        "ctypes.dlopen",
        "ctypes.dlsym",
        "ctypes.call_function",
        "ctypes.string_at",
        "ctypes.PyObj_FromPtr",
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


class ProtectedEnvironmentError(NNqueueError, ImportError):
    """Intervention code asked for something the protected environment does not allow."""


_extra_modules: set[str] = set()


def is_allowed_module(name: str, deserializing: bool = False) -> bool:
    """Whether module ``name`` (or its package) is allow-listed and not a blocked submodule."""
    parts = name.split(".")
    prefixes = {".".join(parts[: index + 1]) for index in range(len(parts))}
    if prefixes & BLOCKED_SUBMODULES:
        return False
    allowed = ALLOWED_MODULES | _extra_modules
    if deserializing:
        allowed = allowed | DESERIALIZATION_MODULES
    return bool(prefixes & allowed)


def is_blocked_attribute(name: str) -> bool:
    return name in BLOCKED_ATTRIBUTES


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
    """``__import__`` for intervention code: allowed modules only, returned protected."""
    if level:
        raise refused(f"relative import of {name!r}")
    if not is_allowed_module(name):
        raise refused(f"module {name!r}")
    module = builtins.__import__(name, None, None, fromlist, 0)
    return protect(module)


# --- builtins ----------------------------------------------------------------------------------


def guarded_getattr(obj: Any, name: str, *default: Any) -> Any:
    if isinstance(name, str) and is_blocked_attribute(name):
        raise AttributeError(f"attribute {name!r} is not available in intervention code")
    value = getattr(obj, name, *default)
    return protect(value) if isinstance(value, types.ModuleType) else value


def guarded_hasattr(obj: Any, name: str) -> bool:
    try:
        guarded_getattr(obj, name)
    except AttributeError:
        return False
    return True


def guarded_setattr(obj: Any, name: str, value: Any) -> None:
    if isinstance(name, str) and is_blocked_attribute(name):
        raise AttributeError(f"attribute {name!r} cannot be set in intervention code")
    setattr(obj, name, value)


def guarded_delattr(obj: Any, name: str) -> None:
    if isinstance(name, str) and is_blocked_attribute(name):
        raise AttributeError(f"attribute {name!r} cannot be deleted in intervention code")
    delattr(obj, name)


SAFE_BUILTINS: dict[str, Any] = {
    **{name: value for name, value in vars(builtins).items() if name in ALLOWED_BUILTINS},
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


def check_code(code: types.CodeType) -> None:
    """Refuse code that names an attribute leading out of the sandbox (``x.__globals__``, ``f.f_back``)."""
    for each in _code_objects(code):
        for name in each.co_names:
            if is_blocked_attribute(name):
                raise refused(f"the attribute {name!r}")


# --- deserialization ---------------------------------------------------------------------------


def _guarded_subimport(name: str) -> types.ModuleType:
    if not is_allowed_module(name):
        raise refused(f"module {name!r}")
    __import__(name)
    return protect(sys.modules[name])


def _guarded_load_function(*args: Any) -> types.FunctionType:
    from nnsight.intervention.serialization import _load_function

    function = _load_function(*args)
    check_code(function.__code__)
    safe = types.FunctionType(
        function.__code__, {"__builtins__": SAFE_BUILTINS}, function.__name__, function.__defaults__
    )
    safe.__kwdefaults__, safe.__annotations__ = function.__kwdefaults__, function.__annotations__
    return safe


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
}


def find_class(module: str, name: str) -> Any:
    """The global a payload names, if the protected environment allows it (see the module doc)."""
    replaced = _REPLACED.get((module, name))
    if replaced is not None:
        return replaced
    if module == "builtins":
        if name not in SAFE_BUILTINS:
            raise refused(f"the builtin {name!r}")
        return SAFE_BUILTINS[name]
    allowed = (
        is_allowed_module(module, deserializing=True) or (module, name.split(".", 1)[0]) in DESERIALIZATION_GLOBALS
    )
    if not allowed or any(map(is_blocked_attribute, name.split("."))):
        raise refused(f"{module}.{name}")
    if name in HIDDEN_ATTRIBUTES.get(module.split(".", 1)[0], ()):
        raise refused(f"{module}.{name}")
    __import__(module)
    value = sys.modules[module]
    for part in name.split("."):
        value = getattr(value, part)
    return value


class RestrictedUnpickler(pickle.Unpickler):
    """nnsight's unpickler (persistent ids from a map) with the protected environment's globals."""

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


# --- installing it in a process ----------------------------------------------------------------

_installed = threading.Lock()
_done: list[bool] = []


def install(extra_modules: Iterable[str] = ()) -> None:
    """Protect every nnsight payload this process unpickles and every block it runs; idempotent.

    For processes that run only users' code besides vLLM's and nnsight's own (the engine, a trace
    builder): it changes nnsight's classes process-wide.
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

        scope_init = Scope.__init__

        def protected_scope(self: Scope, own: dict[str, Any], shared: dict[str, Any], glbls: dict[str, Any]) -> None:
            scope_init(self, own, shared, glbls)
            dict.__setitem__(self, "__builtins__", SAFE_BUILTINS)  # what exec takes builtins from

        Scope.__init__ = protected_scope

        run = Mediator._run

        def checked_run(self: Mediator) -> None:
            check_code(self.code)
            run(self)

        Mediator._run = checked_run
        sys.addaudithook(_audit)


_auditing = threading.local()


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if event in PROCESS_EVENTS:
        if getattr(getcurrent(), "mediator", None) is not None:
            raise refused(f"the operation {event!r}")
    elif event in INTROSPECTION_EVENTS and not getattr(_auditing, "active", False):
        _auditing.active = True  # sys._getframe raises an event of its own
        try:
            caller = sys._getframe(1)
        finally:
            _auditing.active = False
        if caller.f_builtins is SAFE_BUILTINS:
            raise refused(f"the operation {event!r}")
