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
import fnmatch
import json
import logging
import os
import pwd
import shutil
import stat
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from nnqueue import probe_memo
from nnqueue.errors import NNqueueError
from nnqueue.libc import libc

log = logging.getLogger(__name__)

# Names (fnmatch patterns) of environment variables that hold the service's secrets.
SECRET_ENV_PATTERNS = ("NNQUEUE_DATABASE_URL", "NNQUEUE_BROKER_URL", "NNQUEUE_S3__*", "AWS_*")
# Where the engine user comes from when a sandboxed child has no settings object (set by the worker).
ENGINE_USER_ENV = "NNQUEUE_ENGINE_USER"
# Extra secret patterns, comma-separated, exported by the worker for its sandboxed children.
EXTRA_SECRETS_ENV = "NNQUEUE_SECRET_ENV_PATTERNS"
DEFAULT_ENGINE_USER = "nnqueue-engine"
# Set by the worker to its own pid: the engine processes it starts enter the sandbox (and only those: never
# the process that set it, nor a library user's process that builds an engine itself).
SANDBOX_ENV = "NNQUEUE_ENGINE_SANDBOX"
# How long a starting root worker waits for processes of its engine account that are no worker's to exit
# before it refuses to start (:func:`lasting_foreign_processes`).
STRANGERS_GRACE_S = 10.0

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


def anchor_python_path() -> None:
    """Make ``PYTHONPATH``'s relative entries absolute, against this process's working folder (where its own
    imports found them): the engine's processes and the containment's probe start elsewhere (the probe in ``/``),
    and ``PYTHONPATH=.`` from a checkout made the engine user's imports of nnqueue fail there, which refused
    every trace (seen on a GPU machine)."""
    if entries := os.environ.get("PYTHONPATH"):
        os.environ["PYTHONPATH"] = os.pathsep.join(os.path.abspath(entry) for entry in entries.split(os.pathsep))


def scrub_environment(extra: Iterable[str] = ()) -> list[str]:
    """Remove every variable matching a secret pattern from ``os.environ``, and blank them in the environment
    block this process started with (:func:`blank_initial_environment`); returns the names removed."""
    extra = list(extra)
    removed = [name for name in list(os.environ) if is_secret(name, extra)]
    for name in removed:
        del os.environ[name]
    blank_initial_environment(extra)
    return removed


def blank_initial_environment(extra: Iterable[str] = ()) -> int:
    """Overwrite with NULs the secret variables in the environment block this process started with, which
    ``/proc/<pid>/environ`` shows whatever ``os.environ`` holds now; returns how many were blanked.

    Non-dumpability keeps that file from processes of the same user, not from root: an engine that had to keep
    root (see :func:`plan_containment`) could read it. The block is the strings on the stack between
    ``env_start`` and ``env_end`` (``/proc/self/stat``, proc(5)); libc's ``environ`` no longer points at the
    removed ones (``unsetenv``), so nothing reads them again. Linux only; elsewhere nothing is done."""
    extra = list(extra)
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        start, end = int(fields[47]), int(fields[48])  # env_start, env_end: fields 50 and 51 of proc(5)
        block = ctypes.string_at(start, end - start)
    except (OSError, IndexError, ValueError):
        return 0
    blanked, offset = 0, 0
    for entry in block.split(b"\0"):
        name = entry.split(b"=", 1)[0].decode(errors="replace")
        if b"=" in entry and is_secret(name, extra):
            ctypes.memset(start + offset, 0, len(entry))
            blanked += 1
        offset += len(entry) + 1
    return blanked


def prctl(option: int, arg: int) -> int:
    """``prctl(option, arg)`` through libc; raises OSError on failure (Linux only)."""
    result = libc().prctl(option, ctypes.c_ulong(arg), 0, 0, 0)
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
    """The account engine processes drop to (``name``, else ``$NNQUEUE_ENGINE_USER``, else ``nnqueue-engine``);
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
    account = None
    if os.geteuid() == 0:
        try:
            account = engine_user(user)
        except ValueError:  # no such account (a library use, not a worker, which creates it): the engine keeps root
            account = None
    if account is not None:
        os.chown(directory, account.uid, account.gid)
    return directory


def enter_sandbox(extra_secret_patterns: Iterable[str] | None = None, hand_over: Iterable[Path] = ()) -> None:
    """What a spawned child that will run users' code calls first: scrub its environment and, when root and
    started by a worker (:func:`started_by_worker`), drop to the engine user the worker chose (see
    :func:`drop_privileges` for ``hand_over``), then check that no thread kept uid 0 or a capability
    (:func:`privileged_threads`; RuntimeError otherwise). ``extra_secret_patterns`` default to
    ``$NNQUEUE_SECRET_ENV_PATTERNS``."""
    if extra_secret_patterns is None:
        extra_secret_patterns = os.environ.get(EXTRA_SECRETS_ENV, "").split(",")
    scrub_environment(extra_secret_patterns)
    if not started_by_worker():
        return
    detach_resource_tracker()
    if drop_privileges(hand_over=hand_over):
        if held := privileged_threads():
            raise RuntimeError(f"dropping privileges left threads privileged: {', '.join(held[:5])}")
    elif os.geteuid() == 0:
        drop_capabilities()


def detach_resource_tracker() -> None:
    """Replace this process's pipe to multiprocessing's resource tracker with ``/dev/null``. The tracker is the
    worker's (root, in the host's view; spawn and the engine core server hand its pipe to engine cores), and unlinks
    every ``/dev/shm`` name still registered with it when the worker exits: a seventh red-team round's escaped engine
    registered host names it could not see. What this process creates there lives in the engine's own ``/dev/shm``,
    which ends with it; the tracker, never started here (its probe of ``/dev/null`` succeeds), has nothing to do."""
    from multiprocessing import resource_tracker

    tracker: int | None = resource_tracker._resource_tracker._fd  # type: ignore[attr-defined]
    if tracker is None:
        return
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, tracker)
    finally:
        os.close(null)


def privileged_threads() -> list[str]:
    """The threads of this process that run as uid 0 (real, effective, saved or filesystem) or hold a capability
    (effective, permitted or ambient), each as ``"<tid>: <why>"``; empty: none.

    glibc's ``setuid`` applies to every thread (it signals each to make the call) and the kernel then clears
    their capabilities, so after :func:`drop_privileges` this is empty; it is checked rather than assumed."""
    held = []
    for task in os.listdir("/proc/self/task"):
        try:
            fields = dict(
                line.split(":", 1) for line in Path(f"/proc/self/task/{task}/status").read_text().splitlines()
            )
        except OSError:  # the thread ended meanwhile
            continue
        why = ["uid 0"] if "0" in fields["Uid"].split() else []
        why += [name for name in ("CapEff", "CapPrm", "CapAmb") if int(fields.get(name, "0"), 16)]
        if why:
            held.append(f"{task}: {' '.join(why)}")
    return held


_PR_CAPBSET_DROP = 24
_CAPABILITY_VERSION_3 = 0x20080522


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def drop_capabilities() -> None:
    """Give up every capability of the calling thread (and the threads it starts afterwards), for good: what an
    engine that keeps uid 0 (its user could not use this Python, see :func:`plan_containment`) can still give
    up in the thread that runs users' code. Without ``CAP_SYS_PTRACE`` that thread can no longer read a
    non-dumpable process's ``/proc`` environ or memory (the worker's), without ``CAP_DAC_OVERRIDE`` /
    ``CAP_DAC_READ_SEARCH`` no file that is not root's own, without ``CAP_KILL`` no other user's process. Files
    root owns stay readable, and capabilities are per thread: threads started before (vLLM's, ZMQ's) keep
    theirs, so code that gets itself run in one of them has them. Only the switch to the engine user is
    process-wide; ``NNQUEUE_ENGINE_USER_REQUIRED`` insists on it.
    The bounding set goes first (``PR_CAPBSET_DROP`` needs ``CAP_SETPCAP``), so no exec could bring them back."""
    last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    for capability in range(last + 1):
        prctl(_PR_CAPBSET_DROP, capability)
    header = _CapHeader(_CAPABILITY_VERSION_3, 0)
    data = (_CapData * 2)()
    if libc().capset(ctypes.byref(header), data) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, os.strerror(errno))


def started_by_worker() -> bool:
    """Whether this process is an engine (or builder) process that an nnqueue worker started: the worker
    exports its pid in ``NNQUEUE_ENGINE_SANDBOX`` (:func:`mark_engine_sandbox`). A library user's process
    that builds an engine itself never has it, so nothing it imports changes its user."""
    marker = os.environ.get(SANDBOX_ENV, "")
    return marker.isdigit() and int(marker) != os.getpid()


# Set by the worker when its engine processes open sockets after start-up (vLLM's Ray executor): their seccomp
# filter then allows AF_INET/AF_INET6 sockets.
SECCOMP_NETWORK_ENV = "NNQUEUE_ENGINE_SECCOMP_NETWORK"


def engine_needs_network() -> bool:
    """In an engine or builder process: whether its worker said it needs TCP/UDP sockets (Ray)."""
    return os.environ.get(SECCOMP_NETWORK_ENV) == "true"


def mark_engine_sandbox() -> None:
    """In the worker: the engine and builder processes it starts from now on enter the sandbox."""
    os.environ[SANDBOX_ENV] = str(os.getpid())


# -- the engine user: the account, who else uses it, whether it can run this interpreter ----------


class EngineUserError(NNqueueError, RuntimeError):
    """The worker cannot run its engine as configured (the message says what to change): a configuration
    error, so ``nnqueue worker`` exits 2 and its supervisor does not start it again."""


@dataclass(frozen=True)
class Containment:
    """What a worker's engine processes run under, for its log, its registration, ``/readyz`` and the traces it
    takes.

    ``engine_user``: the account they switch to, or None when they keep the worker's user; ``note``: why;
    ``seccomp``: None when the seccomp filter applies, else why not; ``network_note`` and ``filesystem_note``:
    their network (:mod:`nnqueue.netns`) and filesystem (:mod:`nnqueue.mountns`), isolated and private or not;
    ``operators``: the owners whose traces the worker still runs when its containment is degraded
    (``NNQUEUE_OPERATOR_OWNERS``; ``*``: every owner's); ``probe``: the key of the passed probe the decision
    rests on (:mod:`nnqueue.probe_memo`), forgotten if the engine then fails to start; ``memory_note``: the bound
    on their memory (:mod:`nnqueue.cgroups`), or why there is none."""

    engine_user: str | None
    note: str
    seccomp: str | None
    network_isolated: bool = False
    network_note: str = ""
    filesystem_private: bool = False
    filesystem_note: str = ""
    operators: tuple[str, ...] = ()
    probe: str | None = None
    memory_note: str = ""

    def degradations(self) -> list[str]:
        """Why users' code in the engine could reach more than the engine's own (empty: it cannot)."""
        found = [] if self.engine_user is not None else [self.note]
        if not self.network_isolated:
            found.append(f"the engine's processes use {self.network_note}")
        if not self.filesystem_private:
            found.append(f"the engine's processes see {self.filesystem_note}")
        return found

    def traces(self) -> str:
        """Whose traces this worker runs, in words."""
        if not self.degradations() or "*" in self.operators:
            return "every owner's"
        if self.operators:
            return f"only its operator's (NNQUEUE_OPERATOR_OWNERS: {', '.join(self.operators)}), harvests and steering"
        return "none (NNQUEUE_OPERATOR_OWNERS is empty): harvests and steering only"

    def refusal(self, owner: str) -> str | None:
        """Why this worker does not run a trace of ``owner``'s (None: it does). A worker whose engine is not
        fully contained runs no user code but its operator's: harvests and steering run no user code."""
        degradations = self.degradations()
        if not degradations or "*" in self.operators or owner in self.operators:
            return None
        return (
            f"this worker's engine is not isolated ({'; '.join(degradations)}), so it runs no other owner's trace:"
            f" it runs {self.traces()}. Run the trace on a worker whose /readyz isolation is 'full', or ask the"
            " operator (docs/operator/engine-isolation.md)"
        )

    def report(self) -> dict[str, str]:
        degradations = self.degradations()
        return {
            "engine_user": self.engine_user or f"kept {pwd.getpwuid(os.geteuid()).pw_name}",
            "note": self.note,
            "seccomp": self.seccomp or "applied",
            "network": self.network_note,
            "filesystem": self.filesystem_note,
            "memory": self.memory_note,
            "isolation": f"degraded: {'; '.join(degradations)}" if degradations else "full",
            "traces": self.traces(),
        }


def ensure_account(name: str, attempts: int = 5) -> EngineUser:
    """The account ``name``; the default one (``nnqueue-engine``) is created (``useradd --system``, no home,
    no login shell) when missing. Several workers may start at once on a fresh machine: a lost race (the
    account appeared meanwhile, or the password file was locked) is looked up again."""
    for attempt in range(attempts):
        try:
            pwd.getpwnam(name)
        except KeyError:
            if name != DEFAULT_ENGINE_USER:
                raise EngineUserError(
                    f"NNQUEUE_ENGINE_USER={name!r} is not a user on this machine: create it (useradd --system"
                    f" {name}) or leave NNQUEUE_ENGINE_USER unset for the dedicated {DEFAULT_ENGINE_USER!r}"
                ) from None
            _create_account(name, last=attempt == attempts - 1)
            time.sleep(0.2 * attempt)
            continue
        try:
            account = engine_user(name)
        except ValueError as error:  # root
            raise EngineUserError(str(error)) from None
        assert account is not None
        return account
    raise EngineUserError(f"the account {name!r} could not be created")  # pragma: no cover - _create_account raised


def _create_account(name: str, last: bool) -> None:
    useradd = shutil.which("useradd") or "/usr/sbin/useradd"
    command = [useradd, "--system", "--user-group", "--no-create-home", "--home-dir", "/nonexistent"]
    command += ["--shell", "/usr/sbin/nologin", name]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    except OSError as error:
        raise EngineUserError(
            f"the dedicated engine account {name!r} does not exist and {useradd} could not run ({error}): create"
            f" it in the image (useradd --system {name}) or set NNQUEUE_ENGINE_USER to an account nothing else uses"
        ) from None
    # 9: the name is taken (another worker created it meanwhile); 10: the password file was locked.
    if done.returncode not in (0, 9) and (last or done.returncode != 10):
        raise EngineUserError(
            f"creating the dedicated engine account {name!r} failed ({' '.join(command)}: {done.stderr.strip()}):"
            f" create it in the image, or set NNQUEUE_ENGINE_USER to an account nothing else uses"
        )
    log.info("created the engine account %r (useradd --system)", name)


def foreign_processes(account: EngineUser) -> list[str]:
    """Processes that run as ``account`` (any of their real, effective, saved or filesystem uids) and are not
    an nnqueue worker's engine or builder processes, each as ``"pid (command)"``.

    A process of ours is one whose nearest ancestor not running as ``account`` is an ``nnqueue worker``: by
    its command line, or (a serving worker's title is Celery's) by being the worker that the process's
    environment names (``NNQUEUE_ENGINE_SANDBOX``, which engine and builder processes inherit), or a
    descendant of that worker's naming it too (the builders' zygote, and its server of engine cores). Builders are
    the zygote's children, engine cores the core server's (or the worker's, where it spawned them), vLLM's
    model-runner processes the engine core's. This tells a shared account (a database server, another
    service's daemon) from engines; it is not a defence against the account's own processes, which control their
    command lines and environments."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        pid = int(entry.name)
        if account.uid in _uids(pid) and _state(pid) not in _ENDED and not _ours(pid, account.uid):
            found.append(f"{pid} ({' '.join(_cmdline(pid))[:120] or '?'})")
    return found


# Zombie and dead: the process has ended and only waits for its parent to collect its exit status.
_ENDED = ("Z", "X")


def lasting_foreign_processes(account: EngineUser, grace: float) -> list[str]:
    """:func:`foreign_processes` that are still there after up to ``grace`` seconds.

    A worker killed a moment ago (its supervisor restarts it; another worker of the host starts meanwhile)
    leaves engine processes that take a few seconds to exit: orphaned, with their memory and command line
    already gone, they are no longer any worker's and would otherwise count as strangers."""
    deadline = time.monotonic() + grace
    while (found := foreign_processes(account)) and time.monotonic() < deadline:
        time.sleep(0.25)
    return found


def _status(pid: int, field: str) -> list[str]:
    """The values of one line of ``/proc/<pid>/status`` (none once the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{field}:"):
                return line.split()[1:]
    except OSError:
        pass
    return []


def _uids(pid: int) -> set[int]:
    return {int(value) for value in _status(pid, "Uid")}


def _ppid(pid: int) -> int:
    return int(next(iter(_status(pid, "PPid")), 0))


def _state(pid: int) -> str:
    return next(iter(_status(pid, "State")), "X")


def _cmdline(pid: int) -> list[str]:
    try:
        return [part for part in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0") if part]
    except OSError:
        return []


def _ours(pid: int, uid: int) -> bool:
    process, seen = pid, set()
    while pid > 1 and pid not in seen and uid in _uids(pid):
        seen.add(pid)
        pid = _ppid(pid)
    argv = _cmdline(pid)  # python -m nnqueue worker ..., or the console script: python .../bin/nnqueue worker ...
    if "worker" in argv and any(Path(part).name == "nnqueue" for part in argv[:3]):
        return True
    worker = _sandbox_of(process)
    # The worker itself, or the zygote it forks its trace builders from (nnqueue.enginecore.zygote: its child), or
    # the zygote's server of engine cores (nnqueue.enginecore.core_forks: its child), each naming the worker.
    while worker is not None and pid != worker and pid > 1 and pid not in seen and _sandbox_of(pid) == worker:
        seen.add(pid)
        pid = _ppid(pid)
    return worker is not None and pid == worker


def _sandbox_of(pid: int) -> int | None:
    """The worker that a process's environment names as its engine's (``NNQUEUE_ENGINE_SANDBOX``)."""
    prefix = f"{SANDBOX_ENV}=".encode()
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    named = [entry.removeprefix(prefix) for entry in environ if entry.startswith(prefix)]
    return int(named[0]) if named and named[0].isdigit() else None


# The probe: a fresh interpreter, run as the engine user, imports what the engine processes import after the
# switch and reads the files inductor compiles against (its own Python.h among them); it prints, as one JSON
# list, the problems and what it read (its modules' files, the files it mapped, the files it was asked to read).
_PROBE = """
import ctypes
ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)  # PR_SET_DUMPABLE 0: an engine of the same user cannot read its memory
import importlib, json, os, sys, sysconfig
modules, files = json.loads(sys.argv[1])
files.append(os.path.join(sysconfig.get_paths()["include"], "Python.h"))
problems = []
for name in modules:
    try:
        importlib.import_module(name)
    except BaseException as error:
        problems.append(f"import {name}: {type(error).__name__}: {error}")
for name in files:
    try:
        open(name, "rb").close()
    except OSError as error:
        problems.append(f"read {name}: {error.strerror}")
read = {getattr(module, "__file__", None) for module in list(sys.modules.values())}
with open("/proc/self/maps") as maps:
    read.update(line.split(None, 5)[5].strip() for line in maps if len(line.split(None, 5)) == 6)
print(json.dumps([problems, sorted(name for name in read | set(files) if name and name.startswith("/"))]))
"""


# How the probe runs where the engine will (its filesystem view and network: nnqueue.enginecore.spawning), given
# the probe's own call.
Contained = Callable[[Callable[[], "subprocess.CompletedProcess[str]"]], "subprocess.CompletedProcess[str]"]


@dataclass(frozen=True)
class Probed:
    """What the probe could not import or read (empty: it passed), and the absolute paths it read."""

    problems: list[str]
    read: list[str] = field(default_factory=list)


def probe(
    account: EngineUser,
    modules: Iterable[str],
    files: Iterable[Path],
    timeout_s: float = 300.0,
    python: str = sys.executable,
    contained: Contained | None = None,
) -> Probed:
    """What ``account`` cannot import or read with ``python`` (this interpreter), run as that account (no
    problems: nothing), where ``contained`` runs it (None: here), and what it read.

    Modules of the standard library that the engine imports lazily (``symtable``), the libraries' modules
    that jobs load after the switch (nnsight's errors, inductor's ``codecache``) and the headers inductor
    compiles against (the interpreter's ``Python.h``, always checked, and ``files``) fail here exactly as
    they would in the engine."""
    home = Path(tempfile.mkdtemp(prefix=f"nnqueue-probe-{account.name}-"))
    os.chown(home, account.uid, account.gid)
    env = without_secrets(dict(os.environ), os.environ.get(EXTRA_SECRETS_ENV, "").split(","))
    env.update(HOME=str(home), XDG_CACHE_HOME=str(home / ".cache"), USER=account.name, LOGNAME=account.name)
    env.pop(SANDBOX_ENV, None)
    request = json.dumps([list(modules), [str(path) for path in files]])

    def run() -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [python, "-c", _PROBE, request],
            user=account.uid,
            group=account.gid,
            extra_groups=[],
            env=env,
            cwd="/",
            capture_output=True,
            text=True,
            timeout=timeout_s,
        )

    try:
        done = run() if contained is None else contained(run)
    except OSError as error:
        return Probed([f"run {python}: {error.strerror or error}"])
    except subprocess.TimeoutExpired:
        return Probed([f"the probe did not finish in {timeout_s:.0f} s"])
    finally:
        shutil.rmtree(home, ignore_errors=True)
    try:
        problems, read = json.loads(done.stdout.strip().splitlines()[-1])
    except (ValueError, IndexError):
        return Probed([f"{python} exited with {done.returncode}: {done.stderr.strip()[-2000:]}"])
    return Probed([str(problem) for problem in problems], [str(name) for name in read])


def interpreter_paths() -> list[Path]:
    """What the engine processes read after the switch: the interpreter, the standard library, its headers,
    the site-packages folders and the folder nnqueue is imported from (an editable checkout)."""
    import site
    import sysconfig

    paths = [Path(os.path.realpath(sys.executable)), Path(os.__file__).parent, Path(sysconfig.get_paths()["include"])]
    paths += [Path(folder) for folder in site.getsitepackages() if Path(folder).is_dir()]
    paths.append(Path(__file__).resolve().parent.parent)
    return list(dict.fromkeys(paths))


def blocked_at(path: Path, account: EngineUser, need: int = 0o4) -> Path | None:
    """The first folder on the way to ``path`` that ``account`` may not pass, or ``path`` itself when it lacks
    the ``need`` permission bits (read, by default), judged by owners and mode bits; None when nothing blocks it."""
    for part in [*reversed(path.parents), path]:
        required = need if part == path else 0o1
        try:
            info = part.stat()
        except OSError:
            return None
        if info.st_uid == account.uid:
            bits = info.st_mode >> 6
        elif info.st_gid == account.gid:
            bits = info.st_mode >> 3
        else:
            bits = info.st_mode
        if bits & required != required:
            return part
    return None


def what_to_change(account: EngineUser, problems: list[str], paths: Iterable[Path] | None = None) -> str:
    """The probe's problems and the fix for the folders that keep the engine user from ``paths`` (default
    :func:`interpreter_paths`), as one message."""
    blocked: dict[Path, Path] = {}
    for path in interpreter_paths() if paths is None else paths:
        if (part := blocked_at(path, account)) is not None:
            blocked.setdefault(part, path)
    lines = [f"the engine user {account.name!r} cannot use this Python: {'; '.join(problems[:3])}"]
    for part, path in blocked.items():
        mode = stat.S_IMODE(part.stat().st_mode)
        owner = pwd.getpwuid(part.stat().st_uid).pw_name
        lines.append(f"{part} (mode {mode:04o}, owner {owner}) keeps it from {path}")
    fixes = [f"install Python and the virtualenv where {account.name!r} can read them (outside /root, e.g."]
    fixes[0] += " /opt or /usr/local, as nnqueue's Docker images do)"
    fixes += [f"chmod o+x {part} (lets others pass through it, not list it)" for part in blocked if part.is_dir()]
    lines.append("fix: " + ", or ".join(fixes))
    return "; ".join(lines)


def plan_containment(
    user: str,
    required: bool,
    seccomp: str | None,
    modules: Iterable[str],
    python: str = sys.executable,
    *,
    files: Iterable[Path] = (),
    contained: Contained | None = None,
    memo: Path | None = None,
    where: str = "",
) -> Containment:
    """Decide, at a worker's start, which user its engine processes run as (see docs/operator/engine-isolation.md).

    As root, with ``user`` set: the account (created if it is the default and missing) must be used by no
    other process (else :class:`EngineUserError`), and a probe run as it where the engine will run
    (``contained``: in its private filesystem view, where the interpreter, the virtualenv and the model are
    readable whatever the host's modes) must import ``modules`` and read the headers and ``files`` (the
    model's); then the engine switches to it. When the probe fails the engine keeps root, behind every layer
    that does not need the switch, and its worker runs only its operator's traces (:meth:`Containment.refusal`),
    unless ``required`` (``NNQUEUE_ENGINE_USER_REQUIRED``): then :class:`EngineUserError` says what to change.
    ``seccomp``: why the seccomp filter is unavailable, or None. ``memo``: the folder where a passed probe is
    remembered (:mod:`nnqueue.probe_memo`; None: always probe), ``where`` what ``contained`` does, as text.
    """
    uid = os.geteuid()
    if uid != 0 or not user:
        why = (
            f"the worker runs as uid {uid}, not root: its engine processes keep that user"
            if uid != 0
            else "NNQUEUE_ENGINE_USER is empty: the engine processes stay root"
        )
        if required:
            raise EngineUserError(
                f"NNQUEUE_ENGINE_USER_REQUIRED is true but {why}; run the worker as root with NNQUEUE_ENGINE_USER"
                f" set (default {DEFAULT_ENGINE_USER!r}), or set NNQUEUE_ENGINE_USER_REQUIRED=false"
            )
        return Containment(None, why, seccomp)
    account = ensure_account(user)
    if others := lasting_foreign_processes(account, STRANGERS_GRACE_S):
        raise EngineUserError(
            f"other processes already run as the engine user {account.name!r} (uid {account.uid}): "
            f"{', '.join(others[:5])}; engine processes would share their files and could signal them. Give the"
            f" engine an account of its own: leave NNQUEUE_ENGINE_USER unset (the dedicated {DEFAULT_ENGINE_USER!r})"
            " or name an account nothing else uses"
        )
    modules, files = list(modules), list(files)
    key = probe_memo.question(python, account.uid, account.gid, modules, files, where)
    problems = _probe_unless_remembered(account, modules, files, python, contained, memo, key)
    if not problems:
        switched = f"engine processes switch to {account.name!r} once they are up"
        return Containment(account.name, switched, seccomp, probe=key if memo is not None else None)
    paths = None if python == sys.executable else [Path(os.path.realpath(python))]
    message = what_to_change(account, problems, paths)
    if required:
        raise EngineUserError(f"NNQUEUE_ENGINE_USER_REQUIRED is true and {message}")
    return Containment(None, f"engine processes keep root, because {message}", seccomp)


def _probe_unless_remembered(
    account: EngineUser,
    modules: list[str],
    files: list[Path],
    python: str,
    contained: Contained | None,
    memo: Path | None,
    key: str,
) -> list[str]:
    if memo is not None and probe_memo.passed(memo, key):
        log.info("the engine user's probe passed before and nothing it read has changed: not run again")
        return []
    probed = probe(account, modules, files, python=python, contained=contained)
    if memo is not None and not probed.problems:
        probe_memo.remember(memo, key, probed.read)
    return probed.problems


def unreadable_by(account: EngineUser, paths: Iterable[Path]) -> list[Path]:
    """The folders of ``paths`` that ``account`` cannot list and read, or cannot reach (a folder above lacks
    its search permission), judged by owners and mode bits."""
    return [path for path in paths if blocked_at(path, account, need=0o5) is not None]


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
