"""What a harvest chunk captures: module points, the token selection, the stored dtype, the shard layout.

Shared by both sides of the engine boundary: the frontend (and the scheduler validating a spec at
submit) builds these, the engine process rebuilds them from the JSON dict the frontend sends with
``nnqueue_harvest_begin``. Stdlib only (and nnqueue's exception base), so importing it pulls in neither torch nor vLLM.

A shard (one safetensors file per chunk) holds, for each capture, a 2-D ``[rows, features]`` tensor
named by `Capture.key`, and three int64 columns shared by every capture: `PROMPT_INDEX`,
`TOKEN_POSITION` and `TOKEN_ID`. Rows are grouped by prompt in prompt-index order, and by position
within a prompt. A ``mean`` row has position and token id ``-1``.

A chunk may also let the model generate (`Generation`) and take rows of the generated tokens
(`Selection.tokens`): positions from the prompt's length on, whose token ids are the sampled tokens. As in
a trace, a generated token is run through the model only when the model goes on to the next one, so the
last generated token of a sequence has no row: a prompt of ``L`` tokens that generated ``G`` has positions
``0 .. L + G - 2``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from nnqueue.errors import NNqueueError

IO = Literal["input", "output"]
SelectionKind = Literal["all", "first", "last", "mean", "positions"]
Tokens = Literal["prompt", "generated", "both"]

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
        tokens: which tokens the selection applies to: ``"prompt"`` (the default), ``"generated"`` (the
            tokens the model generated; `HarvestSpec.generate` must ask for generation) or ``"both"`` (the
            prompt, then its generated tokens, as one sequence). The kinds apply to that range: ``first`` /
            ``last`` are its first / last ``n``, ``mean`` its mean, ``positions`` count from its start (0 is
            the first generated token for ``"generated"``; negative ones from its end). ``skip`` stays a
            prompt position.
    """

    kind: SelectionKind = "all"
    n: int = 1
    positions: tuple[int, ...] = ()
    skip: int = 0
    tokens: Tokens = "prompt"

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
        if self.tokens not in ("prompt", "generated", "both"):
            raise SpecError(f"selection tokens must be 'prompt', 'generated' or 'both', not {self.tokens!r}")

    def span(self, length: int, generated: int = 0) -> tuple[int, int]:
        """The positions ``[start, stop)`` this selection applies to, for a prompt of ``length`` tokens that
        ran ``generated`` generated tokens through the model."""
        if self.tokens == "prompt":
            return 0, length
        return (length if self.tokens == "generated" else 0), length + generated

    def max_rows(self, length: int, generated: int = 0) -> int:
        """At most the rows this selection takes of a prompt of ``length`` tokens that runs at most ``generated``
        generated tokens through the model (exact but for ``positions`` that a prompt lists twice, negative
        and positive, and for generation that stops early)."""
        start, stop = self.span(length, generated)
        length = max(stop - max(start, self.skip), 0)
        if self.kind == "all":
            return length
        if self.kind == "mean":
            return min(1, length)
        if self.kind in ("first", "last"):
            return min(self.n, length)
        return min(len(set(self.positions)), length)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "n": self.n,
            "positions": list(self.positions),
            "skip": self.skip,
            "tokens": self.tokens,
        }

    @classmethod
    def from_json(cls, data: Any) -> Selection:
        if not isinstance(data, dict) or set(data) - {"kind", "n", "positions", "skip", "tokens"}:
            raise SpecError(f"a selection is {{'kind', 'n', 'positions', 'skip', 'tokens'}}, not {data!r}")
        return cls(
            data.get("kind", "all"),
            data.get("n", 1),
            tuple(data.get("positions") or ()),
            data.get("skip", 0),
            data.get("tokens", "prompt"),
        )


@dataclass(frozen=True)
class Generation:
    """Let the model generate after each prompt, as a trace with these sampling settings would.

    Attributes:
        max_tokens: tokens to generate at most (fewer when the model ends its sequence first, unless
            ``ignore_eos``).
        temperature: 0 is greedy.
        seed: the per-request sampling seed (the same seed, prompt and settings sample the same tokens as a
            trace job given them); None: unseeded.
        ignore_eos: keep generating past the end-of-sequence token, up to ``max_tokens``.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    seed: int | None = None
    ignore_eos: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise SpecError(f"generate max_tokens must be a positive integer, not {self.max_tokens!r}")
        temperature = self.temperature
        if isinstance(temperature, bool) or not isinstance(temperature, int | float) or not 0 <= temperature < 1e6:
            raise SpecError(f"generate temperature must be a number >= 0, not {temperature!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise SpecError(f"generate seed must be an integer or null, not {self.seed!r}")
        if not isinstance(self.ignore_eos, bool):
            raise SpecError(f"generate ignore_eos must be true or false, not {self.ignore_eos!r}")

    @property
    def positions(self) -> int:
        """At most the generated positions run through the model (the last token is sampled, never run)."""
        return self.max_tokens - 1

    def to_json(self) -> dict[str, Any]:
        return {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "seed": self.seed,
            "ignore_eos": self.ignore_eos,
        }

    @classmethod
    def from_json(cls, data: Any) -> Generation:
        fields = {"max_tokens", "temperature", "seed", "ignore_eos"}
        if not isinstance(data, dict) or set(data) - fields:
            raise SpecError(f"generate is {{'max_tokens', 'temperature', 'seed', 'ignore_eos'}}, not {data!r}")
        return cls(**data)


def check_generation(selection: Selection, generation: Generation | None) -> None:
    """A selection of generated tokens needs generation."""
    if selection.tokens != "prompt" and generation is None:
        raise SpecError(f"a selection of {selection.tokens!r} tokens needs 'generate' (max_tokens, ...)")


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
