"""nnqueue.isolation: what the engine user can read, the start-up probe and the decision it makes, the dedicated
account, and what a process that switched can no longer reach (the worker's processes themselves:
tests/workers/test_isolation.py)."""

from __future__ import annotations

import json
import os
import pwd
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from nnqueue import isolation
from nnqueue.isolation import (
    DEFAULT_ENGINE_USER,
    EngineUser,
    EngineUserError,
    foreign_processes,
    lasting_foreign_processes,
    plan_containment,
    probe,
    unreadable_by,
)

STRANGER = EngineUser("stranger", 54321, 54321)  # owns nothing here, in no group of these files


def test_a_folder_is_unreadable_when_a_folder_above_it_cannot_be_searched(reachable: Path) -> None:
    private, public = reachable / "home", reachable / "opt"
    (private / "lib").mkdir(parents=True)
    (public / "lib").mkdir(parents=True)
    for folder in (reachable, private / "lib", public, public / "lib"):
        folder.chmod(0o755)
    private.chmod(0o700)  # root's home

    assert unreadable_by(STRANGER, [private / "lib", public / "lib"]) == [private / "lib"]


def test_a_folder_its_owner_or_group_may_read_is_readable(reachable: Path) -> None:
    folder = reachable / "lib"
    folder.mkdir()
    info = folder.stat()
    folder.chmod(0o750)
    assert unreadable_by(STRANGER, [folder]) == [folder]
    assert unreadable_by(EngineUser("group", 54321, info.st_gid), [folder]) == []
    folder.chmod(0o700)
    assert unreadable_by(EngineUser("owner", info.st_uid, 54321), [folder]) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="dropping privileges needs root")
def test_a_kernel_compiled_after_the_drop_has_writable_caches() -> None:
    """Triton fixes its default cache folder (root's ``~/.triton``) when imported, and torch's inductor writes
    its cache folders into the environment when first used (``/tmp/torchinductor_root``, and
    ``TRITON_CACHE_DIR`` under it per device), both maybe before the drop: the engine user must still be
    able to create what a new kernel writes, or it kills the engine (seen on the H100 and on 2x H200)."""
    pytest.importorskip("triton")
    script = textwrap.dedent(
        """
        import os, triton.knobs
        from torch._inductor.runtime.cache_dir_utils import cache_dir, triton_cache_dir
        from nnqueue.isolation import drop_privileges, engine_user
        os.environ["TRITON_CACHE_DIR"] = triton_cache_dir(1)  # what inductor's autotuner does, as root
        assert drop_privileges(engine_user("nobody"))
        for folder in (os.path.join(triton.knobs.cache.dir, "kernel"), os.path.join(cache_dir(), "kernel")):
            os.makedirs(folder)
            print(folder)
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    for folder in done.stdout.split():
        assert not folder.startswith((os.path.expanduser("~"), "/tmp/torchinductor_root")), folder


# -- the engine user's probe, the decision, the account ---------------------------------------------------

needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="running processes as another user needs root")
SYSTEM_PYTHON = "/usr/bin/python3"  # Debian's, readable by every user (its headers: python3-dev)


@pytest.fixture
def engine_account(spare_engine_account: EngineUser) -> EngineUser:
    """Not the workers' account (tests/conftest.py says why): this file runs squatters and probes as it."""
    return spare_engine_account


@pytest.fixture
def hidden_python(reachable: Path) -> Path:
    """A copy of the system Python in a folder only root may enter, as a Python in root's mode-700 home is."""
    home = reachable / "root-home"
    (home / "bin").mkdir(parents=True)
    python = home / "bin" / "python3"
    shutil.copy2(os.path.realpath(SYSTEM_PYTHON), python)
    home.chmod(0o700)
    return python


@needs_root
@pytest.mark.skipif(not Path(SYSTEM_PYTHON).exists(), reason="no system Python to probe with")
def test_the_probe_names_what_the_engine_user_cannot_import_or_read(
    engine_account: EngineUser, reachable: Path
) -> None:
    secret = reachable / "private" / "secret.txt"
    secret.parent.mkdir()
    secret.write_text("root only")
    secret.parent.chmod(0o700)

    passed = probe(engine_account, ["json", "symtable"], [], python=SYSTEM_PYTHON)
    assert passed.problems == []
    assert any(name.endswith("/symtable.py") for name in passed.read)  # what it read, for nnqueue.probe_memo
    problems = probe(engine_account, ["json", "no_such_module_here"], [secret], python=SYSTEM_PYTHON).problems
    assert len(problems) == 2
    assert problems[0].startswith("import no_such_module_here: ModuleNotFoundError")
    assert problems[1] == f"read {secret}: Permission denied"


@needs_root
@pytest.mark.skipif(not Path(SYSTEM_PYTHON).exists(), reason="no system Python to probe with")
def test_a_relative_python_path_is_anchored_where_the_worker_found_its_modules(
    engine_account: EngineUser, reachable: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # PYTHONPATH=. from a checkout: the probe (and the engine) start elsewhere, where "." is another folder.
    (reachable / "checkout").mkdir()
    (reachable / "checkout" / "nnqueue_probe_target.py").write_text("")
    monkeypatch.chdir(reachable)
    monkeypatch.setenv("PYTHONPATH", f"checkout{os.pathsep}/usr/lib")
    missed = probe(engine_account, ["nnqueue_probe_target"], [], python=SYSTEM_PYTHON).problems
    assert [problem.split(":")[0] for problem in missed] == ["import nnqueue_probe_target"]
    isolation.anchor_python_path()
    assert os.environ["PYTHONPATH"] == f"{reachable / 'checkout'}{os.pathsep}/usr/lib"
    assert probe(engine_account, ["nnqueue_probe_target"], [], python=SYSTEM_PYTHON).problems == []


@needs_root
def test_an_engine_user_that_cannot_reach_python_keeps_the_engine_root_or_refuses_saying_what_to_change(
    engine_account: EngineUser, hidden_python: Path
) -> None:
    kept = plan_containment(engine_account.name, False, None, ["json"], python=str(hidden_python))
    assert kept.engine_user is None and kept.report()["engine_user"] == "kept root"
    home = hidden_python.parent.parent
    assert "engine processes keep root" in kept.note and "Permission denied" in kept.note
    assert f"{home} (mode 0700, owner root) keeps it from {hidden_python}" in kept.note
    assert f"chmod o+x {home}" in kept.note and "outside /root" in kept.note

    with pytest.raises(EngineUserError, match="NNQUEUE_ENGINE_USER_REQUIRED is true") as refused:
        plan_containment(engine_account.name, True, None, ["json"], python=str(hidden_python))
    assert f"chmod o+x {home}" in str(refused.value)


@needs_root
@pytest.mark.skipif(not Path(SYSTEM_PYTHON).exists(), reason="no system Python to probe with")
def test_an_engine_user_that_can_use_python_is_switched_to(engine_account: EngineUser) -> None:
    account = engine_account.name
    switched = plan_containment(account, True, "seccomp filter unavailable: test", ["json"], SYSTEM_PYTHON)
    assert switched.engine_user == account
    report = switched.report()
    assert {name: report[name] for name in ("engine_user", "note", "seccomp")} == {
        "engine_user": account,
        "note": f"engine processes switch to {account!r} once they are up",
        "seccomp": "seccomp filter unavailable: test",
    }


@needs_root
def test_an_engine_user_that_another_process_runs_as_is_refused(
    engine_account: EngineUser, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(isolation, "STRANGERS_GRACE_S", 0.5)
    squatter = subprocess.Popen(["sleep", "60"], user=engine_account.uid, group=engine_account.gid, extra_groups=[])
    try:
        assert any(entry.startswith(f"{squatter.pid} (sleep 60") for entry in foreign_processes(engine_account))
        with pytest.raises(EngineUserError, match="other processes already run as the engine user") as refused:
            plan_containment(engine_account.name, False, None, ["json"], SYSTEM_PYTHON)
        assert str(squatter.pid) in str(refused.value)
    finally:
        squatter.kill()
        squatter.wait()
    assert not any(entry.startswith(f"{squatter.pid} ") for entry in foreign_processes(engine_account))


@needs_root
def test_processes_of_the_account_that_are_exiting_or_ended_are_not_strangers(engine_account: EngineUser) -> None:
    """A killed worker's engine processes take a moment to exit (the failure that kept ``pytest -n 2`` from being
    the default): a starting worker waits for them, and a process that has ended (a zombie) is nobody."""
    as_account = {"user": engine_account.uid, "group": engine_account.gid, "extra_groups": []}
    ended = subprocess.Popen(["true"], **as_account)  # not waited for: a zombie until the end of this test
    staying = subprocess.Popen(["sleep", "60"], **as_account)
    while psutil.Process(ended.pid).status() != psutil.STATUS_ZOMBIE:
        time.sleep(0.05)
    exiting = subprocess.Popen(["sleep", "2"], **as_account)
    try:
        listed = {entry.split(" ", 1)[0] for entry in foreign_processes(engine_account)}
        assert str(ended.pid) not in listed and {str(exiting.pid), str(staying.pid)} <= listed
        started = time.monotonic()
        lasting = lasting_foreign_processes(engine_account, grace=3)
        waited = time.monotonic() - started
    finally:
        for process in (ended, exiting, staying):
            process.kill()
            process.wait()
    assert [entry.split(" ", 1)[0] for entry in lasting] == [str(staying.pid)]
    assert 2.9 < waited < 10  # it waited its grace for the one that stayed


@needs_root
def test_a_serving_workers_engine_processes_are_not_taken_for_other_users_of_the_account(
    engine_account: EngineUser,
) -> None:
    """Once a worker serves, its title is Celery's, not ``nnqueue worker``: its engine and builder processes are
    told apart by the worker their environment names, up the line of its processes (a second worker on the host
    must not refuse to start)."""
    named = {"ours": str(os.getpid()), "theirs": "1"}  # this process stands in for the worker
    started = {
        who: subprocess.Popen(
            ["sleep", "60"],
            user=engine_account.uid,
            group=engine_account.gid,
            extra_groups=[],
            env={**os.environ, "NNQUEUE_ENGINE_SANDBOX": worker},
        )
        for who, worker in named.items()
    }
    # A builder is the child of the worker's zygote (root, unsandboxed: nnqueue.enginecore.zygote), which names the
    # worker too; a zygote of another worker's does not make its children ours.
    zygote = "import subprocess, sys; subprocess.run(['sleep', '60'], user=int(sys.argv[1]), group=int(sys.argv[2]))"
    zygotes = {
        who: subprocess.Popen(
            [sys.executable, "-c", zygote, str(engine_account.uid), str(engine_account.gid)],
            env={**os.environ, "NNQUEUE_ENGINE_SANDBOX": worker},
        )
        for who, worker in named.items()
    }
    # An engine core is the child of the zygote's core server (root, the zygote's child: nnqueue.enginecore.core_forks).
    server = "import subprocess, sys; subprocess.run([sys.executable, '-c', *sys.argv[1:]])"
    servers = {
        who: subprocess.Popen(
            [sys.executable, "-c", server, zygote, str(engine_account.uid), str(engine_account.gid)],
            env={**os.environ, "NNQUEUE_ENGINE_SANDBOX": worker},
        )
        for who, worker in named.items()
    }
    try:
        builders = {who: wait_for_child(process.pid) for who, process in zygotes.items()}
        cores = {who: wait_for_child(wait_for_child(process.pid)) for who, process in servers.items()}
        foreign = {entry.split(" ", 1)[0] for entry in foreign_processes(engine_account)}
    finally:
        for process in [*started.values(), *zygotes.values(), *servers.values()]:
            for child in psutil.Process(process.pid).children(recursive=True):
                child.kill()
            process.kill()
            process.wait()
    assert str(started["ours"].pid) not in foreign and str(started["theirs"].pid) in foreign
    assert str(builders["ours"]) not in foreign and str(builders["theirs"]) in foreign
    assert str(cores["ours"]) not in foreign and str(cores["theirs"]) in foreign


def wait_for_child(pid: int) -> int:
    """The pid of ``pid``'s first child, once it has one."""
    deadline = time.monotonic() + 30
    while not (children := psutil.Process(pid).children()):
        assert time.monotonic() < deadline, f"process {pid} started no child"
        time.sleep(0.05)
    return children[0].pid


def test_the_test_servers_never_run_as_the_engine_user() -> None:
    from tests.utils.servers import POSTGRES_USER_WHEN_ROOT

    assert POSTGRES_USER_WHEN_ROOT != DEFAULT_ENGINE_USER


def test_a_worker_that_is_not_root_keeps_its_user_unless_the_switch_is_required(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    kept = plan_containment(DEFAULT_ENGINE_USER, False, None, ["json"])
    assert kept.engine_user is None and "not root" in kept.note
    with pytest.raises(EngineUserError, match="run the worker as root"):
        plan_containment(DEFAULT_ENGINE_USER, True, None, ["json"])


# -- only worker-started engine processes switch (a library never changes its caller's user) --------------

SANDBOX_ENTRY = textwrap.dedent(
    """
    import json, os, sys
    from nnqueue.enginecore.sandbox import SandboxedWorker
    if sys.argv[1] == "worker":
        os.environ["NNQUEUE_ENGINE_SANDBOX"] = str(os.getppid())  # what a worker exports for its engines
    os.environ["NNQUEUE_ENGINE_USER"] = "nobody"
    os.environ["NNQUEUE_ENGINE_SECCOMP"] = "false"
    os.environ["NNQUEUE_PROTECTED_ENVIRONMENT"] = "false"  # the switch alone (its lock-down is tested elsewhere)
    SandboxedWorker._nnqueue_enter_sandbox(SandboxedWorker())  # what the first execute_model does
    print(json.dumps({"uid": os.getuid()}))
    """
)


@needs_root
@pytest.mark.parametrize("started_by", ["worker", "library"])
def test_only_an_engine_process_a_worker_started_switches_user(started_by: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", SANDBOX_ENTRY, started_by], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    uid = json.loads(done.stdout.strip().splitlines()[-1])["uid"]
    assert uid == (pwd.getpwnam("nobody").pw_uid if started_by == "worker" else 0)


# -- what a switched engine process can no longer reach: files, signals, sockets --------------------------

AFTER_THE_SWITCH = textwrap.dedent(
    """
    import json, os, socket, sys
    from nnqueue.isolation import drop_privileges, engine_user
    worker_pid, secret, socket_path = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    assert drop_privileges(engine_user("nobody"))

    def attempt(action):
        try:
            action()
        except OSError as error:
            return type(error).__name__
        return "done"

    def connect():
        with socket.socket(socket.AF_UNIX) as client:
            client.connect(socket_path)

    print(json.dumps({
        "uid": os.getuid(),
        "signal": attempt(lambda: os.kill(worker_pid, 0)),
        "read": attempt(lambda: open(secret).read()),
        "environ": attempt(lambda: open(f"/proc/{worker_pid}/environ").read()),
        "connect": attempt(connect),
    }))
    """
)


@needs_root
def test_a_switched_engine_process_cannot_signal_the_worker_read_its_files_or_connect_to_its_sockets(
    reachable: Path,
) -> None:
    import socket

    private = reachable / "private"
    private.mkdir(mode=0o700)
    private.chmod(0o711)  # others may pass, not list: the file's own mode must keep them out
    secret = private / "secret.env"
    secret.write_text("NNQUEUE_DATABASE_URL=postgresql://secret\n")
    secret.chmod(0o600)
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(private / "worker.sock"))
    (private / "worker.sock").chmod(0o600)
    server.listen()
    stand_in = subprocess.Popen(["sleep", "60"])  # a root process, as the worker is
    try:
        done = subprocess.run(
            [sys.executable, "-c", AFTER_THE_SWITCH, str(stand_in.pid), str(secret), str(private / "worker.sock")],
            capture_output=True,
            text=True,
            timeout=300,
        )
    finally:
        stand_in.kill()
        stand_in.wait()
        server.close()
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == {
        "uid": pwd.getpwnam("nobody").pw_uid,
        "signal": "PermissionError",
        "read": "PermissionError",
        "environ": "PermissionError",
        "connect": "PermissionError",
    }


def test_secrets_are_blanked_in_the_environment_block_proc_shows() -> None:
    script = textwrap.dedent(
        """
        from nnqueue.isolation import scrub_environment
        removed = scrub_environment(["MY_TOKEN"])
        block = open("/proc/self/environ", "rb").read()
        print(sorted(removed), b"s3cr3t" in block, b"t0ken" in block, b"KEEP_ME=visible" in block)
        """
    )
    env = {**os.environ, "NNQUEUE_DATABASE_URL": "postgresql://u:s3cr3t@db/x", "MY_TOKEN": "t0ken"}
    env["KEEP_ME"] = "visible"
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "'MY_TOKEN', 'NNQUEUE_DATABASE_URL'" in done.stdout
    assert done.stdout.strip().endswith("False False True")


@pytest.mark.skipif(os.geteuid() != 0, reason="a handoff folder is chowned only by a root process")
def test_a_handoff_folder_where_the_engine_account_does_not_exist_is_the_roots_own(tmp_path: Path) -> None:
    """Outside a worker (which creates the account) a root process whose engine keeps root still gets its folder."""
    from nnqueue.isolation import engine_writable_dir

    directory = engine_writable_dir("handoff-", user="nnqueue-no-such-account", parent=tmp_path)
    assert directory.parent == tmp_path
    assert directory.stat().st_uid == 0
    assert directory.stat().st_mode & 0o777 == 0o700


# -- every thread: the switch reaches the threads started before it; giving up capabilities does not ----------

THREADS = textwrap.dedent(
    """
    import json, sys, threading
    from nnqueue.isolation import drop_capabilities, drop_privileges, engine_user, privileged_threads
    stop = threading.Event()
    started = [threading.Thread(target=stop.wait) for _ in range(3)]  # as vLLM's and ZMQ's threads are
    for thread in started:
        thread.start()
    before = privileged_threads()
    if sys.argv[1] == "switch":
        assert drop_privileges(engine_user("nobody"))
    else:
        drop_capabilities()  # the calling thread's alone
    after = privileged_threads()
    stop.set()
    print(json.dumps({"before": len(before), "after": [entry.split(": ", 1)[1] for entry in after]}))
    """
)


@needs_root
@pytest.mark.parametrize("drop", ["switch", "capabilities"])
def test_the_switch_leaves_no_thread_with_root_or_a_capability_and_that_is_checked(drop: str) -> None:
    done = subprocess.run([sys.executable, "-c", THREADS, drop], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    found = json.loads(done.stdout.strip().splitlines()[-1])
    assert found["before"] == 4
    if drop == "switch":
        assert found["after"] == []
    else:  # the other three threads keep their capabilities (all keep uid 0): why a kept root runs no one else's code
        assert sorted(found["after"]) == ["uid 0", *["uid 0 CapEff CapPrm"] * 3]


def test_a_sandboxed_process_writes_to_no_resource_tracker_but_dev_null(tmp_path: Path) -> None:
    """Red-team round 7's E7b: an engine core held the worker's resource-tracker pipe (the tracker runs as root in the
    host's view and, at the worker's exit, unlinks every /dev/shm name registered with it). In a process that
    multiprocessing's spawn started (handed the tracker's pipe, as an engine core is), detaching leaves that
    descriptor on /dev/null: a REGISTER line goes nowhere, and no tracker of its own is started."""
    victim = f"/nnq-e7b-{os.getpid()}"
    code = textwrap.dedent(
        f"""
        import multiprocessing, os
        from multiprocessing import resource_tracker

        def child():
            from nnqueue.isolation import detach_resource_tracker
            fd = resource_tracker._resource_tracker._fd
            before = os.readlink(f"/proc/self/fd/{{fd}}")
            detach_resource_tracker()
            resource_tracker.register({victim!r}, "shared_memory")  # what the escaped engine wrote
            print(before.startswith("pipe:"), os.readlink(f"/proc/self/fd/{{fd}}"), len(multiprocessing.active_children()))

        if __name__ == "__main__":
            resource_tracker.ensure_running()
            process = multiprocessing.get_context("spawn").Process(target=child)
            process.start()
            process.join()
        """
    )
    script = tmp_path / "tracker.py"
    script.write_text(code)
    victim_file = Path("/dev/shm") / victim.lstrip("/")
    victim_file.write_bytes(b"another process's segment")
    try:
        ran = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=60, cwd=tmp_path)
        assert ran.stdout.split() == ["True", "/dev/null", "0"], ran.stderr
        assert victim_file.exists()  # the tracker (ended with its script) had nothing to unlink
    finally:
        victim_file.unlink(missing_ok=True)
