"""The child-process pool and its frames (nnqueue.enginecore.child_process), with real child processes: what both
the trace builders and the transformers engine rely on. Each child here serves a small handler through the
module's own `serve`; what it does on a request is named by the request."""

from __future__ import annotations

import asyncio
import os
import sys
import time
from collections.abc import Callable, Iterator

import psutil
import pytest

from nnqueue.enginecore.child_process import ChildError, ChildFailed, ChildPool, ChildTimedOut

# The child: reports its environment and pid, echoes, raises, exits, hangs or breaks the protocol on request.
CHILD = """
import json, os, sys, time
from nnqueue.enginecore import child_process

def handle(request):
    if request == b"env":
        return json.dumps(dict(os.environ)).encode()
    if request == b"pid":
        return str(os.getpid()).encode()
    if request == b"raise":
        raise KeyError("no such thing")
    if request == b"exit":
        os._exit(7)
    if request == b"hang":
        time.sleep(600)
    if request == b"garbage":
        os.write(protocol.fileno(), b"not a frame at all")
        time.sleep(600)
    if request == b"big":
        return b"x" * (2 << 20)
    if request == b"fds":  # what each of its descriptors is
        links = [f"/proc/self/fd/{fd}" for fd in os.listdir("/proc/self/fd")]
        return json.dumps([os.readlink(link) for link in links if os.path.exists(link)]).encode()  # not listdir's
    if request == b"ask":  # two questions to the worker, then an answer made of its replies
        return child_process.ask(b"first") + b"+" + child_process.ask(b"second")
    return b"echo:" + request

protocol = child_process.open_protocol()
print("user code's print goes to stderr")
child_process.serve(protocol, {"child": "test"}, handle)
"""

# The same child forked from a zygote (nnqueue.enginecore.zygote), as the trace builders are: each test runs both ways.
FORKED_CHILD = "from nnqueue.enginecore import zygote\nzygote.serve_forks(zygote.channel())\n" + CHILD
PoolFactory = Callable[..., ChildPool]


@pytest.fixture()
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


@pytest.fixture(params=["spawned", "forked"])
def pool(request: pytest.FixtureRequest) -> PoolFactory:
    """Makes pools of spawned children, or of children forked from a zygote."""
    forked = request.param == "forked"

    def make(size: int = 1, command: list[str] | None = None, answer_timeout_s: float | None = None) -> ChildPool:
        return ChildPool(
            "test child",
            command or [sys.executable, "-c", FORKED_CHILD if forked else CHILD],
            size,
            ready_timeout_s=60,
            max_answer_bytes=1 << 20,
            answer_timeout_s=answer_timeout_s,
            zygote=forked,
        )

    return make


def test_answers_errors_and_deaths_each_have_their_outcome(loop: asyncio.AbstractEventLoop, pool: PoolFactory) -> None:
    children = pool()

    async def scenario() -> None:
        first = int(await children.call(b"pid", "while testing", bytes))
        assert await children.call(b"hello", "while testing", bytes) == b"echo:hello"  # print() did not break it
        with pytest.raises(ChildError) as reported:
            await children.call(b"raise", "while testing", bytes)
        assert reported.value.type_name == "KeyError" and "no such thing" in reported.value.message
        assert "handle" in reported.value.traceback
        assert int(await children.call(b"pid", "while testing", bytes)) == first  # an error keeps the child
        # 7, its own; 255 where another part of the process reaped it first (asyncio then reports 255)
        with pytest.raises(ChildFailed, match=r"the test child process died while testing \(exit code (7|255)\)"):
            await children.call(b"exit", "while testing", bytes)
        assert int(await children.call(b"pid", "while testing", bytes)) != first  # replaced
        await children.close()

    loop.run_until_complete(scenario())


def test_a_child_that_breaks_the_protocol_is_killed_and_replaced(
    loop: asyncio.AbstractEventLoop, pool: PoolFactory
) -> None:
    children = pool()

    async def scenario() -> None:
        first = int(await children.call(b"pid", "while testing", bytes))
        with pytest.raises(ChildFailed, match="broke the protocol while testing"):
            await children.call(b"garbage", "while testing", bytes)
        with pytest.raises(ChildFailed, match="broke the protocol"):
            await children.call(b"big", "while testing", bytes)  # over max_answer_bytes
        with pytest.raises(ChildFailed, match="broke the protocol"):
            await children.call(b"hello", "while testing", lambda answer: int(answer))  # read refuses the answer
        assert int(await children.call(b"pid", "while testing", bytes)) not in (first, 0)
        await children.close()
        with pytest.raises(ProcessLookupError):
            os.kill(first, 0)

    loop.run_until_complete(scenario())


def test_a_child_asks_the_worker_while_it_handles_a_request(loop: asyncio.AbstractEventLoop, pool: PoolFactory) -> None:
    children = pool()
    asked: list[bytes] = []

    async def reply(question: bytes) -> bytes:
        asked.append(question)
        await asyncio.sleep(0)
        return question.upper()

    async def refuse(question: bytes) -> bytes:
        raise LookupError("the worker's own failure")

    async def scenario() -> None:
        pid = int(await children.call(b"pid", "while testing", bytes))
        assert await children.call(b"ask", "while testing", bytes, reply) == b"FIRST+SECOND"
        assert asked == [b"first", b"second"]
        assert int(await children.call(b"pid", "while testing", bytes)) == pid  # the child lives on
        # What the reply raises is raised as it is (not the child's failure); the child, left waiting, is stopped.
        with pytest.raises(LookupError, match="the worker's own failure"):
            await children.call(b"ask", "while testing", bytes, refuse)
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        # A question with nothing to reply to it breaks the protocol: the child is killed.
        with pytest.raises(ChildFailed, match="broke the protocol while testing"):
            await children.call(b"ask", "while testing", bytes)
        await children.close()

    loop.run_until_complete(scenario())


def test_a_child_silent_past_the_answer_timeout_is_stopped_and_the_askers_time_is_not_its(
    loop: asyncio.AbstractEventLoop, pool: PoolFactory
) -> None:
    children = pool(answer_timeout_s=1.5)

    async def slow_reply(question: bytes) -> bytes:
        await asyncio.sleep(2)  # the worker's time (a session's trace on the engine): not the child's
        return question

    async def scenario() -> None:
        pid = int(await children.call(b"pid", "while testing", bytes))
        assert await children.call(b"ask", "while testing", bytes, slow_reply) == b"first+second"
        started = time.monotonic()
        with pytest.raises(ChildTimedOut, match=r"ran 1\.5 s without answering while testing"):
            await children.call(b"hang", "while testing", bytes)
        assert time.monotonic() - started < 30
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        assert await children.call(b"again", "while testing", bytes) == b"echo:again"  # a fresh child
        await children.close()

    loop.run_until_complete(scenario())


def test_a_child_that_ran_a_domains_code_serves_no_other_domain(
    loop: asyncio.AbstractEventLoop, pool: PoolFactory
) -> None:
    children = pool()

    async def pid(domain: str | None, runs_code: bool = False) -> int:
        return int(await children.call(b"pid", "while testing", bytes, domain=domain, runs_code=runs_code))

    async def scenario() -> None:
        fresh = await pid("alice")
        assert await pid("bob") == fresh  # a request that runs no code leaves the child fresh
        assert await pid("alice", runs_code=True) == fresh
        assert await pid("alice") == await pid("alice", runs_code=True) == fresh  # alice's from now on
        bobs = await pid("bob", runs_code=True)
        assert bobs != fresh
        with pytest.raises(ProcessLookupError):  # stopped to keep the pool within its size
            os.kill(fresh, 0)
        assert await pid("alice") != bobs  # bob's child serves bob only, checks included
        assert await pid(None) not in (fresh, bobs)  # no domain: any child (alice's fresh one, idle)
        # At a switch of domains, a child that ran a domain's code is replaced; a fresh one is kept.
        assert await children.retire_domains() == 0
        carols = await pid("carol", runs_code=True)
        assert await children.retire_domains() == 1
        with pytest.raises(ProcessLookupError):
            os.kill(carols, 0)
        assert await pid("dave", runs_code=True) != carols  # the replacement
        await children.close()

    loop.run_until_complete(scenario())


def test_another_domain_gets_a_new_child_beside_the_first_while_the_pool_has_room(
    loop: asyncio.AbstractEventLoop, pool: PoolFactory
) -> None:
    children = pool(size=2)

    async def scenario() -> None:
        alices = int(await children.call(b"pid", "while testing", bytes, domain="alice", runs_code=True))
        bobs = int(await children.call(b"pid", "while testing", bytes, domain="bob", runs_code=True))
        assert bobs != alices
        os.kill(alices, 0)  # still there: there was room for bob's
        assert int(await children.call(b"pid", "while testing", bytes, domain="alice")) == alices
        await children.close()

    loop.run_until_complete(scenario())


def test_a_cancelled_request_kills_its_child(loop: asyncio.AbstractEventLoop, pool: PoolFactory) -> None:
    children = pool()

    async def scenario() -> None:
        pid = int(await children.call(b"pid", "while testing", bytes))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(children.call(b"hang", "while testing", bytes), 1)
        with pytest.raises(ProcessLookupError):  # killed and reaped, not left to hang
            os.kill(pid, 0)
        assert int(await children.call(b"pid", "while testing", bytes)) != pid
        await children.close()

    loop.run_until_complete(scenario())


def test_a_child_that_died_idle_is_replaced_before_the_next_request(
    loop: asyncio.AbstractEventLoop, pool: PoolFactory
) -> None:
    children = pool()

    async def scenario() -> None:
        await children.start()
        pid = int(await children.call(b"pid", "while testing", bytes))
        os.kill(pid, 9)
        await asyncio.sleep(0.5)  # asyncio's child watcher sees it exit
        assert int(await children.call(b"pid", "while testing", bytes)) != pid  # no failed request
        await children.close()

    loop.run_until_complete(scenario())


def test_children_get_no_secrets_and_run_concurrently(
    loop: asyncio.AbstractEventLoop, pool: PoolFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NNQUEUE_DATABASE_URL", "postgresql://secret")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "secret")
    monkeypatch.setenv("NNQUEUE_SECRET_ENV_PATTERNS", "MY_TOKEN_*")
    monkeypatch.setenv("MY_TOKEN_A", "secret")
    monkeypatch.setenv("NNQUEUE_HARMLESS", "kept")
    children = pool(size=2)

    async def scenario() -> None:
        import json

        environ = json.loads(await children.call(b"env", "while testing", bytes))
        assert environ["NNQUEUE_HARMLESS"] == "kept"
        assert not {"NNQUEUE_DATABASE_URL", "AWS_SECRET_ACCESS_KEY", "MY_TOKEN_A"} & set(environ)
        pids = await asyncio.gather(*(children.call(b"pid", "while testing", bytes) for _ in range(2)))
        assert len(set(pids)) == 2  # two requests at once: two children
        await children.close()

    loop.run_until_complete(scenario())


def test_launched_children_start_before_the_loop_runs_again_and_take_the_first_requests(
    loop: asyncio.AbstractEventLoop, pool: PoolFactory, request: pytest.FixtureRequest
) -> None:
    """What a worker does while its engine loads: the children (forked ones: their zygote) run as soon as `launch`
    returns, before the loop gets to read their READY frames, and the first requests, even those made before they are
    ready, go to them."""
    children = pool(size=2)
    forked = request.node.callspec.params["pool"] == "forked"

    def running() -> set[int]:
        """The pool's processes that are no zygote."""
        ours = [
            child
            for child in psutil.Process().children(recursive=True)
            if "child_process.serve" in " ".join(child.cmdline())
        ]
        return {child.pid for child in ours} - {child.ppid() for child in ours}

    async def scenario() -> None:
        ready = await children.launch(2)
        launched = running()
        assert len(launched) == (1 if forked else 2) and not ready.done()  # forked: the zygote, loading
        early = [asyncio.ensure_future(children.call(b"pid", "while testing", bytes)) for _ in range(3)]
        await ready
        answered = {int(pid) for pid in await asyncio.gather(*early)}
        assert answered <= running() and len(running()) == 2  # no third child was started
        assert forked or running() == launched
        await children.close()

    loop.run_until_complete(scenario())


def test_a_forked_child_holds_nothing_of_its_zygote_or_its_siblings(
    loop: asyncio.AbstractEventLoop, pool: PoolFactory
) -> None:
    """A forked child keeps its own pipes and stderr: not the zygote's socket to the worker, nor another child's
    pipes (both spawned and forked children hold stdin, stdout, stderr and the protocol's copy of stdout)."""
    children = pool(size=2)

    async def scenario() -> None:
        import json

        both = await asyncio.gather(*(children.call(b"fds", "while testing", bytes) for _ in range(2)))
        for held in map(json.loads, both):
            assert len(held) <= 4 and not any(target.startswith("socket:") for target in held), held
        await children.close()

    loop.run_until_complete(scenario())


def test_a_launched_child_that_does_not_start_is_logged_and_the_request_starts_another(
    loop: asyncio.AbstractEventLoop, pool: PoolFactory, caplog: pytest.LogCaptureFixture
) -> None:
    children = pool(command=[sys.executable, "-c", "import sys; sys.exit(4)"])

    async def scenario() -> None:
        await (await children.launch(1))
        assert "the test child process did not start" in caplog.text
        with pytest.raises(ChildFailed, match="did not start"):
            await children.call(b"pid", "while testing", bytes)

    loop.run_until_complete(scenario())


def test_a_child_that_dies_before_it_is_ready_says_so_at_once(
    loop: asyncio.AbstractEventLoop, pool: PoolFactory, request: pytest.FixtureRequest
) -> None:
    """Forked, it dies as soon as it is forked: its exit can reach the worker before its fork is answered."""
    forked = request.node.callspec.params["pool"] == "forked"
    preamble = "from nnqueue.enginecore import zygote\nzygote.serve_forks(zygote.channel())\n" if forked else ""
    children = pool(command=[sys.executable, "-c", preamble + "import os\nos._exit(3)"])

    async def scenario() -> None:
        for _ in range(3):
            with pytest.raises(ChildFailed, match="the test child process did not start"):
                await asyncio.wait_for(children.call(b"pid", "while testing", bytes), 30)
        await asyncio.wait_for(children.close(), 30)

    loop.run_until_complete(scenario())


def test_a_child_that_does_not_start_says_so(loop: asyncio.AbstractEventLoop, pool: PoolFactory) -> None:
    children = pool(command=[sys.executable, "-c", "import sys; sys.exit(4)"])

    async def scenario() -> None:
        with pytest.raises(ChildFailed, match="the test child process did not start") as failed:
            await children.call(b"pid", "while testing", bytes)
        assert not failed.value.started

    loop.run_until_complete(scenario())
