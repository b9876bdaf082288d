"""``nnqueue.harvest``, the streaming reader, on shards in the suite's S3 (SeaweedFS, presigned GETs) and on a
downloaded harvest: every row exactly once across DataLoader workers and ranks, with and without the shuffle
buffer; a resumed stream goes on where it stopped; a corrupt shard is refused; each row's prompt length and
generated flag come along (not in a harvest from before they were recorded); outlier rows are dropped or clipped."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from nnqueue.outliers import Outliers
from tests.utils.services import Services

if TYPE_CHECKING:
    from nnqueue.harvest import HarvestDataset, ShardRef

KEY = "model.layers.0.output"
ROWS = [50, 75, 64, 110, 1, 93, 70]  # per shard


def shard(first_row: int, rows: int, labels: bool = True) -> bytes:
    """Rows whose values name them: row r is [r, r, r, r] (its norm 2r); prompts of 10 rows, the last 3 generated."""
    import torch
    from safetensors.torch import save

    ids = torch.arange(first_row, first_row + rows)
    columns = {"prompt_length": torch.full((rows,), 7), "generated": ids % 10 >= 7} if labels else {}
    return save(
        {
            KEY: ids[:, None].float().repeat(1, 4),
            "prompt_index": ids // 10,
            "token_position": ids % 10,
            "token_id": ids,
            **columns,
        }
    )


@pytest.fixture(scope="module")
def shards() -> list[bytes]:
    starts = [sum(ROWS[:i]) for i in range(len(ROWS))]
    return [shard(start, rows) for start, rows in zip(starts, ROWS, strict=True)]


@pytest.fixture(scope="module")
def stored(services: Services, shards: list[bytes]) -> list[ShardRef]:
    from nnqueue.harvest import ShardRef

    refs = []
    for index, data in enumerate(shards):
        key = f"harvests/reader-test/shard-{index:05d}.safetensors"
        services.store.put_bytes(key, data)
        url = services.store.presigned_get_url(key, 600)
        refs.append(ShardRef(key, ROWS[index], hashlib.sha256(data).hexdigest(), url))
    return refs


def dataset(refs: list[ShardRef], **options: Any) -> HarvestDataset:
    from nnqueue.harvest import HarvestDataset

    settings: dict[str, Any] = {"batch_size": 16, "shuffle_buffer": 0, "seed": 0, "epoch": 0, "prefetch": 2}
    settings |= {"drop_last": False, "rank": 0, "world_size": 1, "resume": {}}
    return HarvestDataset(refs, [KEY], **(settings | options))


def rows_of(batches: Any) -> list[int]:
    import torch

    seen = []
    for batch in batches:
        assert torch.equal(batch[KEY][:, 0], batch["token_id"].float())  # values travel with their ids
        seen += batch["token_id"].tolist()
    return seen


@pytest.mark.parametrize("shuffle_buffer", [0, 64])
def test_every_row_once_across_workers_and_ranks(stored: list[ShardRef], shuffle_buffer: int) -> None:
    from torch.utils.data import DataLoader

    seen = []
    for rank in range(2):
        reader = dataset(stored, rank=rank, world_size=2, shuffle_buffer=shuffle_buffer)
        seen += rows_of(DataLoader(reader, batch_size=None, num_workers=2))
    assert sorted(seen) == list(range(sum(ROWS)))
    in_order = seen == sorted(seen)
    assert in_order is False  # four consumers interleave (and the buffer shuffles)


def test_one_consumer_reads_in_harvest_order_in_full_batches(stored: list[ShardRef]) -> None:
    batches = list(dataset(stored))
    assert rows_of(batches) == list(range(sum(ROWS)))
    assert [len(b["token_id"]) for b in batches] == [16] * (sum(ROWS) // 16) + [sum(ROWS) % 16]
    assert batches[-1]["position"] == {0: len(batches)}
    assert len(list(dataset(stored, drop_last=True))) == sum(ROWS) // 16


@pytest.mark.parametrize("shuffle_buffer", [0, 100])
def test_a_resumed_stream_goes_on_where_it_stopped(stored: list[ShardRef], shuffle_buffer: int) -> None:
    whole = rows_of(dataset(stored, shuffle_buffer=shuffle_buffer))
    stream = iter(dataset(stored, shuffle_buffer=shuffle_buffer))
    first = [next(stream) for _ in range(9)]  # past the first two shards (125 rows)
    position = first[-1]["position"]
    resumed = rows_of(dataset(stored, shuffle_buffer=shuffle_buffer, resume=position))
    assert rows_of(first) + resumed == whole


def test_a_corrupt_shard_is_refused(stored: list[ShardRef]) -> None:
    from nnqueue.harvest import ShardCorrupt, ShardRef

    bad = [*stored[:2], ShardRef(stored[2].name, stored[2].rows, "0" * 64, stored[2].url)]
    with pytest.raises(ShardCorrupt, match="shard-00002"):
        list(dataset(bad))


@pytest.mark.parametrize("range_bytes", [97, 4096, 1 << 20])
def test_ranged_reads_give_every_row_once_and_check_each_shard(
    stored: list[ShardRef], shards: list[bytes], range_bytes: int
) -> None:
    from nnqueue.harvest import ShardCorrupt, ShardRef

    # With their sizes the shards are read in Range GETs (a shard's ranges and the next shards' in flight
    # together), into one buffer each, hashed as the ranges arrive in order.
    sized = [ShardRef(r.name, r.rows, r.sha256, r.url, len(data)) for r, data in zip(stored, shards, strict=True)]
    assert rows_of(dataset(sized, range_bytes=range_bytes, prefetch=3)) == list(range(sum(ROWS)))
    bad = [*sized[:2], ShardRef(sized[2].name, sized[2].rows, "0" * 64, sized[2].url, sized[2].bytes)]
    with pytest.raises(ShardCorrupt, match=r"shard-00002\.safetensors arrived with sha256"):
        list(dataset(bad, range_bytes=range_bytes))
    short = [ShardRef(sized[0].name, sized[0].rows, sized[0].sha256, sized[0].url, sized[0].bytes + 10)]
    with pytest.raises(ShardCorrupt, match=r"416|ended after|arrived with sha256"):
        list(dataset(short, range_bytes=range_bytes))


def downloaded(folder: Path, shards: list[bytes], manifest_format: str = "nnqueue-harvest/2") -> str:
    """``shards`` as a downloaded harvest in ``folder`` (its median norm 100); its manifest's path."""
    folder.mkdir(exist_ok=True)
    entries = []
    for index, data in enumerate(shards):
        name = f"shard-{index:05d}.safetensors"
        (folder / name).write_bytes(data)
        entries.append({"file": name, "rows": ROWS[index], "sha256": hashlib.sha256(data).hexdigest()})
    manifest = {
        "format": manifest_format,
        "spec": {"captures": [{"module": "model.layers.0", "io": "output", "part": None}]},
        "statistics": {KEY: {"norm": {"percentiles": {"p50": 100.0}}}},
        "shards": entries,
    }
    (folder / "manifest.json").write_text(json.dumps(manifest))
    return str(folder / "manifest.json")


def test_open_reads_a_downloaded_harvest_by_its_manifest(tmp_path: Path, shards: list[bytes]) -> None:
    import torch

    import nnqueue.harvest

    reader = nnqueue.harvest.open(downloaded(tmp_path, shards), batch_size=100)
    assert reader.rows == sum(ROWS)
    batches = list(reader)
    assert rows_of(batches) == list(range(sum(ROWS)))
    generated = torch.cat([batch["generated"] for batch in batches])
    assert generated.dtype == torch.bool and generated.tolist() == [row % 10 >= 7 for row in range(sum(ROWS))]
    assert all((batch["prompt_length"] == 7).all() for batch in batches)
    with pytest.raises(ValueError, match="no captures"):
        nnqueue.harvest.open(downloaded(tmp_path, shards), captures=["model.layers.9.output"])

    # A harvest from before shards had the prompt_length and generated columns reads as it did.
    starts = [sum(ROWS[:i]) for i in range(len(ROWS))]
    old = [shard(start, rows, labels=False) for start, rows in zip(starts, ROWS, strict=True)]
    batches = list(nnqueue.harvest.open(downloaded(tmp_path / "old", old, "nnqueue-harvest/1"), batch_size=100))
    assert rows_of(batches) == list(range(sum(ROWS))) and "generated" not in batches[0]


def test_outlier_rows_are_dropped_or_clipped_as_they_arrive(tmp_path: Path, shards: list[bytes]) -> None:
    import torch

    import nnqueue.harvest

    manifest = downloaded(tmp_path, shards)
    # 4x the median norm (100): rows over 400, the rows r > 200, are left out; the others come once each.
    dropping = nnqueue.harvest.open(manifest, batch_size=64, outliers={"action": "drop", "times_median": 4})
    assert rows_of(dropping) == list(range(201))
    resumed = nnqueue.harvest.open(
        manifest, batch_size=64, outliers={"action": "drop", "times_median": 4}, resume={0: 2}
    )
    assert rows_of(resumed) == list(range(128, 201))  # the batches after the first two, of the rows kept
    clipping = nnqueue.harvest.open(manifest, batch_size=512, outliers=Outliers("clip", max_norm=300.0))
    values = torch.cat([batch[KEY] for batch in clipping])
    norms = values.norm(dim=1)
    assert len(values) == sum(ROWS) and norms.max().item() == pytest.approx(300.0, rel=1e-6)
    assert norms[:150].tolist() == pytest.approx([2.0 * row for row in range(150)], rel=1e-6)
