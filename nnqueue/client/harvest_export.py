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

``hf`` writes one row per harvested row: ``prompt_index``, ``token_position``, ``token_id``, ``prompt_length``,
``generated`` and one ``Sequence(float, d)`` column per capture; every selection exports. (A ``saelens`` export has
``generated`` too, per sequence; harvests from before nnqueue recorded them have neither column.)

``outliers`` (`nnqueue.outliers.Outliers`) drops or clips rows over a norm limit as each shard is read (one
streaming pass, as without it): an absolute norm, or a multiple of each capture's median norm from the manifest's
statistics. The export summary counts each capture's rows over its limit and the rows dropped.

A ``saelens`` export's ``nnqueue_export.json`` has a ``sae_lens`` block: the arguments of SAELens's
``LanguageModelSAERunnerConfig`` that follow from the harvest (the model class and name, the hook name, ``d_in``,
the context size, ``prepend_bos``: whether the harvested prompts began with a BOS token) and a set that works
together: ``train_batch_size_tokens`` (``batch_size_tokens``), ``n_batches_in_buffer`` (SAELens 6.54 refuses a
buffer, ``n_batches_in_buffer * context_size`` tokens, smaller than a training batch; this one holds
`BUFFER_BATCHES` batches, and at least SAELens's default 20 sequences), ``store_batch_size_prompts`` (at most the
sequences there are), ``n_batches_for_norm_estimate`` (at most one pass, at most SAELens's default 1000) and
``training_tokens`` (one pass over the export).

Arrow has no bfloat16: a ``bfloat16`` harvest is written as float32 (exact: every bfloat16 is a float32, at
twice the size); ``float16`` and ``float32`` are kept. ``nnqueue_export.json`` in the folder records the
conversion, the column names, the packing and the harvest's manifest.

Shards are read one at a time (sha256-checked) and written through ``datasets``' ``ArrowWriter``; the folder is
then saved with ``save_to_disk``, so the disk holds the export twice for a moment. ``datasets`` comes with
``pip install 'nnqueue[train]'``; without it the export says so before it reads anything.

``dest`` is a local folder, or ``s3://bucket/prefix`` (`nnqueue.client.export_upload`): the folder is written in a
local temporary folder, then uploaded under the prefix.
"""

from __future__ import annotations

import json
import math
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
from nnqueue.outliers import Outliers, harvest_limits, screened

Format = Literal["saelens", "hf"]
HookNames = Literal["module", "transformer-lens"]
EXPORT_FILE = "nnqueue_export.json"
COLUMNS = ("prompt_index", "token_position", "token_id")
LABELS = ("prompt_length", "generated")  # in shards of manifest format nnqueue-harvest/2 and later
ARROW_DTYPES = {"bfloat16": "float32", "float16": "float16", "float32": "float32"}
BATCH_SIZE_TOKENS = 4096  # SAELens's default train_batch_size_tokens
BUFFER_BATCHES = 4  # training batches SAELens's shuffling buffer holds, in the sae_lens block
_LAYER = re.compile(r"^(?:model\.)?layers\.(\d+)\.(input|output)$")


class ExportError(ValueError):
    """A harvest that cannot be exported as asked; the message says why."""


@dataclass
class ExportReport:
    """What an export wrote: rows, sequences (saelens), rows left over, columns and their widths, the dtype
    conversion, generated rows, what ``outliers`` did and the ``sae_lens`` block; ``path`` is the local folder or
    the ``s3://`` URL."""

    path: Path | str
    format: Format
    rows: int = 0
    sequences: int = 0
    dropped_rows: int = 0
    columns: dict[str, str] = field(default_factory=dict)  # shard tensor -> column
    widths: dict[str, int] = field(default_factory=dict)  # column -> d_in
    dtype: dict[str, str] = field(default_factory=dict)
    generated_rows: int = 0
    outliers: dict[str, Any] | None = None
    sae_lens: dict[str, Any] | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "rows": self.rows,
            "sequences": self.sequences,
            "dropped_rows": self.dropped_rows,
            "columns": self.columns,
            "widths": self.widths,
            "dtype": self.dtype,
            "generated_rows": self.generated_rows,
            "outliers": self.outliers,
            "sae_lens": self.sae_lens,
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


@dataclass(frozen=True)
class ExportOptions:
    """How to export: ``context_size`` (saelens: tokens per sequence), ``hook_names`` (see the module docstring),
    ``outliers`` (rows to drop or clip), and for the ``sae_lens`` block ``batch_size_tokens`` (SAELens's
    ``train_batch_size_tokens``) and ``model_name`` (the model SAELens loads; default: the manifest's repository,
    or the model folder's path relative to the worker's directory)."""

    context_size: int = 128
    hook_names: HookNames = "module"
    outliers: Outliers | None = None
    batch_size_tokens: int = BATCH_SIZE_TOKENS
    model_name: str | None = None


def require_train_extra() -> None:
    """Raise `ExportError` saying what to install when ``datasets`` (the ``train`` extra) is missing."""
    try:
        import datasets  # noqa: F401
    except ImportError as error:
        raise ExportError(
            f"exporting a harvest needs the training extra: pip install 'nnqueue[train]' ({error})"
        ) from None


def export(harvest: Harvest, dest: str | Path, fmt: Format, options: ExportOptions | None = None) -> ExportReport:
    """Write ``harvest`` (completed) into the new or empty folder ``dest`` (or under the new or empty prefix of an
    ``s3://bucket/prefix``) as ``fmt``; raises `ExportError`."""
    options = options or ExportOptions()
    require_train_extra()
    if not is_remote(dest):
        return _export(harvest, Path(dest), fmt, options)
    try:
        remote, client = S3Destination.parse(str(dest)), s3_client()
        remote.check_empty(client)
        with tempfile.TemporaryDirectory(prefix="nnqueue-export-") as folder:
            report = _export(harvest, Path(folder), fmt, options)
            remote.upload(client, Path(folder))
    except UploadError as error:
        raise ExportError(str(error)) from None
    report.path = str(remote)
    return report


def _export(harvest: Harvest, dest: Path, fmt: Format, options: ExportOptions) -> ExportReport:
    context_size = options.context_size
    if options.batch_size_tokens < 1:
        raise ExportError("batch_size_tokens must be at least 1")
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
    report = ExportReport(target, fmt, columns=column_names(manifest, options.hook_names))
    report.dtype = {"harvested": stored, "exported": ARROW_DTYPES[stored], "exact": "true"}
    labels = LABELS if manifest.get("format") != "nnqueue-harvest/1" else ()
    screening = _Screening.of(options.outliers, manifest, list(report.columns)) if options.outliers else None
    shards = (_load(harvest, shard, screening) for shard in harvest.shards())
    partial = target / ".partial"
    partial.mkdir(parents=True, exist_ok=True)
    try:
        if fmt == "saelens":
            _write_saelens(shards, report, context_size, labels, partial)
            report.sae_lens = sae_lens_block(manifest, report, options)
        else:
            _write_hf(shards, report, labels, partial)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    report.outliers = screening.to_json() if screening is not None else None
    (target / EXPORT_FILE).write_text(
        json.dumps({**report.to_json(), "context_size": context_size, "manifest": manifest}, indent=1)
    )
    return report


def sae_lens_block(manifest: dict[str, Any], report: ExportReport, options: ExportOptions) -> dict[str, Any]:
    """The arguments of SAELens's ``LanguageModelSAERunnerConfig`` that follow from a saelens export of the
    harvest (its first capture's column; see the module docstring)."""
    provenance = manifest.get("provenance") or {}
    model = provenance.get("model") or {}
    column = next(iter(report.columns.values()))
    batch, context_size = options.batch_size_tokens, options.context_size
    return {
        "model_class_name": "HookedTransformer" if options.hook_names == "transformer-lens" else "AutoModelForCausalLM",
        "model_name": options.model_name or model.get("repository") or model.get("path"),
        "hook_name": column,
        "d_in": report.widths[column],
        "context_size": context_size,
        "prepend_bos": bool(provenance.get("prompts_start_with_bos")),
        "train_batch_size_tokens": batch,
        "n_batches_in_buffer": max(20, math.ceil(BUFFER_BATCHES * batch / context_size)),
        "store_batch_size_prompts": max(1, min(32, report.sequences)),
        "n_batches_for_norm_estimate": max(1, min(1000, report.rows // batch)),
        "training_tokens": report.rows,
    }


@dataclass
class _Screening:
    """The export's outlier option, each capture's limit (from the manifest's statistics), and what it did."""

    outliers: Outliers
    limits: dict[str, float]  # shard tensor -> norm limit
    over: dict[str, int]
    dropped_rows: int = 0

    @classmethod
    def of(cls, outliers: Outliers, manifest: dict[str, Any], keys: list[str]) -> _Screening:
        try:
            limits = harvest_limits(outliers, manifest.get("statistics") or {}, keys)
        except ValueError as error:
            raise ExportError(str(error)) from None
        return cls(outliers, limits, dict.fromkeys(keys, 0))

    def apply(self, tensors: dict[str, Any]) -> dict[str, Any]:
        kept, found = screened(tensors, self.limits, self.outliers.action)
        for key, count in found.over.items():
            self.over[key] += count
        self.dropped_rows += len(next(iter(tensors.values()))) - len(next(iter(kept.values())))
        return kept

    def to_json(self) -> dict[str, Any]:
        return {**self.outliers.to_json(), "limits": self.limits, "over": self.over, "dropped_rows": self.dropped_rows}


def _load(harvest: Harvest, shard: dict[str, Any], screening: _Screening | None) -> dict[str, np.ndarray]:
    """A shard's tensors as numpy arrays, outliers screened, bfloat16 widened to float32."""
    import torch
    from safetensors.torch import load

    tensors = load(harvest.shard_bytes(shard))
    if screening is not None:
        tensors = screening.apply(tensors)
    return {
        name: (value.float() if value.dtype == torch.bfloat16 else value).numpy() for name, value in tensors.items()
    }


def _write_saelens(
    shards: Iterator[dict[str, np.ndarray]],
    report: ExportReport,
    context_size: int,
    labels: tuple[str, ...],
    partial: Path,
) -> None:
    from datasets import Array2D, Features, Sequence, Value

    first = next(shards)
    widths = {key: first[key].shape[1] for key in report.columns}
    report.widths = {column: widths[key] for key, column in report.columns.items()}
    dtype = report.dtype["exported"]
    generated = "generated" in labels
    features = Features(
        {
            **{column: Array2D((context_size, widths[key]), dtype) for key, column in report.columns.items()},
            "token_ids": Sequence(Value("int32"), length=context_size),
            **({"generated": Sequence(Value("bool"), length=context_size)} if generated else {}),
        }
    )
    pending: dict[str, list[np.ndarray]] = {
        key: [] for key in [*report.columns, "token_id", *(["generated"] if generated else [])]
    }
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
            if generated:
                batch["generated"] = joined["generated"][:whole].reshape(-1, context_size)
                report.generated_rows += int(batch["generated"].sum())
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


def _write_hf(
    shards: Iterator[dict[str, np.ndarray]], report: ExportReport, labels: tuple[str, ...], partial: Path
) -> None:
    from datasets import Features, Sequence, Value

    first = next(shards)
    widths = {key: first[key].shape[1] for key in report.columns}
    report.widths = {column: widths[key] for key, column in report.columns.items()}
    dtype = report.dtype["exported"]
    label_types = {"prompt_length": Value("int64"), "generated": Value("bool")}
    features = Features(
        {
            **{name: Value("int64") for name in COLUMNS},
            **{name: label_types[name] for name in labels},
            **{column: Sequence(Value(dtype), length=widths[key]) for key, column in report.columns.items()},
        }
    )
    with _Writer(partial / "rows.arrow", features) as writer:
        for tensors in chain([first], shards):
            plain = {name: tensors[name] for name in (*COLUMNS, *labels)}
            writer.write({**plain, **_renamed(tensors, report.columns)})
            report.rows += len(tensors["token_id"])
            report.generated_rows += int(tensors["generated"].sum()) if "generated" in labels else 0
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
