"""Outlier rows of a harvest: rows whose L2 norm is over a limit, dropped or clipped to it.

A model's attention-sink positions (the BOS token, or whichever early tokens a text makes the model use as one)
have residual norms tens to hundreds of times the others'; no fixed ``selection.skip`` removes them all, and a few
such rows can hold most of a batch's squared norm and spike an SAE's loss. `Outliers` names a limit, absolute
(``max_norm``) or a multiple of the rows' median norm (``times_median``), and what happens to a row over it:
``drop`` leaves the row out (with every capture's value of it), ``clip`` scales that capture's value down to the
limit (its direction kept).

Three places apply it, with the same `screen`: a harvest's spec (``outliers:``, in the engine's shard writer,
whose median is the chunk's own rows', computed exactly), and on the reading side the export
(``nnqueue harvest export --drop-norm-above 10x``) and the streaming reader (``nnqueue.harvest.open(...,
outliers=...)``), whose median is the harvest's, read off the manifest's norm histogram (within about 7.5%).

Shared by the server and the client (as `nnqueue.trace_payload` is): the standard library and the exception base
at import; torch only inside the functions that screen rows.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from nnqueue.errors import NNqueueError

if TYPE_CHECKING:
    import torch

Action = Literal["drop", "clip"]
_LIMIT = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*(x?)\s*$")


class OutlierSpecError(NNqueueError, ValueError):
    """An outlier option that is not well-formed; the message says why."""


@dataclass(frozen=True)
class Outliers:
    """Rows whose norm is over a limit, and what to do with them.

    Attributes:
        action: ``"drop"`` leaves such a row out (a row over the limit in any capture is left out of every
            capture); ``"clip"`` scales the capture's value to the limit's norm.
        max_norm: the limit, as a norm; or
        times_median: the limit, as this multiple of the median row norm (of each capture).
    """

    action: Action = "drop"
    max_norm: float | None = None
    times_median: float | None = None

    def __post_init__(self) -> None:
        if self.action not in ("drop", "clip"):
            raise OutlierSpecError(f"outliers action must be 'drop' or 'clip', not {self.action!r}")
        given = [name for name in ("max_norm", "times_median") if getattr(self, name) is not None]
        if len(given) != 1:
            raise OutlierSpecError("outliers need exactly one limit: max_norm (a norm) or times_median (a multiple)")
        value = getattr(self, given[0])
        if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < math.inf:
            raise OutlierSpecError(f"outliers {given[0]} must be a positive number, not {value!r}")

    @classmethod
    def parse(cls, action: Action, limit: str) -> Outliers:
        """From the command line: ``limit`` a norm (``"1500"``) or a multiple of the median (``"10x"``)."""
        found = _LIMIT.match(limit)
        if found is None:
            raise OutlierSpecError(
                f"an outlier limit is a norm (1500) or a multiple of the median norm (10x), not {limit!r}"
            )
        value = float(found[1])
        return cls(action, times_median=value) if found[2] else cls(action, max_norm=value)

    def limit(self, median: float) -> float:
        """The norm limit, for rows whose median norm is ``median``."""
        return self.max_norm if self.max_norm is not None else float(self.times_median or 0) * median

    def describe(self) -> str:
        limit = f"{self.max_norm:g}" if self.max_norm is not None else f"{self.times_median:g}x the median norm"
        return f"{self.action} rows with a norm over {limit}"

    def to_json(self) -> dict[str, Any]:
        return {"action": self.action, "max_norm": self.max_norm, "times_median": self.times_median}

    @classmethod
    def from_report(cls, report: Mapping[str, Any]) -> Outliers:
        """The option a report of what it did records (its fields, beside the limits and counts)."""
        return cls.from_json({name: report[name] for name in ("action", "max_norm", "times_median")})

    @classmethod
    def from_json(cls, data: Any) -> Outliers:
        if isinstance(data, Outliers):
            return data
        if not isinstance(data, dict) or set(data) - {"action", "max_norm", "times_median"}:
            raise OutlierSpecError(f"outliers are {{'action', 'max_norm' or 'times_median'}}, not {data!r:.200}")
        return cls(data.get("action", "drop"), data.get("max_norm"), data.get("times_median"))


@dataclass
class Screened:
    """What `screen` did to some rows: ``keep`` marks the rows left (None: all of them), ``over`` counts each
    capture's rows over its limit (dropped or clipped)."""

    keep: torch.Tensor | None
    over: dict[str, int]


def row_norms(rows: torch.Tensor) -> torch.Tensor:
    """Each row's L2 norm, in float32."""
    import torch

    return torch.linalg.vector_norm(rows.float(), dim=1)


def screen(
    values: Mapping[str, torch.Tensor],
    limits: Mapping[str, float],
    action: Action,
    norms: Mapping[str, torch.Tensor] | None = None,
) -> Screened:
    """Screen rows (``values``: capture -> ``[rows, width]``, the same rows in each) against each capture's limit
    in ``limits``: ``clip`` scales the rows over it in place; ``drop`` returns which rows to keep. Rows with a NaN
    or Inf are left as they are. ``norms``: the rows' norms, if already computed."""
    import torch

    dropped: torch.Tensor | None = None
    over: dict[str, int] = {}
    for key, limit in limits.items():
        rows = values[key]
        norm = norms[key] if norms is not None else row_norms(rows)
        beyond = (norm > limit) & torch.isfinite(norm)
        over[key] = int(beyond.sum())
        if not over[key]:
            continue
        if action == "clip":
            with torch.inference_mode(rows.is_inference()):  # an engine's captured rows are inference tensors
                rows[beyond] = (rows[beyond].float() * (limit / norm[beyond])[:, None]).to(rows.dtype)
        else:
            dropped = beyond if dropped is None else dropped | beyond
    return Screened(None if dropped is None else ~dropped, over)


def screened(
    tensors: Mapping[str, torch.Tensor], limits: Mapping[str, float], action: Action
) -> tuple[dict[str, torch.Tensor], Screened]:
    """`screen` a shard's ``tensors`` (captures and columns alike), then keep their rows kept."""
    found = screen(tensors, limits, action)
    if found.keep is None:
        return dict(tensors), found
    return {name: value[found.keep] for name, value in tensors.items()}, found


def harvest_limits(outliers: Outliers, statistics: Mapping[str, Any], keys: list[str]) -> dict[str, float]:
    """Each capture's limit from a harvest manifest's ``statistics`` (the median: its norm histogram's p50)."""
    if outliers.max_norm is not None:
        return dict.fromkeys(keys, outliers.max_norm)
    limits = {}
    for key in keys:
        median = ((statistics.get(key) or {}).get("norm") or {}).get("percentiles", {}).get("p50")
        if median is None:
            raise OutlierSpecError(f"the manifest has no norm statistics for {key}: give the limit as a norm")
        limits[key] = outliers.limit(float(median))
    return limits
