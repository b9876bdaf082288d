"""Sinks: the engine writes an object to a handoff file (staged beside it, renamed whole) and reports its size and
the sha256 of the bytes as it wrote them; it has nothing else to write to (no URL, no network, no pipe)."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from nnqueue.enginecore import sink

MiB = 1 << 20


@pytest.mark.parametrize(
    "description",
    [
        None,
        {"kind": "handoff", "path": "relative/path"},
        {"kind": "pipe", "path": "/tmp/shard.pipe"},
        {"kind": "ftp", "url": "ftp://x"},
        {"kind": "presigned_put", "url": "http://127.0.0.1:1/bucket/key"},
        {"kind": "multipart", "part_size": 5, "urls": ["http://127.0.0.1:1/"]},
    ],
)
def test_only_handoff_files_are_written_to(description: object) -> None:
    with pytest.raises(sink.SinkError, match="not a sink description"):
        sink.check(description)


def pieces(data: bytes, size: int) -> list[memoryview]:
    view = memoryview(data)
    return [view[start : start + size] for start in range(0, len(data), size)]


@pytest.fixture(scope="module")
def data() -> bytes:
    return os.urandom(11 * MiB + 123)


def test_a_stream_to_a_handoff_file_is_hashed_and_renamed_whole(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "shard.safetensors"
    written = sink.write_stream({"kind": "handoff", "path": str(path)}, len(data), pieces(data, 3 * MiB + 1))
    assert (written.size, written.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    assert path.read_bytes() == data

    def failing():  # a failed write leaves neither the file nor its staging file behind
        yield b"abc"
        raise RuntimeError("capture failed")

    with pytest.raises(RuntimeError):
        sink.write_stream({"kind": "handoff", "path": str(tmp_path / "failed")}, 3, failing())
    with pytest.raises(sink.SinkError, match="wrote 3 bytes, expected 4"):
        sink.write_stream({"kind": "handoff", "path": str(tmp_path / "short")}, 4, [b"abc"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard.safetensors"]


def test_saves_are_hashed_as_written_and_safetensors_only_when_asked_and_possible(tmp_path: Path) -> None:
    import torch

    from nnqueue.enginecore.trace_results import write_saves

    saves = {"logits": torch.randn(3, 7), "ids": torch.arange(5)}
    sinks = {name: {"kind": "handoff", "path": str(tmp_path / name)} for name in ("torch", "safetensors")}
    written = write_saves(saves, sinks)
    for name, path in ((name, Path(spec["path"])) for name, spec in sinks.items()):
        data = path.read_bytes()
        assert written[name] == {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    loaded = torch.load(tmp_path / "torch")
    assert all(torch.equal(loaded[name], value) for name, value in saves.items())
    from safetensors.torch import load_file

    assert torch.equal(load_file(tmp_path / "safetensors")["logits"], saves["logits"])

    os.unlink(tmp_path / "safetensors")
    assert set(write_saves(saves, {"torch": sinks["torch"]})) == {"torch"}  # not asked for
    assert set(write_saves({"text": "not a tensor"}, sinks)) == {"torch"}  # not possible
    assert not (tmp_path / "safetensors").exists()
