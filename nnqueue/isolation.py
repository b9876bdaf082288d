"""Process isolation: the processes that run users' code hold no secrets and cannot reach their parent's.

A worker process holds the service's credentials (database, broker, object store). The processes that
run intervention code (vLLM's engine core and its model-runner workers, and the sandboxed
trace-builder processes) must not be able to read them. Three measures, all stdlib, used by the
worker before it starts any such process and by those processes themselves:

1. **A scrubbed environment.** :func:`scrub_environment` removes the secrets (``NNQUEUE_DATABASE_URL``,
   ``NNQUEUE_BROKER_URL``, ``NNQUEUE_S3__*``, ``AWS_*`` and the configured extra patterns) from this
   process's ``os.environ`` (and so from libc's ``environ``, which children inherit). The worker reads its
   settings first, then scrubs, then starts the engine: every process started after that (spawned, never
   forked, so no copy of the worker's heap comes along) starts clean.
2. **A non-dumpable worker.** :func:`make_non_dumpable` (``prctl(PR_SET_DUMPABLE, 0)``): the kernel then
   refuses a process of the same user ``/proc/<worker>/environ`` (which still shows the environment the
   worker *started* with, secrets included), ``/proc/<worker>/mem``, ``ptrace`` and core dumps.
3. **An unprivileged user.** When the worker runs as root, :func:`drop_privileges` switches an engine
   process to ``NNQUEUE_ENGINE_USER`` (default ``nobody``) once it is up (model loaded, sockets to its
   peers connected) and before any user code runs, with a private writable ``HOME`` (caches: torch compile, triton). It can then read no file
   that only root (or the operator) may read, such as a ``chmod 600`` ``.env``.

A child process that will run users' code calls :func:`enter_sandbox` first thing::

    from nnqueue import isolation

    def builder_main(...):            # the target of a spawned multiprocessing.Process
        isolation.enter_sandbox()     # scrub, and drop to NNQUEUE_ENGINE_USER when root
        ...                           # now unpickle and run users' payloads

The network is :mod:`nnqueue.netns`'s (a root worker's engine processes have only their own loopback).
What this does NOT do: a worker run as a non-root user shares that user's files with its engine (its
``~/.aws``, a readable ``.env``): :func:`env_file_warnings` says so at start-up.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import fnmatch
import logging
import os
import pwd
import stat
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# Names (fnmatch patterns) of environment variables that hold the service's secrets.
SECRET_ENV_PATTERNS = ("NNQUEUE_DATABASE_URL", "NNQUEUE_BROKER_URL", "NNQUEUE_S3__*", "AWS_*")
# Where the engine user comes from when a sandboxed child has no settings object (set by the worker).
ENGINE_USER_ENV = "NNQUEUE_ENGINE_USER"
# Extra secret patterns, comma-separated, exported by the worker for its sandboxed children.
EXTRA_SECRETS_ENV = "NNQUEUE_SECRET_ENV_PATTERNS"
DEFAULT_ENGINE_USER = "nobody"

_PR_SET_PDEATHSIG = 1
_PR_SET_DUMPABLE = 4


def secret_patterns(extra: Iterable[str] = ()) -> list[str]:
    """The built-in secret patterns plus ``extra`` (blank entries ignored)."""
    return [*SECRET_ENV_PATTERNS, *(pattern.strip() for pattern in extra if pattern.strip())]


def is_secret(name: str, extra: Iterable[str] = ()) -> bool:
    """Whether the environment variable ``name`` matches a secret pattern."""
    return any(fnmatch.fnmatchcase(name, pattern) for pattern in secret_patterns(extra))


def without_secrets(environ: dict[str, str], extra: Iterable[str] = ()) -> dict[str, str]:
    """``environ`` without the secrets: an environment to start a child that runs users' code with."""
    extra = list(extra)
    return {name: value for name, value in environ.items() if not is_secret(name, extra)}


def scrub_environment(extra: Iterable[str] = ()) -> list[str]:
    """Remove every variable matching a secret pattern from ``os.environ``; returns the names removed."""
    extra = list(extra)
    removed = [name for name in list(os.environ) if is_secret(name, extra)]
    for name in removed:
        del os.environ[name]
    return removed


def prctl(option: int, arg: int) -> int:
    """``prctl(option, arg)`` through libc; raises OSError on failure (Linux only)."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    result = libc.prctl(option, ctypes.c_ulong(arg), 0, 0, 0)
    if result < 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))
    return int(result)


def make_non_dumpable() -> None:
    """Make this process non-dumpable: same-user processes cannot read its /proc environ or memory."""
    prctl(_PR_SET_DUMPABLE, 0)


def set_parent_death_signal(signum: int) -> None:
    """Have the kernel send ``signum`` to this process when the thread that started it exits."""
    prctl(_PR_SET_PDEATHSIG, signum)


@dataclass(frozen=True)
class EngineUser:
    name: str
    uid: int
    gid: int


def engine_user(name: str | None = None) -> EngineUser | None:
    """The account engine processes drop to (``name``, else ``$NNQUEUE_ENGINE_USER``, else ``nobody``);
    None when it is set empty: the engine processes then keep the worker's user (not recommended)."""
    name = os.environ.get(ENGINE_USER_ENV, DEFAULT_ENGINE_USER) if name is None else name
    if not name:
        return None
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        raise ValueError(f"NNQUEUE_ENGINE_USER={name!r} is not a user on this machine") from None
    if entry.pw_uid == 0:
        raise ValueError(f"NNQUEUE_ENGINE_USER={name!r} is root; engine processes must not run user code as root")
    return EngineUser(name, entry.pw_uid, entry.pw_gid)


def drop_privileges(user: EngineUser | None = None, hand_over: Iterable[Path] = ()) -> bool:
    """When root: switch this whole process (every thread) to the engine user, with a private HOME.

    Returns False (and changes nothing) when not root: the process then keeps its user, and its
    isolation rests on the scrubbed environment and the non-dumpable parent. The HOME it gets is a
    fresh directory owned by the engine user (mode 0700), also set as ``XDG_CACHE_HOME``'s parent,
    so torch's, triton's and vLLM's caches written after the drop land somewhere writable. Triton reads
    its default home (``~``) once, at import, so ``TRITON_HOME`` names the new one, and the cache folders
    that torch's inductor writes into the environment when first used (``TORCHINDUCTOR_CACHE_DIR``,
    ``/tmp/torchinductor_root``; ``TRITON_CACHE_DIR``, a folder under it), maybe before the drop and
    inherited by the engine's worker processes, move into the new HOME too: a kernel first compiled after
    the drop (a new batch shape) would otherwise fail the engine on a folder of root's (seen on the H100
    with ``~/.triton``, on 2x H200 with ``/tmp/torchinductor_root/triton/1``).
    ``hand_over``: files the process keeps using afterwards, given to the engine user first.
    """
    user = user or engine_user()
    if os.geteuid() != 0 or user is None:
        return False
    for path in hand_over:
        os.chown(path, user.uid, user.gid)
    home = Path(tempfile.mkdtemp(prefix=f"nnqueue-{user.name}-"))
    os.chown(home, user.uid, user.gid)
    home.chmod(stat.S_IRWXU)
    os.setgroups([])
    os.setgid(user.gid)
    os.setuid(user.uid)  # glibc applies it to every thread of the process
    if os.getuid() == 0 or os.geteuid() == 0:
        raise RuntimeError("dropping privileges failed: the process is still root")
    os.environ.update(
        {
            "HOME": str(home),
            "XDG_CACHE_HOME": str(home / ".cache"),
            "TRITON_HOME": str(home),
            "TRITON_CACHE_DIR": str(home / ".triton" / "cache"),
            "TORCHINDUCTOR_CACHE_DIR": str(home / "torchinductor"),
            "USER": user.name,
            "LOGNAME": user.name,
        }
    )
    return True


def engine_writable_dir(prefix: str, user: str | None = None, parent: Path | None = None) -> Path:
    """A fresh private directory (mode 0700, in ``parent`` or the temp folder) that the engine processes
    can write after dropping to the engine user (owned by it when this process is root) and this process
    can read."""
    directory = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    account = engine_user(user) if os.geteuid() == 0 else None
    if account is not None:
        os.chown(directory, account.uid, account.gid)
    return directory


def enter_sandbox(extra_secret_patterns: Iterable[str] | None = None, hand_over: Iterable[Path] = ()) -> None:
    """What a spawned child that will run users' code calls first: scrub its environment and, when
    root, drop to the engine user (see :func:`drop_privileges` for ``hand_over``).
    ``extra_secret_patterns`` default to ``$NNQUEUE_SECRET_ENV_PATTERNS``."""
    if extra_secret_patterns is None:
        extra_secret_patterns = os.environ.get(EXTRA_SECRETS_ENV, "").split(",")
    scrub_environment(extra_secret_patterns)
    drop_privileges(hand_over=hand_over)


def unreadable_by(account: EngineUser, paths: Iterable[Path]) -> list[Path]:
    """The folders of ``paths`` that ``account`` cannot list and read, or cannot reach (a folder above lacks
    its search permission), judged by owners and mode bits."""
    return [path for path in paths if not _readable(path, account)]


def _readable(folder: Path, account: EngineUser) -> bool:
    for part, required in [(folder, 0o5), *((parent, 0o1) for parent in folder.parents)]:
        info = part.stat()
        if info.st_uid == account.uid:
            bits = info.st_mode >> 6
        elif info.st_gid == account.gid:
            bits = info.st_mode >> 3
        else:
            bits = info.st_mode
        if bits & required != required:
            return False
    return True


def python_warnings(user: str | None = None) -> list[str]:
    """Why the engine processes may fail to import modules once they run as the engine user: they keep this
    interpreter's paths, and modules that users' code imports after the drop load from there."""
    account = engine_user(user) if os.geteuid() == 0 else None
    if account is None:
        return []
    folders = [Path(os.__file__).parent, Path(__file__).parent.parent]  # the standard library, site-packages
    return [
        f"the engine user {account.name!r} cannot read {folder} (a Python installed in root's home?): modules"
        " that intervention code imports will fail to load in the engine; install Python where that user can"
        " read it (as the Docker images do) or set NNQUEUE_ENGINE_USER to a user that can"
        for folder in unreadable_by(account, folders)
    ]


def env_file_warnings(env_file: Path, user: str | None = None) -> list[str]:
    """Why the settings file ``env_file`` may be readable by the processes that run users' code.

    Settings read ``.env`` in the working directory, and engine processes start in that directory.
    Root workers' engines run as the engine user: the file must not be readable by others. A worker
    run as any other user shares that user with its engine, which can then read the file whatever
    its mode: pass the secrets in the environment instead (they are scrubbed before the engine starts).
    """
    if not env_file.is_file():
        return []
    account = engine_user(user) if os.geteuid() == 0 else None
    if account is None:
        return [
            f"{env_file.resolve()} holds settings and the engine processes run as this same user, so users'"
            " intervention code can read it; give the worker its secrets through the environment instead"
            " (they are removed before the engine starts), or run it as root with NNQUEUE_ENGINE_USER"
        ]
    mode = env_file.stat().st_mode
    owned_by_engine_user = env_file.stat().st_uid == account.uid
    if mode & stat.S_IROTH or owned_by_engine_user:
        return [
            f"{env_file.resolve()} is readable by the engine user {account.name!r}, which runs users'"
            f" intervention code: chmod 600 it (owned by the worker's user)"
        ]
    return []
