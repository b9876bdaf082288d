"""Harvest path vs raw vLLM on one engine (CPU): is capturing activations close to free?

On one dispatched engine with nnqueue's worker class, the same P prompts x L random tokens
(``TokensPrompt``, ``max_tokens=1``: prefill only) run as:

* (a) raw ``AsyncLLM.generate`` with the harvest's sampling settings, every prompt submitted at once;
* (h) the harvest path (`nnqueue.engines.harvest_runner.run_chunk`): the prompts in chunks of
  ``--prompts-per-chunk``, ``--chunks`` of them in flight (as a worker's bulk slots run them), each
  chunk's shard written by the engine to a handoff file (the engine's side; a worker then uploads it): one layer
  every token, one layer last token, four layers every token.

Each of ``--reps`` rounds runs every variant once, each right after a run of (a); the paired ratio is
the median over rounds of (a)'s time over the variant's beside it (the machine's speed drifts when it
is shared), the paired CPU ratio the same with the CPU seconds the run cost this process and the engine
core (steadier than wall time there), and the plain ratio the variant's median tokens/s over (a)'s, in
the same process. The store's
write rate is measured in the same run: each variant's shard bytes over its wall time, and the handoff
sink alone writing as many bytes as the four-layer run did. The value of one layer for prompt 0 is
checked against nnsight's own trace on the same engine.

    .venv/bin/python benchmarks/harvest_throughput.py            # SmolLM2-135M (as the demo converts it)
    .venv/bin/python benchmarks/harvest_throughput.py --tiny     # the test suite's tiny model, seconds

``benchmarks/harvest_gpu_bench.py`` imports the harvest parts of this file for its GPU runs.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

VARIANTS = {  # name -> (layers, selection kind)
    "one layer all-token": (1, "all"),
    "one layer last-token": (1, "last"),
    "four layers all-token": (4, "all"),
}


def variant_layers(num_layers: int, layer: int, count: int) -> list[int]:
    """``layer`` alone, or ``count`` layers (at most all of them) spread over the model, ending at its last."""
    if count == 1:
        return [layer]
    count = min(count, num_layers)
    return [round((index + 1) * num_layers / count) - 1 for index in range(count)]


async def raw_generate(llm: Any, prompts: list[list[int]]) -> None:
    """(a): plain requests with the harvest's sampling settings, all at once, drained to their token."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    tag = uuid.uuid4().hex[:8]

    async def one(index: int, ids: list[int]) -> None:
        async for _ in llm.generate(TokensPrompt(prompt_token_ids=ids), params, f"raw-{tag}-{index}"):
            pass

    await asyncio.gather(*(one(index, ids) for index, ids in enumerate(prompts)))


async def harvest(
    llm: Any,
    prompts: list[list[int]],
    layers: list[int],
    selection: str,
    dtype: str,
    out_dir: Path,
    prompts_per_chunk: int,
    chunks_in_flight: int,
    sinks: Any = None,
    timeline: list[dict[str, float]] | None = None,
) -> list[Any]:
    """(h): every prompt through `run_chunk`, in chunks, ``chunks_in_flight`` at a time; their results. With
    ``sinks`` (the worker's `ResultSinks`), each chunk goes the worker's whole way, as ``ChunkRunner`` runs it: its
    shard handed off in the sinks' folder (its parts sent while the engine writes it: ``ShardFollower``), its slot
    freed once the shard fits the upload budget
    (``UploadBudget``, ``NNQUEUE_WORKER_UPLOAD_BUDGET_BYTES``' default), then uploaded by `ResultSinks.commit_shard`
    to ``shard_key(chunk id)`` in their store while the next chunks run; else the engine writes it to ``out_dir``.
    ``timeline`` gets each chunk's seconds from the start: began, shard reported, slot freed, stored."""
    from nnqueue.engines.harvest_runner import Capture, ChunkWork, Selection, run_chunk
    from nnqueue.engines.trace_report import WrittenObject
    from nnqueue.settings import Settings
    from nnqueue.workers.chunk_execution import shard_bound
    from nnqueue.workers.upload_budget import UploadBudget

    slots = asyncio.Semaphore(chunks_in_flight)
    budget = UploadBudget(Settings.model_fields["worker_upload_budget_bytes"].default)
    tag = uuid.uuid4().hex[:8]
    engine_writable(out_dir)
    zero = time.perf_counter()

    async def chunk(number: int, first: int) -> Any:
        indices = list(range(first, min(first + prompts_per_chunk, len(prompts))))
        chunk_id = f"bench-{tag}-{number:05d}"
        bound = shard_bound(
            [prompts[i] for i in indices],
            llm.model_config,
            captures=len(layers),
            selection=Selection(selection),
            dtype=dtype,
            generated=0,
        )  # as ChunkRunner bounds it: the size hint of the upload's parts
        opened = None if sinks is None else sinks.open_shard(shard_key(chunk_id), f"{chunk_id}.safetensors", bound)
        work = ChunkWork(
            chunk_id=chunk_id,
            prompt_indices=indices,
            token_ids=[prompts[i] for i in indices],
            captures=[Capture(f"model.layers.{layer}") for layer in layers],
            selection=Selection(selection),
            dtype=dtype,
            sink=opened.spec
            if opened is not None
            else {"kind": "handoff", "path": str(out_dir / f"{chunk_id}.safetensors")},
        )
        stamps = {}
        async with contextlib.AsyncExitStack() as stack:
            follower = None if opened is None else await stack.enter_async_context(sinks.following(opened))
            async with slots:
                stamps["began"] = time.perf_counter() - zero
                running = run_chunk(llm, work)
                result = await (running if follower is None else follower.during(running))
                stamps["reported"] = time.perf_counter() - zero
                if opened is not None:  # the slot is held until the shard has room, as ChunkRunner.run_next holds it
                    await stack.enter_async_context(budget.room(result.bytes))
                stamps["freed"] = time.perf_counter() - zero
            if follower is not None:
                await asyncio.to_thread(follower.commit, WrittenObject(result.bytes, result.sha256))
        stamps["stored"] = time.perf_counter() - zero
        if timeline is not None:
            timeline.append(stamps)
        return result

    starts = range(0, len(prompts), prompts_per_chunk)
    return list(await asyncio.gather(*(chunk(n, first) for n, first in enumerate(starts))))


def timeline_summary(timeline: list[dict[str, float]]) -> dict[str, float]:
    """Where a run's chunks spent their time: on the engine (begun to shard reported), waiting for upload room (the
    engine's back pressure), uploading; and the tail, from the last shard reported to the last stored."""

    def spans(start: str, end: str) -> list[float]:
        return [stamps[end] - stamps[start] for stamps in timeline]

    engine, waited, upload = spans("began", "reported"), spans("reported", "freed"), spans("freed", "stored")
    return {
        "engine_s_median": round(statistics.median(engine), 3),
        "waited_for_room_s_total": round(sum(waited), 3),
        "upload_s_median": round(statistics.median(upload), 3),
        "upload_s_max": round(max(upload), 3),
        "tail_s": round(max(s["stored"] for s in timeline) - max(s["reported"] for s in timeline), 3),
    }


def shard_key(chunk_id: str) -> str:
    return f"harvests/bench/{chunk_id}.safetensors"


def store_put_rate(store: Any, out_dir: Path, nbytes: int, objects: int, concurrency: int) -> float:
    """MB/s of the store alone taking ``objects`` files of ``nbytes / objects`` bytes each, ``concurrency`` at a
    time, through ``ObjectStore.put_stream`` (the call the worker's upload makes), from files in ``out_dir``."""
    from concurrent.futures import ThreadPoolExecutor

    size = max(1, nbytes // objects)
    path = out_dir / "put-rate.bin"
    path.write_bytes(os.urandom(size))

    def put(index: int) -> int:
        with open(path, "rb") as file:
            return int(store.put_stream(f"harvests/bench/put-rate-{index}.bin", file, size_hint=size))

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        total = sum(pool.map(put, range(objects)))
    seconds = time.perf_counter() - started
    path.unlink()
    return total / seconds / 1e6


def engine_writable(path: Path) -> None:
    """Create ``path`` where the engine can write its shards: a root engine drops to the engine user
    (``nnqueue.isolation``), so the folder becomes that user's and its parent (a private temp folder)
    becomes traversable, not readable, by others."""
    from nnqueue import isolation

    path.mkdir(parents=True, exist_ok=True)
    account = isolation.engine_user() if os.geteuid() == 0 else None
    if account is not None:
        os.chown(path, account.uid, account.gid)
        path.parent.chmod(path.parent.stat().st_mode | 0o011)


def sink_write_rate(out_dir: Path, nbytes: int, piece: int = 64 << 20) -> float:
    """MB/s of the handoff sink (the engine's own write path; not fsync'd) writing ``nbytes`` from memory."""
    from nnqueue.enginecore import sink

    block = memoryview(os.urandom(piece))
    pieces = [block[: min(piece, nbytes - start)] for start in range(0, nbytes, piece)]
    path = out_dir / "write-rate.bin"
    started = time.perf_counter()
    sink.write_stream({"kind": "handoff", "path": str(path)}, nbytes, pieces)
    seconds = time.perf_counter() - started
    path.unlink()
    return nbytes / seconds / 1e6


def cpu_seconds() -> float:
    """User + system CPU seconds of this process and its live descendants (the engine core), from /proc.

    On a shared machine wall time drifts with the neighbours' load; the CPU time a run costs does far less,
    so its ratio is the steadier measure of the capture path's own cost.
    """
    tick, pids, total = os.sysconf("SC_CLK_TCK"), [os.getpid()], 0.0
    while pids:
        pid = pids.pop()
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
            for task in Path(f"/proc/{pid}/task").iterdir():
                pids += [int(child) for child in (task / "children").read_text().split()]
        except (FileNotFoundError, ProcessLookupError):
            continue
    return total


def harvest_rows(
    report: dict[str, Any],
    run: Any,
    llm: Any,
    prompts: list[list[int]],
    num_layers: int,
    layer: int,
    dtype: str,
    out_dir: Path,
    prompts_per_chunk: int,
    chunks_in_flight: int,
    reps: int,
    raw: Any = None,
    sinks: Any = None,
) -> dict[str, Any]:
    """Time every harvest variant into ``report["rows"]`` (medians of ``reps`` rounds).

    Each round runs every variant once, each right after a run of ``raw()`` when given (row "(a) raw
    vLLM, paired"): on a loaded machine, whose speed drifts within seconds, a variant is compared with
    the raw run beside it (``paired_ratio``: the median of those ratios). ``run`` runs a coroutine on
    the engine's loop. Then the handoff sink alone writes as many bytes as the largest variant did, and with
    ``sinks`` (shards uploaded to their store: `harvest`) the store alone takes as many (``store_put_MB_s``).
    Returns the last one-layer all-token results and their shards' folder (for value checks).
    """
    tokens = sum(len(ids) for ids in prompts)
    variants = {name: (variant_layers(num_layers, layer, count), kind) for name, (count, kind) in VARIANTS.items()}
    kept_dir = out_dir.with_name(out_dir.name + "-kept")  # the one-layer all-token shards, for value checks
    times: dict[str, list[float]] = {name: [] for name in ["raw", *variants]}
    cpu: dict[str, list[float]] = {name: [] for name in ["raw", *variants]}
    pairs: dict[str, list[tuple[float, float]]] = {name: [] for name in variants}  # (wall, cpu) ratios
    results: dict[str, list[Any]] = {}
    timelines: dict[str, list[dict[str, float]]] = {}  # the last round's, per variant

    def measure(name: str, fn: Any) -> Any:
        started, cpu_started = time.perf_counter(), cpu_seconds()
        value = fn()
        times[name].append(time.perf_counter() - started)
        cpu[name].append(cpu_seconds() - cpu_started)
        return value

    for _ in range(reps):
        for name, (layers, kind) in variants.items():
            if raw is not None:
                measure("raw", raw)
            target = kept_dir if name == "one layer all-token" else out_dir
            shutil.rmtree(target, ignore_errors=True)
            timelines[name] = []
            work = harvest(
                llm, prompts, layers, kind, dtype, target, prompts_per_chunk, chunks_in_flight, sinks, timelines[name]
            )
            results[name] = measure(name, lambda work=work: run(work))
            if raw is not None:
                pairs[name].append((times["raw"][-1] / times[name][-1], cpu["raw"][-1] / cpu[name][-1]))
            assert sum(result.tokens for result in results[name]) == tokens
    if raw is not None:
        report["rows"]["(a) raw vLLM, paired"] = {
            "tok_s": round(tokens / statistics.median(times["raw"])),
            "runs_s": [round(t, 3) for t in times["raw"]],
            "cpu_s": [round(t, 3) for t in cpu["raw"]],
        }
        print(f"(a) raw vLLM, paired {report['rows']['(a) raw vLLM, paired']}", flush=True)
    for name, (layers, _) in variants.items():
        median, written = statistics.median(times[name]), sum(result.bytes for result in results[name])
        report["rows"][f"(h) {name}"] = row = {
            "tok_s": round(tokens / median),
            "runs_s": [round(t, 3) for t in times[name]],
            "layers": layers,
            "shard_bytes": written,
            "store_MB_s": round(written / median / 1e6, 1),
            "steps_per_chunk": round(statistics.mean(result.steps for result in results[name]), 2),
            "cpu_s": [round(t, 3) for t in cpu[name]],
            "timeline": timeline_summary(timelines[name]),
        }
        if pairs[name]:
            row["paired_ratio"] = round(statistics.median(wall for wall, _ in pairs[name]), 3)
            row["paired_cpu_ratio"] = round(statistics.median(cpu_ratio for _, cpu_ratio in pairs[name]), 3)
        print(
            f"(h) {name:<30} {row['tok_s']:>9,} tok/s  runs {row['runs_s']}  "
            f"{written / 1e6:,.1f} MB at {row['store_MB_s']:,.1f} MB/s  layers {layers}  {row['timeline']}",
            flush=True,
        )
    biggest = max(sum(result.bytes for result in found) for found in results.values())
    shutil.rmtree(out_dir, ignore_errors=True)
    out_dir.mkdir(parents=True)
    report["sink_write_MB_s"] = round(sink_write_rate(out_dir, biggest), 1)
    report["sink_write_bytes"] = biggest
    print(f"handoff sink alone, {biggest / 1e6:,.1f} MB: {report['sink_write_MB_s']:,.1f} MB/s", flush=True)
    if Path("/dev/shm").is_dir():  # the handoff in memory (NNQUEUE_WORKER_HANDOFF_DIR on a tmpfs)
        shm = Path(tempfile.mkdtemp(prefix="harvest-sink-", dir="/dev/shm"))
        report["sink_write_MB_s_dev_shm"] = round(sink_write_rate(shm, biggest), 1)
        shm.rmdir()
        print(f"handoff sink alone into /dev/shm: {report['sink_write_MB_s_dev_shm']:,.1f} MB/s", flush=True)
    kept = results["one layer all-token"]
    if sinks is not None:
        objects = len(results[max(results, key=lambda name: sum(result.bytes for result in results[name]))])
        report["store_put_MB_s"] = round(store_put_rate(sinks.store, out_dir, biggest, objects, chunks_in_flight), 1)
        report["store_parts_in_flight"] = getattr(sinks.store, "parts_in_flight", None)
        print(
            f"store alone ({type(sinks.store).__name__}), {objects} objects, {chunks_in_flight} at a time, "
            f"{report['store_parts_in_flight']} parts in flight: {report['store_put_MB_s']:,.1f} MB/s",
            flush=True,
        )
        for name in variants:  # each row's upload rate beside the store's own
            row = report["rows"][f"(h) {name}"]
            row["store_put_MB_s"] = report["store_put_MB_s"]
            print(
                f"(h) {name:<30} uploaded at {row['store_MB_s']:,.1f} MB/s; the store's PUT rate "
                f"{report['store_put_MB_s']:,.1f} MB/s ({row['store_MB_s'] / report['store_put_MB_s']:.3f})",
                flush=True,
            )
        kept_dir.mkdir(parents=True, exist_ok=True)
        for result in kept:  # the value checks read the shards where the engine would have left them
            (kept_dir / f"{result.chunk_id}.safetensors").write_bytes(sinks.store.get_bytes(shard_key(result.chunk_id)))
    shutil.rmtree(out_dir, ignore_errors=True)
    return {"results": kept, "out_dir": kept_dir, "layer": layer}


def versus_bounds(report: dict[str, Any], raw_tok_s: float) -> dict[str, float]:
    """Each harvest row's tokens/s over the lower of raw vLLM and what the store's PUT rate (where shards went to a
    store; else the handoff sink's measured write rate) allows at that row's bytes per token (issue 35's bound for
    the four-layer target)."""
    tokens = report["prompts"] * report["tokens_per_prompt"]
    bounds = {}
    store_mb_s = report.get("store_put_MB_s") or report.get("sink_write_MB_s", float("inf"))
    for name, row in report["rows"].items():
        if "shard_bytes" in row:
            store_tok_s = store_mb_s * 1e6 / (row["shard_bytes"] / tokens)
            bounds[name] = round(row["tok_s"] / min(raw_tok_s, store_tok_s), 3)
    return bounds


def shard_rows(results: list[Any], out_dir: Path, prompt: int, key: str) -> Any:
    """Prompt ``prompt``'s rows of capture ``key``, read from its shard with safetensors alone."""
    from safetensors import safe_open

    for result in results:
        for rows in result.prompts:
            if rows.prompt_index == prompt:
                with safe_open(str(out_dir / f"{result.chunk_id}.safetensors"), "pt") as shard:
                    return shard.get_slice(key)[rows.first_row : rows.first_row + rows.rows]
    raise KeyError(prompt)


def nnsight_value(engine: Any, run: Any, ids: list[int], layer: int) -> Any:
    """nnsight's own trace of the same prompt: layer ``layer``'s (mlp_out + residual), every token."""
    with engine.trace(ids, temperature=0.0, max_tokens=1) as tracer:
        out = engine.model.layers[layer].output
        h = (out[0] + out[1]).save()

    async def drain() -> Any:
        return await tracer.backend

    return run(drain()).saves["h"]


def relative_error(a: Any, b: Any) -> float:
    a, b = a.float().cpu(), b.float().cpu()
    return float((a - b).norm() / b.norm())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="the test suite's tiny model (a logic check)")
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--layer", type=int, help="the one-layer variants' layer (default: the middle one)")
    parser.add_argument("--prompts-per-chunk", type=int, default=8)
    parser.add_argument("--chunks", type=int, default=4, help="chunks in flight")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--models-dir", type=Path, default=ROOT / ".nnqueue" / "models")
    parser.add_argument("--out", type=Path, help="write the report here as JSON")
    args = parser.parse_args()

    import torch

    from nnqueue.engines.platform import load_engine
    from nnqueue.workers.engine_host import EngineHost

    work = Path(tempfile.mkdtemp(prefix="harvest-throughput-"))
    if args.tiny:
        from tests.utils.tiny_model import build_tiny_llama

        model_dir = build_tiny_llama(work / "tiny-llama")
        args.prompts, args.tokens, args.reps = min(args.prompts, 16), min(args.tokens, 32), 1
    else:
        from rich.console import Console

        from nnqueue.demo import ensure_model

        model_dir, _ = ensure_model(args.models_dir, Console(stderr=True))
    config = json.loads((model_dir / "config.json").read_text())
    num_layers, vocab = config["num_hidden_layers"], config["vocab_size"]
    layer = args.layer if args.layer is not None else num_layers // 2
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (args.prompts, args.tokens), generator=generator).tolist()

    host = EngineHost()
    engine_kwargs = {
        "dtype": "float32",
        "max_model_len": args.tokens + 16,
        "seed": 0,
        "max_num_batched_tokens": max(4096, args.tokens + 16),
    }

    async def load() -> Any:
        return load_engine(str(model_dir), **engine_kwargs)

    engine = host.call(load())
    llm = engine.vllm_entrypoint

    def run(coroutine: Any) -> Any:
        return host.call(coroutine)

    report: dict[str, Any] = {
        "model": model_dir.name,
        "prompts": args.prompts,
        "tokens_per_prompt": args.tokens,
        "prompts_per_chunk": args.prompts_per_chunk,
        "chunks_in_flight": args.chunks,
        "engine": engine_kwargs,
        "rows": {},
    }

    # Warm-up: first-call costs (kernels, hooks, pinned pools, nnsight's code capture) stay out of the numbers.
    run(raw_generate(llm, prompts[:8]))
    run(harvest(llm, prompts[:8], variant_layers(num_layers, layer, 4), "all", "float32", work / "warm", 4, 2))
    kept = harvest_rows(
        report,
        run,
        llm,
        prompts,
        num_layers,
        layer,
        "float32",
        work / "shards",
        args.prompts_per_chunk,
        args.chunks,
        args.reps,
        raw=lambda: run(raw_generate(llm, prompts)),
    )
    reference = nnsight_value(engine, run, prompts[0], kept["layer"])
    harvested = shard_rows(kept["results"], kept["out_dir"], 0, f"model.layers.{kept['layer']}.output")
    report["harvest_vs_nnsight_rel_err"] = relative_error(harvested, reference)
    base = report["rows"]["(a) raw vLLM, paired"]["tok_s"]
    report["ratios_vs_raw"] = {name: round(row["tok_s"] / base, 3) for name, row in report["rows"].items()}
    report["paired_ratios"] = {
        name: row["paired_ratio"] for name, row in report["rows"].items() if "paired_ratio" in row
    }
    report["paired_cpu_ratios"] = {
        name: row["paired_cpu_ratio"] for name, row in report["rows"].items() if "paired_cpu_ratio" in row
    }
    report["harvest_vs_bound"] = versus_bounds(report, base)
    keys = (
        "paired_ratios",
        "paired_cpu_ratios",
        "ratios_vs_raw",
        "harvest_vs_bound",
        "sink_write_MB_s",
        "harvest_vs_nnsight_rel_err",
    )
    print(json.dumps({k: report[k] for k in keys}, indent=1))
    if args.out:
        args.out.write_text(json.dumps(report, indent=1))

    llm.shutdown()
    engine.vllm_entrypoint = None
    host.stop()
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
