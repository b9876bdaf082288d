"""nnqueue.probe_memo: a passed start-up probe is remembered until anything it read changes, and only in a folder of
root's alone; a worker's plan skips the probe it remembers (run as another account: needs root)."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest

from nnqueue import probe_memo
from nnqueue.isolation import Containment, EngineUser, EngineUserError, plan_containment, probe

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="running a probe as another user needs root")
SYSTEM_PYTHON = "/usr/bin/python3"  # Debian's, readable by every user


@pytest.fixture
def memo(tmp_path: Path) -> Path:
    return tmp_path / "probes"  # made by the first record, mode 0700


@pytest.fixture
def module(reachable: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A module the engine user can import, on the probe's path."""
    (reachable / "probed_here.py").write_text("VALUE = 1\n")
    monkeypatch.setenv("PYTHONPATH", str(reachable))
    return reachable / "probed_here.py"


def test_a_passed_probe_is_remembered_until_a_file_it_read_changes(
    spare_engine_account: EngineUser, memo: Path, module: Path
) -> None:
    account = spare_engine_account
    key = probe_memo.question(SYSTEM_PYTHON, account.uid, account.gid, ["probed_here"], [], where="host")
    probed = probe(account, ["probed_here"], [], python=SYSTEM_PYTHON)
    assert probed.problems == [] and str(module) in probed.read
    assert not probe_memo.passed(memo, key)
    probe_memo.remember(memo, key, probed.read)
    assert (memo.stat().st_mode & 0o777) == 0o700
    assert probe_memo.passed(memo, key)
    other = probe_memo.question(SYSTEM_PYTHON, account.uid, account.gid, ["probed_here", "json"], [], where="host")
    assert not probe_memo.passed(memo, other)  # another question

    module.chmod(0o600)  # now the engine user cannot import it: the record no longer holds
    assert not probe_memo.passed(memo, key)
    assert probe(account, ["probed_here"], [], python=SYSTEM_PYTHON).problems[0].startswith("import probed_here")
    module.chmod(0o644)  # changed back: still changed since the record (its change time moved), so probe again
    assert not probe_memo.passed(memo, key)

    probe_memo.remember(memo, key, probe(account, ["probed_here"], [], python=SYSTEM_PYTHON).read)
    module.parent.chmod(0o700)  # a folder above it
    assert not probe_memo.passed(memo, key)
    module.parent.chmod(0o755)

    probe_memo.remember(memo, key, probe(account, ["probed_here"], [], python=SYSTEM_PYTHON).read)
    probe_memo.remember(memo, other, probe(account, ["probed_here", "json"], [], python=SYSTEM_PYTHON).read)
    probe_memo.forget(memo, key)  # the engine it let switch users failed to start
    assert not probe_memo.passed(memo, key) and probe_memo.passed(memo, other)


def test_records_count_only_in_a_folder_of_roots_alone(tmp_path: Path) -> None:
    key = probe_memo.question(SYSTEM_PYTHON, 1, 1, ["json"], [], where="host")
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o755)
    probe_memo.remember(shared, key, [SYSTEM_PYTHON])
    assert not (shared / f"{key}.json").exists()  # others may enter it: nothing written
    shared.chmod(0o700)
    probe_memo.remember(shared, key, [SYSTEM_PYTHON])
    assert probe_memo.passed(shared, key)
    shared.chmod(0o770)  # a group may now write there: a record in it proves nothing
    assert not probe_memo.passed(shared, key)
    shared.chmod(0o700)
    linked = tmp_path / "linked"
    linked.symlink_to(shared)
    assert not probe_memo.passed(linked, key)


def test_a_workers_plan_skips_the_probe_it_remembers(
    spare_engine_account: EngineUser, memo: Path, module: Path, caplog: pytest.LogCaptureFixture
) -> None:
    def plan() -> Containment:
        return plan_containment(
            spare_engine_account.name, True, None, ["probed_here"], SYSTEM_PYTHON, memo=memo, where="host"
        )

    caplog.set_level(logging.INFO, logger="nnqueue.isolation")
    first = plan()
    assert first.engine_user == spare_engine_account.name and first.probe is not None
    assert "not run again" not in caplog.text
    assert plan() == first
    assert "not run again" in caplog.text

    module.chmod(0o600)  # a failed probe is never remembered, and the change is seen
    caplog.clear()
    with pytest.raises(EngineUserError, match="cannot use this Python: import probed_here"):
        plan()
    assert "not run again" not in caplog.text
