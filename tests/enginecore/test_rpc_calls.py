"""``nnqueue_calls``, the engine's side of the grouped calls: each call runs in order and is answered as it would be
alone, one that raises is answered with its failure without failing the others (or the engine), only the per-job
calls may be made this way, and the answer carries the outbox's completions."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import pytest

from nnqueue.enginecore import outbox
from nnqueue.enginecore.outbox import CALL_FAILED

if TYPE_CHECKING:
    from nnqueue.enginecore.rpc import NNqueueRPC


def new_worker() -> NNqueueRPC:
    """An engine worker whose calls note that they ran (beginning a steer raises)."""
    from nnqueue.enginecore import rpc

    class Worker(rpc.NNqueueRPC):
        def __init__(self) -> None:
            self.ran: list[tuple[str, tuple[Any, ...]]] = []

        def nnqueue_finish_trace(self, *args: Any) -> bool:  # type: ignore[override]
            self.ran.append(("finish", args))
            return True

        def nnqueue_steer_begin(self, spec: dict[str, Any]) -> dict[str, Any]:
            self.ran.append(("begin", (spec,)))
            raise KeyError("edits")

        def nnqueue_load_weights(self, *args: Any) -> dict[str, Any]:  # type: ignore[override]
            self.ran.append(("load", args))
            return {"loaded": 1}

    return Worker()


def test_calls_run_in_order_each_answered_and_the_outbox_comes_back(monkeypatch: pytest.MonkeyPatch) -> None:
    from nnqueue.enginecore import rpc

    monkeypatch.setattr(rpc, "stage_reporting", lambda: True)
    outbox.drain()
    outbox.post({"id": "t-0", "kind": "trace_result"})
    worker = new_worker()
    answer = worker.nnqueue_calls(
        [
            ("nnqueue_finish_trace", ["t-1", ["r-1"]]),
            ("nnqueue_steer_begin", [{"job": "j"}]),
            ("nnqueue_load_weights", [["/x.safetensors"], None]),  # not a per-job call: refused, never run
            ("nnqueue_finish_trace", ["t-2", ["r-2"]]),
        ]
    )
    assert worker.ran == [("finish", ("t-1", ["r-1"])), ("begin", ({"job": "j"},)), ("finish", ("t-2", ["r-2"]))]
    assert answer["answers"] == [
        True,
        {CALL_FAILED: "KeyError: 'edits'"},
        {CALL_FAILED: "'nnqueue_load_weights' is not a call nnqueue_calls makes"},
        True,
    ]
    assert answer["outbox"] == [{"id": "t-0", "kind": "trace_result"}] and outbox.drain() == []


def test_ranks_that_do_not_report_bring_no_outbox(monkeypatch: pytest.MonkeyPatch) -> None:
    from nnqueue.enginecore import rpc

    monkeypatch.setattr(rpc, "stage_reporting", lambda: False)
    outbox.post({"id": "t-0", "kind": "trace_result"})
    try:
        assert new_worker().nnqueue_calls([]) == {"answers": [], "outbox": None}
    finally:
        outbox.drain()
