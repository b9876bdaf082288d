"""Every ratio the benchmarks measured, as one table generated from ``benchmarks/results/*.json`` at build time, so
that the figures a reader looks up are the ones the runs wrote, never a copy that went stale.

A mkdocs hook (``hooks:`` in mkdocs.yml): ``on_page_markdown`` replaces the marker line ``<!-- benchmark-figures -->``
(docs/benchmarks/figures.md) with one row per ratio a results file records: the numbers under a key that names a
ratio (``ratios_vs_a``, ``ratios_vs_raw``, a row's ``ratio``, ``harvest_vs_bound``, ...), with the file, the device and
the date the run recorded (``device`` and ``date``, where it did). Pages quote a figure from this table and link it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

MARKER = "<!-- benchmark-figures -->"
RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"


def is_ratio_key(key: str) -> bool:
    """``ratios_vs_a``, ``ratio``, ``harvest_vs_bound``; not the checks beside them (``b_vs_c_rel_err``, ``..._pass``)."""
    return "ratio" in key or ("_vs_" in key and not key.endswith(("rel_err", "_pass", "_equal")))


def ratios(value: Any, path: tuple[str, ...] = (), counted: bool = False) -> list[tuple[str, float]]:
    """``(what, ratio)`` for each number in ``value`` under a ratio's key; ``what`` names the keys on its way."""
    if isinstance(value, dict):
        found = []
        for key, inner in value.items():
            found += ratios(inner, (*path, str(key)), counted or is_ratio_key(str(key)))
        return found
    if counted and isinstance(value, int | float) and not isinstance(value, bool):
        return [(" / ".join(path), float(value))]
    return []


def figures(results: Path = RESULTS) -> list[tuple[str, str, str, str, float]]:
    """``(file, device, date, what, ratio)`` for every ratio of every results file, by file then as written."""
    rows = []
    for path in sorted(results.glob("*.json")):
        data = json.loads(path.read_text())
        if not isinstance(data, dict):
            continue
        device, date = str(data.get("device", "")), str(data.get("date", ""))
        rows += [(path.name, device, date, what, value) for what, value in ratios(data)]
    return rows


def table(results: Path = RESULTS) -> str:
    lines = ["| results file | device | date | measurement | ratio |", "| --- | --- | --- | --- | ---: |"]
    for name, device, date, what, value in figures(results):
        cell = what.replace("|", "\\|")
        lines.append(f"| `{name}` | {device} | {date} | {cell} | {value:.3f} |")
    return "\n".join(lines)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    if MARKER not in markdown:
        return markdown
    return markdown.replace(MARKER, table())
