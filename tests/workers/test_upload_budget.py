"""The upload budget: shards handed off wait for room only when what is held does not leave enough, in the order
they came; a shard larger than the whole budget goes alone; a chunk cancelled while it waits takes nothing."""

from __future__ import annotations

import asyncio

import pytest

from nnqueue.workers.upload_budget import UploadBudget


async def hold(budget: UploadBudget, nbytes: int, order: list[int], release: asyncio.Event) -> None:
    async with budget.room(nbytes):
        order.append(nbytes)
        await release.wait()


def test_shards_wait_only_when_the_budget_is_full_and_in_the_order_they_came() -> None:
    async def scenario() -> None:
        budget = UploadBudget(100)
        order: list[int] = []
        first, second = asyncio.Event(), asyncio.Event()
        held = [asyncio.create_task(hold(budget, n, order, first)) for n in (60, 30)]
        await asyncio.sleep(0)
        assert order == [60, 30] and budget.held == 90  # both fit: neither waited
        waiting = [asyncio.create_task(hold(budget, n, order, second)) for n in (50, 5)]
        await asyncio.sleep(0)
        assert order == [60, 30] and budget.held == 90  # 5 would fit, but it came after 50, which does not
        first.set()
        await asyncio.gather(*held)
        assert order == [60, 30, 50, 5] and budget.held == 55
        second.set()
        await asyncio.gather(*waiting)
        assert budget.held == 0

    asyncio.run(scenario())


def test_a_shard_larger_than_the_budget_goes_alone() -> None:
    async def scenario() -> None:
        budget = UploadBudget(100)
        order: list[int] = []
        release = asyncio.Event()
        small = asyncio.create_task(hold(budget, 10, order, release))
        await asyncio.sleep(0)
        big = asyncio.create_task(hold(budget, 250, order, asyncio.Event()))
        await asyncio.sleep(0)
        assert order == [10]
        release.set()
        await small
        await asyncio.sleep(0)
        assert order == [10, 250] and budget.held == 250
        big.cancel()
        with pytest.raises(asyncio.CancelledError):
            await big
        assert budget.held == 0

    asyncio.run(scenario())


def test_a_chunk_cancelled_while_it_waits_takes_nothing_and_lets_the_next_go() -> None:
    async def scenario() -> None:
        budget = UploadBudget(100)
        order: list[int] = []
        release = asyncio.Event()
        first = asyncio.create_task(hold(budget, 80, order, release))
        await asyncio.sleep(0)
        cancelled = asyncio.create_task(hold(budget, 90, order, asyncio.Event()))
        after = asyncio.create_task(hold(budget, 20, order, release))
        await asyncio.sleep(0)
        cancelled.cancel()  # it was first in line: the one behind it now fits beside what is held
        with pytest.raises(asyncio.CancelledError):
            await cancelled
        await asyncio.sleep(0)
        assert order == [80, 20] and budget.held == 100
        release.set()
        await asyncio.gather(first, after)
        assert budget.held == 0

    asyncio.run(scenario())


def test_a_budget_needs_a_byte() -> None:
    with pytest.raises(ValueError, match="at least one byte"):
        UploadBudget(0)
