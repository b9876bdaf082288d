"""``nnqueue up`` as a researcher runs it: a subprocess serving the tiny model; from this (another) process a
``remote=True`` trace with nnsight's own client, a job through the nnqueue client and a harvest; then SIGTERM,
a second ``nnqueue up`` on the same data directory, and the same key still reads the old job and harvest."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from nnqueue.client import Client
from nnqueue.embedded import free_port
from tests.utils.tiny_model import TINY_ENGINE_KWARGS

pytestmark = pytest.mark.slow  # end to end: two runs of `nnqueue up`, each with a worker process

PROMPT = "The Eiffel Tower is in"


class Up:
    """One ``nnqueue up`` subprocess, its output in a file."""

    def __init__(self, model: Path, data_dir: Path, port: int, log: Path) -> None:
        engine = [f"--{name.replace('_', '-')}={value}" for name, value in TINY_ENGINE_KWARGS.items()]
        command = [sys.executable, "-m", "nnqueue", "up", "--model", str(model), "--data-dir", str(data_dir)]
        command += ["--port", str(port), "--max-concurrent-jobs", "2", *engine]
        self.log = log
        with open(log, "wb") as out:
            env = {**os.environ, "COLUMNS": "200", "VLLM_CPU_KVCACHE_SPACE": "1"}
            self.process = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_serving(self, timeout: float = 600) -> str:
        """The key it printed, once it says it serves."""
        deadline = time.monotonic() + timeout
        while not (found := re.search(r"^API key: (\S+)$", self.output(), re.MULTILINE)):
            assert self.process.poll() is None, f"nnqueue up exited {self.process.returncode}:\n{self.output()}"
            assert time.monotonic() < deadline, f"nnqueue up did not serve in {timeout} s:\n{self.output()}"
            time.sleep(1)
        return found[1]

    def terminate(self, timeout: float = 120) -> int:
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        finally:
            if self.process.poll() is None:
                os.killpg(self.process.pid, signal.SIGKILL)


def test_nnqueue_up_serves_remote_traces_and_harvests_and_keeps_its_state_across_a_restart(
    tmp_path: Path, tiny_model_path: Path, client_model: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nnsight import CONFIG

    data, port = tmp_path / "data", free_port()
    url = f"http://127.0.0.1:{port}"
    up = Up(tiny_model_path, data, port, tmp_path / "up-1.log")
    try:
        key = up.wait_serving()
        assert f"NDIF_HOST={url}/ndif" in up.output() and f"{url}/status" in up.output()
        assert (data / "api-key").stat().st_mode & 0o077 == 0

        monkeypatch.setattr(CONFIG.API, "HOST", f"{url}/ndif")
        monkeypatch.setattr(CONFIG.API, "APIKEY", key)
        monkeypatch.setattr(CONFIG.APP, "REMOTE_LOGGING", False)
        with client_model.trace(PROMPT, temperature=0.0, max_tokens=1, remote=True):
            remote_logits = client_model.logits.save()

        with Client(url, key) as client:
            backend = client.backend(model_key=str(tiny_model_path), progress=False)
            with client_model.trace(PROMPT, temperature=0.0, max_tokens=1, backend=backend):
                logits = client_model.logits.save()
            assert torch.equal(logits, remote_logits)
            job_id = backend.job.id
            texts = tmp_path / "texts.txt"
            texts.write_text("The Eiffel Tower is in Paris\nA job queue runs many traces\n")
            spec = {
                "model_key": str(tiny_model_path),
                "dataset": {"format": "text"},
                "captures": [{"module": "model.layers.0"}],
                "selection": {"kind": "all"},
                "dtype": "float32",
                "prompts_per_chunk": 1,
            }
            harvest = client.harvest(spec, dataset=texts)
            harvest.wait(timeout=300)
            harvest_id = harvest.id
        assert up.terminate() == 0, up.output()
    finally:
        if up.process.poll() is None:
            up.terminate()

    again = Up(tiny_model_path, data, port, tmp_path / "up-2.log")
    try:
        assert again.wait_serving() == key, "the key changed across the restart"
        with Client(url, key) as client:
            assert torch.equal(client.job(job_id).result()["logits"], logits)
            assert {job.id for job in client.jobs()} >= {job_id}
            shards = client.get_harvest(harvest_id).download(tmp_path / "shards", progress=False)
            assert any(Path(shards).rglob("*.safetensors"))
        assert again.terminate() == 0, again.output()
    finally:
        if again.process.poll() is None:
            again.terminate()
