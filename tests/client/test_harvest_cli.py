"""``nnqueue harvest ...`` and ``nnqueue schedules ...`` against the real API, a real worker (tiny model) and S3:
a YAML spec with an uploaded text file runs to the end, its shards download (resumably, checked against their
sha256) and load with safetensors alone, its statistics are those of its rows; a harvest exported for SAELens
trains an SAE with the recipe of docs/user/harvest-training.md; schedules are created, listed, paused, resumed
and deleted."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file
from typer.testing import CliRunner

from nnqueue.cli import app
from nnqueue.embedded import ApiServer
from tests.utils.api import create_secret
from tests.utils.services import MODEL_KEY, Services, WorkerProcess
from tests.utils.tiny_model import CORPUS

pytestmark = [pytest.mark.slow, pytest.mark.shared_worker]  # a worker process runs the harvest (the shared one)

UUID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
SPEC = f"""\
model_key: {MODEL_KEY}
dataset: {{format: text}}
captures: [{{module: model.layers.1}}]
selection: {{kind: last}}
prompts_per_chunk: 2
"""
SAE_SPEC = f"""\
model_key: {MODEL_KEY}
dataset: {{format: text}}
captures: [{{module: model.layers.1}}]
selection: {{kind: all, skip: 1}}
dtype: bfloat16
prompts_per_chunk: 16
"""


@pytest.fixture(scope="module")
def harvester(services: Services) -> str:
    return create_secret(services.sessions, "hana", ("harvest",))


def cli(args: list[str], url: str, secret: str, exit_code: int = 0, env: dict[str, str] | None = None) -> Any:
    env = {"NNQUEUE_URL": url, "NNQUEUE_API_KEY": secret, "COLUMNS": "250", **(env or {})}
    result = CliRunner().invoke(app, args, env=env)
    assert result.exit_code == exit_code, result.output
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
    login = (api_server.url, harvester)
    assert "3 chunks" in submitted
    assert "completed" in cli(["harvest", "status", harvest_id], api_server.url, harvester)
    assert harvest_id in cli(["harvest", "list"], api_server.url, harvester)
    manifest = json.loads(cli(["harvest", "manifest", harvest_id], api_server.url, harvester))
    assert manifest["dataset"]["prompts"] == 5 and len(manifest["shards"]) == 3

    target = tmp_path / "out"
    cli(["harvest", "download", harvest_id, str(target)], api_server.url, harvester)
    (target / "shard-00001.safetensors").write_bytes(b"torn")  # an interrupted download: fetched again
    cli(["harvest", "download", harvest_id, str(target), "--parallel", "2"], api_server.url, harvester)
    prompts, values = [], []
    for shard in manifest["shards"]:
        tensors = load_file(target / shard["file"])
        assert tensors["model.layers.1.output"].shape[0] == shard["rows"] == shard["prompts"]  # one last token each
        prompts += tensors["prompt_index"].tolist()
        values.append(tensors["model.layers.1.output"].double())
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

    # The statistics the shard writers took, summed over the shards, are those of the rows downloaded.
    stats = manifest["statistics"]["model.layers.1.output"]
    rows = torch.cat(values)
    assert stats["count"] == 5 and stats["width"] == 128 and stats["nan"] == stats["inf"] == 0
    torch.testing.assert_close(torch.tensor(stats["mean"], dtype=torch.float64), rows.mean(0), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(
        torch.tensor(stats["std"], dtype=torch.float64), rows.std(0, correction=0), atol=1e-5, rtol=1e-5
    )
    assert stats["norm"]["max"] == pytest.approx(float(rows.norm(dim=1).max()), rel=1e-5)
    shown = cli(["harvest", "inspect", harvest_id, "--rows", "2"], api_server.url, harvester)
    assert "model.layers.1.output" in shown and "[5, 128]" in shown and "float32" in shown
    first = load_file(target / "shard-00000.safetensors")["model.layers.1.output"]
    assert f"{first[0, 0].item():.4g}" in shown  # the first row's values

    refused = cli(["harvest", "export", harvest_id, str(tmp_path / "sae"), "--format", "saelens"], *login, exit_code=1)
    assert "selection is 'last'" in refused and not (tmp_path / "sae" / "state.json").exists()


def train_sae(dest: Path, steps: int) -> tuple[float, float]:
    """docs/user/harvest-training.md's SAELens recipe on the export in ``dest``; the reconstruction loss of the
    SAE before and after training, on the export's activations."""
    from datasets import load_dataset, load_from_disk
    from sae_lens import (
        LanguageModelSAERunnerConfig,
        LanguageModelSAETrainingRunner,
        LoggingConfig,
        StandardTrainingSAEConfig,
    )

    export = json.loads((dest / "nnqueue_export.json").read_text())
    hook, context_size = next(iter(export["columns"].values())), export["context_size"]
    d_in = export["manifest"]["statistics"]["model.layers.1.output"]["width"]
    cfg = LanguageModelSAERunnerConfig(
        sae=StandardTrainingSAEConfig(d_in=d_in, d_sae=4 * d_in, l1_coefficient=1e-3),
        model_class_name="AutoModelForCausalLM",
        model_name=export["manifest"]["provenance"]["model"]["path"],
        hook_name=hook,
        use_cached_activations=True,
        cached_activations_path=str(dest),
        context_size=context_size,
        training_tokens=steps * 64,
        train_batch_size_tokens=64,
        store_batch_size_prompts=4,
        n_batches_in_buffer=4,
        lr=3e-3,
        device="cpu",
        logger=LoggingConfig(log_to_wandb=False),
        checkpoint_path=None,
        output_path=None,
    )
    runner = LanguageModelSAETrainingRunner(cfg, override_dataset=load_dataset(str(dest / "tokens"), split="train"))
    activations = load_from_disk(str(dest)).with_format("torch")[:][hook].reshape(-1, d_in)

    def loss(sae: Any) -> float:
        with torch.no_grad():
            return float((sae(activations) - activations).pow(2).sum(-1).mean())

    before = loss(runner.sae)
    after = loss(runner.run())
    return before, after


def test_a_harvest_exports_for_saelens_and_an_sae_trains_on_it(
    api_server: ApiServer, harvester: str, worker: WorkerProcess, services: Services, tmp_path: Path
) -> None:
    from datasets import load_from_disk

    login = (api_server.url, harvester)
    (tmp_path / "spec.yaml").write_text(SAE_SPEC)
    lines = [f"{sentence} Line {index}." for index in range(12) for sentence in CORPUS]
    (tmp_path / "texts.txt").write_text("\n".join(lines) + "\n")
    dry_run = ["harvest", "submit", str(tmp_path / "spec.yaml"), "--dataset", str(tmp_path / "texts.txt"), "--dry-run"]
    estimated = cli(dry_run, *login)
    assert f"{len(lines)} prompts" in estimated and "5 shards" in estimated and "rows" in estimated
    submitted = cli(
        ["harvest", "submit", str(tmp_path / "spec.yaml"), "--dataset", str(tmp_path / "texts.txt"), "--wait"], *login
    )
    [harvest_id] = set(UUID.findall(submitted))
    assert "tokens/s" in cli(dry_run, *login)  # now the model's workers have a measured rate
    cli(["harvest", "download", harvest_id, str(tmp_path / "shards")], *login)
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    shards = [load_file(tmp_path / "shards" / shard["file"]) for shard in manifest["shards"]]
    rows = torch.cat([shard["model.layers.1.output"] for shard in shards])
    ids = torch.cat([shard["token_id"] for shard in shards])
    # skip: 1 left out every prompt's position 0, the BOS token the tokenizer adds (the manifest says it does).
    assert torch.cat([shard["token_position"] for shard in shards]).min() == 1 and 1 not in ids.tolist()
    provenance = manifest["provenance"]
    assert provenance["tokenizer"]["adds_bos_token"] is True and provenance["text_prompts_start_with_bos"] is True
    assert len(provenance["model"]["sha256"]) == 64 and provenance["engine_dtype"] == "float32"

    dest = tmp_path / "sae"
    said = cli(["harvest", "export", harvest_id, str(dest), "--format", "saelens", "--context-size", "16"], *login)
    assert "bfloat16 stored as float32" in said
    saved = load_from_disk(str(dest)).with_format("torch")
    whole = len(rows) // 16 * 16
    assert saved.features["model.layers.1"].shape == (16, 128) and len(saved) == whole // 16
    exported = saved[:]
    assert torch.equal(exported["model.layers.1"].reshape(-1, 128), rows[:whole].float())  # bf16 -> f32 is exact
    assert torch.equal(exported["token_ids"].reshape(-1), ids[:whole].int())
    record = json.loads((dest / "nnqueue_export.json").read_text())
    assert record["dtype"] == {"harvested": "bfloat16", "exported": "float32", "exact": "true"}
    assert record["dropped_rows"] == len(rows) - whole

    # The same export into the object store: the folder's files under the prefix, which opens as the local one.
    s3 = services.settings.s3
    aws = {
        "AWS_ENDPOINT_URL": s3.endpoint_url or "",
        "AWS_ACCESS_KEY_ID": s3.access_key_id or "",
        "AWS_SECRET_ACCESS_KEY": s3.secret_access_key.get_secret_value() if s3.secret_access_key else "",
        "AWS_DEFAULT_REGION": s3.region,
    }
    remote = f"s3://{s3.bucket}/exports/{harvest_id}"
    said = cli(
        ["harvest", "export", harvest_id, remote, "--format", "saelens", "--context-size", "16"], *login, env=aws
    )
    assert f"in {remote}" in said
    local_files = sorted(p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file())
    keys = services.store.list_keys(f"exports/{harvest_id}/")
    assert sorted(key.removeprefix(f"exports/{harvest_id}/") for key in keys) == local_files
    copy = tmp_path / "from-s3"
    for key in keys:
        target = copy / key.removeprefix(f"exports/{harvest_id}/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(services.store.get_bytes(key))
    fetched = load_from_disk(str(copy)).with_format("torch")[:]
    assert torch.equal(fetched["model.layers.1"], exported["model.layers.1"])
    assert torch.equal(fetched["token_ids"], exported["token_ids"])
    refused = cli(["harvest", "export", harvest_id, remote], *login, exit_code=1, env=aws)
    assert "is not empty" in refused

    flat = tmp_path / "hf"
    cli(["harvest", "export", harvest_id, str(flat), "--format", "hf"], *login)
    table = load_from_disk(str(flat)).with_format("torch")[:]
    assert len(table["token_id"]) == len(rows) and torch.equal(table["model.layers.1"], rows.float())
    assert torch.equal(table["prompt_index"], torch.cat([shard["prompt_index"] for shard in shards]))

    before, after = train_sae(dest, steps=40)
    print(f"SAE reconstruction loss {before:.1f} -> {after:.1f} after 40 steps")
    assert after < 0.3 * before  # 0.27 -> 0.03 when written (the tiny model's residual norms are about 0.5)


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
