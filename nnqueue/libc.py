"""libc through ctypes, loaded once: the system calls that isolate the processes running users' code (``prctl``,
``capset``, ``unshare``, ``setns``, ``mount``, ``pivot_root``), which the standard library does not wrap.

Loaded once and kept: while a filesystem view is being built (:mod:`nnqueue.mountns`) the host's files are out
of reach, so nothing may be looked up or loaded then.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import os
from typing import Any


@functools.cache
def libc() -> Any:
    return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)


def check(result: int, what: str, error: type[Exception]) -> None:
    """Raise ``error`` saying ``what`` failed and why (errno) when ``result`` is not 0."""
    if result != 0:
        errno = ctypes.get_errno()
        raise error(f"{what} failed: {os.strerror(errno)}")
