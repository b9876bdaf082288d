"""The README's Python example, exactly as written, in fresh interpreters on this CPU-only machine.

The snippet is read out of README.md ("Using it"); only what a user fills in is replaced: the API's
URL, the key, and the model (the tiny test model, linked as ``tiny-llama`` in the working directory so
that its path is the worker's model key). It runs against the module's live stack (API + worker), as a
script and through ``nnqueue submit``.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nnqueue.embedded import ApiServer
from tests.utils.services import MODEL_KEY, WorkerProcess

pytestmark = pytest.mark.slow  # end to end: fresh interpreters against a real API server and worker


ROOT = Path(__file__).resolve().parents[2]
UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def readme_snippet() -> str:
    readme = (ROOT / "README.md").read_text()
    section = readme.split("## Using it", 1)[1]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory, tiny_model_path: Path, api_server: ApiServer, secret: str) -> Path:
    snippet = readme_snippet()
    for placeholder in ('"http://127.0.0.1:8000"', '"nnq_..."', '"meta-llama/Llama-3.1-8B"'):
        assert placeholder in snippet, f"the README's snippet no longer has {placeholder}"
    snippet = snippet.replace('"http://127.0.0.1:8000"', repr(api_server.url))
    snippet = snippet.replace('"nnq_..."', repr(secret)).replace('"meta-llama/Llama-3.1-8B"', repr(MODEL_KEY))
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
