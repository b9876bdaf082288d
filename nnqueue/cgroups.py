"""A memory and task bound for the processes that run users' code: a cgroup of the worker's, which each joins first.

The engine's private tmpfs's are bounded (:data:`nnqueue.mountns.TMPFS_SIZE`), its folders on the host watched
(:mod:`nnqueue.workers.engine_folders`), but the memory its processes take is not: a tenth red-team round's escaped
engine could take the host's memory with ``memfd_create`` or plain anonymous memory, and the kernel's OOM killer would
then pick whatever process is largest on the host (the database, another worker), not the engine. So a root worker
makes a memory cgroup of its own under the one it runs in (:func:`create`: ``nnqueue-engine-<worker pid>``, cgroup
v1's memory hierarchy or v2's unified one), with a limit (``NNQUEUE_ENGINE_MEMORY_MAX``, default
:data:`DEFAULT_SHARE` of the host's memory), and exports its folder (:data:`GROUP_ENV`). Every process that runs
users' code is in it before it runs any: a trace builder and a forked engine core join it first thing, still root in
the host's view (:func:`join_if_asked`, from :func:`nnqueue.enginecore.spawning.enter_if_asked`); a spawned engine core
is put there by the worker as it starts (:meth:`EngineGroup.place`; it is importing Python then), and the
model-runner workers it spawns are born there. Memory, tmpfs and memfd pages included, is charged to the group of the
process that first touched it: past the limit the kernel reclaims, then kills a process of the group (the engine core:
the worker replaces it, :mod:`nnqueue.workers.engine_restart`; a builder: the pool forks another). The engine user
cannot write the group's files (root's), so its processes cannot leave it. The same group bounds the tasks (processes
and threads) they may have (``NNQUEUE_ENGINE_TASKS_MAX``, the pids controller: in cgroup v1 a group of the same name
in its own hierarchy): round 11's engine, refused ``fork`` by seccomp, could still start threads until the host had
no pid left to give anyone.

The group also says which processes are the engine's: at an engine's replacement, a process of the group that no
longer descends from the worker (a daemon an escaped engine left behind, re-parented to the host's init) is killed
(:meth:`EngineGroup.kill_strays`), and the worker's stop kills what is left and removes the group
(:meth:`EngineGroup.remove`). A worker that is not root, or whose host lets it make no memory cgroup, runs without and
says so (``memory`` in its containment's report). Not bounded by the group: the kernel's own memory for unix
sockets' queued buffers (round 11 queued 187 MB uncharged in v1), held to the engine's descriptor limit only.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

# The folders of the cgroup that the engine's processes join, ``os.pathsep`` between (set by the worker for them).
GROUP_ENV = "NNQUEUE_ENGINE_CGROUP"
# The limit, when none is set: this share of the host's memory (the worker, its database and the others keep the
# rest).
DEFAULT_SHARE = 0.75
_PREFIX = "nnqueue-engine-"
# cgroup v2: where the processes of the worker's own cgroup move, so that it can delegate the memory controller.
_LEAF = "nnqueue-processes"
_REMOVE_WAIT_S = 5.0


@dataclass(frozen=True)
class EngineGroup:
    """A cgroup the engine's processes join: its folders (the memory controller's, then in cgroup v1 the pids
    controller's, where there is one) and its cgroup version (1 or 2)."""

    paths: tuple[Path, ...]
    version: int

    @property
    def path(self) -> Path:
        """The memory controller's folder."""
        return self.paths[0]

    @property
    def limit_bytes(self) -> int:
        name = "memory.limit_in_bytes" if self.version == 1 else "memory.max"
        return int((self.path / name).read_text())

    def place(self, pid: int) -> None:
        """Move the process ``pid`` (all its threads) into the group."""
        for path in self.paths:
            (path / "cgroup.procs").write_text(str(pid))

    def members(self) -> set[int]:
        """The pids of the processes in the group now."""
        try:
            return {int(pid) for pid in (self.path / "cgroup.procs").read_text().split()}
        except FileNotFoundError:
            return set()

    def kill_strays(self, root: int) -> list[int]:
        """Kill the processes of the group that do not descend from ``root`` (the worker); their pids."""
        import psutil  # vLLM's dependency: there wherever an engine runs

        try:
            ours = {root} | {child.pid for child in psutil.Process(root).children(recursive=True)}
        except psutil.Error:
            return []
        strays = sorted(self.members() - ours)
        for pid in strays:
            log.warning("killing process %d, an engine process that outlived its engine", pid)
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        return strays

    def remove(self) -> None:
        """Kill every process in the group and remove it (the worker is stopping)."""
        deadline = time.monotonic() + _REMOVE_WAIT_S
        for path in self.paths:
            while path.exists():
                for pid in EngineGroup((path,), self.version).members():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                try:
                    path.rmdir()
                except FileNotFoundError:
                    break
                except OSError as error:  # EBUSY: a killed process has not left yet
                    if time.monotonic() > deadline:
                        log.warning("the engine's cgroup %s could not be removed: %s", path, error)
                        break
                    time.sleep(0.05)


def create(limit_bytes: int | None, tasks: int) -> tuple[EngineGroup | None, str]:
    """A fresh cgroup for this worker's engine, under the one this process runs in, its memory limited to
    ``limit_bytes`` (None: :data:`DEFAULT_SHARE` of the host's memory) and its tasks to ``tasks`` where the pids
    controller is there, exported in :data:`GROUP_ENV` for the engine's processes; and a note on it for the
    containment's report. None (and why) where it cannot be made: not root, no memory controller, a v2 hierarchy that
    does not delegate it. Groups of workers that died before they removed theirs are removed first."""
    if os.geteuid() != 0:
        return None, "not bounded: the worker is not root, so it makes no cgroup for its engine"
    found = _own_cgroup("memory")
    if found is None:
        return None, "not bounded: this host has no memory cgroup controller this process can use"
    parent, version = found
    parents = [parent]  # and in cgroup v1, the pids hierarchy's
    if version == 1 and (pids := _own_cgroup("pids")) is not None:
        parents.append(pids[0])
    for folder in parents:
        _remove_abandoned(folder, version)
    limit = limit_bytes or int(DEFAULT_SHARE * _host_memory())
    group = EngineGroup(tuple(folder / f"{_PREFIX}{os.getpid()}" for folder in parents), version)
    try:
        if version == 2:
            _delegate(parent)
        for path in group.paths:
            path.mkdir(exist_ok=True)
        _limit(group, limit)
        bounded_tasks = _limit_tasks(group, tasks)
    except OSError as error:
        with contextlib.suppress(OSError):
            for path in group.paths:
                path.rmdir()
        return None, f"not bounded: the engine's cgroup could not be made under {parent}: {error}"
    os.environ[GROUP_ENV] = os.pathsep.join(map(str, group.paths))
    tasks_note = f" and {tasks} tasks" if bounded_tasks else " (its tasks unbounded: no pids controller)"
    settings = "NNQUEUE_ENGINE_MEMORY_MAX, NNQUEUE_ENGINE_TASKS_MAX" if bounded_tasks else "NNQUEUE_ENGINE_MEMORY_MAX"
    return group, f"at most {limit} bytes{tasks_note} ({settings}; cgroup {group.path})"


def asked() -> EngineGroup | None:
    """The engine's group the worker exported (:data:`GROUP_ENV`), or None."""
    if not (exported := os.environ.get(GROUP_ENV)):
        return None
    paths = tuple(Path(path) for path in exported.split(os.pathsep))
    return EngineGroup(paths, 2 if (paths[0] / "memory.max").exists() else 1)


def join_if_asked() -> None:
    """What a child that runs users' code calls first, while root in the host's view: join the engine's group. A
    child that cannot (the group is gone: its worker is stopping) does not start."""
    group = asked()
    if group is not None and os.geteuid() == 0:
        group.place(os.getpid())


def _limit_tasks(group: EngineGroup, tasks: int) -> bool:
    """Bound the group's tasks (threads count) where the pids controller is there; whether it is."""
    pids = group.paths[-1] / "pids.max"
    if not pids.exists():
        return False
    pids.write_text(str(tasks))
    return True


def _limit(group: EngineGroup, limit: int) -> None:
    if group.version == 1:
        (group.path / "memory.limit_in_bytes").write_text(str(limit))
        # Memory and swap together, where the kernel accounts swap: swapping out does not get past the limit.
        with contextlib.suppress(FileNotFoundError, PermissionError):
            (group.path / "memory.memsw.limit_in_bytes").write_text(str(limit))
    else:
        (group.path / "memory.max").write_text(str(limit))
        with contextlib.suppress(FileNotFoundError):
            (group.path / "memory.swap.max").write_text("0")


def _own_cgroup(controller: str) -> tuple[Path, int] | None:
    """The folder of this process's cgroup with ``controller`` (``memory``, ``pids``), and its version; None where it
    has none."""
    mounts = [line.split() for line in Path("/proc/self/mountinfo").read_text().splitlines()]
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        hierarchy, controllers, relative = line.split(":", 2)
        if hierarchy != "0" and controller not in controllers.split(","):
            continue
        for fields in mounts:
            fstype = fields[fields.index("-") + 1]
            options = fields[-1].split(",")
            if (hierarchy == "0" and fstype == "cgroup2") or (fstype == "cgroup" and controller in options):
                root, mountpoint = fields[3], fields[4]
                folder = Path(mountpoint) / os.path.relpath(relative, root)
                if hierarchy == "0" and folder.name == _LEAF:  # moved there by an earlier worker (_delegate)
                    folder = folder.parent
                if hierarchy == "0" and controller not in _controllers(folder):
                    continue
                return folder, 2 if hierarchy == "0" else 1
    return None


def _controllers(folder: Path) -> list[str]:
    try:
        return (folder / "cgroup.controllers").read_text().split()
    except OSError:
        return []


def _delegate(parent: Path) -> None:
    """cgroup v2: let the parent's children have the memory controller, and the pids one where it has it. v2 lets a
    cgroup other than the root give its children a controller only while it holds no process itself: where it holds
    some (this worker's and whatever else runs in its container or unit: a container's cgroup, a GPU host's), they
    move to a leaf of their own, :data:`_LEAF`, as Docker-in-Docker's start does (a systemd unit needs
    ``Delegate=yes`` for this)."""
    control = parent / "cgroup.subtree_control"
    names = [name for name in ("memory", "pids") if name in _controllers(parent)]
    if set(names) <= set(control.read_text().split()):
        return
    wanted = " ".join(f"+{name}" for name in names)
    try:
        control.write_text(wanted)
    except OSError as error:
        if error.errno != errno.EBUSY:
            raise
        leaf = parent / _LEAF
        leaf.mkdir(exist_ok=True)
        for pid in (parent / "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):  # ended meanwhile
                (leaf / "cgroup.procs").write_text(pid)
        control.write_text(wanted)


def _remove_abandoned(parent: Path, version: int) -> None:
    """Remove the groups that workers no longer alive left under ``parent`` (killed, they could not)."""
    for folder in parent.glob(f"{_PREFIX}*"):
        worker = folder.name.removeprefix(_PREFIX)
        if worker.isdigit() and not _alive(int(worker)):
            EngineGroup((folder,), version).remove()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _host_memory() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
