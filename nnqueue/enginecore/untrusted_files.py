"""Files in a folder that an engine's processes write, read and written by the worker without trusting the folder.

The crash report folder (``$NNQUEUE_CRASH_REPORT_DIR``: crash reports, stall beacons) belongs to the engine user, and
the worker, which runs as root, reads what the engine left there and writes its own stall reports into it. Code that
escaped the protected environment can put anything there under the names the worker looks for: a red-team round
linked a beacon's name to ``/etc/shadow`` (the worker read it and wrote 128 of its bytes into a report the engine
could read) and a report's staging name to a file in root's home (the worker created it). So the worker opens the
folder without following a link, each name in it relative to that folder (``dir_fd``) and without following a link
either, reads only a regular file with a single link (not a FIFO, which would block it, nor a device, nor a hard
link to a file elsewhere), and writes only a file it has just created under a name nobody could guess.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@contextlib.contextmanager
def _folder(directory: Path) -> Iterator[int]:
    fd = os.open(directory, _DIRECTORY)
    try:
        yield fd
    finally:
        os.close(fd)


def read(directory: Path, name: str, limit: int) -> bytes:
    """Up to ``limit`` bytes of the file ``name`` in ``directory``; OSError when it is not a regular file of its own
    there (a link, a FIFO, a device, a file with another link)."""
    with _folder(directory) as folder:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=folder)
    with os.fdopen(fd, "rb") as file:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_nlink != 1:
            raise OSError(f"{name} in {directory} is not a file of its own")
        return file.read(limit)


def write(directory: Path, name: str, data: bytes) -> None:
    """Put ``data`` at ``name`` in ``directory`` atomically: written to a new file under a random name, then renamed
    over whatever ``name`` is (a link there is replaced, not followed)."""
    staging = f".{name}.{secrets.token_hex(8)}.tmp"
    with _folder(directory) as folder:
        fd = os.open(staging, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=folder)
        with os.fdopen(fd, "wb") as file:
            file.write(data)
        os.replace(staging, name, src_dir_fd=folder, dst_dir_fd=folder)


def empty(directory: Path) -> None:
    """Remove everything in ``directory``, each name relative to the folder: a link is removed, never followed, and a
    folder in it (whatever links it holds) too."""
    with _folder(directory) as folder:
        for name in os.listdir(folder):
            if stat.S_ISDIR(os.stat(name, dir_fd=folder, follow_symlinks=False).st_mode):
                shutil.rmtree(name, dir_fd=folder)
            else:
                os.unlink(name, dir_fd=folder)
