"""The README's Python examples, exactly as written, in fresh interpreters on this CPU-only machine.

The snippets are read out of README.md ("A trace", "A harvest"); only what a user fills in is replaced: the
API's URL, the key, and the model (the tiny test model, linked as ``tiny-llama`` in the working directory so
that its path is the worker's model key). They run against the module's live stack (API + worker): the trace
as a script and through ``nnqueue submit``, the harvest as a script that downloads and loads its shard.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nnqueue.embedded import ApiServer
from tests.utils.api import create_secret
from tests.utils.services import MODEL_KEY, Services, WorkerProcess

# End to end: fresh interpreters against a real API server and the shared worker.
pytestmark = [pytest.mark.slow, pytest.mark.shared_worker]


ROOT = Path(__file__).resolve().parents[2]
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def readme_snippet(heading: str = "## A trace") -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split(f"\n{heading}\n", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]


def filled_in(snippet: str, url: str, secret: str) -> str:
    """The snippet with the API's URL, the key and the model a user would put in."""
    for placeholder in ('"http://127.0.0.1:8000"', '"nnq_..."', '"meta-llama/Llama-3.1-8B"'):
        assert placeholder in snippet, f"the README's snippet no longer has {placeholder}"
    snippet = snippet.replace('"http://127.0.0.1:8000"', repr(url))
    return snippet.replace('"nnq_..."', repr(secret)).replace('"meta-llama/Llama-3.1-8B"', repr(MODEL_KEY))


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path, api_server: ApiServer, secret: str) -> Path:
    snippet = filled_in(readme_snippet(), api_server.url, secret)
    directory = tmp_path_factory.mktemp("readme")
    (directory / MODEL_KEY).symlink_to(tiny_model_path)
    path = directory / "readme_example.py"
    path.write_text(snippet)
    return path


def fresh(command: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {name: value for name, value in os.environ.items() if not name.startswith("NNQUEUE_")}
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, timeout=600)


def test_the_readme_example_runs_as_written(script: Path, worker: WorkerProcess) -> None:
    run = fresh([sys.executable, script.name], script.parent)
    assert run.returncode == 0, run.stderr[-5000:]
    assert run.stdout.count("tensor(") >= 3  # hidden (mlp_out, residual) and the logits


def test_nnqueue_submit_queues_the_readme_examples_job(script: Path, worker: WorkerProcess) -> None:
    queued = fresh([sys.executable, "-m", "nnqueue", "submit", script.name], script.parent)
    assert "1 job(s) submitted by readme_example.py" in queued.stdout, queued.stdout + queued.stderr[-3000:]
    assert len(set(UUID.findall(queued.stdout))) == 1

    waited = fresh([sys.executable, "-m", "nnqueue", "submit", "--wait", script.name], script.parent)
    assert waited.returncode == 0, waited.stdout + waited.stderr[-3000:]
    assert "tensor(" in waited.stdout and "completed" in waited.stdout


def test_the_readme_harvest_example_runs_as_written(
    tmp_path: Path, api_server: ApiServer, services: Services, worker: WorkerProcess
) -> None:
    harvester = create_secret(services.sessions, "hana", ("harvest",))
    snippet = filled_in(readme_snippet("## A harvest"), api_server.url, harvester)
    assert len(snippet.strip().splitlines()) <= 10
    (tmp_path / "readme_harvest.py").write_text(snippet)
    run = fresh([sys.executable, "readme_harvest.py"], tmp_path)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]
    # Two prompts, every token, one row each: [rows, hidden] with rows > 2 and the tiny model's width.
    rows, width = (int(n) for n in re.findall(r"torch\.Size\(\[(\d+), (\d+)\]\)", run.stdout)[-1])
    assert rows > 2 and width == 128, run.stdout[-2000:]
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert sum(shard["rows"] for shard in manifest["shards"]) == rows
