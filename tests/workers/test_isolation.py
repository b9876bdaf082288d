"""Intervention code on a worker cannot reach the service's secrets, the worker, other files or the network
(nnqueue.isolation, nnqueue.seccomp_filter, nnqueue.netns), or the results it already stored
(nnqueue.workers.sinks).

The protected environment is turned off here (``NNQUEUE_PROTECTED_ENVIRONMENT=false``; the worker tests show it
on) so that the traces run arbitrary code, as a sandbox escape would: what they cannot reach is what the process
isolation alone keeps from them. A root worker's engine runs in a private filesystem view (nnqueue.mountns) where
the engine user can read Python even when it lives in root's mode-700 home (this project's machine: the
workstation layout), so it switches to that user; the assertions follow what the worker registered. The
"reach nothing" test runs in that layout and in one where the engine user can read Python on the host too (a
worker whose /root is passable). A worker run as an unprivileged user shares that user with its engine and relies
on the scrubbed environment, on being non-dumpable and on seccomp.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import os
import shutil
import socket
import stat
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import psutil
import pytest
from sqlalchemy import select

from nnqueue import isolation
from nnqueue.client import Client
from nnqueue.db.models import HarvestChunk, JobStatus
from nnqueue.embedded import ApiServer
from nnqueue.storage.results import load_result
from tests.utils.api import create_secret
from tests.utils.payloads import PROMPTS, PayloadBackend, two_invoke_payload
from tests.utils.services import Services, WorkerProcess
from tests.utils.snooping import UNPROTECTED, assert_no_secret, engine_uid, pwd_uid

if TYPE_CHECKING:
    from nnsight.modeling.vllm import VLLM

pytestmark = pytest.mark.slow  # real worker processes, one as root and one as nobody


def snooping_payload(client: VLLM, worker_pid: int, env_file: str, redis_port: int) -> bytes:
    """A trace that collects the environment, its parent's and the worker's /proc environ and memory, .env, and
    tries to signal and trace the worker, to start a program and to open a TCP connection to the broker."""
    import nnsight

    backend = PayloadBackend()
    with client.trace("Hello", temperature=0.0, max_tokens=1, backend=backend):
        import ctypes
        import os
        import socket

        def read(path: str) -> str:
            try:
                with open(path, "rb") as file:
                    return file.read(4096).decode(errors="replace")
            except OSError as error:
                return f"{type(error).__name__}: {error}"

        def attempt(action: Any) -> str:
            try:
                action()
            except OSError as error:
                return f"{type(error).__name__}: {error}"
            return "done"

        def connect() -> None:
            with socket.create_connection(("127.0.0.1", redis_port), timeout=2):
                pass

        def unix_socket() -> None:
            socket.socket(socket.AF_UNIX).close()

        def leave_cgroup() -> None:  # into the memory hierarchy's root, out of the worker's bound
            with open("/sys/fs/cgroup/memory/cgroup.procs", "w") as procs:
                procs.write(str(os.getpid()))

        libc = ctypes.CDLL(None, use_errno=True)
        found = nnsight.save(
            {
                "environ": {key: value for key, value in os.environ.items() if "NNQUEUE" in key or "AWS" in key},
                "parent": read(f"/proc/{os.getppid()}/environ"),
                "worker": read(f"/proc/{worker_pid}/environ"),
                "worker_mem": read(f"/proc/{worker_pid}/mem"),
                "env_file": read(env_file),
                "uid": os.getuid(),
                "signal_worker": attempt(lambda: os.kill(worker_pid, 0)),
                "ptrace_worker": libc.ptrace(16, worker_pid, 0, 0) == -1 and ctypes.get_errno(),  # PTRACE_ATTACH
                "exec": attempt(lambda: os.execv("/bin/true", ["true"])),
                "tcp": attempt(connect),
                "unix": attempt(unix_socket),
                "cgroup": read("/proc/self/cgroup"),
                "leave_cgroup": attempt(leave_cgroup),
            }
        )
        client.logits
    return backend.payload


def run_snoop(
    services: Services, worker: WorkerProcess, client: VLLM, model_key: str, env_file: Path
) -> dict[str, Any]:
    registered = worker.wait_registered()
    redis_port = int(services.env["NNQUEUE_BROKER_URL"].rsplit(":", 1)[1].split("/")[0])
    payload = snooping_payload(client, registered.pid, str(env_file), redis_port)
    job = services.submit(payload, owner="mallory", model_key=model_key)
    # The first job on a fresh engine also waits for the logprobs kernel built before the seccomp filter (a C
    # compiler run): slow on a loaded machine.
    try:
        finished = services.wait_for(job.id, {JobStatus.COMPLETED, JobStatus.FAILED}, timeout=400)
    except AssertionError as error:
        raise AssertionError(f"{error}\n--- worker log ---\n{worker.log()[-6000:]}") from None
    assert finished.status is JobStatus.COMPLETED, (finished.error_type, finished.error_message)
    return load_result(services.store.get_bytes(finished.result_key))["found"]


@pytest.fixture(scope="module")
def root_worker(
    services: Services, tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[WorkerProcess, Path]]:
    """A root worker without the protected environment (its builders bound to 10 s of a job's code; a fresh engine at
    each trust-domain switch), and the .env in its working directory."""
    # Settings read .env in the working directory: the worker's must not be readable by its engine.
    workdir = tmp_path_factory.mktemp("root-worker")
    env_file = workdir / ".env"
    env_file.write_text(f"NNQUEUE_S3__SECRET_ACCESS_KEY={services.env['NNQUEUE_S3__SECRET_ACCESS_KEY']}\n")
    env_file.chmod(stat.S_IRUSR | stat.S_IWUSR)
    env = {
        **UNPROTECTED,
        "NNQUEUE_TRACE_BUILDERS": "1",
        "NNQUEUE_TRACE_BUILDER_TIMEOUT_S": "10",
        "NNQUEUE_DOMAIN_SWITCH": "restart",
    }
    worker = WorkerProcess(
        services, tiny_model_path, workdir / "worker.log", env=env, cwd=workdir, model_key="tiny-root"
    )
    try:
        worker.wait_registered(timeout=600)  # a loaded machine: the engine may take minutes to start
        yield worker, env_file
    finally:
        worker.stop()


def test_a_root_workers_engine_sees_no_secret_and_cannot_reach_the_worker_or_the_network(
    services: Services, root_worker: tuple[WorkerProcess, Path], client_model: VLLM
) -> None:
    worker, env_file = root_worker
    found = run_snoop(services, worker, client_model, "tiny-root", env_file)

    assert found["uid"] == engine_uid(worker)
    if found["uid"] == 0:  # root kept: the chmod 600 .env is root's own, readable (documented; warned below)
        assert services.env["NNQUEUE_S3__SECRET_ACCESS_KEY"] in found.pop("env_file")
    assert_no_secret(found, services)
    assert "PermissionError" in found["parent"] and "PermissionError" in found["worker_mem"]
    # The seccomp filter: no signal to the worker, no ptrace, no exec, no TCP socket (the engine hands its results
    # to the worker through files); unix sockets still work.
    assert found["signal_worker"].startswith("PermissionError"), found["signal_worker"]
    assert found["ptrace_worker"] == errno.EPERM
    assert found["exec"].startswith("PermissionError"), found
    assert found["tcp"].startswith("PermissionError"), found["tcp"]
    assert found["unix"] == "done"
    containment = worker.wait_registered().containment
    assert containment is not None and containment["seccomp"] == "applied", containment
    assert containment["network"] == "a network namespace of its own (loopback only)", containment
    # The engine's memory is bounded by the worker's cgroup, which it cannot leave.
    assert containment["memory"].startswith("at most "), containment
    assert f"/nnqueue-engine-{worker.wait_registered().pid}\n" in found["cgroup"], found["cgroup"]
    assert found["leave_cgroup"].startswith(("PermissionError", "OSError")), found["leave_cgroup"]
    if found["uid"] != 0:  # a root-owned chmod 600 file is out of the engine user's reach (here, out of its view)
        assert found["env_file"].startswith(("PermissionError", "FileNotFoundError")), found["env_file"]
    else:
        assert ".env holds settings and the engine processes run as this same user" in worker.log()
    assert "secret variables from the engine's environment" in worker.log()
    assert "engine isolation:" in worker.log()


def test_trace_level_code_of_a_raw_payload_runs_without_the_workers_secrets(
    services: Services, root_worker: tuple[WorkerProcess, Path], client_model: VLLM
) -> None:
    import nnsight

    backend = PayloadBackend()
    with client_model.trace(temperature=0.0, max_tokens=1, backend=backend) as tracer:
        # Trace-level code: rebuilt (run) by the worker's builder process, not the engine. (Opened, not
        # os.access'ed: /proc checks ptrace access on open, which access() does not.)
        parent_readable = False
        try:
            with open(f"/proc/{os.getppid()}/environ", "rb") as parent_environ:
                parent_readable = parent_environ.read(1) is not None
        except OSError:
            pass
        seen = nnsight.save(
            {
                "environ": {name: value for name, value in os.environ.items() if name.startswith(("NNQUEUE", "AWS_"))},
                "uid": os.getuid(),
                "parent_readable": parent_readable,
            }
        )
        with tracer.invoke(PROMPTS[0]):
            names = seen
            logits = client_model.logits.save()
    job = services.submit(backend.payload, owner="mallory", model_key="tiny-root")
    done = services.wait_for(job.id, {JobStatus.COMPLETED, JobStatus.FAILED})
    assert done.status is JobStatus.COMPLETED, (done.error_type, done.error_message)
    seen = load_result(services.store.get_bytes(done.result_key))["seen"]

    assert "NNQUEUE_ENGINE_STALL_TIMEOUT_S" in seen["environ"]  # the environment was read
    assert_no_secret(seen, services)
    assert seen["uid"] == engine_uid(root_worker[0]) and not seen["parent_readable"]


def test_top_level_code_that_outruns_the_builders_bound_fails_its_job_saying_so(
    services: Services, root_worker: tuple[WorkerProcess, Path], client_model: VLLM
) -> None:
    backend = PayloadBackend()
    with client_model.trace(temperature=0.0, max_tokens=1, backend=backend) as tracer:
        time.sleep(600)  # trace-level code, in the builder, while the engine is held for this job's domain
        with tracer.invoke(PROMPTS[0]):
            logits = client_model.logits.save()
    slow = services.submit(backend.payload, model_key="tiny-root")
    slow = services.wait_for(slow.id, {JobStatus.FAILED, JobStatus.COMPLETED}, timeout=300)
    assert slow.error_type == "TraceBuilderTimedOut", (slow.error_type, slow.error_message)
    assert "ran 10 s without answering while rebuilding this trace" in slow.error_message
    assert "NNQUEUE_TRACE_BUILDER_TIMEOUT_S" in slow.error_message
    assert slow.started_at is not None and slow.finished_at is not None
    assert (slow.finished_at - slow.started_at).total_seconds() < 120  # not the job's 600 s timeout


def test_a_builder_that_dies_fails_only_its_job_and_is_replaced(
    services: Services, root_worker: tuple[WorkerProcess, Path], client_model: VLLM
) -> None:
    backend = PayloadBackend()
    with client_model.trace(temperature=0.0, max_tokens=1, backend=backend) as tracer:
        os._exit(3)  # trace-level code: it runs where the raw payload is rebuilt, in a builder process
        with tracer.invoke(PROMPTS[0]):
            logits = client_model.logits.save()
    crashed = services.submit(backend.payload, model_key="tiny-root")
    crashed = services.wait_for(crashed.id, {JobStatus.FAILED, JobStatus.COMPLETED})
    # The exit code it reports is 255 here, not the 3 the code asked for (under investigation; see the report).
    assert crashed.error_type == "TraceBuilderCrashed" and "died while rebuilding this trace" in crashed.error_message
    after = services.submit(two_invoke_payload(client_model, raw=True), model_key="tiny-root")
    assert services.wait_for(after.id, {JobStatus.FAILED, JobStatus.COMPLETED}).status is JobStatus.COMPLETED


# What a trace tries from the engine (exec'd there: the same code at trace level in the builder and inside an
# invoke in the engine core): read files and processes' memory, connect to unix sockets, write files; and which
# of its threads still run as root or hold a capability.
REACH = """
import os, socket

def outcome(action):
    try:
        action()
    except OSError as error:
        return type(error).__name__
    return "done"

def read(path):
    with open(path, "rb") as file:
        file.read(1)

def connect(path):
    with socket.socket(socket.AF_UNIX) as client:
        client.settimeout(3)
        client.connect(path)

def write(path):
    with open(path, "wb") as file:
        file.write(b"escaped")

def privileged():
    held = []
    for task in os.listdir("/proc/self/task"):
        lines = open(f"/proc/self/task/{task}/status").read().splitlines()
        status = dict(line.split(":", 1) for line in lines)
        caps = [name for name in ("CapEff", "CapPrm", "CapAmb") if int(status[name], 16)]
        if "0" in status["Uid"].split() or caps:
            held.append(task)
    return held

def same_user():  # every other process of this user: the engine's and builders' of every domain, other engines
    found = []
    for name in os.listdir("/proc"):
        try:
            lines = open(f"/proc/{name}/status").read().splitlines() if name.isdigit() else []
        except OSError:
            continue
        status = dict(line.split(":", 1) for line in lines)
        if lines and int(name) != os.getpid() and str(os.getuid()) in status["Uid"].split():
            found.append(int(name))
    return found

def parent():
    lines = open(f"/proc/{os.getppid()}/status").read().splitlines()
    status = dict(line.split(":", 1) for line in lines)
    return {"uids": status["Uid"].split(), "caps": [status[name].strip() for name in ("CapEff", "CapPrm")]}

found = {
    "uid": os.getuid(),
    "privileged_threads": privileged(),
    "parent": parent(),
    "reads": {path: outcome(lambda path=path: read(path)) for path in targets["reads"]},
    "sockets": {path: outcome(lambda path=path: connect(path)) for path in targets["sockets"]},
    "writes": {path: outcome(lambda path=path: write(path)) for path in targets["writes"]},
    "signals": {pid: outcome(lambda pid=pid: os.kill(pid, 0)) for pid in same_user()},
}
"""


def postgres_paths(services: Services) -> list[Path]:
    """The suite's Postgres server's data file and unix socket, found from its process (none for an outside one)."""
    port = str(urlsplit(services.env["NNQUEUE_DATABASE_URL"]).port)
    for process in psutil.process_iter(["cmdline"]):
        argv = process.info["cmdline"] or []
        if "-D" in argv and "-p" in argv and argv[argv.index("-p") + 1] == port:
            data = Path(argv[argv.index("-D") + 1])
            return [data / "PG_VERSION", data.parent / f".s.PGSQL.{port}"]
    return []


@pytest.fixture(scope="module")
def readable_python_worker(
    services: Services, tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[WorkerProcess]:
    """A root worker in a mount namespace where /root is passable (mode 0755, only its Python and caches in it): the
    layout where the engine user can read this Python on the host too (a Python under /opt or /usr). Its engine
    has two pipeline stages (vLLM's mp executor, as with tensor parallelism): users' code runs in the model-runner
    workers, children of an engine core process that must hold no more than they do."""
    layout = (
        'set -e; stage=$(mktemp -d); mount --bind /root "$stage"; mount -t tmpfs -o mode=0755 tmpfs /root;'
        ' for name in .pyenv .cache; do if [ -e "$stage/$name" ]; then mkdir -p "/root/$name";'
        ' mount --rbind "$stage/$name" "/root/$name"; fi; done; umount -l "$stage"; rmdir "$stage"; exec "$@"'
    )
    wrapper = ["unshare", "--mount", "--propagation", "private", "sh", "-c", layout, "sh"]
    workdir = tmp_path_factory.mktemp("readable-python-worker")
    # vLLM's CPU workers pin their OpenMP threads: one core per stage.
    env = {**UNPROTECTED, "NNQUEUE_TRACE_BUILDERS": "1", "VLLM_CPU_OMP_THREADS_BIND": "0|1"}
    worker = WorkerProcess(
        services,
        tiny_model_path,
        workdir / "worker.log",
        env=env,
        cwd=workdir,
        model_key="tiny-readable",
        wrapper=wrapper,
        engine_args=["--pipeline-parallel-size", "2"],
    )
    try:
        worker.wait_registered(timeout=600)
        yield worker
    finally:
        worker.stop()


@pytest.mark.skipif(os.geteuid() != 0, reason="the engine user and the filesystem view need a root worker")
@pytest.mark.parametrize("layout", ["workstation", "readable-python"])
def test_a_trace_without_the_protected_environment_reaches_nothing_outside_the_engine(
    services: Services,
    client_model: VLLM,
    tiny_model_path: Path,
    tmp_path: Path,
    request: pytest.FixtureRequest,
    layout: str,
) -> None:
    import nnsight

    if layout == "workstation":
        worker, _ = request.getfixturevalue("root_worker")
        model_key = "tiny-root"
    else:
        worker, model_key = request.getfixturevalue("readable_python_worker"), "tiny-readable"
    registered = worker.wait_registered()
    assert registered.containment is not None and registered.containment["isolation"] == "full", registered.containment

    token = uuid.uuid4().hex
    outside, beside_model = tmp_path / "root-only.txt", tiny_model_path / f"root-only-{token}.txt"
    for secret_file in (outside, beside_model):  # beside the model: inside the engine's view
        secret_file.write_text(token)
        secret_file.chmod(0o600)
    listener = socket.socket(socket.AF_UNIX)  # a local service's socket that anyone may connect to
    listening = Path(f"/tmp/nnqueue-test-{token}.sock")
    listener.bind(str(listening))
    listening.chmod(0o777)
    listener.listen()
    root_process = subprocess.Popen(["sleep", "600"])  # a root process that is not non-dumpable
    postgres = postgres_paths(services)
    written = [
        Path(sys.prefix, f"escaped-{token}"),  # the virtualenv
        Path(isolation.__file__).parent / f"escaped-{token}.py",  # the project's source
        Path(f"/etc/cron.d/escaped-{token}"),
        Path(f"/tmp/escaped-{token}"),  # the host's /tmp
        Path.home() / f"escaped-{token}",
        tiny_model_path / f"escaped-{token}",
        worker.log_path.parent / f"escaped-{token}",  # the worker's working folder
    ]
    targets = {
        "reads": [
            str(outside),
            str(beside_model),
            *(str(path) for path in postgres[:1]),
            *(f"/proc/{pid}/{part}" for pid in (registered.pid, root_process.pid) for part in ("mem", "environ")),
        ],
        "sockets": [str(listening), *(str(path) for path in postgres[1:]), *glob.glob("/tmp/seaweedfs-*.sock")],
        "writes": [str(path) for path in written],
    }
    backend = PayloadBackend()
    try:
        with client_model.trace(temperature=0.0, max_tokens=1, backend=backend) as tracer:
            scope = {"targets": targets}
            exec(REACH, scope)  # trace-level code: in the builder process
            from_builder = nnsight.save(scope["found"])
            with tracer.invoke(PROMPTS[0]):
                seen_by_builder = from_builder
                scope = {"targets": targets}
                exec(REACH, scope)  # in the engine core
                from_engine = nnsight.save(scope["found"])
                client_model.logits
        job = services.submit(backend.payload, owner="mallory", model_key=model_key)
        done = services.wait_for(job.id, {JobStatus.COMPLETED, JobStatus.FAILED}, timeout=400)
        assert done.status is JobStatus.COMPLETED, (done.error_type, done.error_message)
        saves = load_result(services.store.get_bytes(done.result_key))
        with socket.socket(socket.AF_UNIX) as control:  # the socket itself is reachable, from here
            control.connect(str(listening))
        escaped = [str(path) for path in written if path.exists()]
    finally:
        root_process.kill()
        root_process.wait()
        listener.close()
        listening.unlink()
        for path in [outside, beside_model, *written]:
            path.unlink(missing_ok=True)

    assert escaped == []  # nothing it wrote reached the host (a write into its private /tmp may "succeed")
    engine_uid = str(pwd_uid(isolation.DEFAULT_ENGINE_USER))
    if layout == "readable-python":  # a pipeline stage's parent: the engine core, switched too
        assert saves["from_engine"]["parent"] == {"uids": [engine_uid] * 4, "caps": ["0" * 16] * 2}, saves
    for where in ("from_builder", "from_engine"):
        found = saves[where]
        assert found["uid"] == int(engine_uid) and found["privileged_threads"] == [], found
        assert len(found["reads"]) == 6 + len(postgres[:1])
        assert all(outcome != "done" for outcome in found["reads"].values()), (where, found["reads"])
        assert all(outcome != "done" for outcome in found["sockets"].values()), (where, found["sockets"])
        assert set(found["writes"]) == set(targets["writes"]), found["writes"]
        # none may signal (stop, kill) another process of the engine user
        assert set(found["signals"].values()) <= {"PermissionError"}, (where, found["signals"])
    # the engine sees the builder that built its trace (a fresh engine core is still root until its first step, so
    # the builder may see no other process of its user)
    assert saves["from_engine"]["signals"], saves["from_engine"]


def service_addresses(services: Services) -> dict[str, tuple[str, int]]:
    """Where the suite's Postgres, Redis and S3 listen (TCP)."""
    urls = {
        "postgres": services.env["NNQUEUE_DATABASE_URL"],
        "redis": services.env["NNQUEUE_BROKER_URL"],
        "s3": services.env["NNQUEUE_S3__ENDPOINT_URL"],
    }
    return {name: (urlsplit(url).hostname or "", urlsplit(url).port or 0) for name, url in urls.items()}


def test_a_trace_cannot_reach_the_services_while_its_job_completes(
    services: Services, root_worker: tuple[WorkerProcess, Path], client_model: VLLM
) -> None:
    import nnsight

    worker, _ = root_worker
    addresses = service_addresses(services)
    backend = PayloadBackend()
    with client_model.trace(temperature=0.0, max_tokens=1, backend=backend) as tracer:
        # Trace-level code runs in the builder process; the invoke's in the engine core.
        import socket

        reached = {}
        for name, address in addresses.items():
            try:
                socket.create_connection(address, timeout=3).close()
                reached[name] = "connected"
            except OSError as error:
                reached[name] = f"{type(error).__name__}: {error}"
        from_builder = nnsight.save(reached)
        with tracer.invoke(PROMPTS[0]):
            seen_by_builder = from_builder  # a trace-level save reaches the result through an invoke
            import socket

            reached = {}
            for name, address in addresses.items():
                try:
                    socket.create_connection(address, timeout=3).close()
                    reached[name] = "connected"
                except OSError as error:
                    reached[name] = f"{type(error).__name__}: {error}"
            from_engine = nnsight.save(reached)
            logits = client_model.logits.save()
    job = services.submit(backend.payload, owner="mallory", model_key="tiny-root")
    done = services.wait_for(job.id, {JobStatus.COMPLETED, JobStatus.FAILED})
    assert done.status is JobStatus.COMPLETED, (done.error_type, done.error_message)
    saves = load_result(services.store.get_bytes(done.result_key))

    for where in ("from_builder", "from_engine"):
        assert set(saves[where]) == {"postgres", "redis", "s3"}
        for name, outcome in saves[where].items():
            assert outcome != "connected" and "timed out" not in outcome, (where, name, outcome)
    assert saves["logits"].shape[-1] > 0  # the model ran as usual
    assert "the engine's processes use a network namespace of its own (loopback only)" in worker.log()


def test_the_engine_cannot_replace_a_finished_jobs_result(
    services: Services, root_worker: tuple[WorkerProcess, Path], client_model: VLLM
) -> None:
    import nnsight

    victim = services.submit(two_invoke_payload(client_model), owner="bob", model_key="tiny-root")
    victim = services.wait_for(victim.id, {JobStatus.COMPLETED, JobStatus.FAILED})
    assert victim.status is JobStatus.COMPLETED and victim.result_key is not None
    original = services.store.get_bytes(victim.result_key)
    assert victim.result_sha256 == hashlib.sha256(original).hexdigest() and victim.result_size == len(original)

    # Everything the engine ever held of bob's result: the files it left in the worker's handoff directories.
    names = [f"{victim.id}-{victim.attempts}-saves.pt", f"{victim.id}-{victim.attempts}-saves.safetensors"]
    backend = PayloadBackend()
    with client_model.trace("Hello", temperature=0.0, max_tokens=1, backend=backend):
        tried = []
        for folder in glob.glob("/tmp/nnqueue-handoff-*"):
            for name in names:
                try:
                    with open(os.path.join(folder, name), "wb") as forged:
                        forged.write(b"\0" * 64)
                    tried.append(name)
                except OSError:
                    pass
        tried = nnsight.save(tried)
        client_model.logits
    job = services.submit(backend.payload, owner="mallory", model_key="tiny-root")
    done = services.wait_for(job.id, {JobStatus.COMPLETED, JobStatus.FAILED})
    assert done.status is JobStatus.COMPLETED, (done.error_type, done.error_message)
    assert load_result(services.store.get_bytes(done.result_key))["tried"]  # it did write those files

    assert services.store.get_bytes(victim.result_key) == original  # what was committed is the worker's copy


def leaving_payload(client: VLLM, token: str | None) -> bytes:
    """A trace whose code, in the engine, saves what a library module that no guard watches holds and the engine's
    pid, then leaves ``token`` there (None: leaves nothing)."""
    import nnsight

    backend = PayloadBackend()
    with client.trace("Hello", temperature=0.0, max_tokens=1, backend=backend):
        import colorsys

        found = nnsight.save({"left": getattr(colorsys, "nnqueue_left", None), "pid": os.getpid()})
        if token is not None:
            colorsys.nnqueue_left = token
        client.logits
    return backend.payload


def test_a_domain_switch_starts_a_fresh_engine_so_what_a_domain_left_in_it_reaches_no_other(
    services: Services, root_worker: tuple[WorkerProcess, Path], client_model: VLLM, api_server: ApiServer
) -> None:
    """``NNQUEUE_DOMAIN_SWITCH=restart``: what a domain's code left in the engine's process, seen by no guard (as an
    escape could), stays with that process; another owner's work, a steering job too (a fifth red-team round's
    escaped trace read and forged one beside it), runs in a fresh one."""
    worker, _ = root_worker
    token = uuid.uuid4().hex

    def run(owner: str, leave: str | None) -> dict[str, Any]:
        job = services.submit(leaving_payload(client_model, leave), owner=owner, model_key="tiny-root")
        done = services.wait_for(job.id, {JobStatus.COMPLETED, JobStatus.FAILED}, timeout=400)
        assert done.status is JobStatus.COMPLETED, (done.error_type, done.error_message)
        found: dict[str, Any] = load_result(services.store.get_bytes(done.result_key))["found"]
        return found

    planted, again = run("mallory", token), run("mallory", None)
    assert again == {"left": token, "pid": planted["pid"]}  # it stays in the process: within a domain, no restart
    steering = {
        "model_key": "tiny-root",
        "dataset": {"token_ids": [[5, 17, 42]]},
        "sampling": {"max_tokens": 2},
        "edits": [{"module": "model.layers.0", "op": "scale", "coefficient": 1.0}],
    }
    harvest = {
        "model_key": "tiny-root",
        "dataset": {"prompts": ["one", "two", "three", "four"]},
        "captures": [{"module": "model.layers.1"}],
        "prompts_per_chunk": 1,
    }
    with Client(api_server.url, create_secret(services.sessions, "sam", ("harvest",))) as client:
        client.steer(steering).wait(timeout=400)
        assert "replacing the engine (a switch from trust domain 'owner:mallory' to 'owner:sam')" in worker.log()
        other = run("alice", None)  # on the engine sam's job left: it ran no trace, so no other restart
        assert other["left"] is None and other["pid"] != planted["pid"], other
        # Sam's harvest beside mallory's traces: its chunks run in turns with them, none handed back by a switch.
        started = client.harvest(harvest)
        traces = [services.submit(leaving_payload(client_model, None), owner="mallory", model_key="tiny-root")]
        assert started.wait(timeout=400, progress=False).status == "completed"
    assert services.wait_for(traces[0].id, {JobStatus.COMPLETED}, timeout=400)
    with services.sessions() as session:
        chunks = session.scalars(select(HarvestChunk).where(HarvestChunk.harvest_id == uuid.UUID(started.id))).all()
    assert [chunk.attempts for chunk in chunks] == [1, 1, 1, 1]


def runs_as(user: str) -> bool:
    """Whether ``user`` can run this interpreter (not when it lives in root's home, mode 0700)."""
    try:
        return subprocess.run([sys.executable, "-c", "pass"], user=user, check=False).returncode == 0
    except PermissionError:
        return False


@pytest.mark.skipif(not runs_as("nobody"), reason="nobody cannot run this Python (it lives in a private directory)")
def test_an_unprivileged_workers_engine_sees_no_secret(
    services: Services,
    start_worker: Callable[..., WorkerProcess],
    client_model: VLLM,
    tiny_model_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    # The worker runs as nobody, so everything it reads must be readable by nobody.
    home = tmp_path_factory.mktemp("nobody-home")
    shutil.copytree(tiny_model_path, home / "model")
    env_file = home / ".env"
    env_file.write_text("NNQUEUE_WORKER_HEARTBEAT_S=0.5\n")
    uid = pwd_uid("nobody")
    for path in [home, *home.rglob("*")]:
        os.chown(path, uid, uid)
    home.chmod(0o755)
    for parent in home.parents:
        if parent.stat().st_mode & stat.S_IXOTH == 0:
            parent.chmod(parent.stat().st_mode | stat.S_IXOTH)
    worker = start_worker(
        # Its engine keeps the worker's user: isolation degraded, so it runs its operator's traces alone.
        env={**UNPROTECTED, "HOME": str(home), "NNQUEUE_OPERATOR_OWNERS": "mallory"},
        cwd=home,
        user="nobody",
        model_key="tiny-nobody",
        model_path=home / "model",
    )

    found = run_snoop(services, worker, client_model, "tiny-nobody", env_file)

    assert_no_secret(found, services)
    assert found["uid"] == uid
    # Same user, but the worker is non-dumpable: its /proc environ is the kernel's to refuse.
    assert "PermissionError" in found["parent"] and "PermissionError" in found["worker"]
    # A .env the engine's user can read is only warned about: it shares the worker's user.
    assert "can read it" in worker.log()


def wait_exit(worker: WorkerProcess, timeout: float = 300) -> int:
    try:
        return worker.process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        worker.stop()
        raise AssertionError(f"the worker did not exit:\n{worker.log()[-5000:]}") from None


def python_reachable_by(account: isolation.EngineUser) -> bool:
    return isolation.blocked_at(Path(os.path.realpath(sys.executable)), account) is None


@pytest.mark.skipif(os.geteuid() != 0, reason="the engine user is switched to only by a root worker")
def test_a_worker_refuses_to_start_when_another_process_runs_as_its_engine_user(
    services: Services, tiny_model_path: Path, tmp_path: Path, spare_engine_account: isolation.EngineUser
) -> None:
    account = spare_engine_account  # the squatter on the workers' own would stop the other test process's workers
    squatter = subprocess.Popen(["sleep", "300"], user=account.uid, group=account.gid, extra_groups=[])
    try:
        env = {"NNQUEUE_ENGINE_USER": account.name}
        worker = WorkerProcess(services, tiny_model_path, tmp_path / "worker.log", env=env, model_key="tiny-squatted")
        code = wait_exit(worker)
    finally:
        squatter.kill()
        squatter.wait()
    log = worker.log()
    assert code == 2, log[-5000:]  # a configuration error: its supervisor did not start it again
    assert f"other processes already run as the engine user '{account.name}' (uid {account.uid}): {squatter.pid}" in log
    assert "leave NNQUEUE_ENGINE_USER unset" in log and log.count("Traceback") == 0


@pytest.mark.skipif(os.geteuid() != 0, reason="the engine user is switched to only by a root worker")
def test_a_worker_that_requires_the_engine_user_refuses_to_start_saying_what_to_change(
    services: Services, tiny_model_path: Path, tmp_path: Path
) -> None:
    account = isolation.ensure_account(isolation.DEFAULT_ENGINE_USER)
    if python_reachable_by(account):
        pytest.skip(
            "this machine's Python is readable by the engine user: nothing to refuse (see tests/test_isolation.py)"
        )
    # On the host's filesystem: in the engine's own view this Python is readable and the switch happens.
    env = {"NNQUEUE_ENGINE_USER_REQUIRED": "true", "NNQUEUE_ENGINE_FILESYSTEM": "host"}
    worker = WorkerProcess(services, tiny_model_path, tmp_path / "worker.log", env=env, model_key="tiny-required")
    code = wait_exit(worker)
    log = worker.log()
    assert code == 2, log[-5000:]
    blocker = isolation.blocked_at(Path(os.path.realpath(sys.executable)), account)
    assert "NNQUEUE_ENGINE_USER_REQUIRED is true and the engine user 'nnqueue-engine' cannot use this Python" in log
    assert f"{blocker} (mode" in log and f"chmod o+x {blocker}" in log
