"""A shared engine's state beyond its weights is read-only to traces too: what a trace changed is put back before
the next step, and who changed it answers for it.

The weights guard (:mod:`nnqueue.enginecore.weights_guard`) keeps the engine's tensors: parameters, buffers
(``rotary_emb.cos_sin_cache``) and tensors held as plain attributes (an attention layer's scales), but not the
KV cache, which every step writes. Everything else that makes a later job's result is plain Python objects, and
a trace holds them (nnsight hands it the real modules; ``type()`` hands it their classes):

* every module's attributes (``model.norm._module.variance_epsilon = 1e4``: a float rebound), its hooks
  (``register_forward_hook``: an entry added to ``_forward_hooks``; PyTorch's global hooks too), its
  ``_parameters``/``_buffers``/``_modules`` tables, and the objects a module holds (an attention layer's
  ``impl``, a layer's ``quant_method``, nnsight's per-module ``State`` and controller ``forward``);
* the classes those objects are instances of, with their bases (``RMSNorm.forward_native = f``), and
  ``torch.Tensor``;
* torch's modes active on the engine's thread (a ``TorchFunctionMode`` or ``TorchDispatchMode`` entered and left
  active, ``torch.device("meta")`` entered: each sees every later torch call there, other owners' steps too);
* torch's global settings that change other jobs' numbers or fail their steps (matmul precision, reduced-precision
  reductions, cuDNN's and oneDNN's switches, deterministic algorithms, the default dtype, autocast on the engine's
  thread), and flush-to-zero of denormals (``torch.set_flush_denormal``, which has no getter: set back every time);
* torch's random seeds (``torch.manual_seed``: vLLM samples the requests without a seed of their own from the
  default generators), put back to the seed they had; a trust-domain switch seeds them afresh (`StateGuard.reseed`);
* nnsight's interleaver, which every request reaches (``client.interleaver``), and its batcher and fragments: their
  attribute names, the types of what each step rebinds (``mediators``, ``busy``) and the identity of the rest
  (``il.handle = f`` saw every later request's modules, other domains' too: `_Shape`);
* pickling's registries (``copyreg.dispatch_table``, ``copy``'s, torch's location taggers), which the result
  writers consult for every later result (`REGISTRIES`);
* the warnings filters and the ``warnings`` module's globals (lazy: ``catch_warnings`` rebinds them for a while),
  and libraries' configuration objects (``nnsight.CONFIG``, walked as a module's attributes are);
* the engine's own code that results pass through: the module globals and classes of nnqueue's engine package
  (the result writer ``trace_results.write_saves``, the sinks, ``WeightsGuard.check``, the RPCs), nnsight's, the
  model's layers' modules, torch's, ``builtins`` and the serializers', and the protected environment's
  configuration (``protected._WATCHED_EVENTS``, ``SAFE_BUILTINS``, the allow-lists, the audit hook's per-thread
  switches).

`StateGuard` takes all of that once, when the engine is up (`accept_current`): each container (a ``__dict__``, a
hook table, a class's dict, an object's slots, a list or set) with a shallow copy of its entries. A check
(`StateGuard.check`) compares every entry by identity, never by ``==`` (a value's own ``__eq__`` is code a trace
could have written), in a few C-level passes over all containers at once (``map(operator.is_, ...)`` over
``itertools.chain``), paid only after a step or finish in which a trace's code ran: on one H200, the trace rows of
``benchmarks/harvest_gpu.py`` (a Llama-3-8B shape) with the guards and without them differ by less than their
run-to-run spread (``benchmarks/results/h200-bench-tp1-v9-trace-guard-{on,off}.json``). A container that differs is
put back entry by entry (a rebound or deleted entry restored, an added one removed), and its name is reported.

Some changes may be the engine's own work that a trace triggered, not the trace's doing: nnsight's
``.source`` instruments a module's forward on first use (its ``State``, the ``FORWARD_CACHE`` memo), a lazily
imported submodule or name appears in a package's globals. These are *lazy* changes: put back too (nnsight
instruments again when next asked), but a trace alone in its step is not failed for them; every other change is
*strict*. Who is failed is the worker mixin's (:mod:`nnqueue.enginecore.weights_guard`): a trace alone in the
step that changed something strict fails with ``StateModified``; traces that shared such a step (or a lazy
change) are each run again alone (``StateModifiedInSharedStep``), so that only the one that changes the state
again is failed.

What it cannot see: a change to an object it does not hold (a class that is none of the above, a library's
module-level cache, a mode left on a thread other than the engine's), a generator set back to the state its seed
starts (``torch.manual_seed(torch.initial_seed())``: the same seed), a write through a tensor alias into memory
that no guarded tensor owns, and anything done with an escape from the protected environment that also rewrites
the guard itself. Trust domains are the boundary (docs/operator/security.md); this bounds what a trace can do to
the other jobs of its own domain.
"""

from __future__ import annotations

import ctypes
import enum
import logging
import operator
import sys
import types
import warnings
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from itertools import chain
from typing import Any

import torch

from nnqueue.enginecore import protected

log = logging.getLogger(__name__)
_MISSING = object()
_proxy_values = types.MappingProxyType.values
# Attributes the interpreter itself adds to a class or a module as caches (copyreg's ``__slotnames__`` when an
# instance is first copied or pickled, a class's empty ``__annotations__`` when first read, the warnings module's
# ``__warningregistry__``): kept when they appear, not reported.
INTERPRETER_CACHES = frozenset({"__slotnames__", "__annotations__", "__warningregistry__"})


def _tuple_layout_holds() -> bool:
    """Whether a tuple's items are an array of object pointers at ``tuple.__basicsize__`` (CPython's layout), so
    that two tuples hold the same objects exactly when those bytes are equal (`_pointers`)."""
    items = (object(), object(), 1.5)
    same, other = tuple(list(items)), (items[0], object(), items[2])
    return (
        sys.implementation.name == "cpython"
        and tuple.__itemsize__ == ctypes.sizeof(ctypes.c_void_p)
        and _pointers(items) == _pointers(same)
        and _pointers(items) != _pointers(other)
        and len(_pointers(items)) == 3 * tuple.__itemsize__
    )


def _pointers(items: tuple[Any, ...]) -> bytes:
    """The addresses of ``items``' objects, as bytes: read from the tuple's own item array (one copy, no per-item
    work), so comparing two of them compares identities, with no object's ``__eq__`` involved."""
    size = len(items) * tuple.__itemsize__
    return (ctypes.c_char * size).from_address(id(items) + tuple.__basicsize__).raw


class _Identities:
    """A sequence of objects compared with another by identity, item by item: as the bytes of their addresses where
    CPython's tuple layout allows it (a few nanoseconds an item), else with ``operator.is_`` (about ten times
    that). Keeps the objects, so their addresses stay theirs."""

    fast = False

    def __init__(self, items: Iterable[Any]) -> None:
        self.items = tuple(items)
        self.raw = _pointers(self.items) if _Identities.fast else b""

    def same(self, items: Iterable[Any]) -> bool:
        if _Identities.fast:
            now = tuple(items)
            return len(now) == len(self.items) and _pointers(now) == self.raw
        return _all_identical(items, self.items)


def _all_identical(items: Iterable[Any], saved: tuple[Any, ...]) -> bool:
    now = tuple(items)
    return len(now) == len(saved) and all(map(operator.is_, now, saved))


_Identities.fast = _tuple_layout_holds()


class Kind(enum.Enum):
    DICT = "dict"  # a real dict: a __dict__, a hook table, module globals
    CLASS = "class"  # a class's dict (a mappingproxy): restored with setattr
    SLOTS = "slots"  # an object's __slots__
    SEQUENCE = "sequence"  # a list, set or deque


@dataclass
class Changes:
    """What a check found and put back: ``strict`` (a trace's doing) and ``lazy`` (possibly the engine's own work
    a trace triggered) container names."""

    strict: list[str] = field(default_factory=list)
    lazy: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.strict or self.lazy)


@dataclass
class _Container:
    name: str
    kind: Kind
    target: Any  # the dict, the class, the object with slots, the list or set
    lazy: bool  # a change here may be the engine's own (see the module doc)
    slots: tuple[str, ...] = ()
    saved: Any = None  # dict: a shallow copy; slots: their values; sequence: a list of its items
    module: str | None = None  # a module's globals: its name (a submodule appearing is the import system's)
    owner: Any = None  # the object whose __dict__ this is (its class is checked too: ``obj.__class__ = X``)
    owner_class: type | None = None
    registry: bool = False  # entries the installation's code adds are kept (`REGISTRIES`)
    modules: frozenset[str] = frozenset()  # a registry's: the modules imported when ``saved`` was taken


# The tag nnsight's serializer puts on the engine's shared objects when a result holds them (an envoy's interleaver,
# the model's tokenizer): their persistent ids.
_TAG, _SHARED_TAGS = "_persistent_id", frozenset({"Interleaver", "Tokenizer"})
# Values an object's step may rebind (a flag, the step's mediators, a rebuilt index): only their type is kept.
_REBOUND = (bool, int, float, str, type(None), list, set, dict)


@dataclass
class _Shape:
    """An object every step changes by rebinding its attributes (nnsight's interleaver: ``mediators``, ``busy``,
    ``parked``): its attribute names are fixed, a value of `_REBOUND` keeps its exact type (a trace's ``dict``
    subclass, or its function bound over a method, ``il.handle = f``, is neither), and any other value its
    identity (the interleaver's batcher, its fragments)."""

    name: str
    target: Any
    fixed: dict[str, Any]
    rebound: dict[str, Any]  # name: the value at the reference (a copy, for a container), put back as a copy

    @classmethod
    def of(cls, obj: Any) -> _Shape:
        attributes = vars(obj)
        rebound = {key: _copy(value) for key, value in attributes.items() if type(value) in _REBOUND}
        fixed = {key: value for key, value in attributes.items() if key not in rebound}
        return cls(f"{type(obj).__module__}.{type(obj).__qualname__} (the engine's)", obj, fixed, rebound)

    def holds(self) -> bool:
        attributes = vars(self.target)
        return (
            len(attributes) == len(self.fixed) + len(self.rebound)
            and all(attributes.get(key, _MISSING) is value for key, value in self.fixed.items())
            and all(type(attributes.get(key, _MISSING)) is type(value) for key, value in self.rebound.items())
        )

    def put_back(self) -> bool:
        """Whether it had changed; it holds again. The tag nnsight's serializer puts on the interleaver of an envoy
        it pickles, or on the tokenizer (``_persistent_id = "Interleaver"``: a result that holds envoys), is kept."""
        attributes = vars(self.target)
        if attributes.get(_TAG) in _SHARED_TAGS:
            self.fixed[_TAG] = attributes[_TAG]
        if self.holds():
            return False
        for key in [key for key in attributes if key not in self.fixed and key not in self.rebound]:
            log.warning("%s: %r was added; removed", self.name, key)
            del attributes[key]
        attributes.update(self.fixed)
        for key, value in self.rebound.items():
            if type(attributes.get(key, _MISSING)) is not type(value):
                log.warning("%s: %r was replaced by another type; put back", self.name, key)
                attributes[key] = _copy(value)
        return True


def _copy(value: Any) -> Any:
    return type(value)(value) if isinstance(value, (list, set, dict)) else value


class StateGuard:
    """The state of ``model`` and of the engine's code as they are now; `check` puts them back (see the module doc).

    ``exclude``: objects never to walk into (the weights guard's tensors are compared there, the KV cache is
    written by every step)."""

    def __init__(
        self,
        model: torch.nn.Module,
        roots: Iterable[Any] = (),
        modules: Iterable[str] = (),
        shaped: Iterable[Any] = (),
    ) -> None:
        self.model = model
        self.roots = list(roots)  # objects of the engine whose classes (and their modules) are watched too
        self.extra_modules = list(modules)
        self.shaped = list(shaped)  # objects whose attributes every step rebinds (`_Shape`)
        self.containers: list[_Container] = []
        self.shapes: list[_Shape] = []
        self.accept_current()

    # --------------------------------------------------------------------------------------- reference

    def accept_current(self) -> None:
        """Take the state as it is now for the reference (at start, and after nnqueue's own legitimate changes:
        a harvest's or steering job's hooks installed, weights loaded)."""
        # The protected environment's memos, filled once on first use (an envoy tree's unpickling fills them in an
        # engine without the environment installed): filled now, so that their filling is no change of a trace's.
        protected._unsafe_values()
        protected._reconstructor_ids()
        # torch.compile's first use patches nn.Module's __init__ and __setstate__ (once, process-wide): patched
        # now, as that first use would, so that a step that compiles first is not taken for a trace's change.
        from torch._dynamo.mutation_guard import install_generation_tagging_init

        install_generation_tagging_init()
        # The shaped objects' classes too: a fourth red-team round put a method on the tokenizer's class (vLLM's
        # CachedTokenizer), which the engine calls after every step of every domain.
        walk = _Walk(self.model, [*self.roots, *self.shaped], self.extra_modules)
        self.containers = list(walk.containers())
        imported = frozenset(sys.modules)
        for container in self.containers:
            container.saved, container.modules = _read(container), imported
        self.shapes = [_Shape.of(obj) for obj in self.shaped]
        self._modes = _torch_modes()
        self._seeds = _seeds()
        self._settings = _torch_settings()
        self._freeze()

    def reseed(self, seed: int) -> None:
        """Seed torch's random generators with ``seed`` and take it for the reference: at a trust-domain switch, a
        fresh seed (the same on every rank) ends what the domain before could know of the generators' state (it can
        read the seed and restart its sequence, ``torch.manual_seed(torch.initial_seed())``, which no check sees)."""
        torch.manual_seed(seed)
        self._seeds = _seeds()

    def accept_hooks(self) -> None:
        """Take the modules' hook tables as they are now (nnqueue installed a harvest's or a steering job's hooks).
        Called at every steering job's begin: the flat views are rebuilt only when a table changed (most begins
        install no hook: the points' hooks stay installed), a walk of everything the guard holds otherwise."""
        changed = False
        for container in self.containers:
            if container.name.endswith(_HOOK_SUFFIXES) and not _read_matches(container):
                container.saved = _read(container)
                changed = True
        if changed:
            self._freeze()

    def _freeze(self) -> None:
        """The flat views the fast check compares."""
        groups: dict[Kind, list[_Container]] = {kind: [] for kind in Kind}
        for container in self.containers:
            groups[container.kind].append(container)
        dicts, classes = groups[Kind.DICT], groups[Kind.CLASS]
        slots, sequences = groups[Kind.SLOTS], groups[Kind.SEQUENCE]
        self._dicts = [container.target for container in dicts]
        self._classes = [container.target.__dict__ for container in classes]
        self._slot_getters = [operator.attrgetter(*container.slots, "__class__") for container in slots]
        self._slot_objects = [container.target for container in slots]
        self._sequences = [container.target for container in sequences]
        self._typed = [container.owner for container in self.containers if container.owner is not None]
        self._lengths = [len(container.saved) for container in (*dicts, *classes, *sequences)]
        self._saved = _Identities(
            chain(
                chain.from_iterable(container.saved for container in dicts),
                chain.from_iterable(container.saved.values() for container in dicts),
                chain.from_iterable(container.saved for container in classes),
                chain.from_iterable(container.saved.values() for container in classes),
                chain.from_iterable(container.saved for container in slots),
                chain.from_iterable(container.saved for container in sequences),
                map(type, self._typed),
            )
        )

    def _now(self) -> Iterator[Any]:
        """What `_freeze` saved, read again now, in the same order."""
        return chain(
            chain.from_iterable(self._dicts),
            chain.from_iterable(map(dict.values, self._dicts)),
            chain.from_iterable(self._classes),
            chain.from_iterable(map(_proxy_values, self._classes)),
            chain.from_iterable(map(operator.call, self._slot_getters, self._slot_objects)),
            chain.from_iterable(self._sequences),
            map(type, self._typed),
        )

    # --------------------------------------------------------------------------------------- checks

    def check(self) -> Changes:
        """What changed since the reference, each container put back as it was (see the module doc)."""
        found = Changes()
        torch.set_flush_denormal(False)  # no getter: always put back (the engine never sets it)
        if self._unchanged():
            return found
        if not _switches_off():
            _switch_off()
            found.strict.append(_SWITCHES)
        if not _same_modes(self._modes):
            _put_back_modes(self._modes)
            found.strict.append(_MODES)
        if _seeds() != self._seeds:
            _put_back_seeds(self._seeds)
            found.strict.append(_SEEDS)
        if changed_settings := _put_back_settings(self._settings):
            found.strict.append(f"{_SETTINGS} ({', '.join(changed_settings)})")
        for container in self.containers:
            obj, cls = container.owner, container.owner_class
            if obj is not None and cls is not None and type(obj) is not cls:
                _restore_class(obj, cls)
                found.strict.append(f"the class of {type(obj).__qualname__} object")
        found.strict.extend(shape.name for shape in self.shapes if shape.put_back())
        for container in self.containers:
            if _read_matches(container):
                continue
            restored = self._restore(container)
            if restored is _Restored.NOTHING:
                continue  # only what the import system adds (a submodule imported meanwhile): taken as it is
            lazy = container.lazy or restored is _Restored.ADDED_GLOBALS
            (found.lazy if lazy else found.strict).append(container.name)
        self._freeze()  # a restore keeps each container's object, but a submodule taken changes the views
        return found

    def _unchanged(self) -> bool:
        """Every container's entries, read in a few C-level passes, are the saved objects (see `_Identities`)."""
        try:
            lengths = list(map(len, chain(self._dicts, self._classes, self._sequences)))
            return (
                lengths == self._lengths
                and self._saved.same(self._now())
                and all(map(_Shape.holds, self.shapes))
                and _switches_off()
                and _same_modes(self._modes)
                and _seeds() == self._seeds
                and _torch_settings() == self._settings
            )
        except Exception:  # noqa: BLE001 - an unset slot, a container of the wrong type: the slow path says which
            return False

    def _restore(self, container: _Container) -> _Restored:
        """Put ``container`` back; what was different (see `_Restored`)."""
        saved, target = container.saved, container.target
        if container.registry and _library_additions(container):
            return _Restored.NOTHING
        if container.kind is Kind.DICT:
            level = logging.DEBUG if container.lazy else logging.WARNING
            return _restore_dict(target, saved, container.module, container.name, level)
        if container.kind is Kind.CLASS:
            changed = False
            for name in [name for name in target.__dict__ if name not in saved]:
                if name in INTERPRETER_CACHES:
                    saved[name] = target.__dict__[name]
                    continue
                log.warning("%s: %s was added; removed", container.name, name)
                delattr(target, name)
                changed = True
            for name, value in saved.items():
                if target.__dict__.get(name, _MISSING) is not value:
                    log.warning("%s: %s was changed; put back", container.name, name)
                    setattr(target, name, value)
                    changed = True
            return _Restored.CHANGED if changed else _Restored.NOTHING
        if container.kind is Kind.SLOTS:
            for name, value in zip((*container.slots, "__class__"), saved, strict=True):
                if getattr(target, name, _MISSING) is not value:
                    object.__setattr__(target, name, value)
            return _Restored.CHANGED
        if container.kind is Kind.SEQUENCE:
            if isinstance(target, list):
                target[:] = saved
            else:
                target.clear()
                (target.update if isinstance(target, set) else target.extend)(saved)
            if target is warnings.filters:
                warnings._filters_mutated()  # type: ignore[attr-defined]  # what each warning did, cached: dropped
        return _Restored.CHANGED


_HOOK_SUFFIXES = ("hooks", "hooks_with_kwargs", "hooks_always_called")
_SWITCHES = "nnqueue.enginecore.protected's audit switches on the engine's thread"


def _read(container: _Container) -> Any:
    target = container.target
    if container.kind is Kind.DICT:
        return dict(target)
    if container.kind is Kind.CLASS:
        return dict(target.__dict__)
    if container.kind is Kind.SLOTS:
        return operator.attrgetter(*container.slots, "__class__")(target)
    return list(target)


def _read_matches(container: _Container) -> bool:
    """Whether ``container``'s entries are its saved ones, by identity (the slow path's per-container test)."""
    try:
        now = _read(container)
    except AttributeError:
        return False
    saved = container.saved
    if len(now) != len(saved):
        return False
    if isinstance(saved, dict):
        return all(map(operator.is_, now, saved)) and all(map(operator.is_, now.values(), saved.values()))
    return all(map(operator.is_, now, saved))


class _Restored(enum.Enum):
    NOTHING = "nothing"  # only submodules the import system added (an import meanwhile): taken as they are
    ADDED_GLOBALS = "added globals"  # only names added to a module's globals (a lazily imported name): lazy
    CHANGED = "changed"


def _restore_dict(
    target: dict[Any, Any], saved: dict[Any, Any], module: str | None, where: str, level: int
) -> _Restored:
    """Put ``target`` back as ``saved``, logging each entry at ``level`` (``where``: the container's name)."""
    added = changed = False
    saved.update((name, value) for name, value in target.items() if _serializer_tag(name, value))  # kept
    for name in [name for name in target if name not in saved]:
        value = target[name]
        submodule = isinstance(value, types.ModuleType) and sys.modules.get(f"{module}.{name}") is value
        if module is not None and (submodule or name in INTERPRETER_CACHES):
            saved[name] = value  # a submodule imported meanwhile, a warnings registry: the interpreter's, kept
            continue
        log.log(level, "%s: %r was added; removed", where, name)
        del target[name]
        added = True
    for name, value in saved.items():
        if target.get(name, _MISSING) is not value:
            log.log(level, "%s: %r was changed; put back", where, name)
            target[name] = value
            changed = True
    if changed or (added and module is None):
        return _Restored.CHANGED
    return _Restored.ADDED_GLOBALS if added else _Restored.NOTHING


def _library_additions(container: _Container) -> bool:
    """Whether all that changed in a registry are entries a library imported meanwhile added for its own types (a
    new module's class for a key, the installation's code for a value); if so they are kept. An entry for a type
    that was there before (``copy.dispatch_table[torch.Tensor]``) is a trace's, whatever its value."""
    saved, now = container.saved, _read(container)
    imported = frozenset(sys.modules)
    new_modules = imported - container.modules
    if isinstance(saved, dict):
        if any(now.get(key, _MISSING) is not value for key, value in saved.items()):
            return False
        added = [(key, value) for key, value in now.items() if key not in saved]
        if not all(_from_modules(key, new_modules) for key, _ in added):
            return False
    else:
        kept = {id(item) for item in now}
        if any(id(item) not in kept for item in saved):
            return False
        before = {id(item) for item in saved}
        added = [item for item in now if id(item) not in before]
    if not all(map(_library_code, added)):
        return False
    container.saved, container.modules = now, imported
    return True


def _from_modules(key: Any, modules: frozenset[str]) -> bool:
    """Whether a registry's key is a class (or a ``(module, name)`` pair) of one of ``modules``."""
    module = key[0] if isinstance(key, tuple) and key and isinstance(key[0], str) else getattr(key, "__module__", None)
    return isinstance(module, str) and module in modules and isinstance(key, (tuple, type))


def _library_code(entry: Any) -> bool:
    """Whether ``entry`` (a registry's key and value, or its item) holds no function but the installation's (a
    builtin, a class whose functions are the installation's, a Python function whose source is under the
    installation's folders)."""
    if isinstance(entry, tuple):
        return all(map(_library_code, entry))
    if isinstance(entry, (types.FunctionType, types.BuiltinFunctionType)):
        return protected.is_library_function(entry)
    if isinstance(entry, type):  # its methods, static and class methods (``__new__``) unwrapped
        functions = [getattr(value, "__func__", value) for value in vars(entry).values()]
        return all(protected.is_library_function(f) for f in functions if isinstance(f, types.FunctionType))
    return isinstance(entry, (int, str))


def _serializer_tag(name: str, value: Any) -> bool:
    """Whether this entry of a module's ``__dict__`` is the tag nnsight's serializer puts on every module an
    envoy it pickles holds (``Envoy.__getstate__``: ``_persistent_id = "Module:<path>"``, a new string each time):
    the engine's own doing when it pickles a result that holds envoys (``tracer.cache()``'s view), not a trace's."""
    return name == "_persistent_id" and type(value) is str and value.startswith("Module:")


def _restore_class(obj: Any, cls: type) -> None:
    try:
        object.__setattr__(obj, "__class__", cls)
    except TypeError:  # a layout the original class cannot take back: the check still reports it
        log.exception("could not put back the class of an object")


def _switches_off() -> bool:
    """The protected environment's per-thread switches are off on this (the engine's) thread, between steps: a
    trace that set ``_auditing.active`` would have the audit hook pass its events."""
    return not getattr(protected._auditing, "active", False) and not getattr(protected._region, "depth", 0)


def _switch_off() -> None:
    protected._auditing.active = False
    protected._region.depth = 0


_MODES = "torch's function and dispatch modes on the engine's thread (a mode entered and left active)"
_INFRA_MODES = tuple(torch._C._TorchDispatchModeKey.__members__.values())


def _torch_modes() -> tuple[tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]]:
    """The modes active on this (the engine's) thread: torch's function-mode stack, dispatch-mode stack and
    infrastructure dispatch modes (fake, proxy, functional), each mode by identity. A mode that a trace enters and
    leaves active (``TorchFunctionMode().__enter__()``, ``torch.device("meta").__enter__()``) sees every later
    torch call on this thread, other owners' steps included: it can change their results and read their inputs.
    Read and restored with torch's own mode-stack functions in ``torch._C`` (private; as of torch 2.13), which is
    what ``torch.overrides`` and ``torch.utils._python_dispatch`` use."""
    function = tuple(map(torch._C._get_function_stack_at, range(torch._C._len_torch_function_stack())))
    dispatch = tuple(map(torch._C._get_dispatch_stack_at, range(torch._C._len_torch_dispatch_stack())))
    return function, dispatch, tuple(map(torch._C._get_dispatch_mode, _INFRA_MODES))


def _same_modes(saved: tuple[tuple[Any, ...], ...]) -> bool:
    return all(map(_all_identical, _torch_modes(), saved))


def _put_back_modes(saved: tuple[tuple[Any, ...], ...]) -> None:
    function, dispatch, infra = saved
    while torch._C._len_torch_function_stack():
        torch._C._pop_torch_function_stack()
    while torch._C._len_torch_dispatch_stack():
        torch._C._pop_torch_dispatch_stack(None)
    for mode in function:
        torch._C._push_on_torch_function_stack(mode)
    for mode in dispatch:
        torch._C._push_on_torch_dispatch_stack(mode)
    for key, mode in zip(_INFRA_MODES, infra, strict=True):
        if torch._C._get_dispatch_mode(key) is not mode:
            torch._C._unset_dispatch_mode(key)
            if mode is not None:
                torch._C._set_dispatch_mode(mode)


_SETTINGS = "torch's global settings"

_AUTOCAST_DEVICES = ("cpu", "cuda")


def _flag(holder: Any, attribute: str) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    """Read and write ``holder.attribute`` (torch.backends' switches)."""
    return (lambda: getattr(holder, attribute)), (lambda value: setattr(holder, attribute, value))


def _autocast() -> tuple[tuple[bool, torch.dtype], ...]:
    return tuple((torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind)) for kind in _AUTOCAST_DEVICES)


def _set_autocast(saved: tuple[tuple[bool, torch.dtype], ...]) -> None:
    for kind, (enabled, dtype) in zip(_AUTOCAST_DEVICES, saved, strict=True):
        torch.set_autocast_enabled(kind, enabled)
        torch.set_autocast_dtype(kind, dtype)


def _deterministic() -> tuple[bool, bool]:
    return torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()


def _set_deterministic(saved: tuple[bool, bool]) -> None:
    torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])


# torch's settings that change other jobs' numbers or make their steps fail, each read and written back through
# torch's own functions: matmul precision (TF32, or bfloat16 on CPUs with AMX, for float32 models), reduced-precision
# reductions, cuDNN's and oneDNN's switches, deterministic algorithms (a step whose op has none then raises), the
# default dtype, and autocast, which is per thread (the engine's) and recasts every later op. Performance settings
# (threads) and anomaly detection (autograd only: the engine runs under inference mode) are left out.
# Each: its name, how to read it, how to write it back.
_SETTING_ACCESS: tuple[tuple[str, Callable[[], Any], Callable[[Any], None]], ...] = (
    ("float32_matmul_precision", torch.get_float32_matmul_precision, torch.set_float32_matmul_precision),
    *(
        (f"{path}.{attribute}", *_flag(holder, attribute))
        for path, holder, attributes in (
            (
                "cuda.matmul",
                torch.backends.cuda.matmul,
                ("allow_tf32", "allow_fp16_reduced_precision_reduction", "allow_bf16_reduced_precision_reduction"),
            ),
            ("cudnn", torch.backends.cudnn, ("enabled", "allow_tf32", "deterministic", "benchmark")),
            ("mkldnn", torch.backends.mkldnn, ("enabled",)),
        )
        for attribute in attributes
    ),
    ("deterministic_algorithms", _deterministic, _set_deterministic),
    ("default_dtype", torch.get_default_dtype, torch.set_default_dtype),
    ("autocast", _autocast, _set_autocast),
)


def _torch_settings() -> tuple[Any, ...]:
    """The values of `_SETTING_ACCESS`, in its order."""
    return tuple(read() for _, read, _ in _SETTING_ACCESS)


def _put_back_settings(saved: tuple[Any, ...]) -> list[str]:
    """Write back each of torch's settings that differs from ``saved`` (all compared first: matmul precision
    moves ``allow_tf32`` with it); their names."""
    now = _torch_settings()
    changed = [
        (name, write, was) for (name, _, write), was, is_ in zip(_SETTING_ACCESS, saved, now, strict=True) if was != is_
    ]
    for _, write, was in changed:
        write(was)
    return [name for name, _, _ in changed]


_SEEDS = "torch's random seed (torch.manual_seed: the sampling of other jobs without a seed of their own)"


def _seeds() -> tuple[int, int | None]:
    """The seeds of torch's default generators: the CPU's, and the current GPU's once CUDA is up. A trace that
    seeds them (``torch.manual_seed(1234)``) makes every later job's sampling without a seed of its own (vLLM
    draws those from the default generators) predictable to it."""
    return torch.initial_seed(), torch.cuda.initial_seed() if torch.cuda.is_initialized() else None


def _put_back_seeds(seeds: tuple[int, int | None]) -> None:
    """Seed the generators with the seeds they had: the same on every rank of a tensor-parallel engine, whose ranks
    must sample alike (a fresh random seed per rank would make them diverge)."""
    cpu, gpu = seeds
    torch.manual_seed(cpu)  # every device
    if gpu is not None and gpu != cpu:
        torch.cuda.manual_seed_all(gpu)


# --------------------------------------------------------------------------------------------- what is walked

# Modules whose globals and classes the engine's results pass through, besides the model's own (their names, and
# with every loaded submodule for the packages).
ENGINE_PACKAGES = ("nnqueue.enginecore", "nnsight")
ENGINE_MODULES = (
    "builtins",
    "torch",
    "torch.serialization",
    "torch.storage",
    "torch._tensor",
    "torch._utils",
    "torch.nn.modules.module",
    "torch.nn.parameter",
    "torch.nn.functional",
    "pickle",
    "copyreg",
    "hashlib",
    "safetensors.torch",
    "_thread",
    "warnings",
    # its classes: a method put on Logger (``type(torch.autograd.graph.log)``) ran at every log line of the engine,
    # the trust-domain switch's own included (a fourth red-team round)
    "logging",
)
# Of those, the modules whose globals are put back but blamed on no trace alone in its step (lazy): the warnings
# module's are rebound for a while by every ``warnings.catch_warnings()``, which any library may enter.
LAZY_MODULES = ("warnings",)
# Containers in those modules' globals that hold configuration (compared entry by entry, not only bound).
WATCHED_CONTAINERS = (
    *(
        ("torch.nn.modules.module", name)
        for name in (
            "_global_buffer_registration_hooks",
            "_global_module_registration_hooks",
            "_global_parameter_registration_hooks",
            "_global_backward_pre_hooks",
            "_global_backward_hooks",
            "_global_forward_pre_hooks",
            "_global_forward_hooks",
            "_global_forward_hooks_always_called",
            "_global_forward_hooks_with_kwargs",
        )
    ),
    *(
        ("nnqueue.enginecore.protected", name)
        for name in (
            "SAFE_BUILTINS",
            "HIDDEN_ATTRIBUTES",
            "_REPLACED",
            "_extra_modules",
            "_code_roots",
            "_trusted_code",
            "_nnsight_roots",
            "_locked",
            "_done",
            "_unsafe",
            "_reconstructors",
        )
    ),
)
# Registries that every pickler (``torch.save`` in the result writers' threads, outside any step) and ``copy``
# consult before an object's own ``__reduce_ex__`` (an entry added for ``torch.Tensor`` would rewrite every later
# result, other domains' too), and the location taggers ``torch.save`` calls for every storage. A library imported
# for the first time during a step adds its own entries (sympy's, when torch first compiles): an entry for a type of
# a module imported since, whose functions are the installation's code, is kept; any other is a trace's.
REGISTRIES = (
    *(("copyreg", name) for name in ("dispatch_table", "_extension_registry", "_inverted_registry")),
    ("copy", "_deepcopy_dispatch"),
    ("torch.serialization", "_package_registry"),
)
# Memos a trace's legitimate use fills (nnsight's instrumented forwards, built on a module's first ``.source``).
# The warnings filters too: a trace's ``warnings.simplefilter("error")`` makes every warning of another job's code
# an exception, and a module imported for the first time during a step may add its own filters.
LAZY_CONTAINERS = (("nnsight.intervention.source", "FORWARD_CACHE"), ("warnings", "filters"))
# Configuration objects of the libraries that are walked as a module's attributes are (``nnsight.CONFIG.APP.DEBUG``).
WATCHED_OBJECTS = (("nnsight", "CONFIG"),)
# Objects held by a module that are never walked into: other modules (walked on their own), tensors (the weights
# guard's), and what only names code or data (functions, classes: a class is walked as a class).
_LEAVES = (
    torch.nn.Module,
    torch.Tensor,
    type,
    types.FunctionType,
    types.BuiltinFunctionType,
    types.MethodType,
    types.ModuleType,
    str,
    bytes,
    int,
    float,
    complex,
    bool,
    type(None),
    torch.dtype,
    torch.device,
    enum.Enum,
)
# How deep the objects a module holds are walked (the module's own dict is depth 0): an attention layer's
# ``impl`` and its scales (1), a config's sub-configs (2).
OBJECT_DEPTH = 2


class _Walk:
    def __init__(self, model: torch.nn.Module, roots: list[Any], modules: list[str]) -> None:
        self.model = model
        self.roots = roots
        self.module_names = modules
        self.seen: set[int] = set()
        self.classes: dict[int, type] = {}

    def containers(self) -> Iterator[_Container]:
        for path, module in self.model.named_modules():  # each module once (a shared rotary embedding too)
            name = path or "model"
            yield from self._object(name, module, 0)
        for root in self.roots:
            self._note_class(type(root))
        yield from self._engine_code()

    def _object(self, name: str, value: Any, depth: int) -> Iterator[_Container]:
        if id(value) in self.seen:
            return
        self.seen.add(id(value))
        self._note_class(type(value))
        if isinstance(value, (dict, list, set)):
            kind = Kind.DICT if isinstance(value, dict) else Kind.SEQUENCE
            yield _Container(name, kind, value, lazy=False)
            items = (
                value.items() if isinstance(value, dict) else ((str(index), item) for index, item in enumerate(value))
            )
            if isinstance(value, (dict, list)):
                for key, item in items:
                    if not isinstance(item, _LEAVES) and depth < OBJECT_DEPTH:
                        yield from self._object(f"{name}[{key!r}]", item, depth + 1)
            return
        slots = _slots(type(value))
        if slots:
            # nnsight's per-module State: `.source` instruments the body (lazy).
            lazy = type(value).__name__ == "State" and type(value).__module__.startswith("nnsight.")
            yield _Container(f"{name} (slots)", Kind.SLOTS, value, lazy=lazy, slots=slots)
            for slot in slots:
                item = getattr(value, slot, None)
                if not isinstance(item, _LEAVES) and depth < OBJECT_DEPTH:
                    yield from self._object(f"{name}.{slot}", item, depth + 1)
        attributes = getattr(value, "__dict__", None)
        if not isinstance(attributes, dict):
            return
        yield _Container(name, Kind.DICT, attributes, lazy=False, owner=value, owner_class=type(value))
        for key, item in attributes.items():
            if isinstance(item, _LEAVES) and not isinstance(item, type):
                continue
            if isinstance(item, type):
                self._note_class(item)
            elif depth < OBJECT_DEPTH or isinstance(item, (dict, list, set)):
                yield from self._object(f"{name}.{key}", item, depth + (0 if isinstance(item, (dict, set)) else 1))

    def _note_class(self, cls: type) -> None:
        for each in cls.__mro__:
            if each is not object and id(each) not in self.classes:
                self.classes[id(each)] = each

    def _engine_code(self) -> Iterator[_Container]:
        names = set(ENGINE_MODULES) | set(self.module_names)
        loaded = list(sys.modules.items())
        names |= {name for name, _ in loaded if any(name == p or name.startswith(p + ".") for p in ENGINE_PACKAGES)}
        names |= {cls.__module__ for cls in self.classes.values()}
        for name, module in loaded:
            if name not in names or not isinstance(module, types.ModuleType):
                continue
            attributes = vars(module)
            yield _Container(f"{name} (globals)", Kind.DICT, attributes, lazy=name in LAZY_MODULES, module=name)
            for value in list(attributes.values()):
                if isinstance(value, type) and value.__module__ == name:
                    self._note_class(value)
        for module_name, attribute in WATCHED_OBJECTS:
            if (value := getattr(sys.modules.get(module_name), attribute, None)) is not None:
                yield from self._object(f"{module_name}.{attribute}", value, 0)
        for module_name, attribute in (*WATCHED_CONTAINERS, *LAZY_CONTAINERS, *REGISTRIES):
            value = getattr(sys.modules.get(module_name), attribute, None)
            if isinstance(value, (dict, list, set)):
                kind = Kind.DICT if isinstance(value, dict) else Kind.SEQUENCE
                lazy = (module_name, attribute) in LAZY_CONTAINERS
                registry = (module_name, attribute) in REGISTRIES
                yield _Container(f"{module_name}.{attribute}", kind, value, lazy=lazy, registry=registry)
        self._note_class(torch.nn.Parameter)  # and so torch.Tensor
        for cls in self.classes.values():
            if _mutable_class(cls):
                yield _Container(f"class {cls.__module__}.{cls.__qualname__}", Kind.CLASS, cls, lazy=False)


def _slots(cls: type) -> tuple[str, ...]:
    names: list[str] = []
    for each in cls.__mro__:
        declared = each.__dict__.get("__slots__", ())
        for slot in (declared,) if isinstance(declared, str) else declared:
            if slot not in ("__dict__", "__weakref__") and slot not in names:
                names.append(slot)
    return tuple(names)


def _mutable_class(cls: type) -> bool:
    """Whether ``cls``'s dict can be changed from Python (a heap type: classes defined in C cannot be)."""
    return bool(cls.__flags__ & _HEAPTYPE)


_HEAPTYPE = 1 << 9  # Py_TPFLAGS_HEAPTYPE


def describe(names: list[str]) -> str:
    """``names`` for a message: the first five, and how many more."""
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
