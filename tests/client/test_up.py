"""``nnqueue up`` as a newcomer runs it after the demo, with no flags: it serves the demo's model (the folder the
demo converted in its data directory: the run's conversion, tests/utils/demo_model.py, shared with the demo's
test), and from other processes, in the folder it ran in:

* every Python block of the README runs exactly as printed, with only the URL and the key ``up`` printed put in
  (one script: the blocks continue one session; ``nnqueue submit`` of a script is tests/client/test_end_to_end.py's);
* the CLI against it: ``harvest submit --dataset`` with a spec without ``dataset:``, schedules fired by the beat
  inside ``up``, whole ids in piped tables, ``--json``, and ids by their first characters;

then SIGTERM, and a second ``up`` on the same data directory naming the demo's folder (``--model``, the string
nnsight's ``remote=True`` sends): the nnqueue-up page's block runs with the exports it printed, and the same key
still reads the first run's jobs and harvests.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from nnqueue.cli import app
from nnqueue.client import Client
from nnqueue.demo import MODEL_KEY
from nnqueue.embedded import free_port
from tests.utils.demo_model import place_demo_model

pytestmark = pytest.mark.slow  # end to end: two runs of `nnqueue up` on the demo's model, each with a worker

ROOT = Path(__file__).resolve().parents[2]
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
DEMO_FOLDER = f".nnqueue/models/{MODEL_KEY}"  # where the README's meta model is, from the folder `up` ran in


def python_blocks(page: Path) -> list[str]:
    return re.findall(r"```python\n(.*?)```", page.read_text(), re.S)


def clean_env() -> dict[str, str]:
    """This environment without the suite's settings: only what `up` prints configures the processes."""
    env = {name: value for name, value in os.environ.items() if not name.startswith(("NNQUEUE_", "NDIF_"))}
    return {**env, "PYTHONPATH": str(ROOT), "COLUMNS": "200", "VLLM_CPU_KVCACHE_SPACE": "1"}


class Up:
    """One ``nnqueue up`` subprocess in ``folder``, its output in a file."""

    def __init__(self, folder: Path, port: int, log: Path, *options: str) -> None:
        self.log = log
        self.url = self.key = ""  # what it printed, once it serves
        with open(log, "wb") as out:
            self.process = subprocess.Popen(
                [sys.executable, "-m", "nnqueue", "up", "--port", str(port), *options],
                cwd=folder,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=clean_env(),
                start_new_session=True,
            )

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def wait_serving(self, timeout: float = 900) -> tuple[str, str]:
        """The URL and key it printed, once it says it serves."""
        deadline = time.monotonic() + timeout
        while not (key := re.search(r"^API key: (\S+)$", self.output(), re.MULTILINE)):
            assert self.process.poll() is None, f"nnqueue up exited {self.process.returncode}:\n{self.output()}"
            assert time.monotonic() < deadline, f"nnqueue up did not serve in {timeout} s:\n{self.output()}"
            time.sleep(1)
        url = re.search(r"^serving '.+' at (\S+)$", self.output(), re.MULTILINE)
        assert url, self.output()
        return url[1], key[1]

    def exports(self) -> dict[str, str]:
        """The variables of the `export` lines it printed."""
        return dict(re.findall(r"(\w+)=(\S+)", "\n".join(re.findall(r"^\s*export (.*)$", self.output(), re.M))))

    def terminate(self, timeout: float = 120) -> int:
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout)
        finally:
            if self.process.poll() is None:
                os.killpg(self.process.pid, signal.SIGKILL)


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The folder `nnqueue up` runs in (its data directory is the default, ./.nnqueue) and the examples run from,
    with the demo's model converted in the data directory, as ``nnqueue demo`` leaves it."""
    folder = tmp_path_factory.mktemp("newcomer")
    place_demo_model(tmp_path_factory, folder / ".nnqueue" / "models")
    return folder


@pytest.fixture(scope="module")
def port() -> int:
    return free_port()


@pytest.fixture(scope="module")
def up(folder: Path, port: int) -> Iterator[Up]:
    started = Up(folder, port, folder / "up-1.log")
    try:
        started.url, started.key = started.wait_serving()
        yield started
    finally:
        if started.process.poll() is None:
            started.terminate()


def fresh(command: list[str], cwd: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(command, cwd=cwd, env={**clean_env(), **env}, capture_output=True, text=True, timeout=900)


def filled_in(block: str, up: Up) -> str:
    """The block with what `up` printed in place of the README's URL and key, and nothing else changed."""
    for placeholder in ('"http://127.0.0.1:8000"', '"nnq_..."'):
        assert placeholder in block, f"the README's block no longer has {placeholder}"
    return block.replace('"http://127.0.0.1:8000"', repr(up.url)).replace('"nnq_..."', repr(up.key))


def test_up_serves_the_demos_model_by_default_as_the_readme_shows(up: Up, folder: Path) -> None:
    output = up.output()
    assert f"serving {MODEL_KEY!r} at {up.url}" in output
    assert f"a meta model of it for your traces: VLLM({DEMO_FOLDER!r})" in output
    assert "harvest schedules fire here too" in output
    readme = (ROOT / "README.md").read_text()
    for line in (f"serving {MODEL_KEY!r} at http://127.0.0.1:8000", f"VLLM({DEMO_FOLDER!r})", "$ .venv/bin/nnqueue up"):
        assert line in readme
    assert (folder / DEMO_FOLDER / "config.json").is_file()
    assert (folder / ".nnqueue" / "api-key").stat().st_mode & 0o077 == 0


def test_the_readmes_python_blocks_run_as_printed(up: Up, folder: Path) -> None:
    blocks = python_blocks(ROOT / "README.md")
    assert len(blocks) >= 4  # a trace, a harvest, its stream, steering
    script = "\n".join(filled_in(block, up) if "nnq_..." in block else block for block in blocks)
    assert "meta-llama" not in script  # offline: no gated model, no hub
    (folder / "readme.py").write_text(script)
    run = fresh([sys.executable, "readme.py"], folder, HF_HUB_OFFLINE="1")
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    assert run.stdout.count("tensor(") >= 3  # the trace: hidden (mlp_out, residual) and the logits
    shapes = [(int(rows), int(width)) for rows, width in re.findall(r"torch\.Size\(\[(\d+), (\d+)\]\)", run.stdout)]
    # The harvest's shard: every token of two prompts, one row each, SmolLM2-135M's width; the stream's last batch.
    assert len(shapes) == 2 and shapes[0][0] > 2 and shapes[0][1] == shapes[1][1] == 576, run.stdout[-2000:]
    manifest = json.loads((folder / "out" / "manifest.json").read_text())
    assert sum(shard["rows"] for shard in manifest["shards"]) == shapes[0][0] == shapes[1][0]
    steered = run.stdout.rstrip().splitlines()[-1]
    assert steered.strip() and "torch.Size" not in steered  # the steering job's generated text


def nnqueue(up: Up, *args: str) -> Any:
    """The command, in this process, configured only by the exports `up` printed; stdout is not a terminal."""
    env = {name: value for name, value in up.exports().items() if name.startswith("NNQUEUE_")}
    assert set(env) == {"NNQUEUE_URL", "NNQUEUE_API_KEY"}
    return CliRunner().invoke(app, list(args), env={**env, "COLUMNS": "80"}, catch_exceptions=False)


def test_the_cli_harvests_an_uploaded_file_with_a_spec_without_dataset_and_reads_ids_as_printed(
    up: Up, folder: Path
) -> None:
    (folder / "spec.yaml").write_text(f"model_key: {MODEL_KEY}\ncaptures: [{{module: model.layers.15}}]\n")
    (folder / "corpus.txt").write_text("The Eiffel Tower is in Paris\nA job queue runs many traces\n")
    submitted = nnqueue(up, "harvest", "submit", str(folder / "spec.yaml"), "--dataset", str(folder / "corpus.txt"))
    assert submitted.exit_code == 0, submitted.output
    [harvest_id] = UUID.findall(submitted.output)
    waited = nnqueue(up, "harvest", "status", harvest_id[:8], "--wait", "--json")
    assert waited.exit_code == 0, waited.output
    assert json.loads(waited.output)["id"] == harvest_id and json.loads(waited.output)["status"] == "completed"

    # A table to a pipe at 80 columns keeps whole ids (they used to end in "…"); --json is the API's answer.
    listed = nnqueue(up, "harvest", "list")
    assert listed.exit_code == 0 and harvest_id in listed.output and "…" not in listed.output, listed.output
    assert harvest_id in [item["id"] for item in json.loads(nnqueue(up, "harvest", "list", "--json").output)]
    jobs = json.loads(nnqueue(up, "jobs", "--json").output)
    assert jobs and all(UUID.fullmatch(job["id"]) for job in jobs)
    job_id = jobs[0]["id"]
    shown = nnqueue(up, "jobs")
    assert job_id in shown.output and "…" not in shown.output, shown.output
    status = nnqueue(up, "status", job_id[:6], "--json")
    assert status.exit_code == 0 and json.loads(status.output)["id"] == job_id, status.output
    [steering] = json.loads(nnqueue(up, "steer", "list", "--json").output)  # the README's steering job
    assert steering["status"] == "completed"
    assert json.loads(nnqueue(up, "steer", "status", steering["id"][:8], "--json").output)["id"] == steering["id"]
    assert [model["model_key"] for model in json.loads(nnqueue(up, "models", "--json").output)] == [MODEL_KEY]


def test_up_fires_schedules_with_the_beat_inside(up: Up, folder: Path) -> None:
    spec = {"model_key": MODEL_KEY, "captures": [{"module": "model.layers.1"}], "dataset": {"prompts": ["Hello"]}}
    (folder / "scheduled.json").write_text(json.dumps(spec))
    created = nnqueue(up, "schedules", "create", "often", str(folder / "scheduled.json"), "--cron", "* * * * * */5")
    assert created.exit_code == 0, created.output
    deadline = time.monotonic() + 120
    while not (schedule := json.loads(nnqueue(up, "schedules", "list", "--json").output)[0])["last_harvest_id"]:
        assert time.monotonic() < deadline, f"the schedule never fired: {schedule}\n{up.output()}"
        time.sleep(1)
    assert schedule["runs"] >= 1 and not schedule["last_error"]
    fired = nnqueue(up, "harvest", "status", schedule["last_harvest_id"], "--wait", "--json")
    assert fired.exit_code == 0 and json.loads(fired.output)["status"] == "completed", fired.output
    assert nnqueue(up, "schedules", "delete", str(schedule["id"])).exit_code == 0


def test_a_second_up_naming_the_demos_folder_keeps_the_key_and_the_state_and_serves_remote_true(
    up: Up, folder: Path, port: int
) -> None:
    with Client(up.url, up.key) as client:
        jobs = {job.id for job in client.jobs()}
        harvests = [harvest.id for harvest in client.harvests()]
    assert jobs and harvests
    assert up.terminate() == 0, up.output()

    again = Up(folder, port, folder / "up-2.log", "--model", DEMO_FOLDER)
    try:
        url, key = again.wait_serving()
        assert (url, key) == (up.url, up.key), "the URL or the key changed across the restart"
        assert f"serving {DEMO_FOLDER!r} at {url}" in again.output()
        [block] = python_blocks(ROOT / "docs" / "user" / "nnqueue-up.md")
        (folder / "remote.py").write_text(block)
        run = fresh([sys.executable, "remote.py"], folder, HF_HUB_OFFLINE="1", **again.exports())
        assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
        assert "torch.Size([1, 49152]) torch.Size([" in run.stdout, run.stdout  # remote=True's logits, the backend's
        with Client(url, key) as client:
            assert {job.id for job in client.jobs()} >= jobs
            shards = client.get_harvest(harvests[-1]).download(folder / "old-shards", progress=False)
            assert any(Path(shards).rglob("*.safetensors"))
        assert again.terminate() == 0, again.output()
    finally:
        if again.process.poll() is None:
            again.terminate()
