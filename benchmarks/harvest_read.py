"""The streaming reader (``nnqueue.harvest``) against the object store's raw GET rate, in one run.

A local SeaweedFS (``weed mini``, as the test suite starts it) holds ``--shards`` synthetic shards of
``--rows`` rows of a ``--width``-wide bfloat16 capture (plus the three int64 columns), as a harvest writes them.
Then, alternately for ``--reps`` rounds:

* raw: every shard's presigned URL fetched whole with httpx on ``--prefetch`` threads, the bytes counted and
  dropped (no checksum, no parsing): the rate the store can serve to this process;
* reader: a ``HarvestDataset`` over the same URLs (``--prefetch`` shards ahead, sha256 checked, safetensors
  parsed, batches of ``--batch-size`` rows cut), every batch consumed.

The reported ratio is the median of the reader's MB/s over raw's in the same round. Results go to
``--out`` (JSON).

    .venv/bin/python benchmarks/harvest_read.py --out benchmarks/results/harvest-read-cpu.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
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


def reader_rate(refs: list[Any], batch_size: int, prefetch: int) -> tuple[int, float]:
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
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()

    from pydantic import SecretStr

    from nnqueue.harvest import ShardRef
    from nnqueue.settings import S3Settings
    from nnqueue.storage.s3 import S3ObjectStore
    from tests.utils import servers

    server = servers.start_s3()
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
            refs.append(ShardRef(key, args.rows, hashlib.sha256(data).hexdigest(), store.presigned_get_url(key, 3600)))
        shard_bytes = len(data)
        rounds = []
        for _ in range(args.reps):
            raw_bytes, raw_s = raw_rate([ref.url for ref in refs], args.prefetch)
            rows, read_s = reader_rate(refs, args.batch_size, args.prefetch)
            assert rows == args.shards * args.rows
            rounds.append(
                {
                    "raw_MB_s": raw_bytes / raw_s / 1e6,
                    "reader_MB_s": raw_bytes / read_s / 1e6,
                    "reader_rows_s": rows / read_s,
                    "ratio": raw_s / read_s,
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
        "rounds": rounds,
        "median": {name: statistics.median(r[name] for r in rounds) for name in rounds[0]},
    }
    print(json.dumps(result["median"], indent=1))
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
