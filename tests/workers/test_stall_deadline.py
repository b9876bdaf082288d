"""The hard step deadline's watch (nnqueue.workers.stall_deadline): a process that published a stall beacon and stays
in users' code past the stall timeout is SIGKILLed, and the crash report names its job and says why. A worker's
engine killed this way and started again: tests/workers/test_engine_restart.py."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from nnqueue.workers.engine_health import read_crash_report
from nnqueue.workers.stall_deadline import StallDeadline

JOB = uuid.UUID("12345678-1234-5678-1234-567812345678")
STUCK = """
import sys, time
from pathlib import Path
from nnqueue.enginecore.stall_beacon import Beacon
beacon = Beacon(Path(sys.argv[1]))
beacon.publish(time.monotonic(), sys.argv[2])  # as the stall watchdog does on entering a switch
time.sleep(1000)
"""


def test_a_process_in_users_code_past_the_deadline_is_killed_and_its_request_reported(tmp_path: Path) -> None:
    stuck = subprocess.Popen([sys.executable, "-c", STUCK, str(tmp_path), f"{JOB}-1-0-0123abcd"])
    deadline = StallDeadline(tmp_path, stall_timeout_s=0.5, engine_cores=lambda: [stuck.pid])
    deadline.start()
    try:
        assert stuck.wait(timeout=120) == -9  # SIGKILL
    finally:
        stuck.kill()
    report = read_crash_report(tmp_path, wait_s=0)
    assert report is not None and report.cause == "stall" and report.jobs == {JOB}
    assert "more than 0.5 s without returning control to the model" in report.error


def test_a_beacon_that_names_another_process_of_the_worker_kills_nothing(tmp_path: Path) -> None:
    """A fourth red-team round: an engine wrote a beacon named for the worker's root zygote, which the worker killed.
    Only the engine's core processes and their descendants are killed, whatever a beacon's name says."""
    other = subprocess.Popen([sys.executable, "-c", STUCK, str(tmp_path), f"{JOB}-1-0-0123abcd"])
    core = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(1000)"])
    StallDeadline(tmp_path, stall_timeout_s=0.2, engine_cores=lambda: [core.pid]).start()
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            other.wait(timeout=6)  # past the deadline (0.2 s and the 2 s grace) at two polls
        assert read_crash_report(tmp_path, wait_s=0) is None
    finally:
        other.kill()
        core.kill()
