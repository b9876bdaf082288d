"""What a harvest's manifest says about the model: a Hugging Face cache snapshot is its repository and commit, any
other folder its files' digest (which changes with any file), its path only relative to the worker's directory,
and the origin it records; the tokenizer's files are hashed and its BOS behaviour is observed."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from nnqueue.workers.provenance import ORIGIN_FILE, adds_bos, folder_digest, source, tokenizer_digest


def test_a_hugging_face_snapshot_is_named_by_repository_and_commit(tmp_path: Path) -> None:
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-135M" / "snapshots" / commit
    snapshot.mkdir(parents=True)
    assert source(str(snapshot), None) == {"repository": "HuggingFaceTB/SmolLM2-135M", "revision": commit}
    assert source("org/not-a-folder", "v1") == {"repository": "org/not-a-folder", "revision": "v1"}


def test_a_local_checkpoint_is_named_by_the_digest_of_its_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"weights")
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "lock").write_text("ignored")
    expected = hashlib.sha256(
        b"".join(
            f"{name}\0{hashlib.sha256(data).hexdigest()}\n".encode()
            for name, data in (("config.json", b"{}"), ("model.safetensors", b"weights"))
        )
    ).hexdigest()
    # Outside the worker's directory: no path (an absolute one says nothing elsewhere), its name and digest.
    monkeypatch.chdir(Path(__file__).parent)
    assert source(str(tmp_path), None) == {"name": tmp_path.name, "path": None, "sha256": expected}
    # Under it: the path relative to it; and where the weights came from, if the folder says.
    monkeypatch.chdir(tmp_path.parent)
    (tmp_path / ORIGIN_FILE).write_text(json.dumps({"origin": {"repository": "org/base", "quantization": "Q4_1"}}))
    assert source(str(tmp_path), None) == {
        "name": tmp_path.name,
        "path": tmp_path.name,
        "sha256": expected,  # the hidden file is not part of the digest
        "origin": {"repository": "org/base", "quantization": "Q4_1"},
    }
    (tmp_path / "model.safetensors").write_bytes(b"other weights")
    assert folder_digest(tmp_path) != expected


def test_the_tokenizer_is_named_by_the_digest_of_its_files(tiny_model_path: Path, tmp_path: Path) -> None:
    copy = tmp_path / "tokenizer"
    shutil.copytree(tiny_model_path, copy)
    digest = tokenizer_digest(str(copy))
    assert digest is not None and len(digest) == 64 and digest != folder_digest(copy)
    (copy / "model.safetensors").write_bytes(b"other weights")  # not a tokenizer file
    assert tokenizer_digest(str(copy)) == digest
    config = json.loads((copy / "tokenizer_config.json").read_text())
    (copy / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 7}))
    assert tokenizer_digest(str(copy)) != digest
    assert tokenizer_digest("org/not-cached-here") is None


def test_bos_is_observed_from_the_tokenizer(tiny_model_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    assert adds_bos(tokenizer) is True
    tokenizer.bos_token = None
    assert adds_bos(tokenizer) is None
