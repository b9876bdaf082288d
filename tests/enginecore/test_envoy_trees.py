"""Envoy trees of format 2 traces (nnqueue.enginecore.envoy_trees), against the client's meta model as the trace
builders check them: every mediator load gets a tree of its own (a trace's change to its envoys is never another
trace's), trees are kept ready ahead and each is handed out once, bytes that lie about their sha256 register
nothing (and cannot stand in for the real tree), and a tree that is more than envoys is refused, naming why.
The engine's side (the same code in the engine's runner) is tested in tests/engines/test_cpu_engine.py."""

from __future__ import annotations

import hashlib
import math
import pickle
import time
from collections import OrderedDict
from typing import Any

import pytest

from nnqueue import trace_payload
from nnqueue.enginecore.envoy_trees import READY_MIN, TEMPLATES_MAX, EnvoyTrees, TreeRefused
from tests.utils.payloads import PROMPTS, PrebuiltBackend


@pytest.fixture(scope="module")
def trace(client_model: Any) -> trace_payload.PrebuiltTrace:
    backend = PrebuiltBackend()
    layer = client_model.model.layers[1]  # a child envoy referred to on its own, beside the root
    with client_model.trace(temperature=0.0, max_tokens=1, backend=backend) as tracer:
        for prompt in PROMPTS:
            with tracer.invoke(prompt):
                hidden = client_model.model.layers[0].output[0].save()
                later = layer.output[0].save()
    return trace_payload.decode(backend.payload)


def loaded(trees: EnvoyTrees, client_model: Any, mediator: bytes) -> Any:
    from nnsight.intervention.serialization import loads

    return trees.loads(loads)(mediator, client_model._remoteable_persistent_objects())


def roots(mediator: Any) -> tuple[Any, Any]:
    """The root envoy and the child one the mediator's code refers to."""
    names = {**mediator.glbls, **mediator.lcls}
    return names["client_model"], names["layer"]


def test_a_format_2_trace_carries_its_tree_once(trace: trace_payload.PrebuiltTrace) -> None:
    assert trace.envoys is not None and hashlib.sha256(trace.envoys.data).hexdigest() == trace.envoys.sha256
    assert all(len(invoke.mediator) < len(trace.envoys.data) / 4 for invoke in trace.invokes)


def test_each_load_gets_a_tree_of_its_own(trace: trace_payload.PrebuiltTrace, client_model: Any) -> None:
    trees = EnvoyTrees(ahead=False)
    objects = client_model._remoteable_persistent_objects()
    assert trees.add(trace.envoys.sha256, trace.envoys.data, objects)
    first, second = (loaded(trees, client_model, invoke.mediator) for invoke in trace.invokes)
    (root, layer), (other_root, other_layer) = roots(first), roots(second)
    assert layer is root.model.layers[1]  # one mediator's ids resolve in one tree
    assert root is not other_root and layer is not other_layer and root is not client_model
    assert root._children is not other_root._children and root._envoys is not other_root._envoys
    assert root.model.layers[0]._module is client_model.model.layers[0]._module  # modules: the engine's own
    root.model.layers[0].mark = "the first trace's"  # a trace changes its envoys: the other trace sees nothing
    root._aliases["x"] = "y"
    assert not hasattr(other_root.model.layers[0], "mark") and "x" not in other_root._aliases
    again = roots(loaded(trees, client_model, trace.invokes[0].mediator))[0]
    assert not hasattr(again.model.layers[0], "mark") and "x" not in again._aliases


def test_trees_are_kept_ready_ahead_and_each_is_handed_out_once(
    trace: trace_payload.PrebuiltTrace, client_model: Any
) -> None:
    trees = EnvoyTrees()
    digest = trace.envoys.sha256
    trees.add(digest, trace.envoys.data, client_model._remoteable_persistent_objects())
    trees.want({digest: 2})
    ready = trees._templates[digest].ready
    deadline = time.monotonic() + 120
    while len(ready) < READY_MIN:
        assert time.monotonic() < deadline, "the filler thread kept no tree ready"
        time.sleep(0.05)
    waiting = list(ready)
    taken = [trees.take(digest) for _ in waiting]
    assert taken == waiting and len({id(root) for root in taken}) == len(taken)


def test_bytes_that_lie_about_their_sha256_register_nothing(
    trace: trace_payload.PrebuiltTrace, client_model: Any
) -> None:
    trees = EnvoyTrees(ahead=False)
    objects = client_model._remoteable_persistent_objects()
    forged = pickle.dumps(OrderedDict())
    assert not trees.add(trace.envoys.sha256, forged, objects)  # the real tree's sha256, other bytes
    with pytest.raises(TreeRefused, match="was not sent with the request"):
        loaded(trees, client_model, trace.invokes[0].mediator)
    assert trees.add(trace.envoys.sha256, trace.envoys.data, objects)  # the real bytes are taken after a lie
    assert roots(loaded(trees, client_model, trace.invokes[0].mediator))[0].path == "model"


@pytest.mark.parametrize(
    ("tree", "reason"),
    [(math.sqrt, "names math.sqrt, which is not a class"), (OrderedDict(), "holds a OrderedDict, not an envoy")],
)
def test_a_tree_that_is_more_than_envoys_is_refused(client_model: Any, tree: Any, reason: str) -> None:
    trees = EnvoyTrees(ahead=False)
    data = pickle.dumps(tree)
    digest = hashlib.sha256(data).hexdigest()
    assert trees.add(digest, data, client_model._remoteable_persistent_objects())
    with pytest.raises(TreeRefused, match=reason):
        trees.take(digest)


def test_the_least_recently_used_trees_are_forgotten_between_steps(client_model: Any) -> None:
    trees = EnvoyTrees(ahead=False)
    objects = client_model._remoteable_persistent_objects()
    sent = [pickle.dumps(OrderedDict(n=n)) for n in range(TEMPLATES_MAX + 1)]
    digests = [hashlib.sha256(data).hexdigest() for data in sent]
    for digest, data in zip(digests, sent, strict=True):  # one step's new requests: every tree kept until it loads
        assert trees.add(digest, data, objects)
    trees.want({digests[0]: 1})  # the first is used again: the second is now the least recently used
    trees.trim()  # the next step
    with pytest.raises(TreeRefused, match="was not sent with the request"):
        trees.take(digests[1])
    for digest in (digests[0], *digests[2:]):
        with pytest.raises(TreeRefused, match="not an envoy"):  # still known (and refused for what it is)
            trees.take(digest)
