"""Sinks: the engine writes an object to a handoff file (renamed whole) or streams it into the worker's pipe,
with its digest; it has nothing else to write to (no URL, no network)."""

from __future__ import annotations

import hashlib
import os
import threading
from pathlib import Path

import pytest

from nnqueue.enginecore import sink

MiB = 1 << 20


def staged(target: dict[str, str], data: bytes) -> str:
    path = sink.staging_file(target)
    Path(path).write_bytes(data)
    return path


def test_a_handoff_sink_gets_the_whole_file_and_its_digest(tmp_path: Path) -> None:
    target = {"kind": "handoff", "path": str(tmp_path / "saves.pt")}
    data = os.urandom(3 << 20)
    path = staged(target, data)
    assert Path(path).parent == tmp_path  # beside the target: delivering is a rename
    written = sink.deliver(target, path)
    assert (tmp_path / "saves.pt").read_bytes() == data and not os.path.exists(path)
    assert (written.size, written.sha256) == (len(data), hashlib.sha256(data).hexdigest())


@pytest.mark.parametrize(
    "description",
    [
        None,
        {"kind": "handoff", "path": "relative/path"},
        {"kind": "ftp", "url": "ftp://x"},
        {"kind": "presigned_put", "url": "http://127.0.0.1:1/bucket/key"},
        {"kind": "multipart", "part_size": 5, "urls": ["http://127.0.0.1:1/"]},
    ],
)
def test_only_handoff_files_and_pipes_are_written_to(description: object) -> None:
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
    assert sorted(p.name for p in tmp_path.iterdir()) == ["shard.safetensors"]


def test_a_stream_into_a_pipe_reaches_its_reader(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "shard.pipe"
    os.mkfifo(path, 0o600)
    received = bytearray()
    reader = threading.Thread(target=lambda: received.extend(path.read_bytes()))
    reader.start()
    written = sink.write_stream({"kind": "pipe", "path": str(path)}, len(data), pieces(data, 2 * MiB + 7))
    reader.join(timeout=30)
    assert bytes(received) == data and written.sha256 == hashlib.sha256(data).hexdigest()


def test_a_pipe_sink_is_never_a_file_put_in_its_place(tmp_path: Path) -> None:
    path = tmp_path / "shard.pipe"
    path.write_bytes(b"")
    with pytest.raises(sink.SinkError, match="not the frontend's pipe"):
        sink.write_stream({"kind": "pipe", "path": str(path)}, 3, [b"abc"])
    os.symlink(tmp_path / "elsewhere", tmp_path / "link.pipe")
    with pytest.raises(OSError):
        sink.write_stream({"kind": "pipe", "path": str(tmp_path / "link.pipe")}, 3, [b"abc"])
    assert not (tmp_path / "elsewhere").exists()
