"""The supervisor starts the worker again after any exit it did not ask for, exit 0 included
(nnqueue.workers.supervisor): a worker told to exit by someone else (a remote-control ``shutdown`` a trace
published) comes back. A worker whose first start exits 2 was misconfigured, and is not restarted."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # `nnqueue worker` processes that import the engine's libraries, then fail

ROOT = Path(__file__).resolve().parents[2]  # the checkout whose nnqueue the supervisor runs
SUPERVISE = "import sys; from nnqueue.workers.supervisor import Supervisor; sys.exit(Supervisor(sys.argv[1:], 0.5).run())"  # a worker that served 0.5 s is healthy


def supervise(child: str, runs: Path, stderr: int | None = None) -> subprocess.Popen[bytes]:
    """A supervisor (its own process) running ``python -c child``; each start of the child adds a line to ``runs``."""
    script = f"open({str(runs)!r}, 'a').write('run\\n'); {child}"
    return subprocess.Popen(
        [sys.executable, "-c", SUPERVISE, sys.executable, "-c", script],
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        start_new_session=True,
        stderr=stderr,
    )


def started(runs: Path) -> int:
    return len(runs.read_text().splitlines()) if runs.exists() else 0


def test_a_worker_that_exits_0_is_started_again(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    supervisor = supervise("raise SystemExit(0)", runs)
    try:
        deadline = time.monotonic() + 30
        while started(runs) < 2:
            assert supervisor.poll() is None, f"the supervisor exited {supervisor.returncode} after one exit 0"
            assert time.monotonic() < deadline, "the worker was not started again"
            time.sleep(0.1)
    finally:
        if supervisor.poll() is None:
            os.killpg(supervisor.pid, signal.SIGTERM)
            supervisor.wait(timeout=30)


def test_a_worker_told_to_stop_by_the_supervisor_is_not_started_again(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    supervisor = supervise("import time; time.sleep(60)", runs)
    deadline = time.monotonic() + 30
    while started(runs) < 1:
        assert time.monotonic() < deadline
        time.sleep(0.1)
    supervisor.send_signal(signal.SIGTERM)
    supervisor.wait(timeout=30)
    time.sleep(1.5)  # longer than the first backoff
    assert started(runs) == 1


def test_a_first_start_that_exits_2_is_final(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    supervisor = supervise("raise SystemExit(2)", runs)
    assert supervisor.wait(timeout=30) == 2
    assert started(runs) == 1


def backoffs(child: str, runs: Path, starts: int) -> list[str]:
    """The waits the supervisor announced before the child's first ``starts`` - 1 restarts."""
    supervisor = supervise(child, runs, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while started(runs) < starts:
            assert supervisor.poll() is None and time.monotonic() < deadline, "the worker was not started again"
            time.sleep(0.1)
    finally:
        os.killpg(supervisor.pid, signal.SIGTERM)
        _, stderr = supervisor.communicate(timeout=30)
    return re.findall(r"starting it again in (\d+) s", stderr.decode())[: starts - 1]


def test_the_backoff_doubles_while_the_worker_fails_before_it_is_ready(tmp_path: Path) -> None:
    assert backoffs("import time; time.sleep(0.6); raise SystemExit(1)", tmp_path / "runs", 3) == ["1", "2"]


def test_the_backoff_resets_after_a_worker_served_for_the_healthy_interval(tmp_path: Path) -> None:
    ready = "from nnqueue.workers.supervisor import report_ready; report_ready(); import time; time.sleep(0.6)"
    assert backoffs(f"{ready}; raise SystemExit(1)", tmp_path / "runs", 4) == ["1", "1", "1"]


def test_a_worker_that_cannot_import_vllm_exits_2_and_the_supervisor_never_imports_it(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    """``nnqueue worker`` itself, on an embedded (SQLite) database: only the supervised process imports the engine's
    libraries (the supervisor would otherwise pay their import, 10-15 s here, at every worker start, and hold them
    beside the engine). An install where they cannot be imported fails at the first start with exit 2 and a
    message, not in a restart loop."""
    broken = tmp_path / "broken" / "vllm"
    broken.mkdir(parents=True)
    (broken / "__init__.py").write_text("raise ImportError('vllm is broken on purpose')\n")
    env = embedded_env(tmp_path, broken.parent)
    subprocess.run([sys.executable, "-m", "nnqueue", "db", "upgrade"], env=env, check=True, capture_output=True)
    result = worker_command(tiny_model_path, env)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "the worker cannot import its engine's libraries: vllm is broken on purpose" in result.stderr
    assert "starting it again" not in result.stderr


def test_a_worker_on_an_unmigrated_database_exits_2_at_once_saying_what_to_run(tmp_path: Path) -> None:
    """Not a restart loop behind a database error, and not after the engine's load: the schema is checked first."""
    result = worker_command(tmp_path / "no-model-needed", embedded_env(tmp_path))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "is at revision none (no nnqueue tables)" in result.stderr
    assert "run `nnqueue db upgrade`" in result.stderr and "starting it again" not in result.stderr


def worker_command(model: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``nnqueue worker --model model``, supervised, run to its end."""
    command = [sys.executable, "-m", "nnqueue", "worker", "--model", str(model)]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)


def embedded_env(tmp_path: Path, *first_on_path: Path) -> dict[str, str]:
    """The environment of an embedded (SQLite) worker under ``tmp_path``, whose broker is never reached, importing
    ``first_on_path`` before this checkout."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([*map(str, first_on_path), str(ROOT)])}
    env |= {"NNQUEUE_BROKER_URL": "redis://127.0.0.1:1/0", "NNQUEUE_DATA_DIR": str(tmp_path / "data")}
    env.pop("NNQUEUE_DATABASE_URL", None)
    return env
