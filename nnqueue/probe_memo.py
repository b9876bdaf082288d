"""A start-up probe that passed, remembered: a worker that starts again with nothing changed skips it.

A root worker's start-up probe (:func:`nnqueue.isolation.probe`) starts an interpreter as the engine user, in
the engine's network and filesystem view, and imports what the engine imports: 6-7 s of CPU on every start and
every restart of a worker (tiny model, two cores), for an answer that changes only when the files change. A
pass is remembered here, with what the probe's interpreter read: the files of the modules it imported, the
shared libraries it mapped, the files it was asked to read, and every folder above them, each by owner, mode
and inode, and each file by its change time too (``st_ctime`` moves with every ``chmod``, ``chown`` and
rewrite; a replaced file is another inode). The next start with the same question (interpreter, account,
modules, files, view, ``PYTHON*``/``LD_*`` variables) and the same stat of every one of those paths passes
without the probe; anything else probes again.

Only a pass is remembered, so a stale record can only fail closed: the engine switches to the engine user, and
if that user cannot use Python after all the engine fails to start, and the worker forgets that record
(:func:`forget`) before it exits, so that its restart probes again. The records live in a folder only root may
enter (``/var/cache/nnqueue/probes`` by default): the engine user can neither read nor plant one.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
from collections.abc import Iterable
from pathlib import Path

log = logging.getLogger(__name__)

DEFAULT_FOLDER = Path("/var/cache/nnqueue/probes")


def question(python: str, uid: int, gid: int, modules: Iterable[str], files: Iterable[Path], where: str) -> str:
    """The probe's question as a key: what is run, as whom, for what, where (the view and network, as text)."""
    environ = {name: value for name, value in os.environ.items() if name.startswith(("PYTHON", "LD_"))}
    asked = [
        os.path.realpath(python),
        uid,
        gid,
        sorted(modules),
        sorted(map(str, files)),
        where,
        sorted(environ.items()),
    ]
    return hashlib.sha256(json.dumps(asked).encode()).hexdigest()


def passed(folder: Path, key: str) -> bool:
    """Whether a probe with this key passed and nothing it read has changed since."""
    record = folder / f"{key}.json"
    if not _private(folder) or not record.is_file():
        return False
    try:
        read = json.loads(record.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(read, dict) and all(_signature(path) == signature for path, signature in read.items())


def remember(folder: Path, key: str, read: Iterable[str]) -> None:
    """Record a passed probe and the paths it read (those that exist here), with the folders above them."""
    paths: set[str] = set()
    for name in read:
        path = Path(name)
        if path.is_absolute() and path.exists():
            paths.add(str(path))
            paths.update(str(parent) for parent in path.parents)
    try:
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        if not _private(folder):
            log.warning("not remembering the probe: %s is not a folder of root's alone", folder)
            return
        temporary = folder / f".{key}.{os.getpid()}"
        temporary.write_text(json.dumps({path: _signature(path) for path in sorted(paths)}))
        temporary.replace(folder / f"{key}.json")
    except OSError as error:
        log.warning("not remembering the probe in %s: %s", folder, error)


def forget(folder: Path, key: str) -> None:
    """Drop a remembered probe (the engine it let switch users failed to start: the next start probes again)."""
    if _private(folder):
        (folder / f"{key}.json").unlink(missing_ok=True)


def _private(folder: Path) -> bool:
    """A real folder (not a link) that belongs to root and that nobody else may enter or write."""
    try:
        info = folder.lstat()
    except OSError:
        return False
    return stat.S_ISDIR(info.st_mode) and info.st_uid == 0 and info.st_mode & 0o077 == 0


def _signature(path: str) -> list[int] | None:
    """Who may use ``path``, and for a file whether it is the same file, unchanged. A folder's change time is left
    out: it moves whenever an entry is added or removed (``/tmp``, above a model in it, every second)."""
    try:
        info = os.stat(path)
    except OSError:
        return None
    changed = 0 if stat.S_ISDIR(info.st_mode) else info.st_ctime_ns
    return [info.st_mode, info.st_uid, info.st_gid, info.st_ino, changed]
