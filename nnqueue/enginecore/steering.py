"""Declarative steering in the engine: one static-shaped operation per edited module point per step.

A steering job is begun on every rank (``nnqueue_steer_begin``: its edits and vectors), then its prompts
arrive as ordinary requests tagged ``extra_args["nnqueue_steer"] = {"job": key}``. As harvest capture does
(`harvest_capture`), each request gets a *slot* (numpy arrays: its job, its prompt length) when vLLM first
schedules it and loses it when it finishes; that is the only per-request Python.

Per step with steered requests in it, at the top of the runner's ``_model_forward``, the step's layout is
read from the runner (the input batch's request order, ``query_start_loc``, ``num_computed_tokens``), and
for every point some job of the step edits, numpy over the step's tokens fills that point's *persistent*
buffers: per token a mask, a scale, a projection flag, a coefficient and a row of the point's vector table
(each sized to the engine's ``max_num_batched_tokens``; the tables to `MAX_VECTORS` rows, fixed addresses).
One forward hook per point, installed the first time a job edits it, then applies every row's operation at
once (the `Edit` formula with per-row parameters) and keeps unedited rows exactly as they were
(``torch.where`` on the mask): requests without an edit there are untouched. Python work per step grows
with the points edited, not with the requests. The hooks are installed first in line (``prepend``): whatever
else hooks the module, a harvest capture of the same point (`harvest_capture`, e.g. a steering job's own
captures) included, sees the edited value, whichever was installed first.

Positions: a token is a prompt token when its position is below its request's prompt length, else a
generated one (the last sampled token fed back); ``apply_to`` selects on that.

Tensor parallelism: every rank runs the same layout and applies the same edit to its copy of the value;
only points whose value is whole on every rank are offered (`capture_points.replicated`), so each rank's
edit is the full one. Pipeline and data parallelism are refused, as for harvests.

CUDA graphs: the operation reads only the persistent buffers, so it is static-shaped; under vLLM's
breakable graphs (``VLLM_USE_BREAKABLE_CUDAGRAPH``, what nnsight's taps use) a hook that runs while a graph
is recorded registers itself with the recording's ``add_eager`` (as nnsight's ``VLLMInterleaver.handle``),
so replays apply it. The hooks must then exist before the recording (``NNQUEUE_STEER_POINTS``, hooked at
load); an eager engine (nnqueue's default) installs them on first use.
"""

from __future__ import annotations

import fnmatch
import logging
import os
import threading
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

import numpy as np
import torch

from nnqueue.enginecore import capture_points
from nnqueue.enginecore.capture_points import Reader
from nnqueue.enginecore.harvest_spec import IO, RESIDUAL_STREAM, Capture, SpecError
from nnqueue.enginecore.steer_spec import WITH_VECTOR, Edit, check_edits

TAG = "nnqueue_steer"  # the key of a steered request's extra_args
PREINSTALL_ENV = "NNQUEUE_STEER_POINTS"  # points hooked at load, for engines that record CUDA graphs
MAX_VECTORS = 1024  # rows of a point's vector table (row 0 is zeros: unedited tokens read it)
_APPLY_BITS = {"prompt": 1, "generated": 2, "both": 3}
log = logging.getLogger(__name__)


@dataclass(eq=False)
class SteerJob:
    key: str
    number: int
    edits: list[Edit]
    rows: dict[tuple[str, str], int]  # point -> its vector's row in the point's table (0: none)
    error: str | None = None  # an edit that could not be applied in some step


@dataclass(eq=False)
class PointState:
    """One steered point: its parameters per job number (numpy) and its per-token buffers (device)."""

    module: str
    io: str
    part: str | None
    width: int | None  # None: the module does not say (`capture_points.width`); no vectors then
    vectors: torch.Tensor  # [MAX_VECTORS, width] float32
    free_rows: list[int]
    # Per job number (index 0: no edit). apply: bits of _APPLY_BITS.
    apply: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int8))
    scale: np.ndarray = field(default_factory=lambda: np.ones(1, np.float32))
    project: np.ndarray = field(default_factory=lambda: np.zeros(1, np.float32))
    coefficient: np.ndarray = field(default_factory=lambda: np.zeros(1, np.float32))
    row: np.ndarray = field(default_factory=lambda: np.zeros(1, np.int64))
    # Per token of the step, persistent (CUDA graphs read them by address).
    mask: torch.Tensor | None = None
    token_scale: torch.Tensor | None = None
    token_project: torch.Tensor | None = None
    token_coefficient: torch.Tensor | None = None
    token_row: torch.Tensor | None = None
    filled: int = 0  # tokens whose mask the last fill may have set

    def grow(self, numbers: int) -> None:
        old = self.apply.size
        if numbers <= old:
            return
        extra = max(numbers, 2 * old) - old
        self.apply = np.concatenate([self.apply, np.zeros(extra, np.int8)])
        self.scale = np.concatenate([self.scale, np.ones(extra, np.float32)])
        self.project = np.concatenate([self.project, np.zeros(extra, np.float32)])
        self.coefficient = np.concatenate([self.coefficient, np.zeros(extra, np.float32)])
        self.row = np.concatenate([self.row, np.zeros(extra, np.int64)])


class Steering:
    """The steering state of one model runner (every rank)."""

    def __init__(self, runner: Any) -> None:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_world_size

        parallel = runner.vllm_config.parallel_config
        if get_pp_group().world_size > 1 or parallel.data_parallel_size > 1:
            raise SpecError("steering needs one engine process per model replica: no pipeline or data parallelism")
        self.runner = runner
        model = runner.get_model()
        self.modules = dict(model.named_modules())
        self.points = capture_points.capture_points(model, get_tensor_model_parallel_world_size())
        self.widths = {(p["module"], p["io"]): p["width"] for p in self.points}
        self.device: torch.device = runner.device
        self.max_tokens = int(runner.max_num_tokens)
        self.lock = threading.RLock()
        self.jobs: dict[str, SteerJob] = {}
        self.numbered: dict[int, SteerJob] = {}
        self.free_numbers: list[int] = []
        self.next_number = 1  # 0 is "no job"
        self.state: dict[tuple[str, str], PointState] = {}
        self.readers: dict[str, Reader] = {}
        self.hooks: dict[tuple[str, str], Any] = {}
        self.active: frozenset[tuple[str, str]] = frozenset()  # points with an edited token in this step
        self.slot_of: dict[str, int] = {}
        self.slot_request: list[str | None] = []
        self.slot_job = np.zeros(0, np.int64)
        self.slot_length = np.zeros(0, np.int64)
        self.free: list[int] = []

    # ------------------------------------------------------------ jobs (RPC thread)

    def begin(self, spec: dict[str, Any]) -> dict[str, Any]:
        """Begin job ``spec["job"]``: its edits, and ``spec["vectors"]``: name -> little-endian float32 bytes."""
        key = str(spec["job"])
        edits = check_edits([Edit.from_json(e) for e in spec["edits"]])
        capture_points.check_against([Capture(e.module, e.io, e.part) for e in edits], self.points)
        vectors = {str(name): _vector(data) for name, data in dict(spec.get("vectors") or {}).items()}
        for edit in edits:
            if edit.vector is None:
                continue
            if edit.vector not in vectors:
                raise SpecError(f"edit at {edit.module}.{edit.io} names vector {edit.vector!r}, which was not sent")
            width = self.widths.get(edit.point)
            if width is not None and vectors[edit.vector].numel() != width:
                raise SpecError(
                    f"vector {edit.vector!r} has {vectors[edit.vector].numel()} values; {edit.module}.{edit.io}"
                    f" has {width} features"
                )
        with self.lock:
            if key in self.jobs:
                self._end(self.jobs[key])
            number = self.free_numbers.pop() if self.free_numbers else self._new_number()
            job = SteerJob(key, number, edits, {})
            try:
                for edit in edits:
                    self._add_edit(job, edit, vectors.get(edit.vector) if edit.vector else None)
            except Exception:
                self._end(job)
                raise
            self.jobs[key] = self.numbered[number] = job
        return {"job": key}

    def end(self, key: str) -> dict[str, Any]:
        """Drop job ``key``: its slots and vector rows. Idempotent. ``{"ended": whether it was there, "error": why
        an edit of it could not be applied, or None}``."""
        with self.lock:
            job = self.jobs.get(key)
            if job is not None:
                self._end(job)
        return {"ended": job is not None, "error": job.error if job is not None else None}

    def stats(self) -> dict[str, int]:
        with self.lock:
            return {"jobs": len(self.jobs), "requests": len(self.slot_of), "hooked_points": len(self.hooks)}

    def _new_number(self) -> int:
        number, self.next_number = self.next_number, self.next_number + 1
        return number

    def _add_edit(self, job: SteerJob, edit: Edit, vector: torch.Tensor | None) -> None:
        point = self._point(edit)
        if edit.part != point.part and (edit.part or RESIDUAL_STREAM) != (point.part or RESIDUAL_STREAM):
            raise SpecError(
                f"{edit.module}.{edit.io} is steered as part {point.part or RESIDUAL_STREAM} on this engine;"
                " every job steers one part of a point"
            )
        point.grow(job.number + 1)
        row = 0
        if vector is not None:
            if not point.width:
                raise SpecError(f"{edit.module}.{edit.io} does not say its width: only scale and zero edit it")
            if not point.free_rows:
                raise SpecError(f"{edit.module}.{edit.io} holds {MAX_VECTORS - 1} vectors already; try again later")
            row = point.free_rows.pop()
            if edit.op == "project_out":
                norm = float(vector.norm())
                if norm == 0.0:
                    raise SpecError(f"vector {edit.vector!r} is zero: it has no direction to project out")
                vector = vector / norm
            point.vectors[row].copy_(vector.to(point.vectors.device))
            job.rows[edit.point] = row
        n = job.number
        point.apply[n] = _APPLY_BITS[edit.apply_to]
        point.scale[n] = {"scale": edit.coefficient, "zero": 0.0, "set": 0.0}.get(edit.op, 1.0)
        point.project[n] = 1.0 if edit.op == "project_out" else 0.0
        point.coefficient[n] = edit.coefficient if edit.op in WITH_VECTOR - {"project_out"} else 0.0
        point.row[n] = row

    def preinstall(self, names: list[str]) -> None:
        """Hook these points now (``module`` for its output, or ``module.input`` / ``module.output``), before vLLM
        records its CUDA graphs: a graph replays only the hooks that ran while it was recorded."""
        for name in self._expand(filter(None, (n.strip() for n in names))):
            module, _, suffix = name.rpartition(".")
            io: IO = "input" if suffix == "input" else "output"
            if suffix not in ("input", "output"):
                module = name
            capture_points.check_against([Capture(module, io)], self.points)
            with self.lock:
                self._state(module, io, None)

    def _expand(self, names: Iterable[str]) -> list[str]:
        """Names as given, and patterns (a worker's taps, ``model.layers.*.output``) as the points they match."""
        offered = [f"{p['module']}.{p['io']}" for p in self.points]
        expanded: list[str] = []
        for name in names:
            matches = fnmatch.filter(offered, name) if any(c in name for c in "*?[") else [name]
            if not matches:
                raise SpecError(f"{name} matches none of the engine's capture points")
            expanded += matches
        return expanded

    def _point(self, edit: Edit) -> PointState:
        if edit.vector is not None and self.widths.get(edit.point) is None:
            raise SpecError(f"{edit.module}.{edit.io} does not say its width: only scale and zero edit it")
        return self._state(edit.module, edit.io, edit.part)

    def _state(self, module: str, io: IO, part: str | None) -> PointState:
        key = (module, io)
        point = self.state.get(key)
        if point is None:
            width = self.widths.get(key)
            self.readers.setdefault(module, capture_points.reader(self.modules[module]))
            part = capture_points.default_part(self.readers[module], Capture(module, io, part))
            point = PointState(
                module,
                io,
                part,
                width,
                torch.zeros(MAX_VECTORS if width else 0, width or 0, dtype=torch.float32, device=self.device),
                list(range(MAX_VECTORS - 1, 0, -1)) if width else [],
            )
            point.mask = torch.zeros(self.max_tokens, dtype=torch.bool, device=self.device)
            point.token_scale = torch.ones(self.max_tokens, dtype=torch.float32, device=self.device)
            point.token_project = torch.zeros(self.max_tokens, dtype=torch.float32, device=self.device)
            point.token_coefficient = torch.zeros(self.max_tokens, dtype=torch.float32, device=self.device)
            point.token_row = torch.zeros(self.max_tokens, dtype=torch.int64, device=self.device)
            self.state[key] = point
            self._install(point)
        return point

    def _end(self, job: SteerJob) -> None:
        for edit in job.edits:
            point = self.state.get(edit.point)
            if point is None or point.apply.size <= job.number:
                continue
            point.apply[job.number] = 0
            row = job.rows.pop(edit.point, 0)
            if row:
                point.free_rows.append(row)
        for slot in np.flatnonzero(self.slot_job == job.number).tolist():
            self._free(slot)
        if self.jobs.get(job.key) is job:
            del self.jobs[job.key]
            del self.numbered[job.number]
            self.free_numbers.append(job.number)

    # ------------------------------------------------------------ requests (forward thread)

    def schedule(self, scheduler_output: Any) -> None:
        """Give the step's new steered requests slots; free those of finished (or aborted) ones."""
        with self.lock:
            if self.slot_of:
                for request_id in scheduler_output.finished_req_ids:
                    slot = self.slot_of.get(request_id)
                    if slot is not None:
                        self._free(slot)
            if not self.jobs:
                return
            for data in scheduler_output.scheduled_new_reqs:
                params = data.sampling_params
                tag = (params.extra_args or {}).get(TAG) if params is not None else None
                if isinstance(tag, dict) and data.req_id not in self.slot_of:
                    job = self.jobs.get(str(tag.get("job")))
                    if job is not None:
                        self._register(data.req_id, job.number, len(data.prompt_token_ids or ()))

    def _register(self, request_id: str, number: int, length: int) -> None:
        if not self.free:
            old = len(self.slot_request)
            new = max(64, 2 * old)
            self.slot_request.extend([None] * (new - old))
            self.slot_job = np.concatenate([self.slot_job, np.zeros(new - old, np.int64)])
            self.slot_length = np.concatenate([self.slot_length, np.zeros(new - old, np.int64)])
            self.free.extend(range(new - 1, old - 1, -1))
        slot = self.free.pop()
        self.slot_of[request_id] = slot
        self.slot_request[slot] = request_id
        self.slot_job[slot], self.slot_length[slot] = number, length

    def _free(self, slot: int) -> None:
        request_id = self.slot_request[slot]
        if request_id is None:
            return
        del self.slot_of[request_id]
        self.slot_request[slot] = None
        self.slot_job[slot] = 0
        self.free.append(slot)

    # ------------------------------------------------------------ steps (forward thread)

    @contextmanager
    def step(self) -> Iterator[None]:
        """Around the runner's ``_model_forward``: fill the step's buffers, let the hooks edit."""
        with self.lock:
            self.active = self._layout()
            try:
                yield
            finally:
                self.active = frozenset()

    def _layout(self) -> frozenset[tuple[str, str]]:
        runner = self.runner
        batch = runner.input_batch
        count = batch.num_reqs
        slots = np.fromiter(map(self.slot_of.get, batch.req_ids[:count], repeat(-1)), np.int64, count)
        steered = slots >= 0
        if not steered.any():
            return frozenset()
        starts = runner.query_start_loc.np[: count + 1].astype(np.int64)
        tokens = int(starts[count])
        per_request = np.diff(starts)
        number = np.where(steered, self.slot_job[np.maximum(slots, 0)], 0)
        length = np.where(steered, self.slot_length[np.maximum(slots, 0)], 0)
        # Token level: its request's job number, and whether it is a generated token.
        owner = np.repeat(np.arange(count), per_request)
        offset = np.arange(tokens) - starts[owner]
        position = batch.num_computed_tokens_cpu[:count].astype(np.int64)[owner] + offset
        token_job = number[owner]
        which = np.where(position >= length[owner], 2, 1).astype(np.int8)
        jobs = {self.numbered[int(n)] for n in np.unique(number) if int(n) in self.numbered}
        active = set()
        for point_key in {edit.point for job in jobs for edit in job.edits}:
            point = self.state[point_key]
            job_index = np.where(token_job < point.apply.size, token_job, 0)
            mask = (point.apply[job_index] & which) != 0
            if not mask.any():
                continue
            self._fill(point, tokens, job_index, mask)
            active.add(point_key)
        return frozenset(active)

    def _fill(self, point: PointState, tokens: int, job_index: np.ndarray, mask: np.ndarray) -> None:
        assert point.mask is not None and point.token_scale is not None and point.token_project is not None
        assert point.token_coefficient is not None and point.token_row is not None
        if tokens > self.max_tokens:
            raise SpecError(f"a step of {tokens} tokens is over the engine's {self.max_tokens}")
        index = np.where(mask, job_index, 0)
        for buffer, values in (
            (point.mask, mask),
            (point.token_scale, point.scale[index]),
            (point.token_project, point.project[index]),
            (point.token_coefficient, point.coefficient[index]),
            (point.token_row, point.row[index]),
        ):
            buffer[:tokens].copy_(torch.from_numpy(values), non_blocking=True)
        if point.filled > tokens:
            point.mask[tokens : point.filled].zero_()
        point.filled = tokens

    # ------------------------------------------------------------ hooks (forward thread, inside a step)

    def _install(self, point: PointState) -> None:
        key = (point.module, point.io)
        module = self.modules[point.module]
        read = self.readers[point.module]

        if point.io == "output":

            def on_output(_module: Any, _args: Any, output: Any) -> None:
                self._edit(key, point, *read.output_parts(output))

            self.hooks[key] = module.register_forward_hook(on_output, prepend=True)
        else:

            def on_input(_module: Any, args: Any, kwargs: Any) -> None:
                self._edit(key, point, *read.input_parts(args, kwargs))

            self.hooks[key] = module.register_forward_pre_hook(on_input, with_kwargs=True, prepend=True)

    def _edit(self, key: tuple[str, str], point: PointState, hidden: Any, residual: Any) -> None:
        """A hook never fails the step (other users' requests share it): a failure fails the point's jobs."""
        capture = _graph_capture()
        if capture is None and key not in self.active:
            return
        try:
            self._edit_or_record(key, point, hidden, residual, capture)
        except Exception as error:
            log.exception("steering %s.%s failed", *key)
            for job in self.jobs.values():
                if any(edit.point == key for edit in job.edits):
                    job.error = job.error or f"{key[0]}.{key[1]} could not be steered: {error!r}"

    def _edit_or_record(
        self, key: tuple[str, str], point: PointState, hidden: Any, residual: Any, capture: Any
    ) -> None:
        target, extra = hidden, None
        if point.part == "residual":
            target = residual
        elif point.part == RESIDUAL_STREAM and residual is not None:
            extra = residual
        if not isinstance(target, torch.Tensor) or not target.is_floating_point():
            raise SpecError(f"{point.module}.{point.io} is not a float tensor; it cannot be steered")
        if capture is None:
            self._apply(point, target, extra)
            return
        # Recording a graph: run at this point of every replay, against the recording's tensors, when the step
        # edits this point (nnsight's ``VLLMInterleaver.handle`` for taps).
        live_target, live_extra = _weak(target), (_weak(extra) if extra is not None else None)

        def replay() -> None:
            if key in self.active:
                self._apply(point, live_target, live_extra)

        capture.add_eager(replay)

    @staticmethod
    def _apply(point: PointState, target: torch.Tensor, extra: torch.Tensor | None) -> None:
        """``target`` (and ``extra``, the residual a decoder layer's stream adds to it) edited in place, every row
        at once: with ``s = target + extra``, ``target' = scale*target + (scale-1)*extra - scale*p*(s.u)u + c*v``,
        so that ``target' + extra`` is the `Edit` formula applied to ``s``, and an ``add`` is exactly
        ``target + c*v``. Rows whose mask is off keep their values."""
        assert point.mask is not None and point.token_scale is not None and point.token_project is not None
        assert point.token_coefficient is not None and point.token_row is not None
        rows = target.shape[0]
        flat = target.reshape(rows, -1)
        x = flat.float()
        scale = point.token_scale[:rows, None]
        edited = scale * x
        if point.width:  # a point without a width has no vectors: scale and zero only
            vectors = point.vectors.index_select(0, point.token_row[:rows])
            stream = x if extra is None else x + extra.reshape(rows, -1).float()
            projection = (stream * vectors).sum(-1, keepdim=True) * point.token_project[:rows, None]
            edited = edited - scale * projection * vectors + point.token_coefficient[:rows, None] * vectors
        if extra is not None:
            edited = edited + (scale - 1.0) * extra.reshape(rows, -1).float()
        flat.copy_(torch.where(point.mask[:rows, None], edited.to(flat.dtype), flat))


class SteerRunnerMixin:
    """Mixed into the model runner: steering's two points in a step, as `HarvestRunnerMixin`'s.

    Pass-throughs until a steering job has been begun on this rank, or points were preinstalled: the
    comma-separated ``NNQUEUE_STEER_POINTS`` of the engine's environment are hooked when the model is loaded,
    before vLLM records CUDA graphs (`Steering.preinstall`); an eager engine needs none.
    """

    nnqueue_steering: Steering | None = None

    def load_model(self, *args: Any, **kwargs: Any) -> Any:
        loaded = super().load_model(*args, **kwargs)  # type: ignore[misc]
        points = os.environ.get(PREINSTALL_ENV, "")
        if points.strip():
            self.nnqueue_steer().preinstall(points.split(","))
        return loaded

    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if self.nnqueue_steering is not None:
            self.nnqueue_steering.schedule(scheduler_output)
        return super().execute_model(scheduler_output, *args, **kwargs)  # type: ignore[misc]

    def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
        steering = self.nnqueue_steering
        if steering is None or not steering.slot_of:
            return super()._model_forward(*args, **kwargs)  # type: ignore[misc]
        with steering.step():
            return super()._model_forward(*args, **kwargs)  # type: ignore[misc]

    def nnqueue_steer(self) -> Steering:
        if self.nnqueue_steering is None:
            self.nnqueue_steering = Steering(self)
        return self.nnqueue_steering


def _vector(data: Any) -> torch.Tensor:
    if not isinstance(data, (bytes, bytearray)) or len(data) % 4:
        raise SpecError("a steering vector is sent as float32 bytes")
    vector = torch.frombuffer(bytearray(data), dtype=torch.float32)
    if not bool(torch.isfinite(vector).all()):
        raise SpecError("a steering vector has NaN or infinite values")
    return vector


def _graph_capture() -> Any:
    """vLLM's breakable CUDA-graph capture while it records (nnsight's ``interleaver._capture``), else None."""
    try:
        from vllm.compilation.breakable_cudagraph import BreakableCUDAGraphCapture
    except ImportError:
        return None
    capture = BreakableCUDAGraphCapture.current()
    return capture if capture is not None and getattr(capture, "_capturing", False) else None


def _weak(tensor: torch.Tensor) -> torch.Tensor:
    """A weak reference to a CUDA tensor (nnsight's ``interleaver._weak``): the recording's memory, not pinned."""
    from vllm.utils.torch_utils import weak_ref_tensor

    return weak_ref_tensor(tensor) if tensor.is_cuda else tensor
