"""The worker reads and writes the crash folder without following what an engine put there (a fifth red-team round:
a beacon's name linked to /etc/shadow was read by the root worker, a report's staging name linked into root's home
was created by it)."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from nnqueue.enginecore import untrusted_files


@pytest.fixture
def folders(tmp_path: Path) -> tuple[Path, Path]:
    crash, outside = tmp_path / "crash", tmp_path / "outside"
    crash.mkdir()
    outside.mkdir()
    (outside / "secret").write_bytes(b"root's secret")
    return crash, outside


def test_a_regular_file_of_its_own_is_read_up_to_the_limit(folders: tuple[Path, Path]) -> None:
    crash, _ = folders
    (crash / "switch-1.bin").write_bytes(b"0123456789")
    assert untrusted_files.read(crash, "switch-1.bin", 4) == b"0123"


@pytest.mark.parametrize("kind", ["symlink", "hard link"])
def test_a_link_or_a_second_name_is_refused(folders: tuple[Path, Path], kind: str) -> None:
    crash, outside = folders
    name = crash / "crash-1.json"
    if kind == "symlink":
        name.symlink_to(outside / "secret")
    else:
        os.link(outside / "secret", name)
    with pytest.raises(OSError):
        untrusted_files.read(crash, "crash-1.json", 1 << 20)


def test_a_folder_replaced_by_a_link_is_refused(folders: tuple[Path, Path]) -> None:
    crash, outside = folders
    crash.rmdir()
    crash.symlink_to(outside)
    with pytest.raises(OSError):
        untrusted_files.read(crash, "secret", 1 << 20)
    with pytest.raises(OSError):
        untrusted_files.write(crash, "crash-1.json", b"{}")
    with pytest.raises(OSError):  # emptying the "folder" would empty the one it links to
        untrusted_files.empty(crash)
    assert sorted(os.listdir(outside)) == ["secret"]


def test_a_write_replaces_a_link_at_its_name_and_follows_none(folders: tuple[Path, Path]) -> None:
    crash, outside = folders
    (crash / "crash-7.json").symlink_to(outside / "secret")
    for staging in ("crash-7.tmp", ".crash-7.json.tmp"):  # the staging names an engine could guess
        (crash / staging).symlink_to(outside / "planted")
    untrusted_files.write(crash, "crash-7.json", b'{"cause": "stall"}')
    assert (crash / "crash-7.json").read_bytes() == b'{"cause": "stall"}'
    assert not (crash / "crash-7.json").is_symlink()
    assert (outside / "secret").read_bytes() == b"root's secret"
    assert sorted(os.listdir(outside)) == ["secret"]  # nothing created through a planted link


def test_a_fifo_is_refused_without_blocking(folders: tuple[Path, Path]) -> None:
    """No writer: an open without O_NONBLOCK would wait for one forever (the worker's stall deadline thread)."""
    crash, _ = folders
    os.mkfifo(crash / "switch-2.bin")
    done = threading.Event()

    def attempt() -> None:
        try:
            untrusted_files.read(crash, "switch-2.bin", 136)
        except OSError:
            done.set()

    thread = threading.Thread(target=attempt, daemon=True)
    thread.start()
    thread.join(5)
    assert done.is_set()


def test_the_worker_side_readers_and_writer_go_through_it(folders: tuple[Path, Path]) -> None:
    """The stall deadline's beacons, the engine health's crash reports and the worker's own stall report."""
    import struct
    import time

    from nnqueue.enginecore.crash_report import save_report
    from nnqueue.enginecore.stall_beacon import read_all
    from nnqueue.workers.engine_health import read_crash_report

    crash, outside = folders
    (outside / "beacon").write_bytes(struct.pack("<d128s", time.monotonic() - 1000, b"forged"))
    (crash / "switch-5.bin").symlink_to(outside / "beacon")
    assert read_all(crash) == []
    (outside / "report").write_text('{"request_ids": ["x"], "error": "root-only text"}')
    (crash / "crash-5.json").symlink_to(outside / "report")
    assert read_crash_report(crash, wait_s=0) is None
    (crash / "crash-6.tmp").symlink_to(outside / "written")
    save_report(crash, 6, {"cause": "stall"})
    assert not (outside / "written").exists() and (crash / "crash-6.json").read_text() == '{"cause": "stall"}'
