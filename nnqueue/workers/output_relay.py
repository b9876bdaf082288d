"""The worker's stdout and stderr as a pipe it relays into its own log: its child processes never hold the log.

Every process a worker starts inherits its descriptors 1 and 2 (spawn keeps them, the engine core server is handed
them): vLLM's engine core and its model-runner workers, the trace builders and their zygote, the transformers
engine. Those run users' code, and a seventh red-team round's escaped engine core used them on the worker's log
file: it read every trust domain's job and harvest ids back (reopening ``/proc/self/fd/1``), appended lines in the
worker's own format (a forged "the engine serves trust domain ..." among the real ones), and could truncate it.

So the worker, first thing, keeps the streams it was given for itself (``sys.stdout``, ``sys.stderr`` and the log
handlers write there, on descriptors its children do not inherit) and puts a pipe's write end at 1 and 2. A thread
reads the pipe and logs each line as a record of ``nnqueue.output``, in the worker's format, its control characters
escaped and long lines cut, at most :data:`MAX_LINES_PER_S` lines and :data:`MAX_BYTES_PER_S` characters a second
(past that the relay reads nothing until the second ends, so the writers block; what it had read is counted as
dropped): what a child writes cannot pass for the worker's own record, and nothing a child holds reads, rewrites or
truncates the log. All children share the pipe: a line names no process, so an engine's records are the engine's
claims (an escaped one can write lines in its own records' shape), and the worker's own records say what the worker
did; a child that changes the pipe's flags or capacity has them put back at the next read. The price: a child's last
lines are lost when the worker dies before it reads them, and the worker's own writes to the raw descriptors (a C
library's) are relayed as a child's are.
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
_READ_BYTES = 65536


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
    pipe = _SharedEnd(1)
    pending = b""
    window, lines, size, dropped = time.monotonic(), 0, 0, 0
    while chunk := os.read(read, _READ_BYTES):
        pipe.restore()
        *complete, pending = (pending + chunk).split(b"\n")
        if len(pending) > MAX_LINE * 4:  # no newline in sight: what came so far, as a line of its own
            complete.append(pending)
            pending = b""
        for line in complete:
            if lines < MAX_LINES_PER_S and size < MAX_BYTES_PER_S:
                size += _log(line)
                lines += 1
            else:
                dropped += 1
        if lines >= MAX_LINES_PER_S or size >= MAX_BYTES_PER_S:
            # The second's budget is spent: nothing is read until it ends, so the writers block (a flood costs the
            # worker no work); only what was read already is dropped.
            time.sleep(max(0.0, window + 1 - time.monotonic()))
        if time.monotonic() - window >= 1:
            if dropped:
                RELAYED.warning(
                    "%d lines dropped: the children wrote more than %d lines or %d bytes a second",
                    dropped,
                    MAX_LINES_PER_S,
                    MAX_BYTES_PER_S,
                )
            window, lines, size, dropped = time.monotonic(), 0, 0, 0
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
