"""The worker's shard upload against the store's own PUT rate, in one run (CPU, no GPU): a regression benchmark.

A local SeaweedFS (``weed mini``, plus ``--volumes`` - 1 extra volume servers) and ``--shards`` shard-sized files
(``--shard-mb`` each) that the engine's sink wrote to the worker's handoff folder (``nnqueue.enginecore.sink``,
hashed as written; the files are written again, untimed, before each upload row). Each round then uploads them
all, ``--chunks`` at a time:

* (s) **boto3 alone**: ``upload_file`` of a plain boto3 client with its defaults, the library's own rate;
* (p) **put_stream alone**: ``S3ObjectStore.put_stream`` of the open files, the store's PUT rate that
  ``benchmarks/harvest_gpu.py --s3`` bounds harvests with;
* (w) **the worker's path**: each shard as ``ChunkRunner`` hands it off (``UploadBudget.room``, then
  ``ResultSinks.commit_shard`` on an I/O thread: the file checked against the engine's report, uploaded, removed),
  ``--chunks`` chunks' slots on one event loop; every object it stored is read back and its sha256 checked against
  the engine's.

Printed: each row's MB/s and CPU seconds per GB (this process, and the store's processes), the medians over
``--reps`` rounds of (w)/(p) (target >= 0.95: the worker adds nothing to the store's rate) and (p)/(s), and the
engine's handoff write rate into the handoff folder and into ``/dev/shm`` (the memory handoff,
``NNQUEUE_WORKER_HANDOFF_DIR``).

    .venv/bin/python benchmarks/upload_throughput.py --out benchmarks/results/upload-throughput-cpu.json

``benchmarks.common.start_store`` (weed mini with extra volume servers) is shared with
``benchmarks/harvest_gpu.py --s3 --s3-volumes``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import Store, start_store

MB = 1e6


def boto3_alone(store: Store, paths: list[Path], chunks: int) -> None:
    """(s): a plain boto3 client, its defaults, ``upload_file``."""
    import boto3

    settings = store.settings
    client = boto3.client(
        "s3",
        endpoint_url=settings.endpoint_url,
        region_name=settings.region,
        aws_access_key_id=settings.access_key_id,
        aws_secret_access_key=settings.secret_access_key.get_secret_value() if settings.secret_access_key else None,
    )
    with ThreadPoolExecutor(chunks) as pool:
        list(pool.map(lambda path: client.upload_file(str(path), settings.bucket, f"boto3/{path.name}"), paths))


def put_stream_alone(store: Store, paths: list[Path], chunks: int) -> None:
    """(p): ``S3ObjectStore.put_stream`` of each open file."""

    def put(path: Path) -> None:
        with open(path, "rb") as file:
            store.store.put_stream(f"put/{path.name}", file, size_hint=path.stat().st_size)

    with ThreadPoolExecutor(chunks) as pool:
        list(pool.map(put, paths))


def worker_path(sinks: Any, handed_off: list[tuple[Any, Any]], chunks: int, budget_bytes: int) -> None:
    """(w): each handed-off shard as ``ChunkRunner`` stores it, ``chunks`` slots on one loop."""
    from nnqueue.workers.upload_budget import UploadBudget

    async def run() -> None:
        budget, slots = UploadBudget(budget_bytes), asyncio.Semaphore(chunks)

        async def one(sink: Any, reported: Any) -> None:
            async with contextlib.AsyncExitStack() as stack:
                async with slots:  # a slot is held until the shard has room, as run_next holds its bulk token
                    await stack.enter_async_context(budget.room(reported.size))
                await asyncio.to_thread(sinks.commit_shard, sink, reported)

        await asyncio.gather(*(one(sink, reported) for sink, reported in handed_off))

    asyncio.run(run())


def hand_off(sinks: Any, data: bytes, count: int, tag: str) -> list[tuple[Any, Any]]:
    """``count`` shards of ``data`` written by the engine's sink into the handoff folder: (sink, report) each."""
    from nnqueue.enginecore import sink
    from nnqueue.engines.trace_report import WrittenObject

    handed = []
    for index in range(count):
        opened = sinks.open_shard(f"worker/{tag}-{index:05d}.safetensors", f"{tag}-{index:05d}.bin", len(data))
        written = sink.write_stream(opened.spec, len(data), pieces(data))
        handed.append((opened, WrittenObject(written.size, written.sha256)))
    return handed


def pieces(data: bytes, piece: int = 4 << 20) -> list[memoryview]:
    """``data`` in the shard writer's pieces (views, as it yields rows of host blocks)."""
    view = memoryview(data)
    return [view[start : start + piece] for start in range(0, len(data), piece)]


def handoff_write(folder: Path, data: bytes, count: int) -> dict[str, float]:
    """The engine's sink writing ``count`` shards of ``data`` into ``folder`` (the worker reads them once, as an
    upload does): MB/s and CPU-s/GB, hashing included."""
    from nnqueue.enginecore import sink

    directory = Path(tempfile.mkdtemp(prefix="handoff-rate-", dir=folder))
    started, cpu = time.perf_counter(), time.process_time()
    for index in range(count):
        path = directory / f"{index}.bin"
        sink.write_stream({"kind": "handoff", "path": str(path)}, len(data), pieces(data))
        with open(path, "rb") as file:
            while file.read(8 << 20):
                pass
        path.unlink()
    seconds, cpu = time.perf_counter() - started, time.process_time() - cpu
    directory.rmdir()
    nbytes = count * len(data)
    return {"MB_s": round(nbytes / seconds / MB, 1), "cpu_s_per_GB": round(cpu / (nbytes / 1e9), 3)}


def measure(store: Store, nbytes: int, run: Callable[[], None]) -> dict[str, float]:
    started, cpu, store_cpu = time.perf_counter(), time.process_time(), store.cpu_seconds()
    run()
    seconds = time.perf_counter() - started
    gb = nbytes / 1e9
    return {
        "MB_s": nbytes / seconds / MB,
        "cpu_s_per_GB": (time.process_time() - cpu) / gb,
        "store_cpu_s_per_GB": (store.cpu_seconds() - store_cpu) / gb,
    }


def check_stored(store: Store, prefix: str, size: int, count: int, sha256: str | None = None) -> None:
    """``count`` objects of ``size`` bytes under ``prefix`` (with ``sha256``: read back and hashed), then removed."""
    keys = store.store.list_keys(f"{prefix}/")
    assert len(keys) == count, (prefix, len(keys))
    for key in keys:
        assert store.store.size(key) == size, key
        assert sha256 is None or hashlib.sha256(store.store.get_bytes(key)).hexdigest() == sha256, key
    store.store.delete_prefix(f"{prefix}/")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--shard-mb", type=float, default=64.0, help="each shard's size (8B, 16 prompts x 512: 67)")
    parser.add_argument("--chunks", type=int, default=8, help="uploads (chunks) in flight")
    parser.add_argument("--parts", type=int, help="the store's parts in flight (default: nnqueue's)")
    parser.add_argument("--volumes", type=int, default=1, help="SeaweedFS volume servers")
    parser.add_argument("--budget-mb", type=float, default=1024.0, help="the worker's upload budget")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--handoff", type=Path, help="the handoff folder's parent (default: the temp folder)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from nnqueue.workers.sinks import ResultSinks

    data = os.urandom(int(args.shard_mb * MB))
    expected = hashlib.sha256(data).hexdigest()
    nbytes = args.shards * len(data)
    store = start_store(args.volumes, args.parts)
    work = store.scratch(args.handoff or Path(tempfile.gettempdir()))
    sinks = ResultSinks(store.store, work, work)
    rounds = []
    try:
        files = [Path(opened.spec["path"]) for opened, _ in hand_off(sinks, data, args.shards, "files")]
        budget = int(args.budget_mb * MB)
        for _ in range(args.reps):
            rows = {
                "(s) boto3 alone": measure(store, nbytes, lambda: boto3_alone(store, files, args.chunks)),
                "(p) put_stream alone": measure(store, nbytes, lambda: put_stream_alone(store, files, args.chunks)),
            }
            handed = hand_off(sinks, data, args.shards, f"r{len(rounds)}")
            rows["(w) the worker's path"] = measure(
                store, nbytes, lambda handed=handed: worker_path(sinks, handed, args.chunks, budget)
            )
            for prefix in ("boto3", "put"):
                check_stored(store, prefix, len(data), args.shards)
            check_stored(store, "worker", len(data), args.shards, expected)
            rows["ratios"] = {
                "w_over_p": rows["(w) the worker's path"]["MB_s"] / rows["(p) put_stream alone"]["MB_s"],
                "p_over_s": rows["(p) put_stream alone"]["MB_s"] / rows["(s) boto3 alone"]["MB_s"],
            }
            rounds.append(rows)
            print(json.dumps(rows), flush=True)
        handoff = {
            "handoff folder": handoff_write(work, data, min(args.shards, 8)),
            "/dev/shm": handoff_write(Path("/dev/shm"), data, min(args.shards, 8)),
        }
        nodes = store.data_nodes()
    finally:
        store.stop()

    def median(row: str, name: str) -> float:
        return round(statistics.median(found[row][name] for found in rounds), 3)

    result = {
        "benchmark": "upload_throughput",
        "cpus": os.cpu_count(),
        "load_average_1m": round(os.getloadavg()[0], 1),
        "shards": args.shards,
        "shard_bytes": len(data),
        "chunks_in_flight": args.chunks,
        "parts_in_flight": store.settings.upload_parts_in_flight,
        "volume_servers": nodes,
        "median": {row: {name: median(row, name) for name in rounds[0][row]} for row in rounds[0]},
        "engine_handoff_write": handoff,
        "rounds": rounds,
    }
    print(json.dumps({k: result[k] for k in ("median", "engine_handoff_write", "volume_servers")}, indent=1))
    ratio = result["median"]["ratios"]["w_over_p"]
    print(f"the worker's path / put_stream alone: {ratio:.3f} (target >= 0.95)")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
