"""nnqueue.mountns: the filesystem view of the processes that run users' code, entered on a thread of this process
(what the worker does before it starts the engine core), checked from inside: only what it binds, read-only but
its writable folders, a private /tmp, no host socket but those it keeps; the process's other threads unaffected.
The worker's engine in the view: tests/workers/test_isolation.py."""

from __future__ import annotations

import os
import socket
import subprocess
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from nnqueue import mountns

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="a mount namespace needs CAP_SYS_ADMIN (a root worker)")


def outcome(action: Callable[[], Any]) -> str:
    try:
        action()
    except OSError as error:
        return type(error).__name__
    return "done"


def connect(path: Path) -> None:
    with socket.socket(socket.AF_UNIX) as client:
        client.connect(str(path))


def write(path: Path) -> None:
    path.write_text("written")


@pytest.fixture
def listening(tmp_path: Path) -> Iterator[Callable[[Path], Path]]:
    """Listening unix sockets that anyone may connect to, at the paths asked for."""
    servers: list[socket.socket] = []

    def listen(path: Path) -> Path:
        server = socket.socket(socket.AF_UNIX)
        server.bind(str(path))
        path.chmod(0o777)
        server.listen()
        servers.append(server)
        return path

    yield listen
    for server in servers:
        server.close()


def test_the_view_holds_only_what_it_binds_with_a_private_tmp_and_no_host_socket(
    tmp_path: Path, listening: Callable[[Path], Path]
) -> None:
    shown, writable, kept = tmp_path / "shown", tmp_path / "writable", tmp_path / "sockets"
    for folder in (shown, writable, kept):
        folder.mkdir()
    (shown / "model.txt").write_text("weights")
    service = listening(shown / "service.sock")  # a host service's socket inside a bound tree
    own = listening(kept / "engine.sock")  # the engine's own (vLLM's ipc:// sockets)
    host_tmp = Path(tempfile.mkstemp(prefix="nnqueue-test-host-")[1])
    view = mountns.plan([shown], [writable, kept], home=None, sockets_kept=kept, workdir=tmp_path / "work")

    def inside() -> dict[str, Any]:
        mountns.enter(view)
        return {
            "root": sorted(os.listdir("/")),
            "read": (shown / "model.txt").read_text(),
            "write shown": outcome(lambda: write(shown / "x")),
            "write writable": outcome(lambda: write(writable / "x")),
            "write /usr": outcome(lambda: write(Path("/usr/x"))),
            "host tmp": host_tmp.exists(),
            "private tmp": sorted(os.listdir("/tmp")),
            "service": outcome(lambda: connect(service)),
            "own": outcome(lambda: connect(own)),
            "cwd": os.getcwd(),
            "sizes": [os.statvfs(folder).f_blocks * os.statvfs(folder).f_frsize for folder in mountns.PRIVATE_TMPFS],
        }

    try:
        found = mountns.in_fresh_thread(inside)
    finally:
        host_tmp.unlink()

    system = [tree.lstrip("/") for tree in mountns.SYSTEM_TREES if os.path.lexists(tree)]
    assert found["root"] == sorted(["proc", "sys", "dev", "tmp", "var", *system])
    assert found["read"] == "weights"
    assert (found["write shown"], found["write writable"], found["write /usr"]) == ("OSError", "done", "OSError")
    assert (writable / "x").read_text() == "written" and not (shown / "x").exists()
    assert found["host tmp"] is False and found["private tmp"] == [tmp_path.parts[2]]  # the way to the bound trees
    assert found["service"] == "ConnectionRefusedError" and found["own"] == "done"
    assert found["cwd"] == str(tmp_path / "work")
    page = os.sysconf("SC_PAGE_SIZE")
    memory = page * os.sysconf("SC_PHYS_PAGES")
    assert all(0 < size <= memory // 10 + page for size in found["sizes"]), (found["sizes"], memory)  # not half
    # The thread that entered it ended; this one never moved.
    assert os.getcwd() != str(tmp_path / "work") and Path("/proc/self/root").resolve() == Path("/")
    assert host_tmp.parent == Path(tempfile.gettempdir())


def _top_level_links() -> list[str]:
    """The top-level entries the view makes besides the bound ones: the system's trees that are symlinks here."""
    return [tree.lstrip("/") for tree in mountns.SYSTEM_TREES if os.path.islink(tree)]


def test_a_view_that_cannot_be_made_leaves_the_engine_on_the_hosts_filesystem_saying_why() -> None:
    broken = mountns.View(binds=(mountns.Bind("/no/such/folder", "/opt/model"),))
    assert mountns.resolve("host", broken) == (mountns.HOST, "NNQUEUE_ENGINE_FILESYSTEM=host")
    mode, why = mountns.resolve("auto", broken)
    assert mode == mountns.HOST and why is not None and "could not be made here" in why
    with pytest.raises(mountns.ViewError, match="NNQUEUE_ENGINE_FILESYSTEM=private, but"):
        mountns.resolve("private", broken)
    working = mountns.plan([], [], home=None, sockets_kept=None, workdir=Path("/"))
    assert mountns.resolve("auto", working) == (mountns.PRIVATE, None)


def test_a_view_round_trips_through_the_environment_its_children_read() -> None:
    view = mountns.plan([Path(os.__file__).parent], [], home=Path.home(), sockets_kept=None, workdir=Path("/"))
    assert mountns.View.from_json(view.to_json()) == view


def test_a_folder_only_root_may_pass_is_passable_in_the_view_and_what_is_private_in_it_stays_private(
    tmp_path: Path,
) -> None:
    """A checkout in a ``mktemp -d`` folder (mode 0700): its code must be readable by the engine user in the view;
    its .env and its data folder must not."""
    checkout = tmp_path / "checkout"
    (checkout / "data").mkdir(parents=True)
    files = {"module.py": 0o644, ".env": 0o600, "data/results.pt": 0o644}
    for name, mode in files.items():
        (checkout / name).write_text(name)
        (checkout / name).chmod(mode)
    (checkout / "data").chmod(0o700)
    checkout.chmod(0o700)
    view = mountns.plan([checkout], [], home=None, sockets_kept=None, workdir=Path("/"))

    def inside() -> dict[str, str]:
        mountns.enter(view)
        read = {
            name: subprocess.run(["cat", str(checkout / name)], user="nobody", capture_output=True) for name in files
        }
        return {name: done.stdout.decode() for name, done in read.items()}

    assert mountns.in_fresh_thread(inside) == {"module.py": "module.py", ".env": "", "data/results.pt": ""}
