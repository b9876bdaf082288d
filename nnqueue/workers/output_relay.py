"""The worker's stdout and stderr as a pipe it relays into its own log: its child processes never hold the log.

Every process a worker starts inherits its descriptors 1 and 2 (spawn keeps them, the engine core server is handed
them): vLLM's engine core and its model-runner workers, the trace builders and their zygote, the transformers
engine. Those run users' code, and a seventh red-team round's escaped engine core used them on the worker's log
file: it read every trust domain's job and harvest ids back (reopening ``/proc/self/fd/1``), appended lines in the
worker's own format (a forged "the engine serves trust domain ..." among the real ones), and could truncate it.

So the worker, first thing, keeps the streams it was given for itself (``sys.stdout``, ``sys.stderr`` and the log
handlers write there, on descriptors its children do not inherit) and puts a pipe's write end at 1 and 2. A thread
reads the pipe and logs each line as a record of ``nnqueue.output``, in the worker's format, its control characters
escaped and long lines cut, at most :data:`MAX_LINES_PER_S` lines and :data:`MAX_BYTES_PER_S` bytes a second (the
rest counted as dropped): what a child writes cannot pass for the worker's own record, and nothing a child holds
reads, rewrites or truncates the log. All children share the pipe: a line names no process, so an engine's records
are the engine's claims (an escaped one can write lines in its own records' shape), and the worker's own records say
what the worker did; a child that makes the pipe non-blocking or small has it put back at the next read. The price: a child's last lines are lost when the worker dies before it reads
them, and the worker's own writes to the raw descriptors (a C library's) are relayed as a child's are.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sys
import threading
import time
from dataclasses import dataclass, field

# What a child's line is logged as; never one of the worker's own loggers.
RELAYED = logging.getLogger("nnqueue.output")
# A line longer than this (characters, after escaping) is logged in pieces, each marked as cut.
MAX_LINE = 4096
# The lines and bytes logged a second at most: a child flooding its output (an escaped engine) costs the worker's
# Python and the log's disk little.
MAX_LINES_PER_S = 2000
MAX_BYTES_PER_S = 1 << 20
_READ_BYTES = 65536
_PIPE_BYTES = 65536  # a pipe's capacity as Linux makes it


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
    threading.Thread(target=_relay, args=(read,), name="nnqueue-output-relay", daemon=True).start()


def _relay(read: int) -> None:
    pending = b""
    budget = _Budget()
    while chunk := os.read(read, _READ_BYTES):
        _restore_pipe(1)
        *lines, pending = (pending + chunk).split(b"\n")
        if len(pending) > MAX_LINE * 4:  # no newline in sight: what came so far, as a line of its own
            lines.append(pending)
            pending = b""
        for line in budget.admit(lines):
            _log(line)
    if pending:
        _log(pending)


def _restore_pipe(write: int) -> None:
    """The pipe's write end as the children share it (one open file description): blocking, at its full capacity.
    A child may change both (round 8 made the next engines' writes fail half-done); here they are put back."""
    flags = fcntl.fcntl(write, fcntl.F_GETFL)
    if flags & os.O_NONBLOCK:
        fcntl.fcntl(write, fcntl.F_SETFL, flags & ~os.O_NONBLOCK)
    if fcntl.fcntl(write, fcntl.F_GETPIPE_SZ) < _PIPE_BYTES:
        fcntl.fcntl(write, fcntl.F_SETPIPE_SZ, _PIPE_BYTES)


@dataclass
class _Budget:
    """The lines logged in the current second; those over :data:`MAX_LINES_PER_S` or :data:`MAX_BYTES_PER_S` are
    counted, and said in one warning when the next second's lines come."""

    window: float = field(default_factory=time.monotonic)
    lines: int = 0
    size: int = 0
    dropped: int = 0

    def admit(self, lines: list[bytes]) -> list[bytes]:
        if (now := time.monotonic()) - self.window >= 1:
            if self.dropped:
                RELAYED.warning(
                    "%d lines dropped: the children wrote more than %d lines or %d bytes a second",
                    self.dropped,
                    MAX_LINES_PER_S,
                    MAX_BYTES_PER_S,
                )
            self.window, self.lines, self.size, self.dropped = now, 0, 0, 0
        if self.lines >= MAX_LINES_PER_S or self.size >= MAX_BYTES_PER_S:
            self.dropped += len(lines)
            return []
        admitted = []
        for line in lines:
            if self.lines < MAX_LINES_PER_S and self.size + len(line) <= MAX_BYTES_PER_S:
                admitted.append(line)
                self.lines += 1
                self.size += len(line)
            else:
                self.dropped += 1
        return admitted


def _log(line: bytes) -> None:
    text = escape(line.decode("utf-8", errors="backslashreplace").rstrip("\r"))
    for start in range(0, max(len(text), 1), MAX_LINE):
        cut = " [cut]" if len(text) > start + MAX_LINE else ""
        RELAYED.info("%s%s", text[start : start + MAX_LINE], cut)


def escape(text: str) -> str:
    """``text`` as it is when every character is printable (the common line), else with Python's escapes for all
    that is not printable ASCII (``\\x1b``, ``\\t``, ``\\u2028``, non-ASCII letters too): a terminal shows what was
    written, and no line can end, rewrite or reorder another. Both are one C call: a child flooding its output costs
    the worker little."""
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")
