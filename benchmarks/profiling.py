"""Where a benchmark's time goes: each job's timeline (`print_timeline`: `nnqueue.timeline`'s percentiles), timers
wrapped around the worker path's steps (`Profile`), the engine loop's busy time (`LoopBusy`), samples of the engine
loop's stack (`LoopSampler`) and of the engine process's stepping thread (`engine_sampler`, sent there by
``collective_rpc``)."""

from __future__ import annotations

import asyncio
import sys
import time
from typing import Any


class Profile:
    """Wall time and call counts of the worker path's steps, by wrapping module attributes."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}
        self.calls: dict[str, int] = {}
        self.originals: list[tuple[Any, str, Any]] = []

    def add(self, name: str, seconds: float) -> None:
        self.seconds[name] = self.seconds.get(name, 0.0) + seconds
        self.calls[name] = self.calls.get(name, 0) + 1

    def wrap(self, module: Any, attr: str, name: str) -> None:
        original = getattr(module, attr, None)
        if original is None:  # not in this version of nnqueue
            return
        self.originals.append((module, attr, original))
        if asyncio.iscoroutinefunction(original):

            async def timed(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return await original(*args, **kwargs)
                finally:
                    self.add(name, time.perf_counter() - start)
        else:

            def timed(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return original(*args, **kwargs)
                finally:
                    self.add(name, time.perf_counter() - start)

        setattr(module, attr, timed)

    def restore(self) -> None:
        for module, attr, original in reversed(self.originals):
            setattr(module, attr, original)

    def table(self) -> dict[str, dict[str, float]]:
        return {
            n: {
                "calls": self.calls[n],
                "sum_s": round(s, 3),
                "mean_ms": round(1e3 * s / self.calls[n], 2),
            }
            for n, s in self.seconds.items()
        }


class LoopBusy:
    """How long the engine loop was busy (blocked for other tasks): a 1 ms ticker's total lateness."""

    def __init__(self, host: Any) -> None:
        self.host, self.busy, self.running = host, 0.0, True
        self.future = asyncio.run_coroutine_threadsafe(self._tick(), host.loop)

    async def _tick(self) -> None:
        while self.running:
            start = time.perf_counter()
            await asyncio.sleep(0.001)
            self.busy += max(0.0, time.perf_counter() - start - 0.001)

    def stop(self) -> float:
        self.running = False
        self.future.result()
        return round(self.busy, 2)


class LoopSampler:
    """What the engine loop's thread is doing: its stack sampled every ``interval_s`` (a thread of this
    process; a sample waits for the GIL, so time the loop spends holding it is seen late, not missed).
    Samples are counted by the innermost frame and by the innermost frame of nnqueue's own code."""

    def __init__(self, host: Any, interval_s: float = 0.001) -> None:
        import threading

        self.thread_id = host._thread.ident
        self.interval_s, self.running = interval_s, True
        self.innermost: dict[str, int] = {}
        self.ours: dict[str, int] = {}
        self.samples = 0
        self.sampler = threading.Thread(target=self._run, daemon=True)
        self.sampler.start()

    def _run(self) -> None:
        while self.running:
            frame = sys._current_frames().get(self.thread_id)
            if frame is not None:
                self.samples += 1
                self._count(self.innermost, _where(frame))
                ours = frame
                while ours is not None and "/nnqueue/" not in ours.f_code.co_filename:
                    ours = ours.f_back
                self._count(self.ours, _where(ours) if ours is not None else "(no nnqueue frame)")
            time.sleep(self.interval_s)

    @staticmethod
    def _count(table: dict[str, int], key: str) -> None:
        table[key] = table.get(key, 0) + 1

    def stop(self, top: int = 25) -> dict[str, Any]:
        self.running = False
        self.sampler.join()

        def share(table: dict[str, int]) -> dict[str, float]:
            ranked = sorted(table.items(), key=lambda item: -item[1])[:top]
            return {key: round(count / max(1, self.samples), 3) for key, count in ranked}

        return {"samples": self.samples, "innermost": share(self.innermost), "nnqueue_frame": share(self.ours)}


def engine_sampler(worker: Any, action: str, interval_s: float = 0.001) -> Any:
    """Sent into the engine's worker process by ``collective_rpc`` (``--engine-profile``: cloudpickled by
    value, so it imports nothing of this script). ``start``: sample the stack of the thread the RPC runs on
    (the one that steps the model) every ``interval_s``; ``stop``: the shares of time. Each sample counts the
    time since the previous one (a sampler waiting for the GIL would otherwise under-count code that holds it),
    by its innermost frame, its innermost nnsight/nnqueue frame, and its phase: the frame vLLM's engine core (or,
    under tensor parallelism, its worker loop) called to step or answer an RPC."""
    import sys
    import threading
    import time

    def where(frame: Any) -> str:
        parts = frame.f_code.co_filename.split("/")
        return f"{'/'.join(parts[-2:])}:{frame.f_code.co_name}"

    if action == "start":
        target = threading.get_ident()
        state = {"run": True, "n": 0, "s": 0.0, "inner": {}, "ours": {}, "phase": {}}

        def run() -> None:
            last = time.perf_counter()
            while state["run"]:
                frame = sys._current_frames().get(target)
                now = time.perf_counter()
                elapsed, last = now - last, now

                def count(table: dict[str, float], key: str, elapsed: float = elapsed) -> None:
                    table[key] = table.get(key, 0.0) + elapsed

                if frame is not None:
                    state["n"] += 1
                    state["s"] += elapsed
                    count(state["inner"], where(frame))
                    stack = []
                    while frame is not None:
                        stack.append(frame)
                        frame = frame.f_back
                    stack.reverse()  # outermost first
                    ours = [
                        f for f in stack if "/nnsight/" in f.f_code.co_filename or "/nnqueue/" in f.f_code.co_filename
                    ]
                    count(state["ours"], where(ours[-1]) if ours else "(none)")
                    loop = [
                        i
                        for i, f in enumerate(stack)
                        if f.f_code.co_filename.endswith(("v1/engine/core.py", "v1/executor/multiproc_executor.py"))
                    ]
                    inner = stack[loop[-1] + 1 : loop[-1] + 3] if loop else stack[-2:]
                    count(state["phase"], " > ".join(where(f) for f in inner) or "(loop)")
                time.sleep(interval_s)

        worker._nnqueue_bench_sampler = state
        threading.Thread(target=run, daemon=True).start()
        return True
    state = worker._nnqueue_bench_sampler
    state["run"] = False
    time.sleep(0.05)
    n = max(1e-9, state["s"])

    def share(table: dict[str, float], top: int = 30) -> dict[str, float]:
        return {k: round(v / n, 3) for k, v in sorted(table.items(), key=lambda item: -item[1])[:top]}

    return {
        "samples": state["n"],
        "phase": share(state["phase"]),
        "nnsight_nnqueue": share(state["ours"]),
        "innermost": share(state["inner"]),
    }


def _where(frame: Any) -> str:
    code = frame.f_code
    parts = code.co_filename.split("/")
    return f"{'/'.join(parts[-2:])}:{code.co_name}"


def print_timeline(name: str, table: dict[str, dict[str, float]]) -> None:
    """One line per step of a row's job timelines (`nnqueue.timeline.Timelines.percentiles`): p50, p90 and max ms."""
    print(f"  {name}: per-job timeline, ms (p50 / p90 / max)", flush=True)
    for step, value in table.items():
        print(f"    {step:<28} {value['p50_ms']:>9.2f} {value['p90_ms']:>9.2f} {value['max_ms']:>9.2f}", flush=True)
