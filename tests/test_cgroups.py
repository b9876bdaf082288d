"""nnqueue.cgroups: the engine's processes share a memory cgroup of the worker's, so one that takes more memory than
the bound is killed by the kernel, not another process of the host (red-team round 10: memfd and anonymous memory were
bounded by nothing), and what they leave behind is found and killed. Run in a fresh interpreter, as the worker: making
the group exports it in the process's environment. The engine of a real worker in its group:
tests/workers/test_isolation.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

WORKER = textwrap.dedent(
    r"""
    import json, os, subprocess, sys, time
    from nnqueue import cgroups

    group, note = cgroups.create(256 << 20, 64)
    limit = group.limit_bytes
    join = "from nnqueue import cgroups; cgroups.join_if_asked(); "
    def run(code):
        return subprocess.run([sys.executable, "-c", join + code], capture_output=True, text=True, timeout=120)
    # Within the bound; then past it with a memfd, whose pages no process's RSS shows.
    fine = run("b = bytearray(64 << 20); print(open('/proc/self/cgroup').read())")
    hog = run(
        "import mmap, os; fd = os.memfd_create('hog'); os.ftruncate(fd, 1 << 30); m = mmap.mmap(fd, 1 << 30)\n"
        "for at in range(0, 1 << 30, 1 << 20): m[at:at + (1 << 20)] = b'x' * (1 << 20)\n"
        "print('took a GiB')"
    )
    # Threads past the tasks bound (round 11 took 1,000 of the host's pids with threads: fork was refused).
    threads = run(
        "import threading, time\n"
        "started = 0\n"
        "try:\n"
        "    for _ in range(200):\n"
        "        threading.Thread(target=time.sleep, args=(3,), daemon=True).start(); started += 1\n"
        "except RuntimeError:\n"
        "    pass\n"
        "print(started)"
    )
    # A daemon left behind: forked twice, its parent gone, so it descends from nothing of ours.
    daemon = (
        "import os, time\n"
        "if os.fork() == 0:\n"
        "    os.setsid()\n"
        "    if os.fork() == 0:\n"
        "        null = os.open(os.devnull, os.O_RDWR); os.dup2(null, 1); os.dup2(null, 2); time.sleep(60)\n"
        "    os._exit(0)\n"
        "os.wait()\n"
    )
    run(daemon)
    time.sleep(0.3)
    members = sorted(group.members())
    killed = group.kill_strays(os.getpid())
    time.sleep(0.3)
    after = sorted(group.members())
    group.remove()
    print(json.dumps({
        "note": note, "limit": limit, "path": str(group.path),
        "env": os.environ.get(cgroups.GROUP_ENV), "fine": [fine.returncode, fine.stdout], "hog": hog.returncode,
        "threads": threads.stdout.strip(),
        "hog_out": hog.stdout, "members": members, "killed": killed, "after": after, "removed": not group.path.exists(),
    }))
    """
)


@pytest.mark.skipif(os.geteuid() != 0, reason="a root worker's: an unprivileged one makes no cgroup")
def test_the_engines_group_bounds_its_memory_and_its_strays_are_killed() -> None:
    done = subprocess.run([sys.executable, "-c", WORKER], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    group = found["path"]
    assert found["note"] == (
        f"at most {256 << 20} bytes and 64 tasks (NNQUEUE_ENGINE_MEMORY_MAX, NNQUEUE_ENGINE_TASKS_MAX; cgroup {group})"
    )
    # Exported: the memory hierarchy's group, then the pids hierarchy's (cgroup v1: a hierarchy per controller).
    name = group.rsplit("/", 1)[1]
    assert found["limit"] == 256 << 20 and found["env"] == f"{group}:/sys/fs/cgroup/pids/{name}"
    # The child joined the group and lived within the bound.
    assert found["fine"][0] == 0 and group.split("/sys/fs/cgroup/memory", 1)[-1] in found["fine"][1]
    # Past it (memfd pages), the kernel killed it: the worker that made the group lives on.
    assert found["hog"] == -9 and "took a GiB" not in found["hog_out"]
    # Its threads stopped at the tasks bound (64 for the whole group, the interpreter's own among them).
    assert 0 < int(found["threads"]) < 64
    # The daemon, in the group and out of the worker's tree, was killed; the group was emptied and removed.
    assert len(found["killed"]) == 1 and found["killed"] == found["members"] and found["after"] == []
    assert found["removed"]
