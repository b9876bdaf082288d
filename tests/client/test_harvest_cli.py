"""``nnqueue harvest ...`` and ``nnqueue schedules ...`` against the real API, a real worker (tiny model) and S3:
a YAML spec with an uploaded text file runs to the end, its shards download (resumably, checked against their
sha256) and load with safetensors alone, its statistics are those of its rows; docs/user/harvest-training.md
runs as printed, from the harvest to an SAE trained with SAELens and a probe from the streaming reader, and the
exports hold the shards' rows; schedules are created, listed, paused, resumed and deleted."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
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
outliers: {{action: clip, times_median: 1}}
prompts_per_chunk: 2
"""
TRAINING_PAGE = Path(__file__).parents[2] / "docs" / "user" / "harvest-training.md"
FENCE = re.compile(r"^```(\w+)\n(.*?)^```", re.MULTILINE | re.DOTALL)


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
    import torch
    from safetensors.torch import load_file

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
    # The spec's outliers option: each shard writer clipped the rows over its chunk's median norm (of two rows, the
    # lower) to it, so both rows of a two-prompt shard have the norm of the smaller; the one-prompt shard is as it was.
    assert manifest["outliers"] == {
        "action": "clip",
        "max_norm": None,
        "times_median": 1.0,
        "over": {"model.layers.1.output": 2},
        "dropped_rows": 0,
    }
    for shard, norms in zip(manifest["shards"], [value.norm(dim=1) for value in values], strict=True):
        assert shard["outliers"]["over"]["model.layers.1.output"] == len(norms) - 1
        assert shard["outliers"]["limits"]["model.layers.1.output"] == pytest.approx(float(norms.min()), rel=1e-5)
        torch.testing.assert_close(norms, norms.min().expand(len(norms)), rtol=1e-5, atol=0)
    shown = cli(["harvest", "inspect", harvest_id, "--rows", "2"], api_server.url, harvester)
    assert "outliers: clip rows with a norm over 1x the median norm of each chunk: 0 rows dropped" in shown
    assert "model.layers.1.output" in shown and "[5, 128]" in shown and "float32" in shown
    first = load_file(target / "shard-00000.safetensors")["model.layers.1.output"]
    assert f"{first[0, 0].item():.4g}" in shown  # the first row's values
    assert "prompt_length" in shown and "generated" in shown and "False" in shown

    refused = cli(["harvest", "export", harvest_id, str(tmp_path / "sae"), "--format", "saelens"], *login, exit_code=1)
    assert "selection is 'last'" in refused and not (tmp_path / "sae" / "state.json").exists()


def page_blocks(language: str) -> list[str]:
    """The ``language`` code blocks of docs/user/harvest-training.md, in order."""
    return [block for lang, block in FENCE.findall(TRAINING_PAGE.read_text()) if lang == language]


def page_block(marker: str) -> str:
    """The code block of the training page after ``<!-- test: marker -->``."""
    found = re.search(rf"<!-- test: {marker} -->\n```python\n(.*?)```", TRAINING_PAGE.read_text(), re.DOTALL)
    assert found is not None, marker
    return found[1]


def page_command(start: str, harvest_id: str) -> list[str]:
    """The training page's shell command beginning ``start``, its ``$HARVEST`` the harvest's id."""
    lines = [line.split("#")[0].split() for block in page_blocks("bash") for line in block.splitlines()]
    [command] = [line for line in lines if " ".join(line).startswith(start)]
    return [harvest_id if word == "$HARVEST" else word for word in command[1:]]


def test_the_training_page_runs_as_printed(
    api_server: ApiServer,
    harvester: str,
    worker: WorkerProcess,
    services: Services,
    tiny_model_path: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """docs/user/harvest-training.md, from the harvest to a trained SAE and probe: its spec (the test model's key
    and layer put in), its commands (the export sized for the test model) and its Python blocks as printed, in a
    directory laid out as the worker's (the model's folder at the path the manifest gives), then what the export
    holds against the shards themselves."""
    import torch
    from datasets import load_from_disk
    from sae_lens import StandardTrainingSAE
    from safetensors.torch import load_file

    login = (api_server.url, harvester)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "tiny-llama").symlink_to(tiny_model_path)  # where the worker found it, relative to its directory
    lines = [
        {"text": f"{sentence} Line {index}.", "label": number % 2}
        for index in range(30)
        for number, sentence in enumerate(CORPUS)
    ]
    (tmp_path / "corpus.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    [spec_text] = page_blocks("yaml")
    spec = {**yaml.safe_load(spec_text), "model_key": MODEL_KEY, "captures": [{"module": "model.layers.1"}]}
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump(spec))

    submit = page_command("nnqueue harvest submit", "")
    estimated = cli([*submit, "--dry-run"], *login)
    assert f"{len(lines)} prompts" in estimated and "3 shards" in estimated and "rows" in estimated
    [harvest_id] = set(UUID.findall(cli(submit, *login)))
    assert "tokens/s" in cli([*submit, "--dry-run"], *login)  # now the model's workers have a measured rate
    shown = cli(page_command("nnqueue harvest inspect", harvest_id), *login)
    assert "model.layers.1.output" in shown and "> 10x p50" in shown
    said = cli(
        [*page_command("nnqueue harvest export", harvest_id), "--context-size", "16", "--batch-size-tokens", "64"],
        *login,
    )
    assert "bfloat16 stored as float32" in said and "outliers: drop rows with a norm over 10x the median norm" in said

    monkeypatch.setenv("HARVEST", harvest_id)
    monkeypatch.setenv("NNQUEUE_URL", api_server.url)
    monkeypatch.setenv("NNQUEUE_API_KEY", harvester)
    probe: dict[str, Any] = {}
    exec(compile(page_block("probe-recipe"), "harvest-training.md: probe", "exec"), probe)
    assert probe["accuracy"] >= 0.9, probe["accuracy"]  # 6 texts, the label a function of which: separable

    record = json.loads((tmp_path / "acts" / "nnqueue_export.json").read_text())
    manifest = record["manifest"]
    assert manifest["model"] == "tiny-llama" == manifest["provenance"]["model"]["path"]
    assert manifest["provenance"]["prompts_start_with_bos"] is True  # the test tokenizer adds its BOS
    assert record["sae_lens"] == {
        "model_class_name": "AutoModelForCausalLM",
        "model_name": "tiny-llama",
        "hook_name": "model.layers.1",
        "d_in": 128,
        "context_size": 16,
        "prepend_bos": True,
        "train_batch_size_tokens": 64,
        "n_batches_in_buffer": 20,  # SAELens's default: 320 tokens, over 4 batches of 64
        "store_batch_size_prompts": 32,
        "n_batches_for_norm_estimate": record["rows"] // 64,
        "training_tokens": record["rows"],
    }
    sae: dict[str, Any] = {}
    exec(compile(page_block("sae-recipe"), "harvest-training.md: sae", "exec"), sae)
    activations = load_from_disk("acts").with_format("torch")[:]["model.layers.1"].reshape(-1, 128)

    def unexplained(model: Any) -> float:
        """The share of the activations' variance the SAE's reconstruction leaves."""
        with torch.no_grad():
            return float(
                (model(activations) - activations).pow(2).sum() / (activations - activations.mean(0)).pow(2).sum()
            )

    trained, untrained = unexplained(sae["sae"]), unexplained(StandardTrainingSAE(sae["cfg"].sae))
    print(f"the SAE leaves {trained:.3f} of the variance unexplained (untrained: {untrained:.3f})")
    assert trained < 0.75 < 1 < untrained  # 0.58 after its 58 steps, 1.5 untrained, when written
    saved = json.loads((tmp_path / "output" / "cfg.json").read_text())
    assert saved["metadata"]["prepend_bos"] is True and saved["metadata"]["hook_name"] == "model.layers.1"

    # What the export holds: the shards' rows less those over 10x the median norm, packed; generated marked.
    cli(["harvest", "download", harvest_id, str(tmp_path / "shards")], *login)
    shards = [load_file(tmp_path / "shards" / shard["file"]) for shard in manifest["shards"]]
    rows = torch.cat([shard["model.layers.1.output"] for shard in shards])
    ids = torch.cat([shard["token_id"] for shard in shards])
    # skip: 1 left out every prompt's position 0, the BOS token the tokenizer adds (the manifest says it does).
    assert torch.cat([shard["token_position"] for shard in shards]).min() == 1 and 1 not in ids.tolist()
    assert torch.equal(
        torch.cat([shard["prompt_length"] for shard in shards]) > 1, torch.ones(len(ids), dtype=torch.bool)
    )
    assert not any(shard["generated"].any() for shard in shards) and manifest["generated_rows"] == 0
    limit = 10 * manifest["statistics"]["model.layers.1.output"]["norm"]["percentiles"]["p50"]
    kept = rows.float().norm(dim=1) <= limit
    assert record["outliers"]["limits"] == {"model.layers.1.output": limit}
    assert (
        record["outliers"]["dropped_rows"] == int((~kept).sum()) == record["outliers"]["over"]["model.layers.1.output"]
    )
    rows, ids = rows[kept], ids[kept]
    saved_rows = load_from_disk("acts").with_format("torch")
    whole = len(rows) // 16 * 16
    assert saved_rows.features["model.layers.1"].shape == (16, 128) and len(saved_rows) == whole // 16
    exported = saved_rows[:]
    assert torch.equal(exported["model.layers.1"].reshape(-1, 128), rows[:whole].float())  # bf16 -> f32 is exact
    assert torch.equal(exported["token_ids"].reshape(-1), ids[:whole].int())
    assert not exported["generated"].any() and record["generated_rows"] == 0
    assert record["dtype"] == {"harvested": "bfloat16", "exported": "float32", "exact": "true"}
    assert record["dropped_rows"] == len(rows) - whole and record["rows"] == whole

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
    keys = services.store.list_keys(f"exports/{harvest_id}/")
    copy = tmp_path / "from-s3"
    for key in keys:
        target = copy / key.removeprefix(f"exports/{harvest_id}/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(services.store.get_bytes(key))
    assert sorted(p.relative_to(copy).as_posix() for p in copy.rglob("*") if p.is_file()) == sorted(
        p.relative_to(tmp_path / "acts").as_posix() for p in (tmp_path / "acts").rglob("*") if p.is_file()
    )
    fetched = load_from_disk(str(copy)).with_format("torch")[:]
    all_rows = torch.cat([shard["model.layers.1.output"] for shard in shards]).float()  # no outliers option here
    assert torch.equal(fetched["model.layers.1"].reshape(-1, 128), all_rows[: len(all_rows) // 16 * 16])
    refused = cli(["harvest", "export", harvest_id, remote], *login, exit_code=1, env=aws)
    assert "is not empty" in refused

    flat = tmp_path / "hf"
    said = cli(["harvest", "export", harvest_id, str(flat), "--format", "hf", "--clip-norm-above", str(limit)], *login)
    table = load_from_disk(str(flat)).with_format("torch")[:]
    assert len(table["token_id"]) == len(all_rows) and table["generated"].dtype == torch.bool
    assert torch.equal(table["prompt_index"], torch.cat([shard["prompt_index"] for shard in shards]))
    assert torch.equal(table["prompt_length"], torch.cat([shard["prompt_length"] for shard in shards]))
    clipped = all_rows.norm(dim=1) > limit
    assert torch.equal(table["model.layers.1"][~clipped], all_rows[~clipped])
    if clipped.any():
        assert torch.allclose(table["model.layers.1"][clipped].norm(dim=1), torch.tensor(limit), rtol=1e-5)


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
