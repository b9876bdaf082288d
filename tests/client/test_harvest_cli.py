"""``nnqueue harvest ...`` and ``nnqueue schedules ...`` against the real API, a real worker (tiny model) and S3:
a YAML spec with an uploaded text file runs to the end, its shards download (resumably, checked against their
sha256) and load with safetensors alone; schedules are created, listed, paused, resumed and deleted."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file
from typer.testing import CliRunner

from nnqueue.cli import app
from nnqueue.embedded import ApiServer
from tests.utils.api import create_secret
from tests.utils.services import MODEL_KEY, Services, WorkerProcess

pytestmark = pytest.mark.slow  # a worker process runs the harvest

UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
SPEC = f"""\
model_key: {MODEL_KEY}
dataset: {{format: text}}
captures: [{{module: model.layers.1}}]
selection: {{kind: last}}
prompts_per_chunk: 2
"""


@pytest.fixture(scope="module")
def harvester(services: Services) -> str:
    return create_secret(services.sessions, "hana", ("harvest",))


def cli(args: list[str], url: str, secret: str) -> Any:
    result = CliRunner().invoke(app, args, env={"NNQUEUE_URL": url, "NNQUEUE_API_KEY": secret, "COLUMNS": "250"})
    assert result.exit_code == 0, result.output
    return result.output


def test_a_harvest_from_a_yaml_spec_runs_and_its_shards_download_and_load(
    api_server: ApiServer, harvester: str, services: Services, worker: WorkerProcess, tmp_path: Path
) -> None:
    (tmp_path / "spec.yaml").write_text(SPEC)
    (tmp_path / "texts.txt").write_text("one two three\nfour five\nsix\nseven eight nine ten\neleven\n")
    submitted = cli(
        ["harvest", "submit", str(tmp_path / "spec.yaml"), "--dataset", str(tmp_path / "texts.txt"), "--wait"],
        api_server.url,
        harvester,
    )
    [harvest_id] = set(UUID.findall(submitted))
    assert "3 chunks" in submitted
    assert "completed" in cli(["harvest", "status", harvest_id], api_server.url, harvester)
    assert harvest_id in cli(["harvest", "list"], api_server.url, harvester)
    manifest = json.loads(cli(["harvest", "manifest", harvest_id], api_server.url, harvester))
    assert manifest["dataset"]["prompts"] == 5 and len(manifest["shards"]) == 3

    target = tmp_path / "out"
    cli(["harvest", "download", harvest_id, str(target)], api_server.url, harvester)
    (target / "shard-00001.safetensors").write_bytes(b"torn")  # an interrupted download: fetched again
    cli(["harvest", "download", harvest_id, str(target), "--parallel", "2"], api_server.url, harvester)
    prompts = []
    for shard in manifest["shards"]:
        tensors = load_file(target / shard["file"])
        assert tensors["model.layers.1.output"].shape[0] == shard["rows"] == shard["prompts"]  # one last token each
        prompts += tensors["prompt_index"].tolist()
    assert prompts == [0, 1, 2, 3, 4]
    for shard in manifest["shards"]:  # what the worker recorded is what it stored
        assert hashlib.sha256((target / shard["file"]).read_bytes()).hexdigest() == shard["sha256"]

    # A shard changed in the store (S3) after the worker stored it: the download fails loudly and keeps nothing.
    key = f"harvests/{harvest_id}/shard-00001.safetensors"
    forged = bytearray(services.store.get_bytes(key))
    forged[-1] ^= 0xFF
    services.store.put_bytes(key, bytes(forged))
    refused = CliRunner().invoke(
        app,
        ["harvest", "download", harvest_id, str(tmp_path / "again")],
        env={"NNQUEUE_URL": api_server.url, "NNQUEUE_API_KEY": harvester, "COLUMNS": "250"},
    )
    assert refused.exit_code != 0 and "IntegrityError" in refused.output + repr(refused.exception), refused.output
    assert not (tmp_path / "again" / "shard-00001.safetensors").exists()


def test_schedules_are_created_listed_paused_resumed_and_deleted(
    api_server: ApiServer, harvester: str, tmp_path: Path
) -> None:
    spec = tmp_path / "nightly.yaml"
    spec.write_text(SPEC.replace("dataset: {format: text}", "dataset: {prefix: users/hana/nightly/}"))
    created = cli(["schedules", "create", "nightly", str(spec), "--cron", "0 3 * * *"], api_server.url, harvester)
    schedule_id = re.search(r"schedule (\d+) \(nightly\)", created)
    assert schedule_id is not None, created
    number = schedule_id.group(1)
    listed = cli(["schedules", "list"], api_server.url, harvester)
    assert "nightly" in listed and "active" in listed
    cli(["schedules", "pause", number], api_server.url, harvester)
    assert "paused" in cli(["schedules", "list"], api_server.url, harvester)
    cli(["schedules", "resume", number], api_server.url, harvester)
    assert "active" in cli(["schedules", "list"], api_server.url, harvester)
    cli(["schedules", "delete", number], api_server.url, harvester)
    assert "no schedules" in cli(["schedules", "list"], api_server.url, harvester)
