"""The embedded stack run from a checkout in a folder only root may enter (``mktemp -d``, mode 0700, as a clone
under ``/root`` is), as root: a trace reading ``logprobs`` and ``prompt_logprobs`` from ``tracer.result`` and a
trace through nnsight's own ``remote=True`` client both run, with the values of the in-process engine.

On the host the engine user cannot read such a checkout (nor, here, this Python in root's home); in the engine's
filesystem view (nnqueue.mountns) both are bound in, readable, so the worker's start-up probe, run there, passes
and the engine switches to the engine user with every module it imports mid-job (nnsight's, ``symtable``,
inductor's headers: issue 22) readable: its isolation is full, not root kept (issue 33).

The same run is the embedded stack's own end-to-end test (it was tests/client/test_embedded.py, which started a
second stack and worker for it): the client backend's logits equal the in-process engine's bit for bit, both jobs
completed, everything lives under the data directory (the result moved out of the handoff folder, the SQLite rows),
and ``stop()`` leaves no process of the stack running (Redis, the worker and its engine), checked before the
script exits. Not as root the stack runs the same way, and only the isolation (root's layout) is not checked.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.utils.reference import InProcessBackend
from tests.utils.tiny_model import TINY_ENGINE_KWARGS

pytestmark = pytest.mark.slow  # the embedded stack with a worker process (in a subprocess of its own)

CHECKOUT = Path(__file__).resolve().parents[2]
PROMPT = "The Eiffel Tower is in"
SCRIPT = """
import json, sys
from pathlib import Path

import psutil

from nnqueue.demo import EmbeddedStack
from nnqueue.engines.platform import prepare_process

model_path, engine_kwargs, prompt = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
prepare_process()
from nnsight import CONFIG
from nnsight.modeling.vllm import VLLM
from nnqueue.client import Client

import nnqueue
print("nnqueue from", nnqueue.__file__, flush=True)
stack = EmbeddedStack(Path(".nnqueue"), Path(model_path), model_path, engine_kwargs)
try:
    stack.start_services()
    worker = stack.start_worker()
    processes = [psutil.Process(stack.redis.process.pid), psutil.Process(worker.pid)]
    model = VLLM(model_path, **engine_kwargs)
    with Client(stack.api.url, stack.api_key) as client:
        stack.wait_worker(client, timeout=600)
        backend = client.backend(model_key=model_path, progress=False)
        with model.trace(prompt, temperature=0.0, max_tokens=2, logprobs=3, prompt_logprobs=2, backend=backend) as tracer:
            queued_logits = model.logits.save()  # the first step's, before the result
            result = tracer.result.save()
        queued_job = backend.job.id
        CONFIG.API.HOST, CONFIG.API.APIKEY = stack.api.url + "/ndif", stack.api_key
        CONFIG.APP.REMOTE_LOGGING = False
        with model.trace(prompt, remote=True, max_tokens=1, temperature=0.0):
            logits = model.logits.save()
        readyz = client.ready()
        jobs = [(str(job.id), job.info["status"], (job.info.get("result") or {}).get("format")) for job in client.jobs()]
    processes += psutil.Process(worker.pid).children(recursive=True)  # the engine core
finally:
    stack.stop()
# stop() leaves nothing of the stack running (checked here, while this process, their parent, still lives).
psutil.wait_procs(processes, timeout=30)
survivors = [p.pid for p in processes if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
output = result.outputs[0]
print("RESULT " + json.dumps({
    "token_ids": list(output.token_ids),
    "logprobs": [{str(k): v.logprob for k, v in step.items()} for step in output.logprobs],
    "prompt_logprobs": [None if step is None else {str(k): v.logprob for k, v in step.items()} for step in result.prompt_logprobs],
    "queued_logits": queued_logits.tolist(),
    "queued_job": str(queued_job),
    "jobs": jobs,
    "remote_logits": logits.tolist(),
    "engines": readyz["engines"],
    "isolation": readyz["isolation"],
    "processes": len(processes),
    "survivors": survivors,
}), flush=True)
"""


@pytest.fixture
def private_checkout() -> Iterator[Path]:
    """A copy of this checkout's package in a fresh ``mktemp -d`` folder (mode 0700, root's)."""
    folder = Path(tempfile.mkdtemp(prefix="nnqueue-private-"))
    assert stat.S_IMODE(folder.stat().st_mode) == 0o700
    shutil.copytree(CHECKOUT / "nnqueue", folder / "nnqueue", ignore=shutil.ignore_patterns("__pycache__"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def logprobs_of(steps: Any) -> list[Any]:
    return [None if step is None else {str(k): v.logprob for k, v in step.items()} for step in steps]


def assert_same_steps(got: list[Any], want: list[Any]) -> None:
    """Per step, the same token ids with the same logprobs (to float32 rounding)."""
    assert len(got) == len(want)
    for got_step, want_step in zip(got, want, strict=True):
        assert (got_step is None) == (want_step is None)
        if got_step is not None:
            assert got_step.keys() == want_step.keys()
            assert [got_step[k] for k in want_step] == pytest.approx(list(want_step.values()), abs=1e-5)


def test_the_embedded_stack_serves_logprobs_and_remote_traces_from_a_private_checkout_and_stops_everything(
    private_checkout: Path, tiny_model_path: Path, client_model: Any, inprocess_engine: Any
) -> None:
    import torch
    from sqlalchemy import create_engine, text

    env = {name: value for name, value in os.environ.items() if not name.startswith(("NNQUEUE_", "NDIF_"))}
    env["PYTHONPATH"] = str(private_checkout)
    script = private_checkout / "run_embedded.py"
    script.write_text(SCRIPT)
    done = subprocess.run(
        [sys.executable, str(script), str(tiny_model_path), json.dumps(TINY_ENGINE_KWARGS), PROMPT],
        cwd=private_checkout,
        env=env,
        capture_output=True,
        text=True,
        timeout=840,
    )
    worker_log = private_checkout / ".nnqueue" / "logs" / "worker.log"
    log = worker_log.read_text(errors="replace") if worker_log.exists() else ""
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-5000:]}\n--- worker log ---\n{log[-5000:]}"
    assert f"nnqueue from {private_checkout}" in done.stdout
    got = json.loads(done.stdout.split("RESULT ", 1)[1].splitlines()[0])

    backend = InProcessBackend(inprocess_engine)
    with client_model.trace(
        PROMPT, temperature=0.0, max_tokens=2, logprobs=3, prompt_logprobs=2, backend=backend
    ) as tracer:
        local_logits = client_model.logits.save()
        result = tracer.result.save()
    with client_model.trace(PROMPT, max_tokens=1, temperature=0.0, backend=InProcessBackend(inprocess_engine)):
        logits = client_model.logits.save()

    assert got["token_ids"] == list(result.outputs[0].token_ids)
    assert len(got["logprobs"]) == 2 and all(len(step) >= 3 for step in got["logprobs"])
    assert_same_steps(got["logprobs"], logprobs_of(result.outputs[0].logprobs))
    assert got["prompt_logprobs"][0] is None and all(len(step) >= 2 for step in got["prompt_logprobs"][1:])
    assert_same_steps(got["prompt_logprobs"], logprobs_of(result.prompt_logprobs))
    assert torch.equal(torch.tensor(got["queued_logits"]), local_logits)  # the client backend's: bit for bit
    torch.testing.assert_close(torch.tensor(got["remote_logits"]), logits, atol=1e-5, rtol=1e-5)

    # Both jobs completed; the client backend's result is torch's format.
    assert len(got["jobs"]) == 2 and {status for _, status, _ in got["jobs"]} == {"completed"}, got["jobs"]
    assert (got["queued_job"], "completed", "torch") in [tuple(job) for job in got["jobs"]]
    # Everything lives under the data directory: the SQLite file and the local object store, where the
    # engine's handed-off result was moved (nothing is left in the handoff directory).
    data = private_checkout / ".nnqueue"
    assert (data / "objects" / "results" / got["queued_job"] / "1" / "saves.pt").is_file()
    assert not [path for path in (data / "objects" / ".handoff").rglob("*") if path.is_file()]
    with create_engine(f"sqlite:///{data / 'nnqueue.db'}").connect() as connection:
        assert connection.execute(text("select status from jobs")).scalars().all() == ["completed"] * 2
        assert connection.execute(text("select stopped_at is not null from workers")).scalars().all() == [1]
    # stop() left nothing running: Redis, the worker and its engine core (the script waited for them).
    assert got["processes"] >= 3 and got["survivors"] == [], got

    if os.geteuid() != 0:
        return  # the layout of issue 22 is root's: the worker runs as root and its engine switches users
    # The worker said what its engine runs as, in its log and on /readyz: the engine user, fully isolated.
    [containment] = got["engines"].values()
    assert containment["engine_user"] == "nnqueue-engine" and containment["isolation"] == "full", containment
    assert containment["seccomp"] == "applied" and got["isolation"] == "full"
    assert "engine processes switch to 'nnqueue-engine'" in log and "DEGRADED" not in log
