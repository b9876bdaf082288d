"""In-engine activation capture for harvest chunks: forward hooks on vLLM's model, no per-request nnsight.

A harvest chunk is begun on the engine (``nnqueue_harvest_begin``: its captures, token selection,
dtype, prompt indices and sink), then its prompts arrive as ordinary prefill requests tagged
``extra_args["nnqueue_harvest"] = {"chunk": key, "prompt": global prompt index}``. Each request gets a
*slot* (numpy arrays: chunk, prompt index, prompt length, the selected range, positions captured so far)
when vLLM first schedules it, and loses it when its prompt is fully captured or it finishes; that is the
only per-request Python.

Per engine step with harvest requests in it, at the top of the runner's ``_model_forward`` (after
vLLM prepared the step's inputs), the step's layout is read from the runner: the input batch's request
order, ``query_start_loc`` (each request's first row in the flattened ``[num_tokens, hidden]``
activations) and ``num_computed_tokens`` (its first token's position). One C-level map of request ids
to slots, then numpy over the step's tokens, give each chunk's row indices, positions and token ids
for its selection. Forward hooks, installed once per module the first time a chunk asks for it, gather
those rows on the device (the residual stream as hidden + residual, a ``mean`` as a per-request
segment sum), convert the dtype and copy them to pinned host memory on a side CUDA stream (a plain
copy on CPU). Python work per step grows with the chunks and captures in it, not with its requests.

When a chunk's last prompt is captured its blocks go to the writer thread (`shard_writer`), which
writes the shard to the chunk's sink and posts the outcome to the outbox. ``nnqueue_harvest_abort``
drops a chunk: its slots, buffers and any write in progress.

Generation (a chunk begun with ``generate``): its requests sample up to ``max_tokens`` tokens, and each
decode step runs one generated token per request, batched with whatever else the engine runs. The same
layout maps those rows (one per request, at position ``num_computed_tokens``) to their requests and
positions; a decode token's id is read from the step's input ids (on the device under vLLM's async
scheduling, where the host copy holds placeholders: ``GPUModelRunner._prepare_input_ids``). A generating
request is captured until it finishes: when its last possible position ran, or when it appears in
``finished_req_ids`` (it ended early, e.g. at its end-of-sequence token). Selections that depend on
where a sequence ends (``last``, negative ``positions``) keep every candidate row of the generated range
while it runs and are settled once it ended (`Block.keep`, applied by the writer).

Positions are checked, not assumed: rows are taken only for positions not captured before (a
request recomputed after preemption adds no duplicates; decode steps of a prompt-only chunk add nothing), and a request whose
first scheduled position is past what was captured (tokens served from a prefix cache, never run
through the model) fails its chunk rather than leaving a hole. Harvest requests also ask vLLM to skip
reading the prefix cache. Chunked prefill is handled (a ``mean`` is summed over the pieces).

Tensor parallelism: only TP rank 0 captures and writes (it installs hooks; the other ranks do nothing);
captures are limited to values that are whole on every rank (`capture_points.replicated`).

Pipeline parallelism: each stage's TP rank 0 keeps a capture state for the modules its stage holds, and a
chunk is begun on every stage: the stage holding its captures takes it (captures, hooks, writer, outbox, as
with one stage), the others answer None. Every stage sees the same scheduler output and batch layout, so
rows, positions and token ids are the same as with one stage. A chunk's captures live on one stage
(`capture_points.check_against`): the stage's process streams the shard itself, so no rows cross between
processes and a harvest runs at the speed of one stage. Data parallelism is refused.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

import numpy as np
import torch

from nnqueue.enginecore import capture_points, outbox
from nnqueue.enginecore.capture_points import Reader
from nnqueue.enginecore.harvest_spec import (
    RESIDUAL_STREAM,
    Capture,
    Generation,
    Selection,
    SpecError,
    check_captures,
    check_dtype,
    check_generation,
)
from nnqueue.enginecore.shard_writer import Block, ShardJob, ShardWriter, failure
from nnqueue.errors import NNqueueError
from nnqueue.outliers import Outliers

TAG = "nnqueue_harvest"  # the key of a harvest request's extra_args
log = logging.getLogger(__name__)


class CaptureError(NNqueueError, RuntimeError):
    """A capture could not be read in a step; fails its chunk."""


@dataclass(eq=False)
class Chunk:
    key: str
    number: int
    captures: list[Capture]
    selection: Selection
    dtype: torch.dtype
    prompts: list[int]  # sorted, unique
    sink: dict[str, Any]
    metadata: dict[str, str]
    generation: Generation | None = None
    outliers: Outliers | None = None
    unregistered: set[int] = field(default_factory=set)  # prompts no request has claimed yet
    spans: dict[int, tuple[int, int]] = field(default_factory=dict)  # prompt -> its selection's range, once ended
    remaining: int = 0
    tokens: int = 0
    blocks: list[Block] = field(default_factory=list)
    error: str | None = None
    cancelled: threading.Event = field(default_factory=threading.Event)

    @property
    def generates(self) -> bool:
        """Whether its rows come from generated tokens too (its requests are captured until they end)."""
        return self.generation is not None and self.selection.tokens != "prompt"

    @property
    def settled_at_end(self) -> bool:
        """Whether which rows it keeps depends on where a generated sequence ends."""
        selection = self.selection
        return self.generates and (selection.kind == "last" or any(p < 0 for p in selection.positions))


@dataclass(eq=False)
class Take:
    """One chunk's rows in the current step, and the block they go into."""

    chunk: Chunk
    rows: int
    span: tuple[int, int] | None  # the rows are activations[a:b] ...
    index: torch.Tensor | None  # ... or these rows (on the activations' device)
    segments: torch.Tensor | None  # mean: each row's prompt within the step
    block: Block


@dataclass
class Step:
    tokens: int  # rows the step's activations have at least
    takes: dict[tuple[str, str], list[tuple[Take, Capture]]]
    slots: np.ndarray  # harvest requests in the step
    done: np.ndarray  # their positions captured once the step has run
    failed: dict[int, str]  # chunk number -> why, found while laying out the step
    fired: set[tuple[str, str]] = field(default_factory=set)


def selected(
    selection: Selection, position: np.ndarray, start: np.ndarray, stop: np.ndarray, final: bool = True
) -> np.ndarray:
    """Which tokens (``position``, of a sequence whose selected range is ``[start, stop)``) ``selection``
    keeps; vectorized. Not ``final``: ``stop`` only bounds a sequence still generating, so ``last`` and
    negative ``positions`` keep every candidate, to be settled with the final ``stop``."""
    first = np.maximum(start, selection.skip)
    kept = (position >= first) & (position < stop)
    if selection.kind == "first":
        return kept & (position < first + selection.n)
    if selection.kind == "last":
        return kept & (position >= stop - selection.n) if final else kept
    if selection.kind == "positions":
        targets = np.asarray(selection.positions, np.int64)
        if not final and (targets < 0).any():
            return kept
        resolved = np.where(targets < 0, stop[:, None] + targets, start[:, None] + targets)
        return kept & (position[:, None] == resolved).any(axis=1)
    return kept  # all, mean


@dataclass(frozen=True)
class StepTokens:
    """Where the requests ``rows`` (indices into the step's input batch) are in one step, token by token.

    ``owner[t]``: which of ``rows`` token ``t`` belongs to; ``flat[t]``: its row in the step's flattened
    ``[num_tokens, ...]`` activations; ``position[t]``: its position in its request's sequence (prompt, then
    generated tokens). ``begun[r]`` / ``count[r]``: the first position and the tokens request ``r`` runs in
    this step (a prefill or a piece of one: many; a decode step: one). ``tokens``: the step's rows in all.
    """

    owner: np.ndarray
    flat: np.ndarray
    position: np.ndarray
    begun: np.ndarray
    count: np.ndarray
    tokens: int


def step_tokens(runner: Any, rows: np.ndarray) -> StepTokens:
    """The tokens of the input batch's requests ``rows`` in the step the runner has prepared (call between
    vLLM's ``_prepare_inputs`` and the model's forward, e.g. in ``_model_forward``).

    Reads ``query_start_loc`` (each request's first row in the flattened activations) and the input
    batch's ``num_computed_tokens_cpu`` (its first token's position); numpy only, prefill and decode alike.
    Reusable by anything that maps a step's activation rows to requests and positions.
    """
    count_requests = runner.input_batch.num_reqs
    starts = runner.query_start_loc.np[: count_requests + 1].astype(np.int64)
    first, count = starts[rows], starts[rows + 1] - starts[rows]
    begun = runner.input_batch.num_computed_tokens_cpu[rows].astype(np.int64)
    owner = np.repeat(np.arange(rows.size), count)
    offset = np.arange(owner.size) - np.repeat(np.cumsum(count) - count, count)
    return StepTokens(owner, first[owner] + offset, begun[owner] + offset, begun, count, int(starts[count_requests]))


class HarvestCapture:
    """The capture state of one model runner (TP rank 0 of each pipeline stage)."""

    def __init__(self, runner: Any) -> None:
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_world_size

        if runner.vllm_config.parallel_config.data_parallel_size > 1:
            raise SpecError("harvests need one engine per model replica: no data parallelism")
        pipeline = get_pp_group()
        self.runner = runner
        model = runner.get_model()
        self.modules = dict(model.named_modules())
        self.staged = pipeline.world_size > 1
        stage = pipeline.rank_in_group if self.staged else None
        self.points = capture_points.capture_points(
            model, get_tensor_model_parallel_world_size(), stage, bool(pipeline.is_last_rank)
        )
        self.device: torch.device = runner.device
        # Under async scheduling the host input ids of decode tokens are placeholders; the device holds them.
        self.device_token_ids = bool(getattr(runner, "use_async_scheduling", False))
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self.lock = threading.RLock()
        self.chunks: dict[str, Chunk] = {}
        self.numbered: dict[int, Chunk] = {}
        self.next_number = 0
        self.readers: dict[str, Reader] = {}
        self.hooks: dict[tuple[str, str], Any] = {}
        self.writer = ShardWriter()
        self.current: Step | None = None
        # Slots: one per harvest request being captured.
        self.slot_of: dict[str, int] = {}
        self.slot_request: list[str | None] = []
        self.slot_chunk = np.zeros(0, np.int64)  # -1: free
        self.slot_prompt = np.zeros(0, np.int64)
        self.slot_prompt_length = np.zeros(0, np.int64)
        self.slot_start = np.zeros(0, np.int64)  # the first position of the selection's range
        self.slot_length = np.zeros(0, np.int64)  # positions to capture up to (a bound while generating)
        self.slot_done = np.zeros(0, np.int64)
        self.free: list[int] = []

    # ------------------------------------------------------------ chunks (RPC thread)

    def begin(self, spec: dict[str, Any]) -> dict[str, Any] | None:
        """Take the chunk ``spec``: ``{"chunk": key}``; None on a pipeline stage that holds none of its captures."""
        key = str(spec["chunk"])
        captures = check_captures([Capture.from_json(c) for c in spec["captures"]])
        if self.staged:
            mine = capture_points.held(captures, self.points)
            if not mine:
                return None
            if len(mine) < len(captures):
                others = [c.key for c in captures if c not in mine]
                raise SpecError(
                    f"{others} are not on pipeline stage {self.points[0]['stage']} with {mine[0].key}:"
                    " a harvest's captures must live on one stage"
                )
        capture_points.check_against(captures, self.points)
        selection = Selection.from_json(spec["selection"])
        generation = Generation.from_json(spec["generate"]) if spec.get("generate") else None
        check_generation(selection, generation)
        outliers = Outliers.from_json(spec["outliers"]) if spec.get("outliers") else None
        dtype = getattr(torch, check_dtype(spec["dtype"]))
        prompts = sorted({int(p) for p in spec["prompts"]})
        if not prompts:
            raise SpecError("a chunk needs at least one prompt")
        with self.lock:
            if key in self.chunks:
                self._drop(self.chunks[key])
            for capture in captures:
                self._install(capture.module, capture.io)
            chunk = Chunk(
                key,
                self.next_number,
                captures,
                selection,
                dtype,
                prompts,
                dict(spec["sink"]),
                {str(k): str(v) for k, v in (spec.get("metadata") or {}).items()},
                generation,
                outliers,
                unregistered=set(prompts),
                remaining=len(prompts),
            )
            self.next_number += 1
            self.chunks[key] = self.numbered[chunk.number] = chunk
        return {"chunk": key}

    def abort(self, key: str) -> bool:
        """Drop chunk ``key``: its requests' slots, its buffers, a write in progress. Idempotent."""
        with self.lock:
            chunk = self.chunks.get(key)
            if chunk is not None:
                self._drop(chunk)
        return self.writer.cancel(key) or chunk is not None

    def stats(self) -> dict[str, int]:
        with self.lock:
            return {
                "chunks": len(self.chunks),
                "requests": len(self.slot_of),
                "buffered_bytes": sum(b.nbytes() for c in self.chunks.values() for b in c.blocks),
                "writing": len(self.writer.pending),
                "hooked_points": len(self.hooks),
            }

    # ------------------------------------------------------------ requests (forward thread)

    def schedule(self, scheduler_output: Any) -> None:
        """Give the step's new harvest requests slots; end those of finished ones: a generating request is
        captured once it finished, any other (it finished before its prompt was captured) was aborted."""
        with self.lock:
            if self.slot_of:
                ended = set()
                for request_id in scheduler_output.finished_req_ids:
                    slot = self.slot_of.get(request_id)
                    if slot is None:
                        continue
                    chunk = self.numbered.get(int(self.slot_chunk[slot]))
                    if chunk is not None and chunk.generates:
                        ended.add(self._complete(slot))
                    else:
                        self._free(slot)
                self._conclude(ended)
            if not self.chunks:
                return
            for data in scheduler_output.scheduled_new_reqs:
                params = data.sampling_params
                tag = (params.extra_args or {}).get(TAG) if params is not None else None
                if isinstance(tag, dict) and data.req_id not in self.slot_of:
                    self._register(data.req_id, tag, len(data.prompt_token_ids or ()))

    def _register(self, request_id: str, tag: dict[str, Any], length: int) -> None:
        chunk, prompt = self.chunks.get(str(tag.get("chunk"))), tag.get("prompt")
        if chunk is None or not isinstance(prompt, int) or prompt not in chunk.unregistered or length == 0:
            return  # not (or no longer) ours, e.g. an aborted chunk's straggler: it runs uncaptured
        chunk.unregistered.remove(prompt)
        if not self.free:
            self._grow()
        slot = self.free.pop()
        self.slot_of[request_id] = slot
        self.slot_request[slot] = request_id
        self.slot_chunk[slot], self.slot_prompt[slot], self.slot_prompt_length[slot] = chunk.number, prompt, length
        generated = chunk.generation.positions if chunk.generates and chunk.generation is not None else 0
        self.slot_start[slot], self.slot_length[slot] = chunk.selection.span(length, generated)
        self.slot_done[slot] = 0

    def _grow(self) -> None:
        old = len(self.slot_request)
        new = max(64, 2 * old)
        self.slot_request.extend([None] * (new - old))
        self.slot_chunk = np.concatenate([self.slot_chunk, np.full(new - old, -1, np.int64)])
        self.slot_prompt, self.slot_prompt_length, self.slot_start, self.slot_length, self.slot_done = (
            np.concatenate([array, np.zeros(new - old, np.int64)])
            for array in (self.slot_prompt, self.slot_prompt_length, self.slot_start, self.slot_length, self.slot_done)
        )
        self.free.extend(range(new - 1, old - 1, -1))

    def _free(self, slot: int) -> None:
        request_id = self.slot_request[slot]
        if request_id is None:
            return
        del self.slot_of[request_id]
        self.slot_request[slot] = None
        self.slot_chunk[slot] = -1
        self.free.append(slot)

    # ------------------------------------------------------------ steps (forward thread)

    @contextmanager
    def step(self) -> Iterator[None]:
        """Around the runner's ``_model_forward``: lay out the step, let the hooks capture, settle.

        A failure of the capture path fails the harvest chunks, never the step: the engine and its
        other requests (other users' traces) go on.
        """
        with self.lock:
            step: Step | None = None
            try:
                step = self._layout()
            except Exception as error:  # noqa: BLE001
                self._fail_all(error)
            self.current = step
            try:
                yield
            finally:
                self.current = None
            if step is not None:
                try:
                    self._settle(step)
                except Exception as error:  # noqa: BLE001
                    self._fail_all(error)

    def _fail_all(self, error: Exception) -> None:
        log.exception("harvest capture failed; failing every chunk on this engine")
        for chunk in list(self.chunks.values()):
            outbox.post(failure(chunk.key, f"the engine's capture path failed: {error!r}"))
            self._drop(chunk)

    def _layout(self) -> Step | None:
        runner = self.runner
        batch = runner.input_batch
        count_requests = batch.num_reqs
        # The only walk over the step's requests: C-level dict lookups, no Python frame per request.
        slots = np.fromiter(map(self.slot_of.get, batch.req_ids[:count_requests], repeat(-1)), np.int64, count_requests)
        rows = np.flatnonzero(slots >= 0)
        if not rows.size:
            return None
        tokens = step_tokens(runner, rows)
        slot, owner, position = slots[rows], tokens.owner, tokens.position
        start, length, done, chunk_of = (
            self.slot_start[slot],
            self.slot_length[slot],
            self.slot_done[slot],
            self.slot_chunk[slot],
        )
        failed = {
            int(number): "a prompt's tokens were served from vLLM's prefix cache, not run through the model"
            for number in np.unique(chunk_of[tokens.begun > done])
        }
        fresh = (position >= done[owner]) & (position < length[owner])
        takes: dict[tuple[str, str], list[tuple[Take, Capture]]] = {}
        for number in np.unique(chunk_of):
            chunk = self.numbered[int(number)]
            if chunk.error or int(number) in failed:
                continue
            final = not chunk.generates  # else the range ends where the sequence will
            kept = selected(chunk.selection, position, start[owner], length[owner], final)
            chosen = np.flatnonzero(fresh & (chunk_of[owner] == number) & kept)
            if chosen.size:
                take = self._take(chunk, tokens.flat[chosen], owner[chosen], slot, position[chosen])
                for capture in chunk.captures:
                    takes.setdefault((capture.module, capture.io), []).append((take, capture))
        return Step(
            tokens=tokens.tokens,
            takes=takes,
            slots=slot,
            done=np.maximum(done, np.minimum(tokens.begun + tokens.count, length)),
            failed=failed,
        )

    def _take(self, chunk: Chunk, flat: np.ndarray, owner: np.ndarray, slot: np.ndarray, position: np.ndarray) -> Take:
        segments = None
        if chunk.selection.kind == "mean":
            owners, segment = np.unique(owner, return_inverse=True)
            none = np.full(owners.size, -1, np.int64)
            lengths = self.slot_prompt_length[slot[owners]]
            block = Block(self.slot_prompt[slot[owners]], none, none.copy(), lengths, counts=np.bincount(segment))
            segments = torch.from_numpy(segment).to(self.device, non_blocking=True)
        else:
            lengths = self.slot_prompt_length[slot[owner]]
            block = Block(self.slot_prompt[slot[owner]], position, self._token_ids(chunk, flat), lengths)
        contiguous = int(flat[-1]) - int(flat[0]) + 1 == flat.size  # rows ascend, so this means a range
        return Take(
            chunk,
            rows=flat.size,
            span=(int(flat[0]), int(flat[-1]) + 1) if contiguous else None,
            index=None if contiguous else torch.from_numpy(flat).to(self.device, non_blocking=True),
            segments=segments,
            block=block,
        )

    def _token_ids(self, chunk: Chunk, flat: np.ndarray) -> np.ndarray:
        """The step's input token ids at rows ``flat``: from the host, or for a generating chunk under async
        scheduling a host copy of the device's (filled by the side stream; the writer waits for it)."""
        if not (self.device_token_ids and chunk.generates):
            return np.asarray(self.runner.input_ids.np[flat], np.int64)
        device = self.runner.input_ids.gpu
        picked = device.index_select(0, torch.from_numpy(flat).to(device.device, non_blocking=True))
        return self._to_host(picked).numpy()

    def _settle(self, step: Step) -> None:
        """After the forward: check every capture ran, keep the blocks, advance slots, finish chunks."""
        for point, wanted in step.takes.items():
            for take, capture in wanted:
                if point not in step.fired and take.chunk.error is None:
                    take.chunk.error = (
                        f"{capture.module} did not run in the engine's forward, so its {capture.io} was not"
                        " captured (an engine that replays CUDA graphs or compiles the model skips hooks)"
                    )
        kept = {id(take): take for wanted in step.takes.values() for take, _ in wanted}.values()
        ready = None
        if self.stream is not None and kept:
            ready = torch.cuda.Event()
            ready.record(self.stream)
        for take in kept:
            if take.chunk.error is None:
                take.block.ready = ready
                take.chunk.blocks.append(take.block)
        for number, error in step.failed.items():
            self.numbered[number].error = self.numbered[number].error or error

        length = self.slot_length[step.slots]
        finished = step.slots[(step.done >= length) & (self.slot_done[step.slots] < length)]
        self.slot_done[step.slots] = step.done
        touched = {self.numbered[int(number)] for number in np.unique(self.slot_chunk[step.slots])}
        for slot in finished.tolist():  # per request, once: every position it can have rows at has run
            self._complete(slot)
        self._conclude(touched)

    def _complete(self, slot: int) -> Chunk:
        """Request ``slot`` is captured (its prompt, or its sequence once it ended): count it, free its slot."""
        chunk = self.numbered[int(self.slot_chunk[slot])]
        chunk.remaining -= 1
        chunk.tokens += int(self.slot_done[slot])
        chunk.spans[int(self.slot_prompt[slot])] = (int(self.slot_start[slot]), int(self.slot_done[slot]))
        self._free(slot)
        return chunk

    def _conclude(self, chunks: set[Chunk]) -> None:
        """Fail the chunks that failed, write those whose requests are all captured."""
        for chunk in chunks:
            if chunk.error is not None:
                outbox.post(failure(chunk.key, chunk.error))
                self._drop(chunk)
            elif chunk.remaining == 0:
                self._submit(chunk)

    # ------------------------------------------------------------ hooks (forward thread, inside a step)

    def _install(self, module_name: str, io: str) -> None:
        point = (module_name, io)
        if point in self.hooks:
            return
        module = self.modules[module_name]
        read = self.readers[module_name] = capture_points.reader(module)

        if io == "output":

            def on_output(_module: Any, _args: Any, output: Any) -> None:
                step = self.current
                if step is not None and point in step.takes:
                    self._capture(step, point, *read.output_parts(output))

            self.hooks[point] = module.register_forward_hook(on_output)
        else:

            def on_input(_module: Any, args: Any, kwargs: Any) -> None:
                step = self.current
                if step is not None and point in step.takes:
                    self._capture(step, point, *read.input_parts(args, kwargs))

            self.hooks[point] = module.register_forward_pre_hook(on_input, with_kwargs=True)

    def _capture(self, step: Step, point: tuple[str, str], hidden: Any, residual: Any) -> None:
        step.fired.add(point)
        for take, capture in step.takes[point]:
            if take.chunk.error is not None:
                continue
            try:
                take.block.values[capture.key] = self._to_host(self._rows(take, capture, hidden, residual, step.tokens))
            except CaptureError as error:
                take.chunk.error = f"{capture.key}: {error}"
            except Exception as error:  # noqa: BLE001  (e.g. out of pinned memory: this chunk fails, not the step)
                take.chunk.error = f"{capture.key}: {error!r}"

    def _rows(self, take: Take, capture: Capture, hidden: Any, residual: Any, tokens: int) -> torch.Tensor:
        """The take's rows of this capture, as a tensor of its own (the model reuses its buffers)."""
        part = capture_points.default_part(self.readers[capture.module], capture)
        if part == "residual":
            values = [residual]
        elif part == RESIDUAL_STREAM and residual is not None:
            values = [hidden, residual]
        else:  # "hidden", a residual stream before the first residual add, or a plain module
            values = [hidden]
        for value in values:
            if not isinstance(value, torch.Tensor) or not value.is_floating_point():
                raise CaptureError(f"expected a float tensor, got {type(value).__name__}")
            if value.dim() == 0 or value.shape[0] < tokens:
                raise CaptureError(f"has shape {tuple(value.shape)}, not one row per token of the step ({tokens})")
        picked = [
            value[take.span[0] : take.span[1]] if take.span else value.index_select(0, take.index) for value in values
        ]
        rows = (picked[0] + picked[1] if len(picked) == 2 else picked[0]).reshape(take.rows, -1)
        if take.segments is not None:
            sums = torch.zeros(take.block.prompt.size, rows.shape[1], dtype=torch.float32, device=rows.device)
            return sums.index_add_(0, take.segments, rows.float())
        owned = len(picked) == 2 or take.span is None  # a new tensor, not a view of the model's
        return rows.to(take.chunk.dtype, copy=not owned)

    def _to_host(self, value: torch.Tensor) -> torch.Tensor:
        """``value`` in host memory: on CPU it already is; on CUDA a pinned copy on the side stream."""
        if self.stream is None:
            return value
        host = torch.empty(value.shape, dtype=value.dtype, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(value.device))
        with torch.cuda.stream(self.stream):
            host.copy_(value, non_blocking=True)
        value.record_stream(self.stream)  # the allocator must not reuse it before the copy ran
        return host

    # ------------------------------------------------------------ chunk endings

    def _submit(self, chunk: Chunk) -> None:
        self._forget(chunk)
        if chunk.settled_at_end:
            settle(chunk.selection, chunk.blocks, chunk.spans)
        self.writer.submit(
            ShardJob(
                chunk=chunk.key,
                keys=[capture.key for capture in chunk.captures],
                dtype=chunk.dtype,
                mean=chunk.selection.kind == "mean",
                prompts=chunk.prompts,
                tokens=chunk.tokens,
                blocks=chunk.blocks,
                sink=chunk.sink,
                metadata=chunk.metadata,
                cancelled=chunk.cancelled,
                means_generated=chunk.selection.tokens == "generated",
                outliers=chunk.outliers,
            )
        )

    def _drop(self, chunk: Chunk) -> None:
        chunk.cancelled.set()
        self._forget(chunk)
        for slot in np.flatnonzero(self.slot_chunk == chunk.number).tolist():
            self._free(slot)
        chunk.blocks = []

    def _forget(self, chunk: Chunk) -> None:
        self.chunks.pop(chunk.key, None)
        self.numbered.pop(chunk.number, None)


def settle(selection: Selection, blocks: list[Block], spans: dict[int, tuple[int, int]]) -> None:
    """Mark in each block the rows ``selection`` keeps now that each prompt's range (``spans``: prompt ->
    ``(start, stop)``) is known; the writer drops the others (`Block.keep`)."""
    prompts = np.array(sorted(spans), np.int64)
    starts = np.array([spans[p][0] for p in prompts.tolist()], np.int64)
    stops = np.array([spans[p][1] for p in prompts.tolist()], np.int64)
    for block in blocks:
        index = np.searchsorted(prompts, block.prompt)
        keep = selected(selection, block.position, starts[index], stops[index])
        block.keep = None if keep.all() else keep


@contextmanager
def eager_step() -> Iterator[None]:
    """Run this step's model eagerly, its inputs as prepared: a replayed CUDA graph runs no hooks.

    An engine serving taps (:mod:`nnqueue.enginecore.taps`) replays graphs; vLLM's graph wrappers
    (``CUDAGraphWrapper``, ``BreakableCUDAGraphWrapper``) read the step's mode from the forward context when
    called and run the model itself for ``CUDAGraphMode.NONE``. The inputs stay padded to the graph's size;
    a harvest reads only its requests' rows (``query_start_loc``).
    """
    from vllm.config import CUDAGraphMode
    from vllm.forward_context import get_forward_context, is_forward_context_available

    if not is_forward_context_available():
        yield
        return
    context = get_forward_context()
    mode, context.cudagraph_runtime_mode = context.cudagraph_runtime_mode, CUDAGraphMode.NONE
    try:
        yield
    finally:
        context.cudagraph_runtime_mode = mode


class HarvestRunnerMixin:
    """Mixed into the model runner (above nnsight's): the two points where capture hooks into a step.

    ``execute_model`` sees the scheduler's new and finished requests; ``_model_forward`` (vLLM's own
    override point around ``self.model(...)``) runs after the step's inputs are prepared and is the
    one call of the model per step (vLLM's dummy and profiling runs call the model directly). Both are
    pass-throughs until a harvest chunk has been begun on this rank; a step with harvest requests in it runs
    eagerly (`eager_step`), so its hooks fire on an engine that replays CUDA graphs.
    """

    nnqueue_capture: HarvestCapture | None = None

    def execute_model(self, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        if self.nnqueue_capture is not None:
            self.nnqueue_capture.schedule(scheduler_output)
        return super().execute_model(scheduler_output, *args, **kwargs)  # type: ignore[misc]

    def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
        capture = self.nnqueue_capture
        if capture is None or not capture.slot_of:
            return super()._model_forward(*args, **kwargs)  # type: ignore[misc]
        with capture.step(), eager_step():
            return super()._model_forward(*args, **kwargs)  # type: ignore[misc]

    def nnqueue_harvest(self) -> HarvestCapture:
        if self.nnqueue_capture is None:
            self.nnqueue_capture = HarvestCapture(self)
        return self.nnqueue_capture
