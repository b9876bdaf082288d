"""How fast a harvest shard moves from the engine to the store: the old pipe against the handoff file (CPU only).

Both sides of each path run here, in two threads, on the same random shard (``--gib`` of it, written in the
pieces the shard writer yields: 4 MiB, as views of host rows), into a local object store in a fresh temporary
folder (``--store``: put it on the disk a worker's store is on):

* **pipe** (nnqueue before this round): the engine thread hashes each piece and writes it into a FIFO with a
  1 MiB buffer; the worker thread reads it (``poll`` + 1 MiB reads), hashes it again and writes it to the
  store's staged writer (``ObjectStore.open_writer``), which fsyncs and renames at commit.
* **file** (now): the engine thread hashes each piece as it writes it to a staging file in the handoff folder
  and renames it there (``nnqueue.enginecore.sink.write_stream``); the worker checks the file (no link, one
  link, size, owner) and streams it to the store (``ResultSinks.commit_shard`` -> ``ObjectStore.put_stream``:
  a kernel copy on a local store, fsynced and renamed).

Each path runs ``--reps`` times; the best run's GB/s (shard bytes over the time from the engine's first byte
to the store's commit) and the engine thread's own GB/s are printed, with the ratio. Success: the file path
moves several times the pipe's GB/s, and the stored bytes' sha256 is the engine's in both.

    .venv/bin/python benchmarks/handoff_throughput.py --gib 1 --reps 3
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import os
import select
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from nnqueue.enginecore import sink
from nnqueue.engines.trace_report import WrittenObject
from nnqueue.storage.local import LocalObjectStore
from nnqueue.storage.object_store import Digest
from nnqueue.workers.sinks import ResultSinks

PIECE = 4 << 20
PIPE_BYTES = 1 << 20
_F_SETPIPE_SZ = 1031


def pieces(data: bytes) -> Iterator[memoryview]:
    view = memoryview(data)
    for start in range(0, len(data), PIECE):
        yield view[start : start + PIECE]


def pipe_path(data: bytes, store: LocalObjectStore, folder: Path) -> tuple[float, float, Digest]:
    """The removed pipe sink, both ends as they were: (seconds end to end, engine seconds, digest)."""
    path = folder / f"shard-{time.monotonic_ns()}.pipe"
    os.mkfifo(path, 0o600)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    fcntl.fcntl(fd, _F_SETPIPE_SZ, PIPE_BYTES)
    engine: dict[str, float] = {}

    def write() -> None:
        start = time.perf_counter()
        digest = hashlib.sha256()
        with open(path, "wb") as pipe:
            for piece in pieces(data):
                digest.update(piece)
                pipe.write(piece)
        engine["s"] = time.perf_counter() - start

    start = time.perf_counter()
    writer = threading.Thread(target=write)
    writer.start()
    upload = store.open_writer("harvests/bench/pipe.safetensors", size_hint=len(data))
    poller = select.poll()
    poller.register(fd, select.POLLIN | select.POLLHUP)
    while True:
        if not poller.poll(200):
            continue
        try:
            piece = os.read(fd, PIPE_BYTES)
        except BlockingIOError:
            continue
        if not piece:
            break
        upload.write(piece)
    digest = upload.commit()
    elapsed = time.perf_counter() - start
    writer.join()
    os.close(fd)
    path.unlink()
    return elapsed, engine["s"], digest


def file_path(data: bytes, sinks: ResultSinks) -> tuple[float, float, Digest]:
    """The handoff file: (seconds end to end, engine seconds, digest)."""
    opened = sinks.open_shard("harvests/bench/file.safetensors", f"shard-{time.monotonic_ns()}.safetensors", len(data))
    start = time.perf_counter()
    written = sink.write_stream(opened.spec, len(data), pieces(data))
    engine = time.perf_counter() - start
    digest = sinks.commit_shard(opened, WrittenObject(written.size, written.sha256))
    return time.perf_counter() - start, engine, digest


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gib", type=float, default=1.0, help="shard size in GiB")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--store", type=Path, default=None, help="folder for the store and handoff files")
    args = parser.parse_args()
    data = os.urandom(int(args.gib * (1 << 30)))
    expected = hashlib.sha256(data).hexdigest()
    with tempfile.TemporaryDirectory(dir=args.store) as root:
        store = LocalObjectStore(Path(root) / "objects")
        sinks = ResultSinks(store, Path(root) / "handoff")
        handoff = Path(root) / "pipes"
        handoff.mkdir()
        best: dict[str, tuple[float, float]] = {}
        for _ in range(args.reps):
            for name, run in (
                ("pipe", lambda: pipe_path(data, store, handoff)),
                ("file", lambda: file_path(data, sinks)),
            ):
                elapsed, engine, digest = run()
                if (digest.size, digest.sha256) != (len(data), expected):
                    raise SystemExit(f"{name}: the stored digest is not the shard's")
                if name not in best or elapsed < best[name][0]:
                    best[name] = (elapsed, engine)
    gb = len(data) / 1e9
    for name, (elapsed, engine) in best.items():
        print(f"{name}: {gb / elapsed:.2f} GB/s end to end ({gb / engine:.2f} GB/s on the engine's thread)")
    print(f"file / pipe: {best['pipe'][0] / best['file'][0]:.2f}x ({gb:.2f} GB shard, best of {args.reps})")


if __name__ == "__main__":
    main()
