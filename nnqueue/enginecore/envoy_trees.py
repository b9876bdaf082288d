"""Each request's own envoy tree, unpickled ahead of time from its trace's shared tree (prebuilt format 2).

nnsight pickles an invoke's mediator with the whole tree of envoys its code refers to (every module's envoy of
the model: some 360 for a Llama-3-8B), and its runner unpickles each request's mediator, tree and all, in
``Requests.add``, on the thread that steps the model: for one-prompt trace jobs about 12% of that thread on an
H200 (issue 36), during which the GPU waits. Each request must keep a tree of its own: a trace may change its
envoys (attributes, edits, aliases), and another user's trace must never see that (nor the other way round).

A format 2 payload (:mod:`nnqueue.trace_payload`) carries the tree once, as nnsight pickles it, with its sha256;
the mediators refer to the tree's envoys by persistent id (`nnqueue.trace_payload.envoy_pid`: the sha256 and
the envoy's path), and the worker puts ``[sha256, tree bytes]`` in every request's ``extra_args`` (`EXTRA_ARG`).
Here, on every rank:

* `EnvoyTreesMixin._update_states` registers a tree the engine has not seen (`EnvoyTrees.add`): its bytes must
  hash to the sha256 they came with (else they register nothing: a request that lies about its tree finds none,
  or the real one), and unpickle, with the protected environment's checks, into an envoy tree made of classes
  alone (`TreeUnpickler`: no function is called while it loads, so no user code runs and no road past the
  weights guard is taken). A tree that does not is remembered with the reason, which its requests fail with.
* a filler thread keeps trees of the recently used sha256s (`READY_MAX` in all) unpickled ahead, from the verified
  bytes, while the stepping thread waits on the GPU (a thread the stepping thread starts, after the engine
  dropped its privileges: it runs as that thread does);
* each mediator load (nnsight's ``loads``, wrapped) resolves its envoy ids in a tree of its own: the first id
  takes a ready tree (or unpickles one there and then, as before), the others resolve in the same tree. A ready
  tree is taken by one request only, and is exactly what unpickling the request's bytes gives: so each trace's
  envoys are its own, as when every mediator carried its tree, and nothing of one trace's tree is another's.

Trees of many shapes (clients of other nnsight versions, models built with other options) are kept for the
`TEMPLATES_MAX` most recently used sha256s (and every one a step's new requests sent). Format 1 mediators (each with its own tree) load as before.

nnsight internals relied on (0.8.1): the module-level ``loads`` that ``Requests.add`` of
``nnsight.modeling.vllm.model_runners.GPUModelRunner`` calls for each new request (as
:mod:`nnqueue.enginecore.protected` does), and ``scheduled_new_reqs[i].sampling_params.extra_args`` in the
scheduler's output that the runner's ``_update_states`` receives.
"""

from __future__ import annotations

import copyreg
import hashlib
import io
import logging
import sys
import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from typing import Any

from nnqueue import trace_payload
from nnqueue.enginecore import protected
from nnqueue.errors import NNqueueError

log = logging.getLogger(__name__)
EXTRA_ARG = "nnqueue_envoys"  # a request's [tree sha256, tree bytes] (nnqueue.engines.prebuilt puts it there)
# Trees kept unpickled ahead: for each sha256, twice its new requests of the last step that had any (at least
# READY_MIN); READY_MAX in all (an 8B model's tree is about 0.5 MB of objects).
READY_MAX = 64
READY_MIN = 8
TEMPLATES_MAX = 32  # sha256s whose bytes are kept (the least recently used go first, between steps)
_RECONSTRUCTORS = (copyreg._reconstructor, copyreg.__newobj__, copyreg.__newobj_ex__)  # type: ignore[attr-defined]


class TreeRefused(NNqueueError, ValueError):
    """A trace's envoy tree cannot be used; the message says why."""


def _tree_global(value: Any, module: str, name: str) -> Any:
    if isinstance(value, type) or value in _RECONSTRUCTORS:
        return value
    raise TreeRefused(f"an envoy tree names {module}.{name}, which is not a class")


class TreeUnpickler(protected.RestrictedUnpickler):
    """The protected environment's unpickler, for an envoy tree: every global must be a class (or one of pickle's
    own reconstructors), so that loading calls no function."""

    def find_class(self, module: str, name: str) -> Any:
        return _tree_global(super().find_class(module, name), module, name)


class StrictTreeUnpickler(protected.StrictUnpickler):
    """`TreeUnpickler`'s rule over the strict unpickler's opcode checks (a trace builder's check of a tree, before
    any engine loads it)."""

    def find_class(self, module: str, name: str) -> Any:
        return _tree_global(super().find_class(module, name), module, name)


def unpickle_tree(data: bytes, persistent_objects: Any, strict: bool = False) -> Any:
    """A fresh envoy tree from its bytes: its root envoy. ``strict``: with `StrictTreeUnpickler`."""
    from nnsight.intervention.envoy import Envoy

    unpickler = StrictTreeUnpickler if strict else TreeUnpickler
    root = unpickler(io.BytesIO(data), persistent_objects).load()
    if not isinstance(root, Envoy):
        raise TreeRefused(f"an envoy tree holds a {type(root).__name__}, not an envoy")
    return root


def envoy_at(root: Any, path: str) -> Any:
    """The envoy of ``root``'s tree whose path is ``path`` (``root.path`` and the names of the entries below it)."""
    if path == root.path:
        return root
    envoy = root
    if path.startswith(root.path + "."):
        try:
            for name in path[len(root.path) + 1 :].split("."):
                envoy = envoy._child_map[name]
        except (KeyError, AttributeError):
            envoy = None
        if envoy is not None and envoy.path == path:
            return envoy
    # An envoy outside the module entries (one attached to the tree another way): the whole tree's walk.
    for found in root.modules():
        if found.path == path:
            return found
    raise TreeRefused(f"the envoy tree has no envoy at {path!r}")


class _Template:
    def __init__(self, data: bytes, persistent_objects: Any) -> None:
        self.data, self.persistent_objects = data, persistent_objects
        self.ready: deque[Any] = deque()  # root envoys of trees unpickled ahead
        self.target = READY_MIN
        self.refused: str | None = None


class EnvoyTrees:
    """The trees of one engine rank (or of a trace builder's check): registered by sha256, handed out one per
    mediator load. ``ahead``: keep trees unpickled ahead on a filler thread; ``strict``: unpickle them with
    `StrictTreeUnpickler` (a trace builder's check)."""

    def __init__(self, ahead: bool = True, strict: bool = False) -> None:
        self.ahead, self.strict = ahead, strict
        self._templates: OrderedDict[str, _Template] = OrderedDict()
        self._lock = threading.Condition()
        self._filler: threading.Thread | None = None

    def add(self, digest: Any, data: Any, persistent_objects: Any) -> bool:
        """Register a request's tree, ``data`` claimed to hash to ``digest`` (once per sha256: a tree already
        known costs a lookup); whether its sha256 is now known. Bytes that do not hash to their claim register
        nothing: that request's mediator finds no tree (unless another request sent the real one)."""
        if not isinstance(digest, str) or not isinstance(data, bytes):
            return False  # not what the worker sends
        if digest in self._templates:
            return True
        if hashlib.sha256(data).hexdigest() != digest:
            return False
        template = _Template(data, persistent_objects)
        try:
            template.ready.append(unpickle_tree(data, persistent_objects, self.strict))
        except Exception as error:  # noqa: BLE001 - the tree's requests fail with it, not the engine
            template.refused = f"envoy tree {digest[:16]} cannot be used: {type(error).__name__}: {error}"
        with self._lock:
            self._templates[digest] = template
        return True

    def trim(self) -> None:
        """Forget the least recently used sha256s past `TEMPLATES_MAX` (before a step's requests are added, so that
        none of a step's trees is forgotten before its mediators load)."""
        with self._lock:
            while len(self._templates) > TEMPLATES_MAX:
                self._templates.popitem(last=False)

    def want(self, wanted: dict[str, int]) -> None:
        """Ask for trees of these sha256s (the new requests of a step that refer to each) to be ready ahead: twice
        as many (from `READY_MIN` to `READY_MAX`), most recently used first."""
        with self._lock:
            for digest, count in wanted.items():
                if (template := self._templates.get(digest)) is not None:
                    self._templates.move_to_end(digest)
                    template.target = max(READY_MIN, min(READY_MAX, 2 * count))
            if self.ahead:
                self._start_filler()
                self._lock.notify()

    def take(self, digest: str) -> Any:
        """A tree of ``digest`` for one mediator load (its root envoy): a ready one, or one unpickled now."""
        template = self._templates.get(digest)
        if template is None:
            raise TreeRefused(f"envoy tree {digest[:16]} was not sent with the request")
        if template.refused is not None:
            raise TreeRefused(template.refused)
        try:
            tree = template.ready.popleft()
        except IndexError:
            tree = unpickle_tree(template.data, template.persistent_objects, self.strict)
        if self.ahead:
            with self._lock:
                self._lock.notify()
        return tree

    def loads(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        """nnsight's ``loads(data, persistent_objects)`` (``inner``) where a load resolves envoy ids in a tree of
        its own."""

        def load(data: bytes, persistent_objects: Any = None) -> Any:
            return inner(data, persistent_objects=_TreeRefs(self, persistent_objects or {}))

        return load

    def _start_filler(self) -> None:
        if self._filler is None:
            self._filler = threading.Thread(target=self._fill, name="nnqueue-envoy-trees", daemon=True)
            self._filler.start()

    def _fill(self) -> None:
        while True:
            with self._lock:
                template = self._short()
                while template is None:
                    self._lock.wait()
                    template = self._short()
            try:
                tree = unpickle_tree(template.data, template.persistent_objects, self.strict)
            except Exception as error:  # noqa: BLE001 - it unpickled when registered; take() unpickles then
                log.warning("unpickling an envoy tree ahead failed: %s", error)
                template.target = 0
                continue
            template.ready.append(tree)

    def _short(self) -> _Template | None:
        """The most recently used template with fewer ready trees than it wants, while fewer than `READY_MAX` are
        ready in all (under the lock)."""
        if sum(len(template.ready) for template in self._templates.values()) >= READY_MAX:
            return None
        for template in reversed(self._templates.values()):
            if template.refused is None and len(template.ready) < template.target:
                return template
        return None


class _TreeRefs:
    """One mediator load's persistent objects: its envoy ids resolve in one tree of its own, the rest in the
    runner's map."""

    def __init__(self, trees: EnvoyTrees, objects: Any) -> None:
        self.trees, self.objects = trees, objects
        self.digest: str | None = None
        self.root: Any = None

    def __contains__(self, pid: Any) -> bool:
        return trace_payload.parse_envoy_pid(pid) is not None or pid in self.objects

    def __getitem__(self, pid: Any) -> Any:
        parsed = trace_payload.parse_envoy_pid(pid)
        if parsed is None:
            return self.objects[pid]
        digest, path = parsed
        if self.digest is None:
            self.root, self.digest = self.trees.take(digest), digest
        elif digest != self.digest:
            raise TreeRefused("a mediator refers to envoys of two trees")
        return envoy_at(self.root, path)


class EnvoyTreesMixin:
    """Mixed into the model runner (above nnsight's): each request's envoy tree from its trace's shared one."""

    nnsight_persistent_objects: Any
    nnqueue_trees: EnvoyTrees | None = None

    def load_model(self, *args: Any, **kwargs: Any) -> None:
        super().load_model(*args, **kwargs)  # type: ignore[misc]
        self.nnqueue_trees = EnvoyTrees()
        runner = sys.modules["nnsight.modeling.vllm.model_runners.GPUModelRunner"]
        runner.loads = self.nnqueue_trees.loads(runner.loads)  # type: ignore[attr-defined]

    def _update_states(self, scheduler_output: Any) -> None:
        trees = self.nnqueue_trees
        if trees is not None:  # before nnsight's runner loads the new requests' mediators
            trees.trim()
            wanted: dict[str, int] = {}
            for data in getattr(scheduler_output, "scheduled_new_reqs", ()):
                extra = getattr(getattr(data, "sampling_params", None), "extra_args", None) or {}
                tree: Any = extra.get(EXTRA_ARG)
                if isinstance(tree, (list, tuple)) and len(tree) == 2:
                    digest, data = tree
                    if trees.add(digest, data, self.nnsight_persistent_objects):
                        wanted[digest] = wanted.get(digest, 0) + 1
            if wanted:
                trees.want(wanted)
        super()._update_states(scheduler_output)  # type: ignore[misc]
