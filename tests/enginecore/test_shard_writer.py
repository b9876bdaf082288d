"""The shard writer: rows ordered by prompt then position whatever the steps' order, the same bytes for
the same rows, partial means combined, columns that address each prompt's rows and say which are generated,
outlier rows dropped or clipped and counted, safetensors-loadable."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest

from nnqueue.outliers import Outliers

if TYPE_CHECKING:
    import torch

    from nnqueue.enginecore.shard_writer import Block, ShardJob

LENGTHS = {1: 3, 3: 2, 5: 1, 9: 4}  # each prompt's length: positions from it on are generated tokens


def block(prompt: list[int], position: list[int], width: int = 3, counts: list[int] | None = None) -> Block:
    """Rows whose values encode (prompt, position), so any misplacement shows."""
    import torch

    from nnqueue.enginecore.shard_writer import Block

    values = torch.tensor(
        [[p * 100.0 + q + 0.5 * k for k in range(width)] for p, q in zip(prompt, position, strict=True)]
    )
    return Block(
        np.array(prompt),
        np.array(position),
        np.array([1000 + p * 10 + q for p, q in zip(prompt, position, strict=True)]),
        np.array([LENGTHS[p] for p in prompt]),
        counts=None if counts is None else np.array(counts),
        values={"a": values, "b": -values[:, :2].contiguous()},
    )


def job(
    tmp_path: Path,
    blocks: list[Block],
    name: str,
    mean: bool = False,
    dtype: torch.dtype | None = None,
    outliers: Outliers | None = None,
) -> ShardJob:
    """A chunk's shard of ``blocks`` (float32 unless ``dtype``)."""
    import torch

    from nnqueue.enginecore.shard_writer import ShardJob

    return ShardJob(
        chunk=name,
        keys=["b", "a"],
        dtype=torch.float32 if dtype is None else dtype,
        mean=mean,
        prompts=[1, 3, 5, 9],  # 9 has no rows (e.g. a position selection it is too short for)
        tokens=42,
        blocks=blocks,
        sink={"kind": "handoff", "path": str(tmp_path / f"{name}.safetensors")},
        metadata={"harvest": "h1"},
        cancelled=threading.Event(),
        outliers=outliers,
    )


def test_rows_grouped_by_prompt_whatever_the_step_order(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    from nnqueue.enginecore.shard_writer import write_shard

    steps = [block([5, 1, 1], [0, 2, 3]), block([3, 3], [0, 1]), block([1, 1], [0, 1])]  # prompt 1 over two steps
    entry = write_shard(job(tmp_path, steps, "one"))
    path = tmp_path / "one.safetensors"
    shard = load_file(path)
    assert shard["prompt_index"].tolist() == [1, 1, 1, 1, 3, 3, 5]
    assert shard["token_position"].tolist() == [0, 1, 2, 3, 0, 1, 0]
    assert shard["token_id"].tolist() == [1010, 1011, 1012, 1013, 1030, 1031, 1050]
    assert shard["a"][:, 0].tolist() == [100.0, 101.0, 102.0, 103.0, 300.0, 301.0, 500.0]
    torch.testing.assert_close(shard["b"], -shard["a"][:, :2])
    # Each row's prompt length; rows at or past it are of generated tokens (prompt 1's position 3 here).
    assert shard["prompt_length"].tolist() == [3, 3, 3, 3, 2, 2, 1]
    assert shard["generated"].dtype == torch.bool
    assert shard["generated"].tolist() == [False, False, False, True, False, False, False]
    assert entry["prompts"] == [[1, 0, 4], [3, 4, 2], [5, 6, 1], [9, 7, 0]]
    assert (entry["rows"], entry["tokens"], entry["steps"], entry["error"]) == (7, 42, 3, None)
    assert entry["generated_rows"] == 1 and entry["outliers"] is None
    assert entry["bytes"] == path.stat().st_size and entry["sha256"] == hashlib.sha256(path.read_bytes()).hexdigest()

    again = write_shard(job(tmp_path, list(reversed(steps)), "two"))
    assert again["sha256"] == entry["sha256"]


def test_partial_means_are_combined(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    from nnqueue.enginecore.shard_writer import Block, write_shard

    # mean rows: float32 sums over `counts` tokens; prompt 1 was prefilled over two steps.
    first = Block(np.array([1, 3]), np.array([-1, -1]), np.array([-1, -1]), np.array([3, 2]), np.array([2, 4]))
    first.values = {"a": torch.tensor([[2.0, 4.0], [8.0, 8.0]]), "b": torch.tensor([[1.0], [1.0]])}
    second = Block(np.array([1]), np.array([-1]), np.array([-1]), np.array([3]), np.array([2]))
    second.values = {"a": torch.tensor([[6.0, 0.0]]), "b": torch.tensor([[3.0]])}
    entry = write_shard(job(tmp_path, [first, second], "mean", mean=True, dtype=torch.bfloat16))
    shard = load_file(tmp_path / "mean.safetensors")
    assert shard["a"].dtype == torch.bfloat16
    assert shard["a"].float().tolist() == [[2.0, 1.0], [2.0, 2.0]]
    assert shard["b"].float().tolist() == [[1.0], [0.25]]
    assert shard["token_position"].tolist() == [-1, -1]
    assert shard["prompt_length"].tolist() == [3, 2] and shard["generated"].tolist() == [False, False]
    assert entry["prompts"] == [[1, 0, 1], [3, 1, 1], [5, 2, 0], [9, 2, 0]]


def outlying_steps() -> tuple[list[Block], torch.Tensor]:
    """Two steps of 40 rows of norm about 1 (capture "a"; "b" is its negation), three of them (rows 5, 17 and 33)
    scaled to norms 30 to 60; the rows in shard order."""
    import torch

    from nnqueue.enginecore.shard_writer import Block

    generator = torch.Generator().manual_seed(1)
    values = torch.randn(40, 4, generator=generator)
    values /= values.norm(dim=1, keepdim=True)
    for row, scale in ((5, 30.0), (17, 60.0), (33, 45.0)):
        values[row] *= scale
    steps = []
    for rows in (range(20), range(20, 40)):
        part = values[list(rows)]
        step = Block(np.full(20, 1), np.array(list(rows)), np.array(list(rows)), np.full(20, 50), values={})
        step.values = {"a": part.clone(), "b": -part[:, :2].clone()}
        steps.append(step)
    return steps, values


def test_outlier_rows_are_dropped_from_every_capture_and_counted(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    from nnqueue.enginecore.shard_writer import write_shard

    steps, values = outlying_steps()
    entry = write_shard(job(tmp_path, steps, "drop", outliers=Outliers("drop", times_median=10)))
    shard = load_file(tmp_path / "drop.safetensors")
    kept = [row for row in range(40) if row not in (5, 17, 33)]
    assert shard["token_position"].tolist() == kept and entry["rows"] == 37
    torch.testing.assert_close(shard["a"], values[kept])
    torch.testing.assert_close(shard["b"], -values[kept][:, :2])
    # The limit: 10x the median of the chunk's own norms (1, exactly, for "a"; "b" sees only two of four values).
    assert entry["outliers"]["limits"]["a"] == pytest.approx(10.0, rel=1e-5)
    assert entry["outliers"]["over"]["a"] == 3 and entry["outliers"]["dropped_rows"] == 3
    assert entry["stats"]["a"]["count"] == 37 and entry["stats"]["a"]["norm_max"] < 1.01  # of the rows written
    assert entry["prompts"][0] == [1, 0, 37]


def test_outlier_rows_are_clipped_to_the_limit(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import load_file

    from nnqueue.enginecore.shard_writer import write_shard

    steps, values = outlying_steps()
    entry = write_shard(job(tmp_path, steps, "clip", outliers=Outliers("clip", max_norm=40.0)))
    shard = load_file(tmp_path / "clip.safetensors")
    assert entry["rows"] == 40 and entry["outliers"]["dropped_rows"] == 0 and entry["outliers"]["over"]["a"] == 2
    norms = shard["a"].norm(dim=1)
    assert norms[[17, 33]].tolist() == pytest.approx([40.0, 40.0], rel=1e-5)
    assert norms[5].item() == pytest.approx(30.0, rel=1e-5)  # under the limit: as it was
    directions = torch.nn.functional.cosine_similarity(shard["a"][[17, 33]], values[[17, 33]])
    assert directions.tolist() == pytest.approx([1.0, 1.0], rel=1e-5)


def test_cancelled_write_leaves_nothing(tmp_path: Path) -> None:
    from nnqueue.enginecore.shard_writer import Cancelled, write_shard

    cancelled = job(tmp_path, [block([1], [0])], "cancelled")
    cancelled.cancelled.set()
    with pytest.raises(Cancelled):
        write_shard(cancelled)
    assert list(tmp_path.iterdir()) == []


def test_statistics_add_up_across_shards_and_leave_out_nonfinite_rows(tmp_path: Path) -> None:
    import torch

    from nnqueue.enginecore.harvest_stats import check, merge, summarize
    from nnqueue.enginecore.shard_writer import Block, write_shard

    generator = torch.Generator().manual_seed(0)
    first = torch.randn(300, 4, generator=generator) * torch.tensor([1.0, 2.0, 3.0, 4.0]) + 5
    second = torch.randn(200, 4, generator=generator) * 10
    second[7, 1], second[9] = float("nan"), float("inf")
    entries = []
    for name, values in (("s1", first), ("s2", second)):
        rows = values.shape[0]
        step = Block(
            np.zeros(rows, np.int64) + 1,
            np.arange(rows),
            np.arange(rows),
            np.full(rows, rows),
            values={"a": values, "b": values},
        )
        entries.append(write_shard(job(tmp_path, [step], name)))
    assert entries[1]["stats"]["a"]["nan"] == 1 and entries[1]["stats"]["a"]["inf"] == 4
    summary = summarize(merge([check(entry["stats"], ["b", "a"]) for entry in entries]))["a"]
    finite = torch.cat([first, second[[i for i in range(200) if i not in (7, 9)]]]).double()
    assert summary["count"] == 498 and summary["nonfinite_rows"] == 2 and summary["width"] == 4
    torch.testing.assert_close(torch.tensor(summary["mean"], dtype=torch.float64), finite.mean(0), atol=1e-5, rtol=1e-6)
    torch.testing.assert_close(
        torch.tensor(summary["std"], dtype=torch.float64), finite.std(0, correction=0), atol=1e-5, rtol=1e-6
    )
    norms = finite.norm(dim=1)
    assert summary["norm"]["min"] == pytest.approx(float(norms.min()), rel=1e-6)
    assert summary["norm"]["max"] == pytest.approx(float(norms.max()), rel=1e-6)
    for name, p in (("p5", 0.05), ("p50", 0.5), ("p95", 0.95)):
        exact = float(norms.quantile(p))
        assert summary["norm"]["percentiles"][name] == pytest.approx(exact, rel=0.08), name
    assert sum(summary["norm"]["histogram"]["counts"]) == 498


def test_reported_statistics_are_checked() -> None:
    from nnqueue.enginecore.harvest_stats import check

    entry = write_stats_entry()
    assert check({"a": entry}, ["a"]) == {"a": entry}
    with pytest.raises(ValueError, match="histogram"):
        check({"a": {**entry, "count": 3}}, ["a"])
    with pytest.raises(ValueError, match="statistics for"):
        check({"b": entry}, ["a"])
    with pytest.raises(ValueError, match="widths"):
        check({"a": {**entry, "sum": "AAAAAAAAAAA="}}, ["a"])


def write_stats_entry() -> dict:
    import torch

    from nnqueue.enginecore.shard_stats import Accumulator

    accumulator = Accumulator(2)
    accumulator.add(torch.tensor([[3.0, 4.0], [0.0, 0.0]]))
    return accumulator.to_json()
