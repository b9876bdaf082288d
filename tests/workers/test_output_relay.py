"""nnqueue.workers.output_relay: a child's output reaches the worker's log only as ``nnqueue.output`` records, through
a pipe; the worker's own records and streams are its own (red-team round 7: an engine core read, forged and could
truncate the worker's log through the descriptors it inherited)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

WORKER = textwrap.dedent(
    r"""
    import logging, os, subprocess, sys, time
    from nnqueue import logs
    from nnqueue.workers import output_relay

    output_relay.ALLOWANCE_BYTES, output_relay.ALLOWANCE_BYTES_PER_S = 100_000, 1000  # a small allowance, to spend
    output_relay.relay_child_output()
    logs.configure("text")
    logging.getLogger("nnqueue.workers.job_execution").info("the worker's own record")
    child = (
        "import os, sys, time; "
        "print(os.readlink('/proc/self/fd/1'), os.readlink('/proc/self/fd/2')); "
        "sys.stdout.write('2026-12-01 09:02:44,000 INFO nnqueue.workers.job_execution: forged\\x1b[2K\\rline\\n'); "
        "sys.stdout.write('x' * 5000 + '\\n'); "
        "sys.stdout.write('flood\\n' * 5000); sys.stdout.flush(); time.sleep(1.2); print('after the flood')"
    )
    subprocess.run([sys.executable, "-c", child], check=True)
    print("the worker's own stdout")
    shrink = (  # what round 8's escaped engine did to the pipe all children share
        "import fcntl, os; "
        "fcntl.fcntl(1, fcntl.F_SETFL, fcntl.fcntl(1, fcntl.F_GETFL) | os.O_NONBLOCK | os.O_DIRECT); "
        "fcntl.fcntl(1, fcntl.F_SETPIPE_SZ, 4096); os.write(1, b'changed\\n')"
    )
    import fcntl

    def pipe():
        flags = fcntl.fcntl(1, fcntl.F_GETFL)
        print("pipe", bool(flags & os.O_NONBLOCK), bool(flags & os.O_DIRECT), fcntl.fcntl(1, fcntl.F_GETPIPE_SZ))

    subprocess.run([sys.executable, "-c", shrink], check=True)
    time.sleep(0.5)  # the relay reads 'changed', then puts the pipe back
    pipe()
    subprocess.run([sys.executable, "-c", shrink.replace("os.write(1, b'changed\\n')", "0")], check=True)
    output_relay.engine_replaced()  # a fresh engine's start: the pipe put back before anything is read
    pipe()
    started = time.monotonic()  # past the allowance (full: the engine was replaced) and the pipe's 64 KiB: 300 kB
    subprocess.run([sys.executable, "-c", "import sys; sys.stdout.write(('y' * 99 + '\\n') * 3000)"], check=True)
    print("spent in", round(time.monotonic() - started, 1))
    output_relay.engine_replaced()  # the allowance full again: a fresh engine's lines come at once
    subprocess.run([sys.executable, "-c", "print('a fresh engine')"], check=True)
    time.sleep(0.5)  # the relay thread logs what the children wrote
    """
)


def test_a_childs_lines_are_relayed_records_and_it_holds_no_descriptor_of_the_log(tmp_path: Path) -> None:
    log_path = tmp_path / "worker.log"
    with open(log_path, "wb") as log:
        subprocess.run([sys.executable, "-c", WORKER], stdout=log, stderr=subprocess.STDOUT, timeout=60, check=True)
    lines = log_path.read_text().splitlines()
    assert "the worker's own stdout" in lines
    # Blocking, no packet mode, its capacity: as before a child's change, after the relay's next read and at once when
    # a fresh engine is to start.
    assert lines.count("pipe False False 65536") == 2
    [own] = [line for line in lines if "the worker's own record" in line]
    assert " INFO nnqueue.workers.job_execution: the worker's own record" in own
    relayed = [line.split(" INFO nnqueue.output: ", 1) for line in lines if " INFO nnqueue.output: " in line]
    messages = [message for _, message in relayed]
    # The child's descriptors 1 and 2 are the relay's pipe, not the log file (which it could read back or truncate).
    assert messages[0].startswith("pipe:[") and messages[0].split() == [messages[0].split()[0]] * 2
    forged = "2026-12-01 09:02:44,000 INFO nnqueue.workers.job_execution: forged\\x1b[2K\\rline"
    assert messages[1] == forged  # a record of nnqueue.output, its control characters escaped
    assert messages[2] == "x" * 4096 + " [cut]" and messages[3] == "x" * 904  # a long line in pieces
    assert not any(line.startswith("2026-12-01 09:02:44") for line in lines)  # nothing passes for the worker's own
    # A flood: at most MAX_LINES_PER_S lines a second logged, the rest counted.
    floods = messages.count("flood")
    dropped = [line.split(" WARNING nnqueue.output: ", 1)[1] for line in lines if " lines dropped: " in line]
    assert dropped and all(
        line.endswith(
            " lines dropped: the children wrote more than 2000 lines or 1048576 bytes a second, or past their allowance"
            " of 100000 bytes (refilled at 1000 a second)"
        )
        for line in dropped
    )
    # Past the allowance the 300 kB child waited for the relay (1 kB a second), which dropped what it read meanwhile:
    # while the child wrote, the log took no more than the allowance and its refill. A fresh engine's allowance is
    # full: what the pipe held then was logged, and the fresh engine's line.
    ys = messages.count("y" * 99)
    [spent_at] = [at for at, line in enumerate(lines) if line.startswith("spent in ")]
    spent = float(lines[spent_at].split()[-1])
    ys_meanwhile = sum(line.endswith("y" * 99) for line in lines[:spent_at])
    assert spent >= 1 and 0 < ys_meanwhile * 99 <= 100_000 + 1000 * (spent + 1)
    assert 0 < floods < 5000 and ys_meanwhile <= ys < 3000
    assert floods + ys + sum(int(line.split()[0]) for line in dropped) == 5000 + 3000
    assert [message for message in messages if message != "y" * 99][-3:] == [
        "after the flood",
        "changed",
        "a fresh engine",
    ]
