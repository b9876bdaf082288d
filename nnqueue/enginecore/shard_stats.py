"""A shard's per-capture statistics, computed by the writer on the host rows it is about to write.

No second pass over the GPU: the writer thread already holds every row of the chunk in host memory
(`nnqueue.enginecore.shard_writer.Block`), so the sums are taken there, block by block, in float64
(float32 rows summed one block at a time, then added in float64). What is reported is the mergeable form
of `nnqueue.enginecore.harvest_stats` (sums, a fixed-bin norm histogram, NaN/Inf counts).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from nnqueue.enginecore.harvest_stats import BINS, BINS_PER_DECADE, LOW_DECADE, encode


class Accumulator:
    """The running sums of one capture's rows."""

    def __init__(self, width: int) -> None:
        self.count = 0
        self.sum = torch.zeros(width, dtype=torch.float64)
        self.sum_squares = torch.zeros(width, dtype=torch.float64)
        self.histogram = torch.zeros(BINS, dtype=torch.int64)
        self.norm_min, self.norm_max = float("inf"), 0.0
        self.nan = self.inf = self.nonfinite_rows = 0

    def add(self, rows: torch.Tensor) -> None:
        values = rows.float()
        finite = torch.isfinite(values)
        if not bool(finite.all()):
            self.nan += int(torch.isnan(values).sum())
            self.inf += int(torch.isinf(values).sum())
            whole = finite.all(dim=1)
            self.nonfinite_rows += int((~whole).sum())
            values = values[whole]
        if not values.shape[0]:
            return
        self.count += values.shape[0]
        self.sum += values.sum(0, dtype=torch.float64)
        self.sum_squares += values.square().sum(0, dtype=torch.float64)
        norms = torch.linalg.vector_norm(values, dim=1)
        self.norm_min = min(self.norm_min, float(norms.min()))
        self.norm_max = max(self.norm_max, float(norms.max()))
        bins = torch.floor((torch.log10(norms.double()) - LOW_DECADE) * BINS_PER_DECADE) + 1
        self.histogram += torch.bincount(bins.clamp(0, BINS - 1).long(), minlength=BINS)

    def to_json(self) -> dict[str, Any]:
        return {
            "count": self.count,
            "sum": encode(self.sum.numpy().astype("<f8").tobytes()),
            "sum_squares": encode(self.sum_squares.numpy().astype("<f8").tobytes()),
            "norm_histogram": self.histogram.tolist(),
            "norm_min": self.norm_min if self.count else 0.0,
            "norm_max": self.norm_max,
            "nan": self.nan,
            "inf": self.inf,
            "nonfinite_rows": self.nonfinite_rows,
        }


def shard_stats(keys: list[str], widths: dict[str, int], blocks: Iterable[Any]) -> dict[str, dict[str, Any]]:
    """Each capture's statistics over ``blocks`` (whose ``values`` map capture key -> ``[rows, width]``)."""
    sums = {key: Accumulator(widths[key]) for key in keys}
    for block in blocks:
        for key in keys:
            sums[key].add(block.values[key])
    return {key: accumulator.to_json() for key, accumulator in sums.items()}
