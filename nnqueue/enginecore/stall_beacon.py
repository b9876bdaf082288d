"""Where an engine process's forward is in users' code, for the worker to see from outside.

The stall watchdog (:mod:`nnqueue.enginecore.stall_watchdog`) stops a stalled intervention with an asynchronous
exception, which only lands when the stalled thread next runs bytecode: ``time.sleep(1000)``, a catastrophic
regular expression or a loop in a C extension never gets there, and a regular expression holds the GIL, so no
thread of the engine process can even notice. Something outside the process has to stop it.

So each engine process that runs users' code publishes, in a small memory-mapped file of its own
(``switch-<pid>.bin`` in the crash report directory, ``$NNQUEUE_CRASH_REPORT_DIR``), when its forward thread
entered the intervention code it is in now and whose request that code is (0: none); writing it is a copy into
shared memory, no system call. The worker reads these files (:func:`read_all`;
:mod:`nnqueue.workers.stall_deadline` kills the engine process whose code has been in one switch past the
deadline). ``started`` is ``time.monotonic()``, the host's CLOCK_MONOTONIC, the same in every process.

The file is written by a process that runs users' code: the worker takes what it says as a claim that names at
most one of the worker's own running jobs, as it takes the crash report.
"""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from nnqueue.enginecore import untrusted_files

PREFIX = "switch-"
_LAYOUT = struct.Struct("<d128s")  # started (CLOCK_MONOTONIC, 0: not in users' code), the request id


@dataclass(frozen=True)
class InUserCode:
    """An engine process whose forward is in users' code: since ``started``, ``request_id``'s."""

    pid: int
    started: float
    request_id: str


class Beacon:
    """This process's file; see the module doc."""

    def __init__(self, directory: Path) -> None:
        path = directory / f"{PREFIX}{os.getpid()}.bin"
        with open(path, "w+b") as file:
            file.truncate(_LAYOUT.size)
            self._map = mmap.mmap(file.fileno(), _LAYOUT.size)

    def publish(self, started: float, request_id: str) -> None:
        """The forward entered ``request_id``'s code at ``started`` (0: it is in no user's code)."""
        _LAYOUT.pack_into(self._map, 0, started, request_id.encode()[:128])


def read_all(directory: Path) -> list[InUserCode]:
    """The engine processes with a file in ``directory`` whose forward is in users' code now."""
    found = []
    for path in directory.glob(f"{PREFIX}*.bin"):
        try:
            pid = int(path.stem.removeprefix(PREFIX))
            started, request_id = _LAYOUT.unpack(untrusted_files.read(directory, path.name, _LAYOUT.size))
        except (OSError, ValueError, struct.error):
            continue
        if started > 0:
            found.append(InUserCode(pid, started, request_id.rstrip(b"\0").decode(errors="replace")))
    return found
