"""Declarative steering during generation on one vLLM engine: raw vLLM with CUDA graphs vs nnqueue's steering path.

Why: issue 24 asks steering (an addition at one layer, every step) at >= 0.90x raw vLLM. Shape: a Llama-3-8B-shaped
dummy model (`benchmarks.common`'s), P=256 prompts x L=128 tokens, 128 generated each (``ignore_eos``),
greedy. Throughput is generated tokens per second. Each mode runs in its own process (one engine each); the
default runs them all, one after the other, and prints the ratios to (raw).

* (raw) a plain ``AsyncLLM`` (no nnsight, no nnqueue), CUDA graphs on, every prompt submitted at once.
* (eager) nnqueue's engine as ``nnqueue worker`` loads it today (`nnqueue.engines.platform.load_engine`: nnsight's
  worker with nnqueue's runner, eager): (u) every prompt unsteered, then J = 1, 16 and 256 concurrent steering jobs
  (`nnqueue.engines.steer_runner.run_steering`, the worker's own call) mixed with unsteered requests: J jobs of
  ``max(1, P // (2 J))`` prompts each, each job its own vector added at layer ``--layer`` (residual stream, every
  token, prompt and generated), the other prompts plain requests in the same batches. Then two checks on the
  device: an addition of 0 generates what plain requests do, and an addition equals the same steering written as
  an nnsight trace on the same engine (``layers[i].output[0][:] += c * v`` at every step): same greedy tokens,
  log-probabilities within ``--tolerance``.
* (graphs) the same engine with CUDA graphs: nnsight's taps (vLLM's breakable graphs) at the steered layer, and
  the steering hook installed before the graphs are recorded (``NNQUEUE_STEER_POINTS``); rows as (eager).
  Needs a vLLM with breakable CUDA graphs; the row says so when it is missing.
* (queue) rows, in (eager) and (graphs): the same J jobs through the worker's whole path (`benchmarks.common.Queue`:
  payloads frozen as the API does, ``steer`` job rows in SQLite or ``--postgres``, claimed by ``JobRunner`` with
  J Celery-like threads, run by the worker's steering executor, generations stored, committed), the other prompts
  plain meanwhile; submission (the API's work) is not timed.

Run (the lead, on the H100):  python benchmarks/steer_gpu.py --out $OUT
TP=4:                          python benchmarks/steer_gpu.py --tp 4 --out $OUT
CPU logic test:                python benchmarks/steer_gpu.py --tiny
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # nnqueue, tests and benchmarks, from a checkout

from benchmarks.common import SHAPES, Queue, build_model_dir, engine_kwargs, prompt_ids, start, stop
from benchmarks.profiling import print_timeline

JOBS = (1, 16, 256)
COEFFICIENT = 4.0


async def plain(llm: Any, prompts: list[list[int]], max_tokens: int, logprobs: int | None = None) -> list[Any]:
    """Every prompt as a plain greedy request, at once; each one's final output."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=logprobs)
    tag = uuid.uuid4().hex[:8]

    async def one(index: int, ids: list[int]) -> Any:
        final = None
        async for output in llm.generate(TokensPrompt(prompt_token_ids=ids), params, f"plain-{tag}-{index}"):
            final = output
        return final.outputs[0]

    return list(await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts))))


def steer_work(name: str, prompts: list[list[int]], layer: int, vector: Any, max_tokens: int, coef: float) -> Any:
    from nnqueue.engines.steer_runner import Edit, Sampling, SteerWork

    return SteerWork(
        job_id=name,
        token_ids=prompts,
        edits=[Edit(f"model.layers.{layer}", op="add", coefficient=coef, vector="v")],
        vectors={"v": vector.float().cpu().numpy().tobytes()},
        sampling=Sampling(max_tokens=max_tokens, ignore_eos=True),
    )


def split(prompts: list[list[int]], jobs: int, layer: int, width: int, max_tokens: int) -> tuple[list[Any], int]:
    """``jobs`` steering jobs of ``max(1, P // (2 jobs))`` prompts each, each its own vector; the steered prompts."""
    import torch

    per_job = max(1, len(prompts) // (2 * jobs))
    steered = min(jobs * per_job, len(prompts))
    generator = torch.Generator().manual_seed(jobs)
    work = [
        steer_work(
            f"bench-{jobs}-{j}",
            prompts[j * per_job : (j + 1) * per_job],
            layer,
            torch.randn(width, generator=generator),
            max_tokens,
            COEFFICIENT,
        )
        for j in range(jobs)
        if j * per_job < len(prompts)
    ]
    return work, steered


async def mixed(llm: Any, prompts: list[list[int]], jobs: int, layer: int, width: int, max_tokens: int) -> int:
    """`split`'s steering jobs and the rest of the prompts plain, all at once; returns the steered prompts."""
    from nnqueue.engines.steer_runner import run_steering

    work, steered = split(prompts, jobs, layer, width, max_tokens)
    await asyncio.gather(*(run_steering(llm, w) for w in work), plain(llm, prompts[steered:], max_tokens))
    return steered


def payload(work: Any) -> bytes:
    """A steering job's payload as the API freezes it (`nnqueue.scheduler.steering.accept_steering`)."""
    import dataclasses

    import numpy as np

    from nnqueue.scheduler.steering import FORMAT, encode_payload

    body = {
        "format": FORMAT,
        "prompts": work.token_ids,
        "edits": [edit.to_json() for edit in work.edits],
        "sampling": dataclasses.asdict(work.sampling),
    }
    return encode_payload(body, {name: np.frombuffer(v, dtype=np.float32) for name, v in work.vectors.items()})


def through_queue(host: Any, queue: Any, llm: Any, prompts: list[list[int]], jobs: int, args: Any, width: int) -> Any:
    """`split`'s jobs through the worker's path, the rest plain meanwhile: one timer per rep (submission, the
    API's work, is not timed), and the last rep's job timelines."""
    work, steered = split(prompts, jobs, args.layer, width, args.max_tokens)
    payloads = [payload(w) for w in work]
    times = []
    for _ in range(args.reps):
        queue.clear()
        ids = queue.submit(payloads, kind="steer")
        started = time.perf_counter()
        with ThreadPoolExecutor(1) as side:
            rest = side.submit(host.call, plain(llm, prompts[steered:], args.max_tokens))
            outcomes = queue.run(host, ids, len(ids))
            rest.result()
        times.append(time.perf_counter() - started)
        if outcomes != ["completed"] * len(ids):
            raise RuntimeError(f"steering jobs did not complete: {outcomes[:4]} {queue.failure(ids[0])}")
    return times, steered, queue.timelines.percentiles()  # the last run's jobs


def timed(host: Any, make: Any, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        started = time.perf_counter()
        host.call(make())
        times.append(time.perf_counter() - started)
    return times


def row(name: str, times: list[float], tokens: int, extra: dict[str, Any] | None = None) -> dict[str, Any]:
    tok_s = round(tokens / statistics.median(times))
    print(f"{name:<46} {tok_s:>9,} generated tok/s  runs {[round(t, 3) for t in times]}", flush=True)
    return {"tok_s": tok_s, "runs_s": times, **(extra or {})}


def raw_mode(args: argparse.Namespace, model_dir: Path, prompts: list[list[int]]) -> dict[str, Any]:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from nnqueue.engines.platform import prepare_process

    prepare_process()
    kwargs = {**engine_kwargs(args, args.tokens + args.max_tokens + 8), "enforce_eager": args.tiny}

    async def run() -> list[float]:
        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(model_dir), **kwargs))
        await plain(llm, prompts[:8], args.max_tokens)
        times = []
        for _ in range(args.reps):
            started = time.perf_counter()
            await plain(llm, prompts, args.max_tokens)
            times.append(time.perf_counter() - started)
        llm.shutdown()
        return times

    return {
        "(raw) plain AsyncLLM, CUDA graphs": row(
            "(raw) plain AsyncLLM, CUDA graphs", asyncio.run(run()), len(prompts) * args.max_tokens
        )
    }


def nnqueue_mode(args: argparse.Namespace, model_dir: Path, prompts: list[list[int]], graphs: bool) -> dict[str, Any]:
    label = "graphs" if graphs else "eager"
    kwargs = engine_kwargs(args, args.tokens + args.max_tokens + 8)
    if graphs:
        os.environ["NNQUEUE_STEER_POINTS"] = f"model.layers.{args.layer}"
        kwargs.pop("enforce_eager")
        kwargs["taps"] = [f"model.layers.{args.layer}.output"]
    try:
        host, engine, client = start(model_dir, kwargs, concurrency=256)
    except Exception as error:  # an engine without breakable graphs: say so, don't fail the run
        if not graphs:
            raise
        print(f"({label}) unavailable here: {type(error).__name__}: {error}", flush=True)
        return {f"({label})": {"error": f"{type(error).__name__}: {error}"}}
    llm = engine.vllm_entrypoint
    width = SHAPES["tiny" if args.tiny else args.shape]["hidden_size"]
    tokens = len(prompts) * args.max_tokens
    rows: dict[str, Any] = {}
    postgres = None
    if args.postgres:
        from tests.utils.servers import start_postgres

        postgres = start_postgres()
    try:
        host.call(plain(llm, prompts[:8], args.max_tokens))
        host.call(mixed(llm, prompts[:8], 2, args.layer, width, args.max_tokens))  # hooks installed, warm
        rows[f"({label}) nnqueue engine, unsteered"] = row(
            f"({label}) nnqueue engine, unsteered",
            timed(host, lambda: plain(llm, prompts, args.max_tokens), args.reps),
            tokens,
        )
        for jobs in JOBS:
            steered: dict[str, int] = {}

            async def go(jobs: int = jobs, steered: dict[str, int] = steered) -> None:
                steered["n"] = await mixed(llm, prompts, jobs, args.layer, width, args.max_tokens)

            name = f"({label}) {jobs} steering job(s) + unsteered"
            rows[name] = row(name, timed(host, go, args.reps), tokens, {"steered_prompts": steered["n"]})
        queue = Queue(Path(tempfile.mkdtemp(prefix="steer-queue-")), engine, postgres.url if postgres else None)
        for jobs in JOBS:
            times, steered_n, timeline = through_queue(host, queue, llm, prompts, jobs, args, width)
            name = f"({label}) queue: {jobs} steering job(s) + unsteered"
            extra = {"steered_prompts": steered_n, "db": "postgres" if postgres else "sqlite", "timeline_ms": timeline}
            rows[name] = row(name, times, tokens, extra)
            print_timeline(name, timeline)
        if not graphs:
            try:
                rows["checks"] = checks(args, host, engine, client, prompts, width)
            except RuntimeError as error:  # a check that fails to run is a result, not the loss of the rows above
                rows["checks"] = {"error": str(error), "nnsight_ok": False}
                print(f"checks: {json.dumps(rows['checks'])}", flush=True)
    finally:
        stop(host, engine)
        if postgres is not None:
            postgres.stop()
    return rows


def checks(args: argparse.Namespace, host: Any, engine: Any, client: Any, prompts: list[list[int]], width: int) -> dict:
    """On the device: an addition of 0 is a plain generation; an addition equals nnsight's trace of it."""
    import nnsight
    import torch

    from nnqueue import trace_payload
    from nnqueue.client.backend import build_payload
    from nnqueue.engines.outbox import poller
    from nnqueue.engines.prebuilt import to_requests
    from nnqueue.engines.steer_runner import Sampling, run_steering
    from nnqueue.engines.trace_runner import run_trace
    from nnqueue.storage.results import load_result

    llm = engine.vllm_entrypoint
    steps, ids = min(args.max_tokens, 16), prompts[0]
    vector = torch.randn(width, generator=torch.Generator().manual_seed(7))
    zero = steer_work("check-0", prompts[:8], args.layer, vector, steps, 0.0)
    baseline = host.call(plain(llm, prompts[:8], steps))
    nothing = host.call(run_steering(llm, zero))
    zero_ok = [g.token_ids for g in nothing] == [list(o.token_ids) for o in baseline]

    work = steer_work("check-add", [ids], args.layer, vector, steps, COEFFICIENT)
    work = type(work)(
        work.job_id, work.token_ids, work.edits, work.vectors, Sampling(steps, logprobs=1, ignore_eos=True)
    )
    (steered,) = host.call(run_steering(llm, work))

    class Prebuilt:
        payload = b""

        def __call__(self, tracer: Any) -> None:
            self.payload = build_payload(tracer)

    backend = Prebuilt()
    vec, layer = vector.to(getattr(torch, args.dtype)), args.layer  # the trace captures locals only
    with client.trace(ids, temperature=0.0, max_tokens=steps, ignore_eos=True, backend=backend) as tracer:
        logits = nnsight.save(list())
        for _ in tracer.iter[:]:
            hidden = client.model.layers[layer].output[0]
            hidden[:] += COEFFICIENT * vec.to(hidden.device)  # the payload's tensors arrive on the CPU
            logits.append(client.logits)
    handoff = Path(tempfile.mkdtemp(prefix="steer-check-"))
    sinks = {name: {"kind": "handoff", "path": str(handoff / name)} for name in ("torch", "safetensors")}
    requests = to_requests(trace_payload.decode(backend.payload), "steer-check")
    report = host.call(run_trace(engine, requests, trace_id="steer-check", sinks=sinks, outbox=poller(llm)))
    if report.error is not None or report.write_error is not None:
        raise RuntimeError(f"the nnsight trace failed: {report.error or report.write_error}")
    saved = torch.cat(load_result((handoff / "torch").read_bytes())["logits"]).float()
    expected = torch.log_softmax(saved, -1)
    same_tokens = steered.token_ids == saved.argmax(-1).tolist()
    chosen = expected.gather(1, torch.tensor(steered.token_ids)[:, None])[:, 0]
    error = float((torch.tensor(steered.logprobs) - chosen).abs().max())
    result = {
        "zero_addition_equals_plain": zero_ok,
        "nnsight_same_tokens": same_tokens,
        "nnsight_max_logprob_error": error,
        "nnsight_ok": same_tokens and error <= args.tolerance and report.error is None,
    }
    print(f"checks: {json.dumps(result)}", flush=True)
    return result


def child(args: argparse.Namespace) -> dict[str, Any]:
    work = Path(tempfile.mkdtemp(prefix="steer-"))
    shape = "tiny" if args.tiny else args.shape
    model_dir = build_model_dir(work, shape, seeded=False)
    prompts = prompt_ids(args.prompts, args.tokens, SHAPES[shape]["vocab_size"])
    if args.mode == "raw":
        return raw_mode(args, model_dir, prompts)
    return nnqueue_mode(args, model_dir, prompts, graphs=args.mode == "graphs")


def parent(args: argparse.Namespace, argv: list[str]) -> None:
    rows: dict[str, Any] = {}
    modes = ["raw", "eager"] if args.tiny else args.modes.split(",")
    for mode in modes:
        out = Path(tempfile.mkdtemp(prefix="steer-mode-")) / "rows.json"
        print(f"--- {mode}", flush=True)
        done = subprocess.run([sys.executable, __file__, *argv, "--mode", mode, "--rows", str(out)], check=False)
        if done.returncode != 0 or not out.exists():
            rows[f"({mode})"] = {"error": f"exit {done.returncode}"}
            continue
        for name, value in json.loads(out.read_text()).items():
            rows[name + (" (again)" if name in rows else "")] = value
    raw = [v["tok_s"] for k, v in rows.items() if k.startswith("(raw)") and "tok_s" in v]
    base = statistics.mean(raw) if raw else None
    print("\nratios to (raw), mean of its runs before and after:", flush=True)
    for name, value in rows.items():
        if base and isinstance(value, dict) and "tok_s" in value:
            value["ratio"] = round(value["tok_s"] / base, 3)
            print(f"  {name:<50} {value['ratio']:.3f}x", flush=True)
    import torch

    report = {
        "rows": rows,
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "date": time.strftime("%Y-%m-%d"),
        "args": vars(args),
    }
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.out, f"steer-tp{args.tp}.json").write_text(json.dumps(report, indent=1))
    checks_row = rows.get("checks", {})
    print(f"checks: {json.dumps(checks_row)}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tiny", action="store_true", help="CPU logic test: tiny model, float32, P=8 x L=16")
    parser.add_argument("--mode", choices=["raw", "eager", "graphs"], help="one mode, in this process (internal)")
    parser.add_argument("--rows", help="(internal) where a mode writes its rows")
    parser.add_argument("--modes", default="raw,eager,graphs,raw", help="the modes run, in order (not with --tiny)")
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--layer", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--shape", choices=["8b", "70b"], default="8b")
    parser.add_argument("--distributed-executor-backend")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--load-format", default="dummy")
    parser.add_argument("--max-num-seqs", type=int, default=256)
    parser.add_argument("--max-num-batched-tokens", type=int, default=16384)
    parser.add_argument("--gpu-memory-utilization", type=float, default=0.8)
    parser.add_argument("--postgres", action="store_true", help="the queue rows on Postgres (tests' binaries)")
    parser.add_argument("--tolerance", type=float, default=0.05, help="log-probability error vs nnsight (bf16)")
    parser.add_argument("--out", default=os.environ.get("OUT", "."))
    args = parser.parse_args()
    if args.tiny:
        args.prompts, args.tokens, args.max_tokens, args.layer, args.dtype, args.reps = 8, 16, 8, 1, "float32", 1
        args.max_num_batched_tokens, args.tolerance = 256, 1e-4
    if args.mode is None:
        parent(args, sys.argv[1:])
        sys.stdout.flush()
        os._exit(0)
    try:
        rows = child(args)
    except BaseException:  # noqa: BLE001 - fail the mode now rather than wait on the engine's threads
        traceback.print_exc()
        sys.stdout.flush()
        os._exit(1)
    Path(args.rows).write_text(json.dumps(rows))
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
