"""What a harvest chunk captures: module points, the token selection, the stored dtype, the shard layout.

Shared by both sides of the engine boundary: the frontend (and the scheduler validating a spec at
submit) builds these, the engine process rebuilds them from the JSON dict the frontend sends with
``nnqueue_harvest_begin``. Stdlib only (and nnqueue's exception base), so importing it pulls in neither torch nor vLLM.

A shard (one safetensors file per chunk) holds, for each capture, a 2-D ``[rows, features]`` tensor
named by `Capture.key`, and three int64 columns shared by every capture: `PROMPT_INDEX`,
`TOKEN_POSITION` and `TOKEN_ID`. Rows are grouped by prompt in prompt-index order, and by position
within a prompt. A ``mean`` row has position and token id ``-1``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from nnqueue.errors import NNqueueError

IO = Literal["input", "output"]
SelectionKind = Literal["all", "first", "last", "mean", "positions"]

# vLLM decoder layers return ``(hidden, residual)`` and take ``(positions, hidden_states, residual)``;
# the residual stream (what Hugging Face calls the hidden state) is their sum.
RESIDUAL_STREAM = "residual_stream"
DECODER_PARTS = (RESIDUAL_STREAM, "hidden", "residual")
DTYPES = ("bfloat16", "float16", "float32")
PROMPT_INDEX, TOKEN_POSITION, TOKEN_ID = "prompt_index", "token_position", "token_id"
COLUMNS = (PROMPT_INDEX, TOKEN_POSITION, TOKEN_ID)
SHARD_FORMAT = "nnqueue-harvest-shard/1"


class SpecError(NNqueueError, ValueError):
    """A capture, selection or dtype that is not well-formed; the message says why."""


@dataclass(frozen=True)
class Capture:
    """One value to capture at every selected token.

    Attributes:
        module: the module's name in ``named_modules()`` of vLLM's model, e.g. ``"model.layers.16"``.
        io: ``"output"`` (what the module returns) or ``"input"`` (what it is called with).
        part: for a decoder layer, ``"residual_stream"`` (hidden + residual, equal to Hugging Face's
            hidden state; the default), ``"hidden"`` or ``"residual"`` (vLLM's raw halves). For any
            other module None: its tensor output, or its ``hidden_states`` / first argument as input.
    """

    module: str
    io: IO = "output"
    part: str | None = None

    def __post_init__(self) -> None:
        if not self.module or not isinstance(self.module, str):
            raise SpecError("a capture needs a module name")
        if self.io not in ("input", "output"):
            raise SpecError(f"capture io must be 'input' or 'output', not {self.io!r}")
        if self.part is not None and self.part not in DECODER_PARTS:
            raise SpecError(f"capture part must be one of {list(DECODER_PARTS)} or null, not {self.part!r}")

    @property
    def key(self) -> str:
        """The tensor's name in the shard: ``module.io``, plus ``.part`` for a raw decoder-layer half."""
        suffix = f".{self.part}" if self.part not in (None, RESIDUAL_STREAM) else ""
        return f"{self.module}.{self.io}{suffix}"

    def to_json(self) -> dict[str, Any]:
        return {"module": self.module, "io": self.io, "part": self.part}

    @classmethod
    def from_json(cls, data: Any) -> Capture:
        if not isinstance(data, dict) or set(data) - {"module", "io", "part"}:
            raise SpecError(f"a capture is {{'module', 'io', 'part'}}, not {data!r}")
        return cls(data.get("module", ""), data.get("io", "output"), data.get("part"))


@dataclass(frozen=True)
class Selection:
    """Which tokens of each prompt become rows.

    Attributes:
        kind: ``"all"`` every token; ``"first"`` / ``"last"`` the first / last ``n``; ``"mean"`` one row,
            the mean over the prompt's tokens (accumulated in float32); ``"positions"`` the listed
            positions (negative ones count from the end, as in Python; positions a prompt does not
            have are skipped, so such a prompt has fewer rows).
        n: for ``first`` / ``last``; default 1.
        positions: for ``positions``; rows come out in position order, each position once.
        skip: positions ``0 .. skip - 1`` of every prompt are never rows (e.g. an attention sink at
            position 0, whose norm dwarfs the others'); the selection applies to the positions after them:
            ``first`` counts from ``skip``, ``mean`` averages positions from ``skip`` on, and ``last`` /
            ``positions`` drop what falls before it. A prompt of ``skip`` tokens or fewer has no rows.
    """

    kind: SelectionKind = "all"
    n: int = 1
    positions: tuple[int, ...] = ()
    skip: int = 0

    def __post_init__(self) -> None:
        if self.kind not in ("all", "first", "last", "mean", "positions"):
            raise SpecError(f"unknown token selection {self.kind!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise SpecError(f"selection n must be a positive integer, not {self.n!r}")
        if self.kind == "positions" and not self.positions:
            raise SpecError("a 'positions' selection needs at least one position")
        if self.kind != "positions" and self.positions:
            raise SpecError(f"positions are only for a 'positions' selection, not {self.kind!r}")
        if not all(isinstance(p, int) for p in self.positions):
            raise SpecError("selection positions must be integers")
        if not isinstance(self.skip, int) or self.skip < 0:
            raise SpecError(f"selection skip must be a non-negative integer, not {self.skip!r}")

    def max_rows(self, length: int) -> int:
        """At most the rows this selection takes of a prompt of ``length`` tokens (exact but for ``positions``
        that a prompt lists twice, negative and positive)."""
        length = max(length - self.skip, 0)
        if self.kind == "all":
            return length
        if self.kind == "mean":
            return min(1, length)
        if self.kind in ("first", "last"):
            return min(self.n, length)
        return min(len(set(self.positions)), length)

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "n": self.n, "positions": list(self.positions), "skip": self.skip}

    @classmethod
    def from_json(cls, data: Any) -> Selection:
        if not isinstance(data, dict) or set(data) - {"kind", "n", "positions", "skip"}:
            raise SpecError(f"a selection is {{'kind', 'n', 'positions', 'skip'}}, not {data!r}")
        return cls(data.get("kind", "all"), data.get("n", 1), tuple(data.get("positions") or ()), data.get("skip", 0))


def check_dtype(dtype: str) -> str:
    if dtype not in DTYPES:
        raise SpecError(f"dtype must be one of {list(DTYPES)}, not {dtype!r}")
    return dtype


def check_captures(captures: list[Capture]) -> list[Capture]:
    if not captures:
        raise SpecError("a harvest needs at least one capture")
    keys = [capture.key for capture in captures]
    clashes = sorted({key for key in keys if keys.count(key) > 1} | (set(keys) & set(COLUMNS)))
    if clashes:
        raise SpecError(f"captures name the same tensor more than once: {clashes}")
    return captures
