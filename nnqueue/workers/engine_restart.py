"""A dead vLLM engine replaced inside its live worker (and a live one, at a trust-domain switch under
``NNQUEUE_DOMAIN_SWITCH=restart``: :meth:`~nnqueue.workers.engine_health.EngineHealth.replace`).

When the engine core dies (a trace crashed it, or the stall deadline killed it: :mod:`nnqueue.workers.engine_health`
settles its jobs), only the engine core is lost, so only it is started again. The worker used to exit and its
supervisor to start a fresh one: vLLM's import again (14-16 s of CPU), the trace builders' zygote and its meta
model (15 s), the broker, the registration. The process keeps all of that now, and its containment: the fresh
core starts as the first one did, in the engine's network namespace and filesystem view, and switches to the
engine user (forked by the builders' zygote where it serves engine cores: :mod:`nnqueue.enginecore.core_forks`;
12-13 s from the death to the fresh engine serving on one H200 with a Llama-3-8B shape, 32-33 s spawned). Its
registration stays too, so the model keeps a live worker and no job is refused meanwhile; jobs
that come wait for the fresh engine (:meth:`~nnqueue.workers.engine_health.EngineHealth.restarted`).

Before the fresh engine starts, the worker hands back what the dead one held (its harvest chunks; its jobs are
settled already) and clears its crash reports and stall beacons, which describe the dead engine only. The fresh
engine serves the checkpoint: the model's weights updates are replayed onto it before it serves
(:meth:`~nnqueue.workers.weights.CheckpointUpdater.replay_onto`), as a worker starting after them does. A worker
with a TRL trainer's server keeps the old way (its NCCL group is bound to the engine): it exits, and its supervisor
starts a fresh worker.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from nnqueue import cgroups
from nnqueue.enginecore import untrusted_files
from nnqueue.workers import output_relay
from nnqueue.workers.chunk_execution import ChunkRunner
from nnqueue.workers.engine_health import ENGINE_DIED
from nnqueue.workers.engine_processes import kill_and_wait
from nnqueue.workers.weights import CheckpointUpdater

if TYPE_CHECKING:  # imports vLLM
    from nnqueue.workers.trace_execution import VLLMTraceExecutor

log = logging.getLogger(__name__)


@dataclass
class EngineRestart:
    """Start a fresh engine in place of the dead one; the worker's ``EngineHealth.restart``."""

    start: Callable[[], Any]  # a fresh dispatched nnsight VLLM, its core contained as the first one's
    executor: VLLMTraceExecutor
    chunks: ChunkRunner
    updater: CheckpointUpdater
    base: tuple[str, dict[str, Any]]  # the checkpoint's weights version and source
    crash_dir: Path
    hand_back: Callable[[str], None]  # requeue what the worker holds and abort its runs here

    async def __call__(self, why: str = ENGINE_DIED) -> None:
        began = time.monotonic()
        await asyncio.to_thread(self.hand_back, why)
        # The old core's client: its sockets closed, what is left of its processes killed at once (a dead core has
        # nothing to tear down; a live one that a domain switch replaces spent vLLM's 5 s grace period tearing down
        # on one H200), and their end awaited, so that the fresh engine finds their memory free.
        await asyncio.to_thread(kill_and_wait, self.executor.model.vllm_entrypoint)
        # And what they left that lives on outside the worker's tree (a daemon of a spawned core: a forked core's are
        # its server's to kill, nnqueue.enginecore.core_forks).
        if (group := cgroups.asked()) is not None:
            group.kill_strays(os.getpid())
        # The two folders the old engine's processes could write, which the fresh engine's share: the crash folder
        # (its crash reports and stall beacons describe the dead engine only; a fourth red-team round left a file there
        # for the next trust domain's engine) and the handoff folder (its leftovers could stand at names the next
        # domain's files take: a sixth round failed another owner's harvest with planted folders).
        for folder in (self.crash_dir, self.executor.sinks.handoff_dir()):
            empty_folder(folder)
        # And the pipe all engines write their output to, as the worker made it, its allowance full (a tenth red-team
        # round's engine changed its flags, which the relay put back only at its next read, and spent its allowance).
        output_relay.engine_replaced()
        engine = self.start()  # on the engine loop, as the first engine was (vLLM's AsyncLLM binds to it)
        self.executor.use_engine(engine)
        self.chunks.model = engine
        await self.updater.replay_onto(engine.vllm_entrypoint, self.base)
        # The dead engine's client and meta model were frozen with the start-up heap (main.freeze_startup_heap),
        # where the collector never frees them: collect them now, and freeze the fresh engine's.
        gc.unfreeze()
        gc.collect()
        gc.freeze()
        since = "the engine died" if why == ENGINE_DIED else "its replacement began"
        log.info("a fresh engine serves, %.1f s after %s", time.monotonic() - began, since)


def empty_folder(folder: Path) -> None:
    """Empty a folder an engine wrote, trusting no path in it (:func:`nnqueue.enginecore.untrusted_files.empty`),
    logging rather than failing the restart when the folder is not one (the old engine's user replaced it with a
    link: the worker's readers refuse it too)."""
    try:
        untrusted_files.empty(folder)
    except OSError as error:
        log.error("the engine's folder %s could not be emptied: %s", folder, error)
