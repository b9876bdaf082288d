"""A filesystem of their own for the processes that run users' code: read-only, a private /tmp, no host socket.

The engine core, its model-runner workers, the trace builders and the transformers engine run intervention
code. Switched to the engine user (:mod:`nnqueue.isolation`) they can no longer read root's private files, but
on the host's filesystem they would still see everything that is readable by everyone: other users' results in a
shared folder, the unix sockets of local services (a store's filer, a database's socket) in ``/tmp`` or
``/run``, writable folders to leave things in. And they could not even start where the engine user cannot read
Python (a pyenv under root's mode-700 home: the workstation layout), so the engine had to keep root.

So a root worker gives them a **view** (:class:`View`): a fresh mount namespace whose root is a read-only tmpfs
holding only

* the system's trees (``/usr``, ``/etc``, ``/bin``, ``/lib*``, ``/sbin``), ``/proc``, ``/sys`` (read-only) and
  ``/dev`` (its devices: the GPUs'), bound in from the host;
* what the engine reads: the interpreter, the virtualenv, the folder nnqueue is imported from, the model and
  the caches of models and compiled kernels, read-only (``nosuid``), at their own paths, with folders made
  passable in between (so a Python under ``/root`` is readable there: ``/root`` is a folder of the view, not
  root's mode-700 home);
* what the engine writes: the worker's handoff and crash folders, the folder of vLLM's ``ipc://`` sockets
  (``VLLM_RPC_BASE_PATH``: root's, mode 0700) and the compiled-kernel caches that root fills before the switch;
* fresh private tmpfs's at ``/tmp``, ``/var/tmp``, ``/dev/shm`` and ``HOME``, each at most a tenth of the host's
  memory (:data:`TMPFS_SIZE`).

Unix sockets of the host that a bound tree holds when the view is made (listed in ``/proc/net/unix``) are
covered with ``/dev/null``, but for those in the engine's own socket folder; abstract ones belong to the network
namespace, which is the engine's own (:mod:`nnqueue.netns`). Nothing else of the host is there: no ``/home``,
no ``/run``, no ``/var``, no data folder, no other ``/tmp`` file.

How a process gets there. :func:`enter` builds the view on the calling *thread* (``unshare(CLONE_NEWNS)``
unshares the thread's filesystem attributes too, so the process's other threads keep the host's) the way
bubblewrap does: a tmpfs over ``/tmp`` becomes the root with the host's at ``/oldroot`` (``pivot_root``), the
view is built in ``/newroot`` from ``/oldroot``'s paths, the host's root is detached, and ``/newroot`` becomes
the root. A process started from that thread is born in the view. The worker does that from a fresh thread
that ends after the spawn (:mod:`nnqueue.enginecore.spawning`); a child that starts single-threaded enters it
first thing. It needs ``CAP_SYS_ADMIN`` (a root worker; a container needs it granted): elsewhere the engine
runs on the host's filesystem and the worker says so (``NNQUEUE_ENGINE_FILESYSTEM``).
"""

from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import platform
import re
import stat
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Literal

from nnqueue.errors import NNqueueError
from nnqueue.libc import check, libc

# The view the worker's engine processes run in, as JSON (:meth:`View.to_json`), for the children that enter it.
VIEW_ENV = "NNQUEUE_ENGINE_VIEW"
PRIVATE, HOST = "private", "host"
Mode = Literal["auto", "private", "host"]

# The host's trees every view holds, read-only; a top-level symlink (``/bin -> usr/bin``) is kept as one.
SYSTEM_TREES = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
PRIVATE_TMPFS = ("/tmp", "/var/tmp", "/dev/shm")
# Each private tmpfs's size, a share of the host's memory: tmpfs's own default is half of it, so the four of them let
# an escaped engine take all of the host's memory; at a tenth each, 40% at most (the compiled-kernel caches fit).
TMPFS_SIZE = "10%"

_CLONE_NEWNS = 0x00020000
_MS_RDONLY, _MS_NOSUID, _MS_NODEV = 0x1, 0x2, 0x4
_MS_REMOUNT, _MS_BIND, _MS_REC, _MS_PRIVATE = 0x20, 0x1000, 0x4000, 0x40000
_MNT_DETACH = 0x2
_SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217}.get(platform.machine())


class ViewError(NNqueueError):
    """The view could not be made or entered."""


@dataclasses.dataclass(frozen=True)
class Bind:
    """The host's ``source`` (its real path) at ``target`` in the view; ``kind``: ``ro``, ``rw`` or ``dev`` (the
    device tree: read-write, devices allowed) or ``proc``. ``opened``: a read-only folder that others may not
    pass (a checkout in a ``mktemp -d`` folder, mode 0700): the view holds a passable folder there with each of
    its entries bound in, so what is readable in it is readable, and what is private in it (a mode-0700 data
    folder, a mode-0600 ``.env``) stays private."""

    source: str
    target: str
    kind: str = "ro"
    opened: bool = False


@dataclasses.dataclass(frozen=True)
class View:
    """What the engine's processes see. ``binds`` and ``symlinks`` (path, link) are made in order of depth;
    ``tmpfs``: fresh private folders (``mode`` 1777 but ``home``'s, 0755); ``sockets_kept``: the folder whose
    unix sockets stay usable (vLLM's); ``workdir``: where the processes start."""

    binds: tuple[Bind, ...]
    symlinks: tuple[tuple[str, str], ...] = ()
    tmpfs: tuple[str, ...] = PRIVATE_TMPFS
    home: str | None = None
    sockets_kept: str | None = None
    workdir: str = "/"

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self))

    @classmethod
    def from_json(cls, text: str) -> View:
        raw = json.loads(text)
        raw["binds"] = tuple(Bind(**bind) for bind in raw["binds"])
        raw["symlinks"] = tuple(tuple(pair) for pair in raw["symlinks"])
        raw["tmpfs"] = tuple(raw["tmpfs"])
        return cls(**raw)


def plan(
    read_only: Iterable[Path],
    writable: Iterable[Path],
    *,
    home: Path | None,
    sockets_kept: Path | None,
    workdir: Path,
) -> View:
    """The view of the system's trees, ``read_only`` and ``writable`` (paths that do not exist are left out, and
    so is a path inside another of the same kind), a private ``home`` and ``workdir``. Real paths are resolved
    here, on the host: a path reached through a symlink is bound both at its real path and where it was named."""
    symlinks, binds = [], [Bind("/proc", "/proc", "proc"), Bind("/sys", "/sys"), Bind("/dev", "/dev", "dev")]
    for tree in SYSTEM_TREES:
        if os.path.islink(tree):
            symlinks.append((tree, os.readlink(tree)))
        elif os.path.isdir(tree):
            binds.append(Bind(tree, tree))
    for kind, paths in (("ro", read_only), ("rw", writable)):
        named = {str(Path(path).absolute()) for path in paths if os.path.exists(path)}
        for path in _outermost(named | {os.path.realpath(path) for path in named}):
            source = os.path.realpath(path)
            opened = kind == "ro" and os.path.isdir(source) and not os.stat(source).st_mode & stat.S_IXOTH
            binds.append(Bind(source, path, kind, opened))
    return View(
        binds=tuple(sorted(binds, key=lambda bind: _depth(bind.target))),
        symlinks=tuple(symlinks),
        home=str(home) if home is not None and str(home) != "/" else None,
        sockets_kept=str(sockets_kept) if sockets_kept is not None else None,
        workdir=str(workdir),
    )


def _depth(path: str) -> int:
    return len(Path(path).parts)


def _outermost(paths: Iterable[str]) -> list[str]:
    """``paths`` without those inside another of them."""
    chosen: list[str] = []
    for path in sorted(paths, key=_depth):
        if not any(path == kept or path.startswith(kept.rstrip("/") + "/") for kept in chosen):
            chosen.append(path)
    return chosen


def resolve(mode: Mode, check: View) -> tuple[str, str | None]:
    """``(PRIVATE or HOST, why not private)`` for the setting ``mode``, trying ``check`` in a throwaway thread;
    raises :class:`ViewError` when ``mode`` is ``private`` and the view cannot be made here."""
    if mode == HOST:
        return HOST, "NNQUEUE_ENGINE_FILESYSTEM=host"
    why = None
    if os.geteuid() != 0:
        why = "the worker is not root (a mount namespace needs CAP_SYS_ADMIN)"
    else:
        try:
            in_fresh_thread(lambda: enter(check))
        except (OSError, ViewError) as error:
            why = f"a private filesystem view could not be made here ({error}): a container must grant CAP_SYS_ADMIN"
    if why is None:
        return PRIVATE, None
    if mode == PRIVATE:
        raise ViewError(f"NNQUEUE_ENGINE_FILESYSTEM=private, but {why}")
    return HOST, why


def in_fresh_thread(call: Any) -> Any:
    """``call()`` on a thread of its own, which ends afterwards (and with it, namespaces it entered); its result
    or its exception."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(1, thread_name_prefix="nnqueue-namespaces") as pool:
        return pool.submit(call).result()


def enter_if_asked() -> bool:
    """What a child that runs users' code calls first, while it has one thread: enter the view the worker exported
    (``$NNQUEUE_ENGINE_VIEW``); whether there was one."""
    text = os.environ.get(VIEW_ENV)
    if not text:
        return False
    threads = len(os.listdir("/proc/self/task"))
    if threads != 1:
        raise ViewError(f"cannot move a process that already runs {threads} threads into the view")
    enter(View.from_json(text))
    return True


# -- making the view ------------------------------------------------------------------------------------


def _check(result: int, what: str) -> None:
    check(result, what, ViewError)


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    encode = lambda text: text.encode() if text is not None else None  # noqa: E731
    result = libc().mount(encode(source), encode(target), encode(fstype), ctypes.c_ulong(flags), encode(data))
    _check(result, f"mount {source or ''} on {target}")


def _pivot_root(new_root: str, put_old: str) -> None:
    if _SYS_PIVOT_ROOT is None:
        raise ViewError("pivot_root: no system call number known for this architecture")
    _check(libc().syscall(_SYS_PIVOT_ROOT, new_root.encode(), put_old.encode()), "pivot_root")


def _make_point(path: str, like: str) -> None:
    """An empty folder (or file, when ``like`` is not a folder) at ``path`` to mount on."""
    if os.path.isdir(like):
        os.makedirs(path, exist_ok=True)
        return
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if not os.path.lexists(path):
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))


def _mounts_under(target: str) -> list[str]:
    """The mount points at or under ``target`` (this thread's namespace), outermost first."""
    found = []
    for line in Path("/oldroot/proc/thread-self/mountinfo").read_text().splitlines():  # while the view is built
        point = re.sub(r"\\([0-7]{3})", lambda escape: chr(int(escape[1], 8)), line.split()[4])  # \040: a space
        if point == target or point.startswith(target.rstrip("/") + "/"):
            found.append(point)
    return sorted(set(found), key=_depth)


def _bind(bind: Bind, root: str) -> None:
    target = root + bind.target
    if bind.opened:
        os.makedirs(target, mode=0o755, exist_ok=True)
        for name in sorted(os.listdir("/oldroot" + bind.source)):
            _bind(Bind(f"{bind.source}/{name}", f"{bind.target}/{name}", bind.kind), root)
        return
    _make_point(target, "/oldroot" + bind.source)
    _mount("/oldroot" + bind.source, target, None, _MS_BIND | _MS_REC)
    if bind.kind == "proc":
        return
    flags = _MS_BIND | _MS_REMOUNT | _MS_NOSUID
    flags |= {"ro": _MS_RDONLY | _MS_NODEV, "rw": _MS_NODEV, "dev": 0}[bind.kind]
    for point in _mounts_under(target):
        try:
            _mount(None, point, None, flags)
        except ViewError:
            if point == target:
                raise
            # A submount whose own flags the kernel keeps (a nested proc or a locked mount): it stays as it is.


def _host_sockets() -> list[str]:
    """The paths of the unix sockets bound in this thread's network namespace (the host's, before the engine's)."""
    paths = []
    for line in Path("/proc/net/unix").read_text().splitlines()[1:]:
        fields = line.split(maxsplit=7)
        if len(fields) == 8 and fields[7].startswith("/"):
            paths.append(fields[7])
    return paths


def _cover_sockets(view: View, sockets: list[str], root: str) -> None:
    """``/dev/null`` over each host socket that a bound tree shows, but those in ``view.sockets_kept``."""
    shown = [bind.target for bind in view.binds if bind.kind in ("ro", "rw")]
    kept = view.sockets_kept.rstrip("/") + "/" if view.sockets_kept else None
    for path in sockets:
        if kept and path.startswith(kept):
            continue
        if not any(path.startswith(tree.rstrip("/") + "/") for tree in shown):
            continue
        try:
            if stat.S_ISSOCK(os.lstat(root + path).st_mode):
                _mount("/oldroot/dev/null", root + path, None, _MS_BIND)
        except OSError:
            continue  # gone meanwhile


def enter(view: View) -> None:
    """Move the calling thread into a fresh mount namespace whose root is ``view`` (see the module doc); a
    process it starts afterwards is born there. Needs CAP_SYS_ADMIN; raises :class:`ViewError` or OSError."""
    sockets = _host_sockets()
    _check(libc().unshare(_CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    _mount(None, "/", None, _MS_REC | _MS_PRIVATE)
    _mount("tmpfs", "/tmp", "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755")
    os.chdir("/tmp")
    os.mkdir("oldroot")
    os.mkdir("newroot")
    _pivot_root(".", "oldroot")
    os.chdir("/")
    _mount("tmpfs", "/newroot", "tmpfs", _MS_NOSUID | _MS_NODEV, "mode=0755")
    for path, link in view.symlinks:
        os.symlink(link, "/newroot" + path)
    # /dev/shm without the sticky bit: the shared memory root made before the switch is unlinked by the engine user
    # at shutdown (it is all the engine's own, and goes with the namespace anyway).
    private = [(path, f"mode={'0777' if path == '/dev/shm' else '1777'},size={TMPFS_SIZE}") for path in view.tmpfs]
    if view.home:
        private.append((view.home, f"mode=0755,size={TMPFS_SIZE}"))  # root's before the switch; passable
    steps: list[Bind | tuple[str, str]] = [*view.binds, *private]
    for step in sorted(steps, key=lambda step: _depth(step.target if isinstance(step, Bind) else step[0])):
        if isinstance(step, Bind):
            _bind(step, "/newroot")
        else:
            os.makedirs("/newroot" + step[0], exist_ok=True)
            _mount("tmpfs", "/newroot" + step[0], "tmpfs", _MS_NOSUID | _MS_NODEV, step[1])
    _cover_sockets(view, sockets, "/newroot")
    os.makedirs("/newroot" + view.workdir, exist_ok=True)
    _mount(None, "/newroot", None, _MS_REMOUNT | _MS_RDONLY | _MS_NOSUID | _MS_NODEV)
    _check(libc().umount2(b"/oldroot", _MNT_DETACH), "umount /oldroot")
    os.chdir("/newroot")
    _pivot_root(".", ".")  # the view's root over the staging tmpfs, which is then detached
    _check(libc().umount2(b".", _MNT_DETACH), "umount the staging root")
    os.chdir(view.workdir)
