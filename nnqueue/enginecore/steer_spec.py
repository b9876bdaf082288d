"""What a steering job edits: one edit per module point, its operation, vector and the tokens it applies to.

Shared by both sides of the engine boundary, as `harvest_spec` is: the API checks a submitted spec with these
types, the worker sends them to the engine as JSON with ``nnqueue_steer_begin``, and the engine rebuilds and
runs them (`nnqueue.enginecore.steering`). Stdlib only.

An edit's value ``x`` is the module point's value at one token (for a decoder layer, its residual stream by
default, as a harvest's capture reads it: `capture_points`); the operations, with ``c`` the coefficient and
``v`` the edit's vector (``u`` the same vector normalized):

* ``add``: ``x + c * v``
* ``scale``: ``c * x``
* ``project_out``: ``x - (x . u) u`` (the direction removed)
* ``zero``: ``0``
* ``set``: ``c * v`` (every applied token takes the value ``v``; ``c`` defaults to 1)

``apply_to`` picks the tokens: ``prompt`` (the prompt's positions, at prefill), ``generated`` (each generated
token as it is fed back), or ``both``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Literal

from nnqueue.enginecore.harvest_spec import DECODER_PARTS, IO, SpecError

Op = Literal["add", "scale", "project_out", "zero", "set"]
ApplyTo = Literal["prompt", "generated", "both"]
OPS: tuple[str, ...] = ("add", "scale", "project_out", "zero", "set")
APPLY_TO: tuple[str, ...] = ("prompt", "generated", "both")
WITH_VECTOR = frozenset({"add", "project_out", "set"})
MAX_EDITS = 64


@dataclass(frozen=True)
class Edit:
    """One operation at one module point.

    Attributes:
        module: a name of ``named_modules()`` of vLLM's model, e.g. ``"model.layers.16"``.
        io: ``"output"`` or ``"input"``.
        part: for a decoder layer, ``"residual_stream"`` (the default), ``"hidden"`` or ``"residual"``.
        op: see the module's docstring.
        coefficient: ``c``; ignored by ``project_out`` and ``zero``.
        vector: the name of the job's vector (for ``add``, ``project_out`` and ``set``), else None.
        apply_to: ``prompt``, ``generated`` or ``both``.
    """

    module: str
    op: Op
    io: IO = "output"
    part: str | None = None
    coefficient: float = 1.0
    vector: str | None = None
    apply_to: ApplyTo = "both"

    def __post_init__(self) -> None:
        if not self.module or not isinstance(self.module, str):
            raise SpecError("an edit needs a module name")
        if self.io not in ("input", "output"):
            raise SpecError(f"edit io must be 'input' or 'output', not {self.io!r}")
        if self.part is not None and self.part not in DECODER_PARTS:
            raise SpecError(f"edit part must be one of {list(DECODER_PARTS)} or null, not {self.part!r}")
        if self.op not in OPS:
            raise SpecError(f"edit op must be one of {list(OPS)}, not {self.op!r}")
        if self.apply_to not in APPLY_TO:
            raise SpecError(f"edit apply_to must be one of {list(APPLY_TO)}, not {self.apply_to!r}")
        if isinstance(self.coefficient, bool) or not isinstance(self.coefficient, (int, float)):
            raise SpecError(f"edit coefficient must be a number, not {self.coefficient!r}")
        if not math.isfinite(self.coefficient):
            raise SpecError("edit coefficient must be finite")
        if (self.op in WITH_VECTOR) != (self.vector is not None):
            need = "needs a vector" if self.op in WITH_VECTOR else "takes no vector"
            raise SpecError(f"edit op {self.op!r} {need}")

    @property
    def point(self) -> tuple[str, str]:
        return (self.module, self.io)

    def to_json(self) -> dict[str, Any]:
        return {
            "module": self.module,
            "io": self.io,
            "part": self.part,
            "op": self.op,
            "coefficient": float(self.coefficient),
            "vector": self.vector,
            "apply_to": self.apply_to,
        }

    @classmethod
    def from_json(cls, data: Any) -> Edit:
        fields = {"module", "io", "part", "op", "coefficient", "vector", "apply_to"}
        if not isinstance(data, dict) or set(data) - fields:
            raise SpecError(f"an edit has the fields {sorted(fields)}, not {data!r:.200}")
        return cls(
            module=data.get("module", ""),
            op=data.get("op", ""),
            io=data.get("io", "output"),
            part=data.get("part"),
            coefficient=data.get("coefficient", 1.0),
            vector=data.get("vector"),
            apply_to=data.get("apply_to", "both"),
        )


def check_edits(edits: list[Edit]) -> list[Edit]:
    """At least one edit, at most `MAX_EDITS`, one per module point (the engine applies one operation there)."""
    if not edits:
        raise SpecError("a steering job needs at least one edit")
    if len(edits) > MAX_EDITS:
        raise SpecError(f"a steering job has at most {MAX_EDITS} edits, not {len(edits)}")
    points = [f"{edit.module}.{edit.io}" for edit in edits]
    twice = sorted({point for point in points if points.count(point) > 1})
    if twice:
        raise SpecError(f"one edit per module point; more than one at {twice}")
    return edits
