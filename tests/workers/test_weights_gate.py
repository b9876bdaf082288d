"""The weights gate: an update waits for the requests running, new ones wait for the update, the version moves with
it, and a request pinned to the version that went away is refused (nnqueue.workers.weights)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from nnqueue.db.models import WeightsUpdate
from nnqueue.workers.weights import CheckpointUpdater, WeightsGate, WrongWeights, base_version


def test_an_update_waits_for_running_requests_and_holds_new_ones_back() -> None:
    async def scenario() -> list[str]:
        gate, events = WeightsGate("v1", {}), []

        async def request(name: str, hold: asyncio.Event) -> None:
            async with gate.serving() as version:
                events.append(f"{name} on {version}")
                await hold.wait()
                events.append(f"{name} done")

        running = asyncio.Event()
        first = asyncio.ensure_future(request("first", running))
        await asyncio.sleep(0.01)

        async def update() -> None:
            async with gate.paused() as bump:
                events.append("update")
                bump["version"] = "v2"

        updating = asyncio.ensure_future(update())
        await asyncio.sleep(0.01)
        later = asyncio.ensure_future(request("later", asyncio.Event()))
        await asyncio.sleep(0.01)
        assert events == ["first on v1"], "neither the update nor a new request ran while the first held the gate"
        running.set()
        await updating
        await asyncio.sleep(0.01)
        later.cancel()
        await asyncio.gather(first, later, return_exceptions=True)
        assert gate.version == "v2" and len(gate.pauses) == 1 and gate.pauses[0] > 0
        return events

    assert asyncio.run(scenario()) == ["first on v1", "first done", "update", "later on v2"]


def test_a_request_pinned_to_a_version_gone_is_refused() -> None:
    async def scenario() -> None:
        gate = WeightsGate("v2", {})
        async with gate.serving("v2") as version:
            assert version == "v2"
        with pytest.raises(WrongWeights, match="'v1'"):
            async with gate.serving("v1"):
                pass
        assert gate._running == 0

    asyncio.run(scenario())


def test_the_base_version_names_the_checkpoint(tmp_path: Path) -> None:
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "model.safetensors").write_bytes(b"x" * 10)
    first, source = base_version(str(folder), None)
    assert first.startswith("base-") and source["identity"]["files"] == [("model.safetensors", 10)]
    (folder / "model.safetensors").write_bytes(b"x" * 11)
    assert base_version(str(folder), None)[0] != first
    assert base_version("org/model", "abc")[0] != base_version("org/model", "def")[0]


@pytest.mark.parametrize("staged", [False, True])
def test_a_local_checkpoint_reaches_an_engine_that_sees_only_its_own_view_through_its_folder(
    tmp_path: Path, staged: bool
) -> None:
    """In its filesystem view (nnqueue.mountns) the engine sees the updater's folder but not the host's paths."""
    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    for name in ("a.safetensors", "b.safetensors"):
        (checkpoint / name).write_bytes(name.encode())
    none: Any = None
    updater = CheckpointUpdater(none, none, none, none, "m", "w", tmp_path / "downloads", staged=staged)
    (tmp_path / "downloads").mkdir()
    files, folder = updater._fetch(WeightsUpdate(id=7, source=str(checkpoint)))

    if not staged:  # the engine reads them where they are
        assert files == [str(checkpoint / "a.safetensors"), str(checkpoint / "b.safetensors")] and folder is None
        return
    assert folder == tmp_path / "downloads" / "update-7"  # deleted once loaded
    assert files == [str(folder / "a.safetensors"), str(folder / "b.safetensors")]
    for file in files:
        assert Path(file).read_bytes() == Path(file).name.encode()
        assert Path(file).stat().st_ino == (checkpoint / Path(file).name).stat().st_ino  # linked, not copied


def test_a_local_checkpoint_only_its_owner_may_read_is_copied_for_the_engine_user(tmp_path: Path) -> None:
    """A hard link keeps the file's mode: a checkpoint saved 0600 (transformers' ``save_pretrained``) linked into the
    engine's folder was unreadable to the engine user, whose load then failed."""
    checkpoint = tmp_path / "model.safetensors"
    checkpoint.write_bytes(b"weights")
    checkpoint.chmod(0o600)
    none: Any = None
    updater = CheckpointUpdater(none, none, none, none, "m", "w", tmp_path / "downloads", staged=True)
    (tmp_path / "downloads").mkdir()
    files, _ = updater._fetch(WeightsUpdate(id=8, source=str(checkpoint)))
    staged = Path(files[0])
    assert staged.read_bytes() == b"weights" and staged.stat().st_ino != checkpoint.stat().st_ino
    assert staged.stat().st_mode & 0o777 == 0o644
