"""Train on a harvest straight from the object store: ``nnqueue.harvest.open(...)`` is a PyTorch ``IterableDataset``.

    dataset = nnqueue.harvest.open(harvest_id, client, batch_size=4096, shuffle_buffer=2**18)
    for batch in torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=4):
        acts = batch["model.layers.12.output"]          # [4096, d], the harvest's dtype
        position = batch["position"]                      # where this stream is: pass back as resume=

Shards are fetched ``prefetch`` GETs at a time on threads, a shard whose size is known in ranges of
``range_bytes`` (``Range`` GETs on the store's presigned URLs, so one large shard is read over several
connections; whole GETs through the API, which serves no ranges), each range read straight into its place in
the shard's one buffer (``http.client``'s ``readinto``: no per-piece copies, far less Python per byte than a
general HTTP client). Each shard's sha256 is checked against the manifest's before any row is used, and its
tensors are views of that buffer (the safetensors header parsed here; no copy). Each consumer (a ``DataLoader`` worker of a
rank) reads a disjoint set of shards, shard ``i`` of the (per-epoch, seeded) shard order going to consumer
``i % consumers``, so no row is read twice within an epoch whatever the workers and ranks; consumers end with
different row counts when the shards differ (``drop_last`` drops each consumer's final partial batch).

``shuffle_buffer`` rows are held and batches drawn at random from them (seeded per consumer and epoch), on top
of the shuffled shard order; 0 keeps the harvest's order (prompt, then position, within each shard).

Besides the captures, a batch has each row's ``prompt_index``, ``token_position``, ``token_id``, ``prompt_length``
(its prompt's length in tokens) and ``generated`` (bool: a token the model generated); harvests written before
nnqueue recorded the last two (manifest format ``nnqueue-harvest/1``) have only the first three. ``outliers``
(`nnqueue.outliers.Outliers`, or its JSON form) drops or clips rows over a norm limit as each shard arrives, a
``times_median`` limit taken from the manifest's median norm of each capture.

Resuming: every batch carries ``position``, ``{consumer: batches this consumer has yielded}`` for its consumer.
Keep the latest position per consumer (merge the dicts) and pass it as ``resume=`` with the same seed, epoch,
batch size, shuffle buffer, ranks and workers: each consumer's stream is deterministic, so it skips the batches
it already yielded (without a shuffle buffer, whole shards before that point are not even fetched).

``source`` is a harvest id (with a ``client``: shard URLs come from the API, presigned on S3) or the URL or
local path of a ``manifest.json`` (shards are read beside it: a downloaded harvest, or a public bucket).
"""

from __future__ import annotations

import hashlib
import http.client
import json
import random
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from itertools import islice
from pathlib import Path
from typing import Any
from urllib.parse import urljoin, urlsplit

import torch
from torch.utils.data import IterableDataset, get_worker_info

from nnqueue.client.client import Client
from nnqueue.client.errors import NNqueueError
from nnqueue.outliers import Outliers, harvest_limits, screened

COLUMNS = ("prompt_index", "token_position", "token_id")
LABELS = ("prompt_length", "generated")  # the columns of a manifest format nnqueue-harvest/2 and later
_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32, "I64": torch.int64, "BOOL": torch.bool}
PIECE = 1 << 20
RANGE_BYTES = 8 << 20  # the default size of one ranged GET
TIMEOUT_S = 300.0
REDIRECTS = 5


class ShardCorrupt(NNqueueError, RuntimeError):
    """A shard whose bytes do not have the sha256 its manifest records."""


@dataclass(frozen=True)
class ShardRef:
    """One shard to read: its name, rows and sha256 (from the manifest), where to GET it, and its size in bytes
    (from the manifest; None: unknown, read whole)."""

    name: str
    rows: int
    sha256: str
    url: str
    bytes: int | None = None


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
    range_bytes: int = RANGE_BYTES,
    outliers: Outliers | dict[str, Any] | None = None,
) -> HarvestDataset:
    """A completed harvest as an ``IterableDataset`` of batches (dicts of tensors); see the module docstring.

    ``captures``: the shard tensors to read (default: every capture). ``rank``/``world_size``: default from
    ``torch.distributed`` when it is initialized, else 0 and 1. ``prefetch``: GETs in flight (and shards read
    ahead); ``range_bytes``: the size of one ranged GET. ``outliers``: drop or clip rows over a norm limit
    (``{"action": "drop", "times_median": 10}``: rows over 10 times the median norm of their capture)."""
    if client is not None:
        harvest = client.get_harvest(source)
        manifest = harvest.manifest()
        api = client.url.rstrip("/")  # a store that cannot presign: shards come through the API, with the key
        shards = [
            ShardRef(
                s["name"],
                s["rows"],
                s["sha256"],
                f"{api}{s['url']}?inline=1" if s["url"].startswith("/") else s["url"],
                s.get("bytes"),
            )
            for s in harvest.shards()
        ]
    else:
        manifest = json.loads(bytes(_get(source)))
        base = source.split("?", 1)[0].rsplit("/", 1)[0]
        shards = [
            ShardRef(s["file"], s["rows"], s["sha256"], f"{base}/{s['file']}", s.get("bytes"))
            for s in manifest["shards"]
        ]
    if rank is None or world_size is None:
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        rank = torch.distributed.get_rank() if distributed else 0
        world_size = torch.distributed.get_world_size() if distributed else 1
    keys = [_key(capture) for capture in manifest["spec"]["captures"]]
    unknown = set(captures or ()) - set(keys)
    if unknown:
        raise ValueError(f"the harvest has no captures {sorted(unknown)}; it has {keys}")
    screening = None
    if outliers is not None:
        outliers = Outliers.from_json(outliers)
        screening = (outliers, harvest_limits(outliers, manifest.get("statistics") or {}, captures or keys))
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
        range_bytes=range_bytes,
        columns=COLUMNS + (LABELS if manifest.get("format") != "nnqueue-harvest/1" else ()),
        screening=screening,
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
        range_bytes: int = RANGE_BYTES,
        columns: tuple[str, ...] = COLUMNS,
        screening: tuple[Outliers, dict[str, float]] | None = None,
    ) -> None:
        if batch_size < 1 or shuffle_buffer < 0 or prefetch < 1 or range_bytes < 1 or not 0 <= rank < world_size:
            raise ValueError(
                "batch_size, prefetch and range_bytes must be positive, shuffle_buffer >= 0, 0 <= rank < world_size"
            )
        self.shards, self.captures = shards, captures
        self.batch_size, self.shuffle_buffer, self.seed, self.epoch = batch_size, shuffle_buffer, seed, epoch
        self.prefetch, self.drop_last, self.rank, self.world_size = prefetch, drop_last, rank, world_size
        self.resume, self.api, self.range_bytes = resume, api, range_bytes
        self.columns, self.screening = columns, screening

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
        dropping = self.screening is not None and self.screening[0].action == "drop"
        if self.shuffle_buffer or dropping:  # (rows dropped: a shard's rows are not the manifest's count)
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
        """Each shard's tensors, in order, with ``prefetch`` GETs in flight (ranges of the next shards too);
        sha256-checked."""
        with _Connections() as connections, ThreadPoolExecutor(self.prefetch) as pool:
            pending: deque[_Fetch] = deque()
            for shard in shards:
                pending.append(self._start(pool, connections, shard))
                if len(pending) > self.prefetch:
                    yield self._finish(pending.popleft())
            while pending:
                yield self._finish(pending.popleft())

    def _start(self, pool: ThreadPoolExecutor, connections: _Connections, shard: ShardRef) -> _Fetch:
        """Queue the GETs of ``shard``: its ranges into one buffer when it has a size and is read from the store,
        else one whole GET."""
        headers = self._headers(shard.url)
        remote = shard.url.startswith(("http://", "https://"))
        if shard.bytes is None or not remote or headers is not None:  # the API serves no ranges
            fetch = _Fetch(shard, bytearray(), 1)
            fetch.futures.append(pool.submit(fetch.whole, connections, headers))
            return fetch
        fetch = _Fetch(shard, bytearray(shard.bytes), -(-shard.bytes // self.range_bytes))
        view = memoryview(fetch.data)
        for start in range(0, shard.bytes, self.range_bytes):
            fetch.futures.append(pool.submit(fetch.part, connections, view[start : start + self.range_bytes], start))
        return fetch

    def _finish(self, fetch: _Fetch) -> dict[str, torch.Tensor]:
        for future in fetch.futures:
            future.result()
        if fetch.digest != fetch.shard.sha256:
            raise ShardCorrupt(f"{fetch.shard.name} arrived with sha256 {fetch.digest}, expected {fetch.shard.sha256}")
        tensors = _tensors(fetch.data, (*self.captures, *self.columns), fetch.shard.name)
        if self.screening is None:
            return tensors
        outliers, limits = self.screening
        return screened(tensors, limits, outliers.action)[0]

    def _headers(self, url: str) -> dict[str, str] | None:
        """The API key, for a shard read through the API (a store that cannot presign); None elsewhere."""
        return self.api[1] if self.api is not None and url.startswith(self.api[0] + "/") else None


class _Fetch:
    """One shard on its way: its buffer, the GETs filling it, and its sha256, taken as the bytes arrive in order:
    a GET's thread hashes the pieces that became contiguous from the start (one thread at a time), so hashing
    overlaps the other GETs and the batches being cut (hashlib releases the GIL)."""

    def __init__(self, shard: ShardRef, data: bytearray, parts: int) -> None:
        self.shard, self.data = shard, data
        self.futures: list[Future[None]] = []
        self.arrived: dict[int, int] = {}  # start -> stop of pieces not hashed yet
        self.hashed = 0  # bytes hashed, from the start
        self.hashing = False
        self.sha256 = hashlib.sha256()
        self.lock = threading.Lock()

    @property
    def digest(self) -> str | None:
        return self.sha256.hexdigest() if self.hashed == len(self.data) else None

    def whole(self, connections: _Connections, headers: dict[str, str] | None) -> None:
        self.data = _get(self.shard.url, connections, headers)
        self.sha256.update(self.data)
        self.hashed = len(self.data)

    def part(self, connections: _Connections, into: memoryview, start: int) -> None:
        connections.read_range(self.shard.url, into, start, self.arrive)

    def arrive(self, start: int, stop: int) -> None:
        """Bytes ``start .. stop - 1`` are in: hash what is contiguous from the start, unless a thread is at it."""
        with self.lock:
            self.arrived[start] = stop
            if self.hashing:
                return
            self.hashing = True
        view = memoryview(self.data)
        while True:
            with self.lock:
                stop = self.arrived.pop(self.hashed, -1)
                if stop < 0:
                    self.hashing = False
                    return
            self.sha256.update(view[self.hashed : stop])
            self.hashed = stop


class _Connections:
    """Keep-alive HTTP connections, one per thread and server, closed together at the end.

    ``http.client`` rather than httpx: a response read with ``readinto`` lands in the caller's buffer with one
    C-level copy from the socket, where a general client's per-piece Python (parsing, joining) costs more CPU
    than the transfer itself on a loaded machine."""

    def __init__(self) -> None:
        self.local = threading.local()
        self.lock = threading.Lock()
        self.all: list[http.client.HTTPConnection] = []

    def __enter__(self) -> _Connections:
        return self

    def __exit__(self, *exc: object) -> None:
        with self.lock:
            for connection in self.all:
                connection.close()

    def connection(self, scheme: str, netloc: str, fresh: bool = False) -> http.client.HTTPConnection:
        mine: dict[tuple[str, str], http.client.HTTPConnection] = self.local.__dict__.setdefault("connections", {})
        connection = mine.get((scheme, netloc))
        if connection is None or fresh:
            if connection is not None:
                connection.close()
            kind = http.client.HTTPSConnection if scheme == "https" else http.client.HTTPConnection
            connection = mine[(scheme, netloc)] = kind(netloc, timeout=TIMEOUT_S)
            with self.lock:
                self.all.append(connection)
        return connection

    def response(self, url: str, headers: dict[str, str]) -> http.client.HTTPResponse:
        """The response to a GET of ``url`` (redirects followed; the API key kept only for the same server),
        status 200 or 206; raises `ShardCorrupt` naming the status otherwise."""
        for _ in range(REDIRECTS + 1):
            parts = urlsplit(url)
            target = parts.path + (f"?{parts.query}" if parts.query else "")
            for attempt in range(2):  # a kept-alive connection the server closed meanwhile: once more, afresh
                connection = self.connection(parts.scheme, parts.netloc, fresh=attempt > 0)
                try:
                    connection.request("GET", target or "/", headers=headers)
                    response = connection.getresponse()
                    break
                except (http.client.RemoteDisconnected, ConnectionResetError, BrokenPipeError):
                    if attempt:
                        raise
            if response.status in (301, 302, 303, 307, 308) and response.getheader("Location"):
                response.read()
                moved = urljoin(url, response.getheader("Location", ""))
                if urlsplit(moved).netloc != parts.netloc:
                    headers = {name: value for name, value in headers.items() if name.lower() == "range"}
                url = moved
                continue
            if response.status not in (200, 206):
                body = response.read(2000)
                raise ShardCorrupt(f"GET {parts.netloc}{parts.path} answered {response.status}: {body[:500]!r}")
            return response
        raise ShardCorrupt(f"GET {url.split('?', 1)[0]}: more than {REDIRECTS} redirects")

    def read_range(self, url: str, into: memoryview, start: int, arrived: Callable[[int, int], None]) -> None:
        """Bytes ``start .. start + len(into) - 1`` of ``url`` into ``into``; ``arrived(a, b)`` as bytes
        ``a .. b - 1`` are in (pieces of ``PIECE``)."""
        response = self.response(url, {"Range": f"bytes={start}-{start + len(into) - 1}"})
        if response.status != 206:
            response.close()
            raise ShardCorrupt(f"GET {url.split('?', 1)[0]} ignored a Range request (answered {response.status})")
        _read_exactly(response, into, url, lambda a, b: arrived(start + a, start + b))


def _read_exactly(
    response: http.client.HTTPResponse,
    into: memoryview,
    url: str,
    arrived: Callable[[int, int], None] | None = None,
) -> None:
    done = 0
    while done < len(into):
        count = response.readinto(into[done : done + PIECE])
        if not count:
            raise ShardCorrupt(f"GET {url.split('?', 1)[0]}: the body ended after {done} of {len(into)} bytes")
        if arrived is not None:
            arrived(done, done + count)
        done += count
    if response.read(1):
        raise ShardCorrupt(f"GET {url.split('?', 1)[0]}: the body is longer than {len(into)} bytes")


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


def _get(url: str, connections: _Connections | None = None, headers: dict[str, str] | None = None) -> bytearray:
    """A whole object: an http(s) URL (into one buffer of its ``Content-Length``), or a local path."""
    if not url.startswith(("http://", "https://")):
        return bytearray(Path(url.removeprefix("file://")).read_bytes())
    if connections is None:
        with _Connections() as own:
            return _get(url, own, headers)
    response = connections.response(url, dict(headers or {}))
    length = response.getheader("Content-Length")
    if length is None:  # streamed without a length: piece by piece
        data = bytearray()
        while piece := response.read(PIECE):
            data += piece
        return data
    data = bytearray(int(length))
    _read_exactly(response, memoryview(data), url)
    return data
