"""A harvest's dataset: read from the spec or the object store, checked, and frozen as one JSONL object.

At submit the examples are read (inline ``prompts``/``token_ids``, a JSONL field, a Parquet column or the
lines of a text file, after ``offset`` and ``limit``) and written once to ``harvests/<id>/dataset.jsonl``,
one JSON value per line: a string or a list of token ids. Chunks read their byte range of that object, so
a chunk that runs again reads exactly the prompts it read the first time, even if the source file has
changed since, and the manifest's dataset digest (sha256 of that object) names what was harvested.

Files are read only under the caller's prefix ``users/<owner>/``; anything wrong is a
:class:`HarvestRejected` whose message is the 4xx reason.
"""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from nnqueue.scheduler.harvest_spec import DatasetSpec, HarvestRejected
from nnqueue.settings import Settings
from nnqueue.storage.object_store import ObjectNotFound, ObjectStore, validate_key

Example = str | list[int]


@dataclass(frozen=True)
class Limits:
    max_bytes: int  # of a dataset's source files together
    max_prompts: int
    # Harvests one API key may have queued or running at once (None: no cap).
    max_in_flight_per_key: int | None = None

    @classmethod
    def of(cls, settings: Settings) -> Limits:
        return cls(
            max_bytes=settings.harvest_max_dataset_bytes,
            max_prompts=settings.harvest_max_prompts,
            max_in_flight_per_key=settings.max_harvests_in_flight_per_key,
        )


@dataclass(frozen=True)
class FrozenDataset:
    data: bytes  # JSONL, one example per line
    line_starts: list[int]  # byte offset of each line, plus the end
    digest: str

    @property
    def prompts(self) -> int:
        return len(self.line_starts) - 1


def owner_prefix(owner: str) -> str:
    """``users/<owner, percent-quoted>/``: the store prefix whose files ``owner``'s harvests may read."""
    return f"users/{quote(owner, safe='')}/"


def upload_key(owner: str, harvest_id: str, filename: str) -> str:
    """Where a file uploaded with a harvest request is kept (under the owner's prefix, so later specs can name it)."""
    name = quote(filename.rsplit("/", 1)[-1] or "dataset", safe=".-_")
    return f"{owner_prefix(owner)}uploads/{harvest_id}/{name}"


def load_examples(store: ObjectStore, spec: DatasetSpec, owner: str, limits: Limits) -> list[Example]:
    """The spec's examples after offset and limit; raises :class:`HarvestRejected`."""
    if spec.inline is not None:
        examples: list[Any] = [_example(value, f"dataset item {index}") for index, value in enumerate(spec.inline)]
    elif spec.path is not None:
        examples, _ = _read_file(store, _own_key(spec.path, owner), spec, limits)
    elif spec.prefix is not None:
        examples = []
        budget = limits.max_bytes
        for key in store.list_keys(_own_key(spec.prefix, owner, prefix=True)):
            found, size = _read_file(store, key, spec, Limits(budget, limits.max_prompts))
            examples += found
            budget -= size
    else:
        raise HarvestRejected(422, "the dataset has no source: give prompts, token_ids or path, or upload a file")
    return _selected(examples, spec, limits)


def uploaded_examples(data: bytes, key: str, spec: DatasetSpec, limits: Limits) -> list[Example]:
    """The examples of a file uploaded with the harvest (to be kept at ``key``), parsed from the bytes in hand
    rather than read back from the store; raises :class:`HarvestRejected`."""
    return _selected(parse(data, spec.format or format_of(key), spec.field, repr(key)), spec, limits)


def _selected(examples: list[Example], spec: DatasetSpec, limits: Limits) -> list[Example]:
    """The examples after offset and limit, checked: not empty, not over the prompt limit."""
    end = None if spec.limit is None else spec.offset + spec.limit
    selected = examples[spec.offset : end]
    if not selected:
        where = f" after offset {spec.offset}" if spec.offset else ""
        raise HarvestRejected(422, f"the dataset is empty{where}: {len(examples)} examples in all")
    if len(selected) > limits.max_prompts:
        raise HarvestRejected(
            413,
            f"the dataset has {len(selected)} examples; the limit is {limits.max_prompts} "
            "(NNQUEUE_HARVEST_MAX_PROMPTS): use offset and limit to harvest it in parts",
        )
    return selected


def parse(data: bytes, fmt: str, field: str, name: str) -> list[Example]:
    """The examples in a file's bytes; raises :class:`HarvestRejected` naming the file."""
    if fmt == "parquet":
        return _parquet(data, field, name)
    try:
        text = data.decode()
    except UnicodeDecodeError as error:
        raise HarvestRejected(422, f"{name} is not UTF-8 text: {error}") from None
    if fmt == "text":
        return [line for line in text.splitlines() if line.strip()]
    examples: list[Example] = []
    for number, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as error:
            raise HarvestRejected(422, f"{name} line {number} is not JSON: {error}") from None
        if not isinstance(record, dict) or field not in record:
            fields = sorted(record) if isinstance(record, dict) else type(record).__name__
            raise HarvestRejected(422, f"{name} line {number} has no field {field!r}; it has {fields}")
        examples.append(_example(record[field], f"{name} line {number}"))
    return examples


def freeze(examples: list[Example]) -> FrozenDataset:
    """The examples as JSONL bytes, where each line starts, and their sha256."""
    starts, lines, offset = [0], [], 0
    for example in examples:
        line = (json.dumps(example, ensure_ascii=False) + "\n").encode()
        lines.append(line)
        offset += len(line)
        starts.append(offset)
    data = b"".join(lines)
    return FrozenDataset(data, starts, hashlib.sha256(data).hexdigest())


def read_slice(data: bytes) -> list[Example]:
    """The examples of a byte range of a frozen dataset (whole lines)."""
    return [json.loads(line) for line in data.decode().splitlines()]


def check_readable(spec: DatasetSpec, owner: str) -> None:
    """Raise :class:`HarvestRejected` (403, 422) if the spec names files ``owner`` may not read, without reading
    them (a schedule's may not exist yet when it is created)."""
    if spec.path is not None:
        _own_key(spec.path, owner)
    elif spec.prefix is not None:
        _own_key(spec.prefix, owner, prefix=True)


def _own_key(key: str, owner: str, *, prefix: bool = False) -> str:
    mine = owner_prefix(owner)
    try:
        validate_key(key.rstrip("/") if prefix else key)
    except ValueError as error:
        raise HarvestRejected(422, str(error)) from None
    if not key.startswith(mine):
        raise HarvestRejected(403, f"{key!r} is not under your prefix {mine!r}: a harvest reads only your own files")
    return key


def _read_file(store: ObjectStore, key: str, spec: DatasetSpec, limits: Limits) -> tuple[list[Example], int]:
    """The file's examples, and its size in bytes."""
    try:
        size = store.size(key)
    except ObjectNotFound:
        raise HarvestRejected(404, f"no file {key!r} in the object store") from None
    if size > limits.max_bytes:
        raise HarvestRejected(
            413, f"{key!r} is {size} bytes; the limit is {limits.max_bytes} (NNQUEUE_HARVEST_MAX_DATASET_BYTES)"
        )
    return parse(store.get_bytes(key), spec.format or format_of(key), spec.field, repr(key)), size


def format_of(key: str) -> str:
    lowered = key.lower()
    if lowered.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    if lowered.endswith((".parquet", ".pq")):
        return "parquet"
    return "text"


def _parquet(data: bytes, column: str, name: str) -> list[Example]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        parquet = pq.ParquetFile(io.BytesIO(data))
    except (pa.ArrowException, OSError) as error:
        raise HarvestRejected(422, f"{name} is not a Parquet file: {error}") from None
    columns = parquet.schema_arrow.names
    if column not in columns:
        raise HarvestRejected(422, f"{name} has no column {column!r}; its columns: {columns}")
    values = parquet.read(columns=[column]).column(column).to_pylist()
    return [_example(value, f"{name} row {row}") for row, value in enumerate(values)]


def _example(value: Any, where: str) -> Example:
    if isinstance(value, str):
        return value
    if isinstance(value, list) and value and all(isinstance(token, int) and token >= 0 for token in value):
        return value
    raise HarvestRejected(422, f"{where} is neither a string nor a non-empty list of token ids: {str(value)[:80]}")
