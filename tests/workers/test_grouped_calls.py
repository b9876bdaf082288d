"""Group commit: calls arriving while one is in flight run together; each caller gets its own result or error."""

from __future__ import annotations

import asyncio
import threading

from nnqueue.workers.grouped_calls import GroupedCalls


def test_calls_that_arrive_while_one_runs_go_together_in_order() -> None:
    groups: list[list[int]] = []
    release = threading.Event()

    def run(items: list[int]) -> list[int]:
        groups.append(items)
        if len(groups) == 1:
            release.wait(10)  # the first call is in flight while the others arrive
        return [item * 10 for item in items]

    async def main() -> list[int]:
        calls: GroupedCalls[int, int] = GroupedCalls(run)
        first = asyncio.ensure_future(calls(0))
        await asyncio.sleep(0.05)
        rest = [asyncio.ensure_future(calls(item)) for item in range(1, 20)]
        await asyncio.sleep(0.05)
        release.set()
        return await asyncio.gather(first, *rest)

    assert asyncio.run(main()) == [item * 10 for item in range(20)]
    assert groups == [[0], list(range(1, 20))]  # the first at once, alone; the other 19 in one call


def test_an_items_error_goes_to_its_caller_and_a_raised_error_to_its_whole_group() -> None:
    def run(items: list[int]) -> list[int | BaseException]:
        if 99 in items:
            raise ConnectionError("the database went away")
        return [ValueError(f"bad {item}") if item % 2 else item for item in items]

    async def main() -> None:
        calls: GroupedCalls[int, int] = GroupedCalls(run)
        results = await asyncio.gather(*(calls(item) for item in range(4)), return_exceptions=True)
        assert results[0] == 0 and results[2] == 2
        assert [str(error) for error in results[1::2]] == ["bad 1", "bad 3"]
        both = await asyncio.gather(calls(98), calls(99), return_exceptions=True)
        assert [type(error) for error in both] == [ConnectionError, ConnectionError]
        assert await calls(4) == 4  # later groups run as before

    asyncio.run(main())


def test_a_caller_cancelled_before_its_group_starts_is_left_out() -> None:
    groups: list[list[int]] = []
    release = threading.Event()

    def run(items: list[int]) -> list[int]:
        groups.append(items)
        release.wait(10)
        return items

    async def main() -> None:
        calls: GroupedCalls[int, int] = GroupedCalls(run)
        first = asyncio.ensure_future(calls(0))
        await asyncio.sleep(0.05)
        gone, kept = asyncio.ensure_future(calls(1)), asyncio.ensure_future(calls(2))
        await asyncio.sleep(0.01)
        gone.cancel()
        release.set()
        assert (await first, await kept) == (0, 2)

    asyncio.run(main())
    assert groups == [[0], [2]]
