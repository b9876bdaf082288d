"""Train on a harvest straight from the object store: ``nnqueue.harvest.open(...)`` is a PyTorch ``IterableDataset``.

    dataset = nnqueue.harvest.open(harvest_id, client, batch_size=4096, shuffle_buffer=2**18)
    for batch in torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=4):
        acts = batch["model.layers.12.output"]          # [4096, d], the harvest's dtype
        position = batch["position"]                      # where this stream is: pass back as resume=

Shards are fetched whole (one GET each, ``prefetch`` ahead on threads), their sha256 checked against the
manifest's before any row is used, and parsed with safetensors. Each consumer (a ``DataLoader`` worker of a
rank) reads a disjoint set of shards, shard ``i`` of the (per-epoch, seeded) shard order going to consumer
``i % consumers``, so no row is read twice within an epoch whatever the workers and ranks; consumers end with
different row counts when the shards differ (``drop_last`` drops each consumer's final partial batch).

``shuffle_buffer`` rows are held and batches drawn at random from them (seeded per consumer and epoch), on top
of the shuffled shard order; 0 keeps the harvest's order (prompt, then position, within each shard).

Resuming: every batch carries ``position``, ``{consumer: batches this consumer has yielded}`` for its consumer.
Keep the latest position per consumer (merge the dicts) and pass it as ``resume=`` with the same seed, epoch,
batch size, shuffle buffer, ranks and workers: each consumer's stream is deterministic, so it skips the batches
it already yielded (without a shuffle buffer, whole shards before that point are not even fetched).

``source`` is a harvest id (with a ``client``: shard URLs come from the API, presigned on S3) or the URL or
local path of a ``manifest.json`` (shards are read beside it: a downloaded harvest, or a public bucket).
"""

from __future__ import annotations

import hashlib
import json
import random
from collections import deque
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any

import httpx
import torch
from torch.utils.data import IterableDataset, get_worker_info

from nnqueue.client.client import Client
from nnqueue.client.errors import NNqueueError

COLUMNS = ("prompt_index", "token_position", "token_id")
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I64": torch.int64}
PIECE = 1 << 20


class ShardCorrupt(NNqueueError, RuntimeError):
    """A shard whose bytes do not have the sha256 its manifest records."""


@dataclass(frozen=True)
class ShardRef:
    """One shard to read: its name, rows and sha256 (from the manifest), and where to GET it."""

    name: str
    rows: int
    sha256: str
    url: str


def open(  # noqa: A001  (nnqueue.harvest.open, as the issue names it)
    source: str,
    client: Client | None = None,
    *,
    batch_size: int = 4096,
    captures: list[str] | None = None,
    shuffle_buffer: int = 0,
    seed: int = 0,
    epoch: int = 0,
    prefetch: int = 4,
    drop_last: bool = False,
    rank: int | None = None,
    world_size: int | None = None,
    resume: dict[int, int] | None = None,
) -> HarvestDataset:
    """A completed harvest as an ``IterableDataset`` of batches (dicts of tensors); see the module docstring.

    ``captures``: the shard tensors to read (default: every capture). ``rank``/``world_size``: default from
    ``torch.distributed`` when it is initialized, else 0 and 1."""
    if client is not None:
        harvest = client.get_harvest(source)
        manifest = harvest.manifest()
        api = client.url.rstrip("/")  # a store that cannot presign: shards come through the API, with the key
        shards = [
            ShardRef(
                s["name"], s["rows"], s["sha256"], f"{api}{s['url']}?inline=1" if s["url"].startswith("/") else s["url"]
            )
            for s in harvest.shards()
        ]
    else:
        manifest = json.loads(bytes(_get(source)[0]))
        base = source.split("?", 1)[0].rsplit("/", 1)[0]
        shards = [ShardRef(s["file"], s["rows"], s["sha256"], f"{base}/{s['file']}") for s in manifest["shards"]]
    if rank is None or world_size is None:
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        rank = torch.distributed.get_rank() if distributed else 0
        world_size = torch.distributed.get_world_size() if distributed else 1
    keys = [_key(capture) for capture in manifest["spec"]["captures"]]
    unknown = set(captures or ()) - set(keys)
    if unknown:
        raise ValueError(f"the harvest has no captures {sorted(unknown)}; it has {keys}")
    return HarvestDataset(
        shards,
        captures or keys,
        batch_size=batch_size,
        shuffle_buffer=shuffle_buffer,
        seed=seed,
        epoch=epoch,
        prefetch=prefetch,
        drop_last=drop_last,
        rank=rank,
        world_size=world_size,
        resume=dict(resume or {}),
        api=(client.url.rstrip("/"), client.transport.auth_headers()) if client is not None else None,
    )


class HarvestDataset(IterableDataset[dict[str, Any]]):
    """Batches of a harvest's rows, read from the store by each consumer (see the module docstring)."""

    def __init__(
        self,
        shards: list[ShardRef],
        captures: list[str],
        *,
        batch_size: int,
        shuffle_buffer: int,
        seed: int,
        epoch: int,
        prefetch: int,
        drop_last: bool,
        rank: int,
        world_size: int,
        resume: dict[int, int],
        api: tuple[str, dict[str, str]] | None = None,
    ) -> None:
        if batch_size < 1 or shuffle_buffer < 0 or prefetch < 1 or not 0 <= rank < world_size:
            raise ValueError("batch_size and prefetch must be positive, shuffle_buffer >= 0, 0 <= rank < world_size")
        self.shards, self.captures = shards, captures
        self.batch_size, self.shuffle_buffer, self.seed, self.epoch = batch_size, shuffle_buffer, seed, epoch
        self.prefetch, self.drop_last, self.rank, self.world_size = prefetch, drop_last, rank, world_size
        self.resume, self.api = resume, api

    @property
    def rows(self) -> int:
        return sum(shard.rows for shard in self.shards)

    def consumer(self) -> tuple[int, int]:
        """(this consumer's number, how many consumers): ranks times the DataLoader's workers."""
        info = get_worker_info()
        workers, worker = (info.num_workers, info.id) if info is not None else (1, 0)
        return self.rank * workers + worker, self.world_size * workers

    def assigned(self) -> list[ShardRef]:
        """This consumer's shards, in reading order."""
        me, consumers = self.consumer()
        order = list(range(len(self.shards)))
        if self.shuffle_buffer:
            random.Random(f"{self.seed}/{self.epoch}").shuffle(order)
        return [self.shards[index] for index in order[me::consumers]]

    def __iter__(self) -> Iterator[dict[str, Any]]:
        me, _ = self.consumer()
        done = self.resume.get(me, 0)
        shards = self.assigned()
        generator = torch.Generator().manual_seed(random.Random(f"{self.seed}/{self.epoch}/{me}").getrandbits(62))
        drop = 0
        batches: Iterator[dict[str, Any]]
        if self.shuffle_buffer:
            batches = islice(self._batches(shards, generator, 0), done, None)
        else:  # batch k is rows [k * batch_size, (k + 1) * batch_size) of this consumer's shards
            drop = done * self.batch_size
            while shards and shards[0].rows <= drop:
                drop -= shards[0].rows
                shards = shards[1:]
            batches = self._batches(shards, generator, drop)
        # In a DataLoader worker a batch goes to the main process through shared memory, storage and all: a view
        # would take its whole shard along, so it gets storage of its own.
        own = get_worker_info() is not None
        for number, batch in enumerate(batches, done + 1):
            if own:
                batch = {name: value.clone() for name, value in batch.items()}
            batch["position"] = {me: number}
            yield batch

    def _batches(self, shards: list[ShardRef], generator: torch.Generator, drop: int) -> Iterator[dict[str, Any]]:
        """Batches of this consumer's rows, the first ``drop`` left out: in order, or through the shuffle buffer
        (filled to ``shuffle_buffer`` rows, shuffled, and drawn down to half before it is filled again)."""
        if not self.shuffle_buffer:
            yield from self._in_order(shards, drop)
            return
        size, keep = self.batch_size, self.shuffle_buffer // 2
        held: list[dict[str, torch.Tensor]] = []
        count = 0
        for tensors in self._fetched(shards):
            held.append(tensors)
            count += len(tensors["token_id"])
            if count < max(self.shuffle_buffer, size):
                continue
            pool = _permuted(_cat(held), generator)
            out = (count - keep) // size * size
            for start in range(0, out, size):
                yield {name: value[start : start + size] for name, value in pool.items()}
            held, count = [{name: value[out:] for name, value in pool.items()}], count - out
        if count:
            yield from self._tail(_permuted(_cat(held), generator), count)

    def _in_order(self, shards: list[ShardRef], drop: int) -> Iterator[dict[str, Any]]:
        """Batches in the harvest's order: views of each shard, one joined batch where shards meet."""
        size = self.batch_size
        rest: dict[str, torch.Tensor] = {}
        for tensors in self._fetched(shards):
            if drop:
                tensors, drop = {name: value[drop:] for name, value in tensors.items()}, 0
            start = 0
            if rest:
                start = size - len(rest["token_id"])
                tensors_head = {name: value[:start] for name, value in tensors.items()}
                rest = _cat([rest, tensors_head])
                if len(rest["token_id"]) < size:
                    continue
                yield rest
                rest = {}
            rows = len(tensors["token_id"])
            whole = start + (rows - start) // size * size
            for first in range(start, whole, size):
                yield {name: value[first : first + size] for name, value in tensors.items()}
            if whole < rows:
                rest = {name: value[whole:] for name, value in tensors.items()}
        if rest:
            yield from self._tail(rest, len(rest["token_id"]))

    def _tail(self, pool: dict[str, torch.Tensor], count: int) -> Iterator[dict[str, Any]]:
        for start in range(0, count, self.batch_size):
            if self.drop_last and start + self.batch_size > count:
                break
            yield {name: value[start : start + self.batch_size] for name, value in pool.items()}

    def _fetched(self, shards: list[ShardRef]) -> Iterator[dict[str, torch.Tensor]]:
        """Each shard's tensors, in order, ``prefetch`` GETs ahead; sha256-checked."""
        timeout = httpx.Timeout(300.0, connect=10.0)
        with httpx.Client(timeout=timeout, follow_redirects=True) as http, ThreadPoolExecutor(self.prefetch) as pool:
            pending: deque[Future[dict[str, torch.Tensor]]] = deque()
            for shard in shards:
                pending.append(pool.submit(self._read, http, shard))
                if len(pending) > self.prefetch:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()

    def _read(self, http: httpx.Client, shard: ShardRef) -> dict[str, torch.Tensor]:
        data, digest = _get(shard.url, http, self._headers(shard.url))
        if digest != shard.sha256:
            raise ShardCorrupt(f"{shard.name} arrived with sha256 {digest}, expected {shard.sha256}")
        return _tensors(data, (*self.captures, *COLUMNS), shard.name)

    def _headers(self, url: str) -> dict[str, str] | None:
        """The API key, for a shard read through the API (a store that cannot presign); None elsewhere."""
        return self.api[1] if self.api is not None and url.startswith(self.api[0] + "/") else None


def _tensors(data: bytearray, names: tuple[str, ...], shard: str) -> dict[str, torch.Tensor]:
    """The named tensors of a safetensors file's bytes, as views of them (no copy)."""
    size = int.from_bytes(data[:8], "little")
    header = json.loads(bytes(data[8 : 8 + size]))
    tensors = {}
    for name in names:
        entry = header.get(name)
        if entry is None or entry["dtype"] not in _DTYPES:
            raise ShardCorrupt(f"{shard} has no readable tensor {name!r}")
        start, stop = entry["data_offsets"]
        dtype = _DTYPES[entry["dtype"]]
        flat = torch.frombuffer(data, dtype=dtype, count=(stop - start) // dtype.itemsize, offset=8 + size + start)
        tensors[name] = flat.view(entry["shape"])
    return tensors


def _permuted(pool: dict[str, torch.Tensor], generator: torch.Generator) -> dict[str, torch.Tensor]:
    order = torch.randperm(len(pool["token_id"]), generator=generator)
    return {name: value[order] for name, value in pool.items()}


def _cat(parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    if len(parts) == 1:
        return parts[0]
    return {name: torch.cat([part[name] for part in parts]) for name in parts[0]}


def _key(capture: dict[str, Any]) -> str:
    part = capture.get("part")
    return f"{capture['module']}.{capture.get('io', 'output')}" + (
        f".{part}" if part not in (None, "residual_stream") else ""
    )


def _get(url: str, http: httpx.Client | None = None, headers: dict[str, str] | None = None) -> tuple[bytearray, str]:
    """A whole object and its sha256: an http(s) URL (read into one buffer as it arrives), or a local path."""
    if not url.startswith(("http://", "https://")):
        data = bytearray(Path(url.removeprefix("file://")).read_bytes())
        return data, hashlib.sha256(data).hexdigest()
    if http is None:
        with httpx.Client(timeout=300.0, follow_redirects=True) as own:
            return _get(url, own, headers)
    with http.stream("GET", url, headers=headers) as response:
        response.raise_for_status()
        data, digest = bytearray(), hashlib.sha256()
        for piece in response.iter_bytes(PIECE):
            digest.update(piece)
            data += piece
    return data, digest.hexdigest()
