"""A harvest's per-capture statistics: the mergeable sums one shard reports, and the summary a manifest keeps.

Each shard's writer (`nnqueue.enginecore.shard_stats`) reports, per capture, sums that add up across shards:
the rows counted, the per-dimension sum and sum of squares (float64, base64 of little-endian bytes: a
4096-wide capture is 43 kB, not the 170 kB of a JSON list), a histogram of the rows' L2 norms over fixed
log-spaced bins (so histograms of any shards add up bin by bin), the smallest and largest norm, and the NaN
and Inf elements. Rows with a NaN or Inf are counted there and left out of the sums and the histogram, so
one bad row does not turn every mean into NaN.

The manifest's summary (:func:`summarize`) gives per capture the count, the mean and std per dimension,
norm percentiles read off the histogram (within one bin, ``10 ** (1 / BINS_PER_DECADE)``, about 7.5%), and
the NaN/Inf counts. Stdlib only: the scheduler and the worker's frontend import it without torch.
"""

from __future__ import annotations

import base64
import math
import struct
from typing import Any

# Norm histogram: bin 0 holds norms below 10**LOW_DECADE (and zero), the last bin those from 10**HIGH_DECADE.
LOW_DECADE, HIGH_DECADE, BINS_PER_DECADE = -6, 8, 16
BINS = (HIGH_DECADE - LOW_DECADE) * BINS_PER_DECADE + 2
PERCENTILES = (0.1, 1, 5, 25, 50, 75, 95, 99, 99.9)
FIELDS = {"count", "sum", "sum_squares", "norm_histogram", "norm_min", "norm_max", "nan", "inf", "nonfinite_rows"}


def bin_edges() -> list[float]:
    """The norms where bins 1 .. BINS - 1 start (bin 0 starts at 0)."""
    return [10 ** (LOW_DECADE + i / BINS_PER_DECADE) for i in range(BINS - 1)]


def encode(values: list[float] | bytes) -> str:
    data = values if isinstance(values, bytes) else struct.pack(f"<{len(values)}d", *values)
    return base64.b64encode(data).decode()


def decode(text: str) -> list[float]:
    data = base64.b64decode(text, validate=True)
    if len(data) % 8:
        raise ValueError("a float64 vector's bytes are not a multiple of 8")
    return list(struct.unpack(f"<{len(data) // 8}d", data))


def check(stats: Any, keys: list[str]) -> dict[str, dict[str, Any]]:
    """One shard's reported statistics, checked (the engine process is untrusted); raises ValueError."""
    if not isinstance(stats, dict) or sorted(stats) != sorted(keys):
        raise ValueError(f"statistics for {sorted(stats) if isinstance(stats, dict) else stats!r:.200}, not {keys}")
    for key, entry in stats.items():
        if not isinstance(entry, dict) or set(entry) != FIELDS:
            raise ValueError(f"{key}: statistics need the fields {sorted(FIELDS)}")
        counts = [entry[name] for name in ("count", "nan", "inf", "nonfinite_rows")] + list(entry["norm_histogram"])
        if any(not isinstance(n, int) or isinstance(n, bool) or n < 0 for n in counts):
            raise ValueError(f"{key}: counts must be non-negative integers")
        if len(entry["norm_histogram"]) != BINS or sum(entry["norm_histogram"]) != entry["count"]:
            raise ValueError(f"{key}: the norm histogram needs {BINS} bins adding up to the count")
        if len(decode(entry["sum"])) != len(decode(entry["sum_squares"])):
            raise ValueError(f"{key}: the sums have different widths")
        if not all(isinstance(entry[name], (int, float)) for name in ("norm_min", "norm_max")):
            raise ValueError(f"{key}: norm_min and norm_max must be numbers")
    return stats


def merge(shards: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """The statistics of several shards as of one: sums added, histograms added bin by bin."""
    merged: dict[str, dict[str, Any]] = {}
    for shard in shards:
        for key, entry in shard.items():
            into = merged.get(key)
            if into is None:
                merged[key] = {**entry, "sum": decode(entry["sum"]), "sum_squares": decode(entry["sum_squares"])}
                continue
            for name in ("count", "nan", "inf", "nonfinite_rows"):
                into[name] += entry[name]
            into["sum"] = _add(into["sum"], decode(entry["sum"]))
            into["sum_squares"] = _add(into["sum_squares"], decode(entry["sum_squares"]))
            into["norm_histogram"] = [
                a + b for a, b in zip(into["norm_histogram"], entry["norm_histogram"], strict=True)
            ]
            if entry["count"]:
                empty = into["count"] == entry["count"]
                into["norm_min"] = entry["norm_min"] if empty else min(into["norm_min"], entry["norm_min"])
                into["norm_max"] = max(into["norm_max"], entry["norm_max"])
    return merged


def summarize(merged: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per capture: count, mean and std per dimension, norm percentiles and extremes, NaN/Inf counts."""
    summary = {}
    for key, entry in merged.items():
        count = entry["count"]
        mean = [total / count if count else 0.0 for total in entry["sum"]]
        variance = [
            max(sq / count - m * m, 0.0) if count else 0.0 for sq, m in zip(entry["sum_squares"], mean, strict=True)
        ]
        summary[key] = {
            "count": count,
            "width": len(mean),
            "mean": [round(m, 7) for m in mean],
            "std": [round(math.sqrt(v), 7) for v in variance],
            "norm": {
                "min": entry["norm_min"],
                "max": entry["norm_max"],
                "mean_square": sum(entry["sum_squares"]) / count if count else 0.0,
                "percentiles": percentiles(entry["norm_histogram"], entry["norm_min"], entry["norm_max"]),
                "histogram": {
                    "low_decade": LOW_DECADE,
                    "bins_per_decade": BINS_PER_DECADE,
                    "counts": entry["norm_histogram"],
                },
            },
            "nan": entry["nan"],
            "inf": entry["inf"],
            "nonfinite_rows": entry["nonfinite_rows"],
        }
    return summary


def percentiles(histogram: list[int], low: float, high: float) -> dict[str, float]:
    """Approximate norm percentiles: log-linear within the bin where each falls, clamped to [low, high]."""
    total = sum(histogram)
    if not total:
        return {}
    edges = [0.0, *bin_edges(), math.inf]
    found, seen, index = {}, 0, 0
    for p in PERCENTILES:
        target = p / 100 * total
        while index < len(histogram) - 1 and seen + histogram[index] < target:
            seen += histogram[index]
            index += 1
        start, stop = max(edges[index], low), min(edges[index + 1], high)
        fraction = (target - seen) / histogram[index] if histogram[index] else 0.0
        value = start * (stop / start) ** fraction if start > 0 and stop > start else start
        found[f"p{p:g}"] = min(max(value, low), high)
    return found


def _add(a: list[float], b: list[float]) -> list[float]:
    if len(a) != len(b):
        raise ValueError(f"statistics of widths {len(a)} and {len(b)} cannot be merged")
    return [x + y for x, y in zip(a, b, strict=True)]
