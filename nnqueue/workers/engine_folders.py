"""The two host folders the engine writes, watched: an escaped engine must not fill the host's disk through them.

The engine's filesystem view lets it write two folders of the host: the handoff folder, where it leaves results and
shards (:mod:`nnqueue.workers.sinks`), and the crash folder, where it leaves its stall beacons and crash reports
(:mod:`nnqueue.enginecore.crash_report`). Both sit on the host's disk (in its temp folder for a root worker), and a
seventh red-team round's escaped engine could have written without end to either (``RLIMIT_FSIZE`` unlimited).

What may stand there is known: in the handoff folder, the files the worker handed out, each with its bound
(`ResultSinks.overrun`); in the crash folder, a few small files (:data:`CRASH_FOLDER_ENTRIES`,
:data:`CRASH_FOLDER_BYTES`). The :class:`FolderWatchdog` looks at both every second. An overrun is logged as a
warning: a user's result over ``NNQUEUE_MAX_RESULT_BYTES`` is one (the engine writes it whole before the worker
refuses it), and it costs the other jobs on the worker nothing while the disk has room. One that leaves less than a
reserve free on its folder's filesystem stops the worker as if its engine died (a fresh worker and engine replace it;
both folders are removed at the stop): an escaped engine cannot take the disk's last reserve. A file the engine
deleted and keeps writing is in no folder: the watchdog counts what the engine's processes hold open of such files
(:func:`deleted_bytes_held`), and a filesystem of bounded size (``NNQUEUE_WORKER_HANDOFF_DIR``) bounds it too.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the watchdog's only: those modules import the database's and Celery's
    from nnqueue.workers.engine_health import EngineHealth
    from nnqueue.workers.sinks import ResultSinks

log = logging.getLogger(__name__)
# How often the `FolderWatchdog` looks at the folders.
WATCH_INTERVAL_S = 1.0
# The free space the `FolderWatchdog` keeps on a folder's filesystem: this, or this share of it if more.
RESERVE_BYTES = 1 << 30
RESERVE_SHARE = 0.05
# How often an overrun that leaves the reserve free is logged again.
OVERRUN_LOG_INTERVAL_S = 60.0
# What the crash folder may hold: a beacon per engine process and a report per crash, each a few KiB.
CRASH_FOLDER_ENTRIES = 256
CRASH_FOLDER_BYTES = 16 << 20
# The bytes of deleted files of the two folders the engine's processes may hold open.
DELETED_SLACK_BYTES = 1 << 20


@dataclass(frozen=True)
class FolderUsage:
    """What one scan of a folder found (`folder_usage`): its ``entries`` (as many as were read), the bytes they take on
    the disk (``allocated``), and the name of a folder in it, if any."""

    entries: int
    allocated: int
    subfolder: str | None


def folder_usage(folder: Path, most: int) -> FolderUsage:
    """One scan of ``folder`` (opened without following a link, each entry's status read relative to it without
    following one either), reading at most ``most`` + 1 entries: ``entries`` over ``most`` says there are more. An
    entry gone meanwhile is left out. Raises OSError when ``folder`` is not a folder."""
    entries = allocated = 0
    subfolder = None
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        with os.scandir(fd) as scan:
            for entry in scan:
                entries += 1
                if entries > most:
                    break
                try:
                    info = entry.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue
                allocated += info.st_blocks * 512
                if stat.S_ISDIR(info.st_mode):
                    subfolder = entry.name
    finally:
        os.close(fd)
    return FolderUsage(entries, allocated, subfolder)


def crash_folder_overrun(folder: Path) -> str | None:
    """Why the crash folder holds more than an engine's beacons and reports take, or None (also once it is gone: the
    worker removes it when it stops)."""
    try:
        usage = folder_usage(folder, CRASH_FOLDER_ENTRIES)
    except FileNotFoundError:
        return None
    except OSError as error:
        return f"the crash folder {folder} could not be read: {error}"
    return usage_overrun("crash folder", usage, CRASH_FOLDER_ENTRIES, CRASH_FOLDER_BYTES)


def usage_overrun(name: str, usage: FolderUsage, most: int, room: int | None, context: str = "") -> str | None:
    """Why the folder ``name`` holds more than it may, or None: more than ``most`` entries, a folder (whose content
    one scan cannot see: round 9 put 100 MB two folders down in the crash folder), or more than ``room`` bytes on the
    disk (None: unchecked); ``context`` ends the reasons about counts."""
    if usage.entries > most:
        return f"the {name} holds more than {most} entries{context}"
    if usage.subfolder is not None:
        return f"the {name} holds a folder, {usage.subfolder!r}, where the engine leaves files only"
    if room is not None and usage.allocated > room:
        return f"the {name} takes {usage.allocated} bytes on the disk, over the {room} allowed{context}"
    return None


def deleted_bytes_held(pids: Iterable[int], folders: Iterable[Path]) -> int:
    """The bytes on the disk of files once in ``folders`` that were deleted while the processes ``pids`` or their
    descendants keep them open: a file in no folder, which a scan of the folders cannot see (round 8 filled the disk
    so). Read from ``/proc/<pid>/fd`` (the folders are at the same paths in the engine's view)."""
    import psutil  # vLLM's dependency: there wherever an engine runs

    prefixes = tuple(f"{folder}/" for folder in folders)
    held = 0
    for pid in pids:
        try:
            processes = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
        except psutil.Error:
            continue
        for process in processes:
            try:
                descriptors = os.listdir(f"/proc/{process.pid}/fd")
            except OSError:
                continue
            for descriptor in descriptors:
                path = f"/proc/{process.pid}/fd/{descriptor}"
                with contextlib.suppress(OSError):
                    target = os.readlink(path)
                    if target.endswith(" (deleted)") and target.startswith(prefixes):
                        held += os.stat(path).st_blocks * 512
    return held


class FolderWatchdog(threading.Thread):
    """Looks at the handoff folder (`ResultSinks.overrun`) and the crash folder (:func:`crash_folder_overrun`) every
    ``interval_s`` while the engine serves; see the module. Stopping the worker is ``health.dead``, then
    ``health.stop``, as a trust-domain switch that could not verify the engine does (the worker exits with
    ``EXIT_ENGINE_DIED``). An engine being replaced (``dead`` already) is not looked at: its replacement empties both
    folders. It ends once the handoff folder is removed (`ResultSinks.close`)."""

    def __init__(
        self,
        sinks: ResultSinks,
        crash_dir: Path,
        health: EngineHealth,
        engine_processes: Callable[[], Iterable[int]] = tuple,
        interval_s: float = WATCH_INTERVAL_S,
        reserve_bytes: int = RESERVE_BYTES,
    ) -> None:
        super().__init__(name="nnqueue-folder-watchdog", daemon=True)
        self.sinks, self.crash_dir, self.health = sinks, crash_dir, health
        self.engine_processes, self.interval_s, self.reserve_bytes = engine_processes, interval_s, reserve_bytes
        self._logged = -math.inf
        self._free_at_start = _free_bytes(sinks.handoff_dir())

    def run(self) -> None:
        while True:
            time.sleep(self.interval_s)
            if self.sinks.closed:
                return
            if self.health.dead.is_set():
                continue
            handoff = self.sinks.handoff_dir()
            for folder, reason in (
                (handoff, self.sinks.overrun()),
                (self.crash_dir, crash_folder_overrun(self.crash_dir)),
                (handoff, self._deleted_files()),
                (handoff, self._disk_fell(handoff)),
            ):
                if reason is None:
                    continue
                if not self._reserve_left(folder):
                    log.error(
                        "the engine wrote more than it may: %s, and the disk is nearly full; the worker restarts",
                        reason,
                    )
                    self.health.dead.set()
                    self.health.stop()
                    return
                if time.monotonic() - self._logged >= OVERRUN_LOG_INTERVAL_S:
                    self._logged = time.monotonic()
                    log.warning("the engine wrote more than it may: %s", reason)

    def _deleted_files(self) -> str | None:
        """Why the engine's processes hold too much in deleted files of the two folders, or None: more than one file's
        slack (a result the worker discarded while the engine still wrote it is one, within its bound)."""
        held = deleted_bytes_held(self.engine_processes(), (self.sinks.handoff_dir(), self.crash_dir))
        if held <= DELETED_SLACK_BYTES:
            return None
        return f"the engine's processes hold {held} bytes of files deleted from the handoff and crash folders"

    def _disk_fell(self, handoff: Path) -> str | None:
        """Why the disk behind the handoff folder lost more since the worker started than both folders may hold, or
        None: what no scan sees (a deleted file the engine keeps mapped only, or its descriptor in flight in a unix
        socket: round 9) shows as free space gone. Other processes' writes count too: said only with the disk under its
        reserve (where every overrun stops the worker)."""
        room = self.sinks.room()
        fell = self._free_at_start - _free_bytes(handoff)
        if room is None or fell <= room + CRASH_FOLDER_BYTES or self._reserve_left(handoff):
            return None
        return f"the disk behind the handoff folder has {fell} bytes less free than when the worker started"

    def _reserve_left(self, folder: Path) -> bool:
        """Whether ``folder``'s filesystem has its reserve free."""
        try:
            space = os.statvfs(folder)
            free = _free_bytes(folder)
        except OSError:  # the folder was replaced: its overrun said so; nothing to measure
            return False
        return free >= max(self.reserve_bytes, RESERVE_SHARE * space.f_blocks * space.f_frsize)


def _free_bytes(folder: Path) -> int:
    """The bytes an unprivileged process may still write on ``folder``'s filesystem."""
    space = os.statvfs(folder)
    return space.f_bavail * space.f_frsize
