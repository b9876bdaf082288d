"""The streaming reader (``nnqueue.harvest``) against the object store's raw GET rate, in one run.

A local SeaweedFS (``weed mini``, as the test suite starts it) holds ``--shards`` synthetic shards of
``--rows`` rows of a ``--width``-wide bfloat16 capture (plus the three int64 columns), as a harvest writes them.
Then, alternately for ``--reps`` rounds:

* raw (httpx): every shard's presigned URL fetched whole with httpx on ``--prefetch`` threads, the bytes counted
  and dropped (no checksum, no parsing);
* raw (stdlib): the same with ``http.client``, each body read into one preallocated buffer (``readinto``), the
  cheapest way this process has to take bytes off a socket;
* reader: a ``HarvestDataset`` over the same URLs (``--prefetch`` GETs in flight, ranges of ``--range-mb``,
  sha256 checked, safetensors parsed, batches of ``--batch-size`` rows cut), every batch consumed.

The raw rate of a round is the faster of the two raw clients: the rate the store can serve to this process.
The reported ratio is the median over rounds of the reader's MB/s over that raw rate in the same round (the
clients run in turn, so each round sees the machine's load of the moment). Each phase's CPU seconds in this
process per GB (``*_cpu_s_per_GB``) say what the client itself costs, which wall rates on a loaded machine hide:
the reader's is mostly sha256. Results go to ``--out`` (JSON).

    .venv/bin/python benchmarks/harvest_read.py --out benchmarks/results/harvest-read-cpu.json

Where cores are free (the GPU machine's 16, with the payload and server wheels of ``../shared/gpu/README.md``'s
recipe on ``PYTHONPATH`` and ``weed`` on ``PATH``), with shards of an 8B harvest's width, 2 GiB in all, and more
GETs in flight:

    python benchmarks/harvest_read.py --shards 32 --rows 8192 --width 4096 --prefetch 8 --reps 3 --out read.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from itertools import pairwise
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def make_shard(rows: int, width: int, seed: int) -> bytes:
    import torch
    from safetensors.torch import save

    generator = torch.Generator().manual_seed(seed)
    ids = torch.arange(rows)
    return save(
        {
            "model.layers.0.output": torch.randn(rows, width, generator=generator).to(torch.bfloat16),
            "prompt_index": ids // 128,
            "token_position": ids % 128,
            "token_id": ids,
        }
    )


def raw_rate(urls: list[str], threads: int) -> tuple[int, float]:
    import httpx

    with httpx.Client(timeout=300.0) as http, ThreadPoolExecutor(threads) as pool:
        started = time.perf_counter()
        total = sum(pool.map(lambda url: len(http.get(url).content), urls))
        return total, time.perf_counter() - started


def raw_stdlib_rate(urls: list[str], threads: int) -> tuple[int, float]:
    import http.client
    import threading
    from urllib.parse import urlsplit

    local = threading.local()

    def fetch(url: str) -> int:
        parts = urlsplit(url)
        if not hasattr(local, "connection"):
            local.connection = http.client.HTTPConnection(parts.netloc, timeout=300)
        local.connection.request("GET", f"{parts.path}?{parts.query}")
        response = local.connection.getresponse()
        data = memoryview(bytearray(int(response.getheader("Content-Length"))))
        done = 0
        while done < len(data):
            done += response.readinto(data[done:])
        return done

    with ThreadPoolExecutor(threads) as pool:
        started = time.perf_counter()
        total = sum(pool.map(fetch, urls))
        return total, time.perf_counter() - started


def reader_rate(refs: list[Any], batch_size: int, prefetch: int, range_bytes: int) -> tuple[int, float]:
    from nnqueue.harvest import HarvestDataset

    dataset = HarvestDataset(
        refs,
        ["model.layers.0.output"],
        batch_size=batch_size,
        shuffle_buffer=0,
        seed=0,
        epoch=0,
        prefetch=prefetch,
        drop_last=False,
        rank=0,
        world_size=1,
        resume={},
        range_bytes=range_bytes,
    )
    started = time.perf_counter()
    rows = sum(len(batch["token_id"]) for batch in dataset)
    return rows, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=int, default=16)
    parser.add_argument("--rows", type=int, default=8192)
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=4096)
    parser.add_argument("--prefetch", type=int, default=4)
    parser.add_argument("--range-mb", type=float, default=8.0, help="The reader's ranged GETs, in MiB.")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from pydantic import SecretStr

    from nnqueue.harvest import ShardRef
    from nnqueue.settings import S3Settings
    from nnqueue.storage.s3 import S3ObjectStore
    from tests.utils import servers

    server = servers.start_s3(volume_size_limit_mb=30000)  # weed's default volume size: gigabytes of shards
    try:
        store = S3ObjectStore(
            S3Settings(
                endpoint_url=server.endpoint_url,
                bucket="harvest-read-bench",
                region=server.region,
                access_key_id=server.access_key_id,
                secret_access_key=SecretStr(server.secret_access_key),
            )
        )
        refs = []
        for index in range(args.shards):
            data = make_shard(args.rows, args.width, index)
            key = f"harvests/bench/shard-{index:05d}.safetensors"
            store.put_bytes(key, data)
            url = store.presigned_get_url(key, 3600)
            refs.append(ShardRef(key, args.rows, hashlib.sha256(data).hexdigest(), url, len(data)))
        shard_bytes = len(data)
        rounds = []
        range_bytes = int(args.range_mb * (1 << 20))
        for _ in range(args.reps):
            urls = [ref.url for ref in refs]
            cpu = [time.process_time()]
            raw_bytes, httpx_s = raw_rate(urls, args.prefetch)
            cpu.append(time.process_time())
            stdlib_bytes, stdlib_s = raw_stdlib_rate(urls, args.prefetch)
            cpu.append(time.process_time())
            assert stdlib_bytes == raw_bytes
            rows, read_s = reader_rate(refs, args.batch_size, args.prefetch, range_bytes)
            cpu.append(time.process_time())
            assert rows == args.shards * args.rows
            per_gb = [(b - a) / (raw_bytes / 1e9) for a, b in pairwise(cpu)]
            raw_s = min(httpx_s, stdlib_s)
            rounds.append(
                {
                    "raw_httpx_MB_s": raw_bytes / httpx_s / 1e6,
                    "raw_stdlib_MB_s": raw_bytes / stdlib_s / 1e6,
                    "raw_MB_s": raw_bytes / raw_s / 1e6,
                    "reader_MB_s": raw_bytes / read_s / 1e6,
                    "reader_rows_s": rows / read_s,
                    "ratio": raw_s / read_s,
                    "ratio_to_httpx": httpx_s / read_s,
                    "raw_httpx_cpu_s_per_GB": per_gb[0],
                    "raw_stdlib_cpu_s_per_GB": per_gb[1],
                    "reader_cpu_s_per_GB": per_gb[2],
                }
            )
            print(json.dumps(rounds[-1]))
    finally:
        server.stop()
    result = {
        "shards": args.shards,
        "rows_per_shard": args.rows,
        "width": args.width,
        "dtype": "bfloat16",
        "shard_bytes": shard_bytes,
        "batch_size": args.batch_size,
        "prefetch": args.prefetch,
        "range_bytes": range_bytes,
        "rounds": rounds,
        "median": {name: statistics.median(r[name] for r in rounds) for name in rounds[0]},
    }
    print(json.dumps(result["median"], indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
