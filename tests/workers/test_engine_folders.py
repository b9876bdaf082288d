"""nnqueue.workers.engine_folders: the handoff folder holds no more than the worker handed out room for
(`ResultSinks.overrun`) and the crash folder no more than beacons and reports take; an engine that escaped its sandbox
could otherwise fill the host's disk there (a seventh red-team round's finding). The watchdog warns at an overrun,
stops the worker as if its engine died once the disk is nearly full, and the worker removes the handoff folder when
it stops (`ResultSinks.close`)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from nnqueue.enginecore.sink import staging_path
from nnqueue.storage.local import LocalObjectStore
from nnqueue.workers.engine_folders import (
    CRASH_FOLDER_ENTRIES,
    FolderWatchdog,
    crash_folder_overrun,
    deleted_bytes_held,
    folder_usage,
)
from nnqueue.workers.sinks import SPARE_ENTRIES, ResultSinks

JOB = uuid.UUID("12345678-1234-5678-1234-567812345678")
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40


def fill(path: str | Path, size: int) -> None:
    """Write ``size`` bytes at ``path``, allocated on the disk (not a sparse file), as an engine does."""
    Path(path).write_bytes(b"\1" * size)


def sinks_in(tmp_path: Path, max_result_bytes: int | None = 4 * MiB) -> ResultSinks:
    """The worker's sinks, its handoff folder made in ``tmp_path / "handoff"`` (a root worker's is in the temp folder)."""
    store = LocalObjectStore(tmp_path / "objects")
    return ResultSinks(store, tmp_path / "store", tmp_path / "handoff", max_result_bytes=max_result_bytes)


def test_files_handed_out_within_their_bounds_are_no_overrun(tmp_path: Path) -> None:
    sinks = sinks_in(tmp_path)
    assert sinks.overrun() is None  # no folder yet
    job = sinks.open(JOB, 1, safetensors=True)
    shard = sinks.open_shard("harvests/h/shard-0", "shard-0.bin", 2 * MiB)
    fill(job.specs["torch"]["path"], 4 * MiB)  # at its bound
    fill(staging_path(job.specs["safetensors"]["path"]), 3 * MiB)  # being written
    fill(staging_path(shard.spec["path"]), 2 * MiB)
    fill(sinks.handoff_dir() / "unknown.partial", 64 * 1024)  # a name the worker did not hand out, within the slack
    assert sinks.overrun() is None


def test_a_foreign_file_over_what_was_handed_out_is_an_overrun(tmp_path: Path) -> None:
    sinks = sinks_in(tmp_path)
    fill(sinks.handoff_dir() / "filler", 2 * MiB)
    assert "over the 1048576 allowed (0 paths handed out)" in (sinks.overrun() or "")

    shard = sinks.open_shard("harvests/h/shard-0", "shard-0.bin", MiB)
    fill(shard.spec["path"], MiB // 2)
    assert sinks.overrun() is None  # 2.5 MiB of the 3 MiB the shard's bound and the slack allow
    fill(sinks.handoff_dir() / "more", MiB)
    assert "over the 3145728 allowed (1 paths handed out)" in (sinks.overrun() or "")


def test_a_handed_out_file_grown_past_its_bound_is_an_overrun(tmp_path: Path) -> None:
    sinks = sinks_in(tmp_path, max_result_bytes=MiB)
    job = sinks.open(JOB, 1, safetensors=False)
    fill(staging_path(job.specs["torch"]["path"]), 2 * MiB)
    assert sinks.overrun() is None  # the bound, its slack and the folder's
    fill(staging_path(job.specs["torch"]["path"]), 4 * MiB)
    assert "over the 3145728 allowed (1 paths handed out)" in (sinks.overrun() or "")


def test_a_discarded_path_has_no_more_room(tmp_path: Path) -> None:
    sinks = sinks_in(tmp_path)
    job = sinks.open(JOB, 1, safetensors=False)
    sinks.discard(job)
    fill(job.specs["torch"]["path"], 2 * MiB)  # the engine writes the path again once it was taken back
    assert sinks.overrun() is not None
    shard = sinks.open_shard("harvests/h/shard-0", "shard-0.bin", 4 * MiB)
    sinks.discard_shard(shard)
    assert sinks.overrun() is not None


def test_results_without_a_limit_leave_the_bytes_unchecked(tmp_path: Path) -> None:
    sinks = sinks_in(tmp_path, max_result_bytes=None)
    sinks.open(JOB, 1, safetensors=False)
    fill(sinks.handoff_dir() / "filler", 4 * MiB)
    assert sinks.overrun() is None


def test_more_entries_than_the_scan_allows_is_an_overrun(tmp_path: Path) -> None:
    sinks = sinks_in(tmp_path)
    sinks.open(JOB, 1, safetensors=False)  # four entries for it
    for index in range(SPARE_ENTRIES + 4):
        (sinks.handoff_dir() / f"empty-{index}").touch()
    assert sinks.overrun() is None
    (sinks.handoff_dir() / "one-more").touch()
    assert sinks.overrun() == "the handoff folder holds more than 68 entries (1 paths handed out)"
    assert folder_usage(sinks.handoff_dir(), 10).entries == 11  # the scan reads no more than it needs to say so


def test_a_folder_or_a_link_in_place_of_the_folder_is_an_overrun(tmp_path: Path) -> None:
    sinks = sinks_in(tmp_path)
    (sinks.handoff_dir() / "hidden").mkdir()  # what is in it, one scan does not see
    assert "holds a folder, 'hidden'" in (sinks.overrun() or "")

    folder = sinks.handoff_dir()
    folder.rename(tmp_path / "moved")
    folder.symlink_to(tmp_path / "moved")  # the engine user owns the folder: it may move it
    assert "could not be read" in (sinks.overrun() or "")


def test_close_removes_the_folder_and_only_it(tmp_path: Path) -> None:
    sinks = sinks_in(tmp_path)
    sinks.close()  # never made: nothing to remove
    sinks = sinks_in(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    fill(outside / "kept", 10)
    folder = sinks.handoff_dir()
    fill(folder / "leftover", 10)
    (folder / "planted").mkdir()
    (folder / "planted" / "link").symlink_to(outside)
    sinks.close()
    assert not folder.exists()
    assert (outside / "kept").exists() and (tmp_path / "handoff").is_dir()
    assert sinks.overrun() is None  # a closed folder is not the engine's doing


@pytest.fixture
def nearly_full(monkeypatch: pytest.MonkeyPatch) -> int:
    """A reserve over the free space, which stays as it is (other processes' writes would change a real measure, and
    free space gone counts against the engine): the disk counts as nearly full."""
    from nnqueue.workers import engine_folders

    monkeypatch.setattr(engine_folders, "_free_bytes", lambda folder: TiB)
    return 2 * TiB


def crash_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "crash"
    folder.mkdir(exist_ok=True)
    return folder


def health(stopped: threading.Event) -> Any:
    """What the watchdog uses of the worker's ``EngineHealth``."""
    return SimpleNamespace(dead=threading.Event(), stop=stopped.set)


def test_the_watchdog_stops_the_worker_as_if_its_engine_died_once_the_disk_is_nearly_full(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, nearly_full: int
) -> None:
    sinks = sinks_in(tmp_path)
    stopped = threading.Event()
    state = health(stopped)
    watchdog = FolderWatchdog(
        sinks, crash_folder(tmp_path), cast(Any, state), interval_s=0.01, reserve_bytes=nearly_full
    )
    watchdog.start()
    time.sleep(0.1)
    assert not stopped.is_set()
    fill(sinks.handoff_dir() / "filler", 2 * MiB)
    assert stopped.wait(5)
    assert state.dead.is_set()
    watchdog.join(5)
    assert not watchdog.is_alive()  # once
    assert "the engine wrote more than it may: the handoff folder takes" in caplog.text
    assert "the disk is nearly full; the worker restarts" in caplog.text


def test_the_watchdog_only_warns_while_the_disk_keeps_its_reserve(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A user's result over NNQUEUE_MAX_RESULT_BYTES is written whole before the worker refuses it: while the disk
    has room, that costs the other jobs on the worker no restart."""
    sinks = sinks_in(tmp_path)
    stopped = threading.Event()
    watchdog = FolderWatchdog(
        sinks, crash_folder(tmp_path), cast(Any, health(stopped)), interval_s=0.01, reserve_bytes=MiB
    )
    fill(sinks.handoff_dir() / "filler", 2 * MiB)
    watchdog.start()
    assert not stopped.wait(0.3)
    warned = [record for record in caplog.records if "the engine wrote more than it may" in record.getMessage()]
    assert [record.levelname for record in warned] == ["WARNING"]  # once a minute, not at every look
    sinks.close()
    watchdog.join(5)


def test_the_watchdog_leaves_an_engine_being_replaced_and_ends_with_the_folder(tmp_path: Path) -> None:
    sinks = sinks_in(tmp_path)
    stopped = threading.Event()
    state = health(stopped)
    state.dead.set()  # a restart empties the folder
    fill(sinks.handoff_dir() / "filler", 2 * MiB)
    watchdog = FolderWatchdog(sinks, crash_folder(tmp_path), cast(Any, state), interval_s=0.01)
    watchdog.start()
    assert not stopped.wait(0.2)
    state.dead.clear()
    sinks.close()
    watchdog.join(5)
    assert not watchdog.is_alive() and not stopped.is_set()


def test_the_crash_folder_holds_beacons_and_reports_and_no_more(tmp_path: Path) -> None:
    folder = crash_folder(tmp_path)
    for pid in range(8):  # an engine's beacons and a report
        (folder / f"beacon-{pid}.json").write_text(f'{{"pid": {pid}}}')
    assert crash_folder_overrun(folder) is None
    fill(folder / "filler", 17 * MiB)
    assert "the crash folder takes" in (crash_folder_overrun(folder) or "")
    (folder / "filler").unlink()
    for index in range(CRASH_FOLDER_ENTRIES):
        (folder / f"many-{index}").touch()
    assert "more than 256 entries" in (crash_folder_overrun(folder) or "")
    shutil.rmtree(folder)
    assert crash_folder_overrun(folder) is None  # removed when the worker stops


def test_the_watchdog_stops_the_worker_when_the_crash_folder_fills_the_disk(tmp_path: Path, nearly_full: int) -> None:
    sinks = sinks_in(tmp_path)
    stopped = threading.Event()
    state = health(stopped)
    crash = crash_folder(tmp_path)
    watchdog = FolderWatchdog(sinks, crash, cast(Any, state), interval_s=0.01, reserve_bytes=nearly_full)
    watchdog.start()
    assert not stopped.wait(0.1)
    fill(crash / "filler", 17 * MiB)
    assert stopped.wait(5) and state.dead.is_set()
    watchdog.join(5)


def test_a_deleted_file_the_engine_keeps_writing_is_counted_and_stops_the_worker_on_a_full_disk(
    tmp_path: Path, nearly_full: int
) -> None:
    """Red-team round 8: 100 MB written in the handoff folder, unlinked and kept open, took the disk unseen by a
    scan of the folder. The engine's processes' descriptors show it (here a child process stands for the engine)."""
    sinks = sinks_in(tmp_path)
    handoff = sinks.handoff_dir()
    hold = (
        "import os, sys, time; "
        f"f = open({str(handoff / 'gone')!r}, 'wb'); f.write(b'\\1' * (3 << 20)); f.flush(); "
        f"os.unlink({str(handoff / 'gone')!r}); print('held', flush=True); time.sleep(60)"
    )
    engine = subprocess.Popen([sys.executable, "-c", hold], stdout=subprocess.PIPE, text=True)
    try:
        assert engine.stdout is not None and engine.stdout.readline() == "held\n"
        assert not any(handoff.iterdir()) and sinks.overrun() is None  # no scan of the folder sees it
        assert deleted_bytes_held([engine.pid], [handoff]) >= 3 * MiB
        assert deleted_bytes_held([engine.pid], [tmp_path / "elsewhere"]) == 0
        stopped = threading.Event()
        state = health(stopped)
        watchdog = FolderWatchdog(
            sinks,
            crash_folder(tmp_path),
            cast(Any, state),
            lambda: [engine.pid],
            interval_s=0.01,
            reserve_bytes=nearly_full,
        )
        watchdog.start()
        assert stopped.wait(5) and state.dead.is_set()
        watchdog.join(5)
    finally:
        engine.kill()
        engine.wait()
    assert deleted_bytes_held([engine.pid], [handoff]) == 0


def test_a_folder_in_the_crash_folder_is_an_overrun(tmp_path: Path) -> None:
    """Round 9 put 100 MB two folders down in the crash folder, which a scan of its entries did not see."""
    folder = crash_folder(tmp_path)
    (folder / "sub" / "deeper").mkdir(parents=True)
    assert "the crash folder holds a folder, 'sub'" in (crash_folder_overrun(folder) or "")


def test_free_space_gone_where_no_scan_sees_it_stops_the_worker_on_a_nearly_full_disk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Round 9: a deleted file the engine keeps mapped only, or whose descriptor is in flight in a unix socket, is in
    no folder and no process's descriptors; it shows as the disk's free space gone (measured here as the filesystem
    says, the free space set by the test: other processes' writes would change a real measure)."""
    from nnqueue.workers import engine_folders

    free = [10 * TiB]  # far over any real disk's 5%, so that the reserve is the one set here
    monkeypatch.setattr(engine_folders, "_free_bytes", lambda folder: free[0])
    sinks = sinks_in(tmp_path)
    stopped = threading.Event()
    state = health(stopped)
    watchdog = FolderWatchdog(sinks, crash_folder(tmp_path), cast(Any, state), interval_s=0.01, reserve_bytes=5 * TiB)
    watchdog.start()
    free[0] -= TiB  # gone, with the disk keeping its reserve: other processes' writes, maybe
    assert not stopped.wait(0.2)
    free[0] -= 5 * TiB  # and now under it
    assert stopped.wait(5) and state.dead.is_set()
    watchdog.join(5)
