"""The outbox poller: entries from the engine (untrusted) are validated, matched to their waiters by id, and a
broken engine fails the waiters instead of leaving them hanging; the calls made in one turn of the loop go
together in one RPC, sent at once whatever is in flight, each answered as it would be alone, and every RPC brings
the outbox back. The engine
here is a stand-in for vLLM's ``AsyncLLM.collective_rpc`` of ``nnqueue_calls``, which answers with one item per
rank (the real one is tested on the engine: tests/engines/test_steer_runner.py, tests/workers/)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from nnqueue.enginecore.outbox import CALL_FAILED
from nnqueue.engines.outbox import EngineCallFailed, OutboxError, OutboxPoller, valid_entry


class Engine:
    """Answers each ``nnqueue_calls`` RPC with the next of ``outboxes`` (one entry list per rank, or an exception)
    and, for each call, what ``answer`` gives (per rank); it records the calls of each RPC."""

    def __init__(self, *outboxes: Any, answer: Any = None, ranks: int = 2) -> None:
        self.outboxes = list(outboxes)
        self.answer = answer or (lambda method, args, rank: None)
        self.ranks = ranks
        self.rpcs: list[list[tuple[str, tuple[Any, ...]]]] = []
        self.in_flight = self.most_in_flight = 0

    @property
    def calls(self) -> int:
        return len(self.rpcs)

    async def collective_rpc(self, method: str, args: tuple[Any, ...] = ()) -> Any:
        assert method == "nnqueue_calls"
        (calls,) = args
        self.rpcs.append([(name, tuple(call_args)) for name, call_args in calls])
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        await asyncio.sleep(0.01)  # the engine's step, which an RPC waits for
        self.in_flight -= 1
        outbox = self.outboxes.pop(0) if self.outboxes else [[], None]
        if isinstance(outbox, Exception):
            raise outbox
        return [
            {"answers": [self.answer(name, call_args, rank) for name, call_args in calls], "outbox": outbox[rank]}
            for rank in range(self.ranks)
        ]


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


def test_calls_made_together_go_in_one_rpc_and_each_gets_its_own_answers() -> None:
    def answer(method: str, args: tuple[Any, ...], rank: int) -> Any:
        if method == "nnqueue_steer_begin" and args == ("bad",):
            return {CALL_FAILED: "ValueError: no such point"} if rank == 1 else {"job": "bad"}
        return {"rank": rank, "args": list(args)}

    entry = {"id": "t-1", "kind": "trace_result"}
    engine = Engine([[], None], [[entry], None], answer=answer)

    async def calls() -> list[Any]:
        poller = OutboxPoller(engine, interval_s=60)  # no poll of its own in this test
        written = poller.expect("t-1")
        first = asyncio.ensure_future(poller.call("nnqueue_finish_trace", "t-1", ["r-1"]))
        for _ in range(3):  # the first call is made and its RPC sent; the next three are made together
            await asyncio.sleep(0)
        rest = [
            poller.call("nnqueue_steer_begin", "good"),
            poller.call("nnqueue_steer_begin", "bad"),
            poller.call("nnqueue_steer_end", "good"),
        ]
        answers = await asyncio.gather(first, *rest, return_exceptions=True)
        return [*answers, await written]

    finish, begun, refused, ended, written = asyncio.run(calls())
    assert engine.rpcs == [
        [("nnqueue_finish_trace", ("t-1", ["r-1"]))],
        [("nnqueue_steer_begin", ("good",)), ("nnqueue_steer_begin", ("bad",)), ("nnqueue_steer_end", ("good",))],
    ]
    assert engine.most_in_flight == 2  # the second RPC did not wait for the first's answer
    assert finish == [{"rank": 0, "args": ["t-1", ["r-1"]]}, {"rank": 1, "args": ["t-1", ["r-1"]]}]
    assert begun == [{"rank": 0, "args": ["good"]}, {"rank": 1, "args": ["good"]}]
    assert ended == [{"rank": 0, "args": ["good"]}, {"rank": 1, "args": ["good"]}]
    # A call that raised on a rank fails its own caller, naming why; its RPC's other calls are answered.
    assert isinstance(refused, EngineCallFailed) and "nnqueue_steer_begin failed on the engine: ValueError" in str(
        refused
    )
    assert written == entry  # the outbox came back with the calls' RPC: no poll was needed


def test_an_rpc_that_fails_fails_every_call_in_it() -> None:
    engine = Engine(RuntimeError("EngineDeadError"))

    async def calls() -> list[Any]:
        poller = OutboxPoller(engine, interval_s=60)
        return list(
            await asyncio.gather(
                poller.call("nnqueue_steer_end", "a"), poller.call("nnqueue_steer_end", "b"), return_exceptions=True
            )
        )

    failures = asyncio.run(calls())
    assert [str(failure) for failure in failures] == ["EngineDeadError"] * 2 and engine.calls == 1
