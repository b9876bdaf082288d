"""A completed harvest as a Hugging Face ``datasets`` folder: SAELens's cached activations, or one row per token.

``saelens`` writes what SAELens's cached-activations path reads (``CacheActivationsRunner`` writes it,
``ActivationsStore.load_cached_activation_dataset`` reads it with ``datasets.load_from_disk``): one column per
capture, ``Array2D((context_size, d_in))``, and ``token_ids`` (``Sequence(int32, context_size)``). Rows are
packed as SAELens packs its own token sequences: the harvest's rows, in prompt then position order, cut into
sequences of ``context_size`` tokens (a prompt may span two sequences; the rows left over at the end, fewer than
``context_size``, are dropped and counted). Only token-level rows of consecutive positions can be packed, so
a ``last``, ``mean`` or ``positions`` selection is refused. Beside it, ``tokens/`` holds the same sequences'
token ids as a pre-tokenized dataset (a ``tokens`` column) that ``load_dataset`` opens, for SAELens's
``dataset_path``.

Column names: a capture of a module's output (a decoder layer's residual stream) is named by its module
(``model.layers.12``), which is the hook name SAELens gives that module for a Hugging Face model
(``model_class_name="AutoModelForCausalLM"``); ``--hook-names transformer-lens`` names decoder layers as
TransformerLens does (``blocks.12.hook_resid_post``, an input ``blocks.12.hook_resid_pre``). Other captures keep
their shard name.

``hf`` writes one row per harvested row: ``prompt_index``, ``token_position``, ``token_id`` and one
``Sequence(float, d)`` column per capture; every selection exports.

Arrow has no bfloat16: a ``bfloat16`` harvest is written as float32 (exact: every bfloat16 is a float32, at
twice the size); ``float16`` and ``float32`` are kept. ``nnqueue_export.json`` in the folder records the
conversion, the column names, the packing and the harvest's manifest.

Shards are read one at a time (sha256-checked) and written through ``datasets``' ``ArrowWriter``; the folder is
then saved with ``save_to_disk``, so the disk holds the export twice for a moment.

``dest`` is a local folder, or ``s3://bucket/prefix`` (`nnqueue.client.export_upload`): the folder is written in a
local temporary folder, then uploaded under the prefix.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import chain
from pathlib import Path
from typing import Any, Literal

import numpy as np

from nnqueue.client.export_upload import S3Destination, UploadError, is_remote, s3_client
from nnqueue.client.harvest import Harvest

Format = Literal["saelens", "hf"]
HookNames = Literal["module", "transformer-lens"]
EXPORT_FILE = "nnqueue_export.json"
COLUMNS = ("prompt_index", "token_position", "token_id")
ARROW_DTYPES = {"bfloat16": "float32", "float16": "float16", "float32": "float32"}
_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(input|output)$")


class ExportError(ValueError):
    """A harvest that cannot be exported as asked; the message says why."""


@dataclass
class ExportReport:
    """What an export wrote: rows, sequences (saelens), rows dropped, columns and the dtype conversion; ``path``
    is the local folder or the ``s3://`` URL."""

    path: Path | str
    format: Format
    rows: int = 0
    sequences: int = 0
    dropped_rows: int = 0
    columns: dict[str, str] = field(default_factory=dict)  # shard tensor -> column
    dtype: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "rows": self.rows,
            "sequences": self.sequences,
            "dropped_rows": self.dropped_rows,
            "columns": self.columns,
            "dtype": self.dtype,
        }


def column_names(manifest: dict[str, Any], hook_names: HookNames) -> dict[str, str]:
    """Each capture's shard tensor name -> its column name (see the module docstring)."""
    names = {}
    for capture in manifest["spec"]["captures"]:
        module, io, part = capture["module"], capture.get("io", "output"), capture.get("part")
        key = f"{module}.{io}" + (f".{part}" if part not in (None, "residual_stream") else "")
        layer = _LAYER.match(f"{module}.{io}")
        if part not in (None, "residual_stream"):
            names[key] = key
        elif hook_names == "transformer-lens" and layer is not None:
            names[key] = f"blocks.{layer[1]}.hook_resid_{'post' if io == 'output' else 'pre'}"
        else:
            names[key] = module if io == "output" else key
    return names


def export(
    harvest: Harvest,
    dest: str | Path,
    fmt: Format,
    context_size: int = 128,
    hook_names: HookNames = "module",
) -> ExportReport:
    """Write ``harvest`` (completed) into the new or empty folder ``dest`` (or under the new or empty prefix of an
    ``s3://bucket/prefix``) as ``fmt``; raises `ExportError`."""
    if not is_remote(dest):
        return _export(harvest, Path(dest), fmt, context_size, hook_names)
    try:
        remote, client = S3Destination.parse(str(dest)), s3_client()
        remote.check_empty(client)
        with tempfile.TemporaryDirectory(prefix="nnqueue-export-") as folder:
            report = _export(harvest, Path(folder), fmt, context_size, hook_names)
            remote.upload(client, Path(folder))
    except UploadError as error:
        raise ExportError(str(error)) from None
    report.path = str(remote)
    return report


def _export(harvest: Harvest, dest: Path, fmt: Format, context_size: int, hook_names: HookNames) -> ExportReport:
    manifest = harvest.manifest()
    target = dest
    if target.exists() and any(target.iterdir()):
        raise ExportError(f"{target} is not empty: export into a new or empty folder")
    selection = manifest["spec"]["selection"]
    if fmt == "saelens" and selection["kind"] not in ("all", "first"):
        raise ExportError(
            f"a saelens export packs consecutive token positions into sequences of {context_size}; this harvest's "
            f"selection is {selection['kind']!r} (export it with --format hf, one row per harvested row)"
        )
    if context_size < 1:
        raise ExportError("context_size must be at least 1")
    stored = manifest["spec"]["dtype"]
    report = ExportReport(target, fmt, columns=column_names(manifest, hook_names))
    report.dtype = {"harvested": stored, "exported": ARROW_DTYPES[stored], "exact": "true"}
    shards = (_load(harvest, shard) for shard in harvest.shards())
    partial = target / ".partial"
    partial.mkdir(parents=True, exist_ok=True)
    try:
        if fmt == "saelens":
            _write_saelens(shards, report, context_size, partial)
        else:
            _write_hf(shards, report, partial)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    (target / EXPORT_FILE).write_text(
        json.dumps({**report.to_json(), "context_size": context_size, "manifest": manifest}, indent=1)
    )
    return report


def _load(harvest: Harvest, shard: dict[str, Any]) -> dict[str, np.ndarray]:
    """A shard's tensors as numpy arrays, bfloat16 widened to float32."""
    import torch
    from safetensors.torch import load

    tensors = load(harvest.shard_bytes(shard))
    return {
        name: (value.float() if value.dtype == torch.bfloat16 else value).numpy() for name, value in tensors.items()
    }


def _write_saelens(
    shards: Iterator[dict[str, np.ndarray]],
    report: ExportReport,
    context_size: int,
    partial: Path,
) -> None:
    from datasets import Array2D, Features, Sequence, Value

    first = next(shards)
    widths = {key: first[key].shape[1] for key in report.columns}
    dtype = report.dtype["exported"]
    features = Features(
        {
            **{column: Array2D((context_size, widths[key]), dtype) for key, column in report.columns.items()},
            "token_ids": Sequence(Value("int32"), length=context_size),
        }
    )
    pending: dict[str, list[np.ndarray]] = {key: [] for key in [*report.columns, "token_id"]}
    held = 0
    with _Writer(partial / "activations.arrow", features) as writer, _Tokens(Path(report.path), context_size) as tokens:
        for tensors in chain([first], shards):
            for key in pending:
                pending[key].append(tensors[key])
            held += len(tensors["token_id"])
            whole = held // context_size * context_size
            if not whole:
                continue
            joined = {key: np.concatenate(parts) for key, parts in pending.items()}
            ids = joined["token_id"][:whole].reshape(-1, context_size).astype(np.int32)
            batch = {
                column: joined[key][:whole].reshape(-1, context_size, widths[key])
                for key, column in report.columns.items()
            }
            writer.write({**batch, "token_ids": ids})
            tokens.write(ids)
            report.sequences += len(ids)
            report.rows += whole
            pending = {key: [value[whole:]] for key, value in joined.items()}
            held -= whole
    report.dropped_rows = held
    if not report.sequences:
        raise ExportError(
            f"the harvest has {held} rows, fewer than one sequence of {context_size}: choose a smaller --context-size"
        )
    _save(partial / "activations.arrow", Path(report.path))


def _write_hf(shards: Iterator[dict[str, np.ndarray]], report: ExportReport, partial: Path) -> None:
    from datasets import Features, Sequence, Value

    first = next(shards)
    widths = {key: first[key].shape[1] for key in report.columns}
    dtype = report.dtype["exported"]
    features = Features(
        {
            "prompt_index": Value("int64"),
            "token_position": Value("int64"),
            "token_id": Value("int64"),
            **{column: Sequence(Value(dtype), length=widths[key]) for key, column in report.columns.items()},
        }
    )
    with _Writer(partial / "rows.arrow", features) as writer:
        for tensors in chain([first], shards):
            writer.write({**{name: tensors[name] for name in COLUMNS}, **_renamed(tensors, report.columns)})
            report.rows += len(tensors["token_id"])
    _save(partial / "rows.arrow", Path(report.path))


def _renamed(tensors: dict[str, np.ndarray], columns: dict[str, str]) -> dict[str, np.ndarray]:
    return {column: tensors[key] for key, column in columns.items()}


class _Writer:
    """``datasets``' ArrowWriter over one file, batch by batch."""

    def __init__(self, path: Path, features: Any) -> None:
        from datasets.arrow_writer import ArrowWriter

        self.writer = ArrowWriter(features=features, path=str(path))
        self.features = features

    def __enter__(self) -> _Writer:
        return self

    def write(self, batch: dict[str, np.ndarray]) -> None:
        self.writer.write_batch(dict(batch))  # numpy arrays: datasets converts them without a Python loop

    def __exit__(self, *exc: object) -> None:
        self.writer.finalize()
        self.writer.close()


class _Tokens:
    """``tokens/tokens.parquet``: the sequences' token ids, a pre-tokenized dataset for SAELens's ``dataset_path``."""

    def __init__(self, folder: Path, context_size: int) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        (folder / "tokens").mkdir(parents=True, exist_ok=True)
        self.schema = pa.schema([("tokens", pa.list_(pa.int32(), context_size))])
        self.writer = pq.ParquetWriter(str(folder / "tokens" / "tokens.parquet"), self.schema)

    def __enter__(self) -> _Tokens:
        return self

    def write(self, ids: np.ndarray) -> None:
        import pyarrow as pa

        flat = pa.array(ids.reshape(-1), pa.int32())
        column = pa.FixedSizeListArray.from_arrays(flat, ids.shape[1])
        self.writer.write_table(pa.Table.from_arrays([column], schema=self.schema))

    def __exit__(self, *exc: object) -> None:
        self.writer.close()


def _save(arrow: Path, target: Path) -> None:
    """The Arrow file as a ``save_to_disk`` folder (``state.json``, ``dataset_info.json``, ``data-*.arrow``)."""
    from datasets import Dataset

    Dataset.from_file(str(arrow)).save_to_disk(str(target))
