"""The outbox poller: entries from the engine (untrusted) are validated, matched to their waiters by id, and a
broken engine fails the waiters instead of leaving them hanging. The engine here is a stand-in for vLLM's
``AsyncLLM.collective_rpc``, which answers with one list per rank."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from nnqueue.engines.outbox import OutboxError, OutboxPoller, valid_entry


class Engine:
    def __init__(self, *answers: Any) -> None:
        self.answers = list(answers)
        self.calls = 0

    async def collective_rpc(self, method: str) -> Any:
        assert method == "nnqueue_outbox"
        self.calls += 1
        answer = self.answers.pop(0) if self.answers else [[], None]
        if isinstance(answer, Exception):
            raise answer
        return answer


@pytest.mark.parametrize(
    ("entry", "valid"),
    [
        ({"id": "j-1", "kind": "trace_result", "objects": {}}, True),
        ({"id": "", "kind": "trace_result"}, False),
        ({"id": 7, "kind": "trace_result"}, False),
        ({"id": "j", "kind": None}, False),
        ({"id": "j", "kind": "k", "value": float("nan")}, False),
        ({"id": "j", "kind": "k", "value": object()}, False),
        ({"id": "j", "kind": "k", "blob": "x" * (2 << 20)}, False),
        (["id", "kind"], False),
    ],
)
def test_entries_are_validated(entry: Any, valid: bool) -> None:
    assert (valid_entry(entry) is entry) is valid


def test_entries_reach_their_waiters_and_malformed_ones_are_dropped() -> None:
    first = {"id": "a", "kind": "trace_result"}
    second = {"id": "b", "kind": "trace_result"}
    engine = Engine([[{"id": 3}, "junk", first, {"id": "nobody", "kind": "x"}], None], [[second], None])

    async def wait() -> list[Any]:
        poller = OutboxPoller(engine, interval_s=0.001)
        return list(await asyncio.gather(poller.expect("a"), poller.expect("b")))

    assert asyncio.run(wait()) == [first, second] and engine.calls == 2


def test_a_broken_engine_fails_the_waiters() -> None:
    async def wait() -> None:
        await OutboxPoller(Engine(RuntimeError("EngineDeadError")), interval_s=0.001).expect("a")

    with pytest.raises(OutboxError, match="could not be read: EngineDeadError"):
        asyncio.run(wait())


def test_polling_stops_when_nobody_waits() -> None:
    engine = Engine()

    async def cancel_the_only_waiter() -> None:
        poller = OutboxPoller(engine, interval_s=0.001)
        poller.expect("a").cancel()
        await asyncio.sleep(0.05)

    asyncio.run(cancel_the_only_waiter())
    assert engine.calls <= 1
