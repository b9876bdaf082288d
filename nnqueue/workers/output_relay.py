"""The worker's stdout and stderr as a pipe it relays into its own log: its child processes never hold the log.

Every process a worker starts inherits its descriptors 1 and 2 (spawn keeps them, the engine core server is handed
them): vLLM's engine core and its model-runner workers, the trace builders and their zygote, the transformers
engine. Those run users' code, and a seventh red-team round's escaped engine core used them on the worker's log
file: it read every trust domain's job and harvest ids back (reopening ``/proc/self/fd/1``), appended lines in the
worker's own format (a forged "the engine serves trust domain ..." among the real ones), and could truncate it.

So the worker, first thing, keeps the streams it was given for itself (``sys.stdout``, ``sys.stderr`` and the log
handlers write there, on descriptors its children do not inherit) and puts a pipe's write end at 1 and 2. A thread
reads the pipe and logs each line as a record of ``nnqueue.output``, in the worker's format, its control characters
escaped and long lines cut, at most :data:`MAX_LINES_PER_S` lines and :data:`MAX_BYTES_PER_S` characters a second,
and within an allowance of :data:`ALLOWANCE_BYTES` that refills at :data:`ALLOWANCE_BYTES_PER_S` (past either the
relay reads nothing until there is budget again, so the writers block; what it had read is counted as dropped): what a
child writes cannot pass for the worker's own record, nothing a child holds reads, rewrites or truncates the log, and a
flood that lasts grows the log by 14 MB an hour, not the 3.9 GB of a tenth red-team round's. A fresh engine
(`engine_replaced`) finds the allowance full and the pipe as the worker made it. All children share the pipe: a line
names no process, so an engine's records are the engine's claims (an escaped one can write lines in its own records'
shape), and the worker's own records say what the worker did; a child that changes the pipe's flags or capacity has
them put back at the next read, and before a fresh engine starts. The price: a child's last lines are lost when the
worker dies before it reads them, and the worker's own writes to the raw descriptors (a C library's) are relayed as a
child's are.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sys
import threading
import time

# What a child's line is logged as; never one of the worker's own loggers.
RELAYED = logging.getLogger("nnqueue.output")
# A line longer than this (characters, after escaping) is logged in pieces, each marked as cut.
MAX_LINE = 4096
# The lines and bytes logged a second at most: a child flooding its output (an escaped engine) costs the worker's
# Python and the log's disk little.
MAX_LINES_PER_S = 2000
MAX_BYTES_PER_S = 1 << 20
# And in the long run: at most this many characters at once, refilled at this rate (vLLM's own lines at start and its
# stats every few seconds take a few KiB; an hour's flood is held to ~14 MB of log).
ALLOWANCE_BYTES = 32 << 20
ALLOWANCE_BYTES_PER_S = 4096
_READ_BYTES = 65536
# The relay this process runs (`relay_child_output`), once started.
_relay: _Relay | None = None


def relay_child_output() -> None:
    """Keep stdout and stderr for this process (``sys.stdout``, ``sys.stderr``) and give descriptors 1 and 2, which
    child processes inherit, to a pipe whose lines a daemon thread logs (:data:`RELAYED`). Call before the first
    child starts and before logging is configured (handlers take ``sys.stderr`` as it is then)."""
    sys.stdout.flush()
    sys.stderr.flush()
    sys.stdout = os.fdopen(os.dup(1), "w", buffering=1, encoding=sys.stdout.encoding, errors="backslashreplace")
    sys.stderr = os.fdopen(os.dup(2), "w", buffering=1, encoding=sys.stderr.encoding, errors="backslashreplace")
    read, write = os.pipe()
    os.dup2(write, 1)
    os.dup2(write, 2)
    os.close(write)
    RELAYED.setLevel(logging.INFO)  # the children's lines reach the log whatever the worker's level
    global _relay
    _relay = _Relay(read, _SharedEnd(1))
    threading.Thread(target=_relay.run, name="nnqueue-output-relay", daemon=True).start()


def engine_replaced() -> None:
    """Before a fresh engine starts: the pipe as the worker made it (the old engine may have changed its flags or
    capacity since the relay's last read) and the allowance full (the old engine may have spent it). Nothing where
    this process relays no output."""
    if _relay is not None:
        _relay.pipe.restore()
        _relay.budget.refill()


class _Budget:
    """What the relay may still log: this second's lines and characters, and the allowance (which a fresh engine's
    start refills from another thread: changed under ``_lock``)."""

    def __init__(self) -> None:
        self.window = self.refilled = time.monotonic()
        self.lines = self.size = self.dropped = 0
        self.allowance = float(ALLOWANCE_BYTES)
        self._lock = threading.Lock()
        self._full = threading.Event()

    def admits(self) -> bool:
        return self.lines < MAX_LINES_PER_S and self.size < MAX_BYTES_PER_S and self.allowance > 0

    def spend(self, size: int) -> None:
        self.lines += 1
        self.size += size
        with self._lock:
            self.allowance -= size

    def refill(self) -> None:
        """The allowance full again (a fresh engine's), waking a relay that waits for it."""
        with self._lock:
            self.allowance, self.refilled = float(ALLOWANCE_BYTES), time.monotonic()
            self._full.set()

    def pause(self) -> None:
        """Wait while the budget is spent (the writers block meanwhile); say what was dropped once logging resumes,
        and at least once a second."""
        now = time.monotonic()
        with self._lock:
            refill = (now - self.refilled) * ALLOWANCE_BYTES_PER_S
            self.allowance, self.refilled = min(float(ALLOWANCE_BYTES), self.allowance + refill), now
            spent = self.allowance <= 0
            if spent:
                self._full.clear()
        replaced = False  # a fresh engine's allowance came: what the old one had dropped is said at once
        if spent:  # until a second's refill is there, or a fresh engine's full allowance
            replaced = self._full.wait(1 - self.allowance / ALLOWANCE_BYTES_PER_S)
        elif self.lines >= MAX_LINES_PER_S or self.size >= MAX_BYTES_PER_S:
            time.sleep(max(0.0, self.window + 1 - now))
        if replaced or time.monotonic() - self.window >= 1 or (self.dropped and self.admits()):
            if self.dropped:
                RELAYED.warning(
                    "%d lines dropped: the children wrote more than %d lines or %d bytes a second, or past their"
                    " allowance of %d bytes (refilled at %d a second)",
                    self.dropped,
                    MAX_LINES_PER_S,
                    MAX_BYTES_PER_S,
                    ALLOWANCE_BYTES,
                    ALLOWANCE_BYTES_PER_S,
                )
            self.window, self.lines, self.size, self.dropped = time.monotonic(), 0, 0, 0


class _Relay:
    """Reads the pipe's ``read`` end and logs its lines within `budget`; ``pipe`` is its write end."""

    def __init__(self, read: int, pipe: _SharedEnd) -> None:
        self.read, self.pipe, self.budget = read, pipe, _Budget()

    def run(self) -> None:
        pending = b""
        while chunk := os.read(self.read, _READ_BYTES):
            self.pipe.restore()
            *complete, pending = (pending + chunk).split(b"\n")
            if len(pending) > MAX_LINE * 4:  # no newline in sight: what came so far, as a line of its own
                complete.append(pending)
                pending = b""
            for line in complete:
                if self.budget.admits():
                    self.budget.spend(_log(line))
                else:
                    self.budget.dropped += 1
            # Once the budget is spent nothing is read until there is budget again, so the writers block (a flood
            # costs the worker no work); only what was read already is dropped.
            self.budget.pause()
        if pending:
            _log(pending)


class _SharedEnd:
    """The pipe's write end as the children share it (one open file description), and how it was made: its status
    flags and capacity. A child may change them (round 8 made it non-blocking and small, which cut the next engines'
    writes; round 9 set ``O_DIRECT``, packet mode); `restore` puts back exactly what was."""

    def __init__(self, write: int) -> None:
        self.write = write
        self.flags = fcntl.fcntl(write, fcntl.F_GETFL)
        self.size = fcntl.fcntl(write, fcntl.F_GETPIPE_SZ)

    def restore(self) -> None:
        if fcntl.fcntl(self.write, fcntl.F_GETFL) != self.flags:
            fcntl.fcntl(self.write, fcntl.F_SETFL, self.flags)
        if fcntl.fcntl(self.write, fcntl.F_GETPIPE_SZ) != self.size:
            fcntl.fcntl(self.write, fcntl.F_SETPIPE_SZ, self.size)


def _log(line: bytes) -> int:
    """Log ``line`` (in pieces when long); the characters logged."""
    text = escape(line.decode("utf-8", errors="backslashreplace").rstrip("\r"))
    for start in range(0, max(len(text), 1), MAX_LINE):
        cut = " [cut]" if len(text) > start + MAX_LINE else ""
        RELAYED.info("%s%s", text[start : start + MAX_LINE], cut)
    return len(text)


def escape(text: str) -> str:
    """``text`` as it is when every character is printable (the common line), else with Python's escapes for all
    that is not printable ASCII (``\\x1b``, ``\\t``, ``\\u2028``, non-ASCII letters too): a terminal shows what was
    written, and no line can end, rewrite or reorder another. Both are one C call: a child flooding its output costs
    the worker little."""
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")
