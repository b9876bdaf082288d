"""What a harvest's manifest says about the model: a Hugging Face cache snapshot is its repository and commit, any
other folder its files' digest (which changes with any file); the tokenizer's BOS behaviour is observed."""

from __future__ import annotations

import hashlib
from pathlib import Path

from nnqueue.workers.provenance import adds_bos, folder_digest, source


def test_a_hugging_face_snapshot_is_named_by_repository_and_commit(tmp_path: Path) -> None:
    commit = "0123456789abcdef0123456789abcdef01234567"
    snapshot = tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-135M" / "snapshots" / commit
    snapshot.mkdir(parents=True)
    assert source(str(snapshot), None) == {"repository": "HuggingFaceTB/SmolLM2-135M", "revision": commit}
    assert source("org/not-a-folder", "v1") == {"repository": "org/not-a-folder", "revision": "v1"}


def test_a_local_checkpoint_is_named_by_the_digest_of_its_files(tmp_path: Path) -> None:
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
    assert source(str(tmp_path), None) == {"path": str(tmp_path.resolve()), "sha256": expected}
    (tmp_path / "model.safetensors").write_bytes(b"other weights")
    assert folder_digest(tmp_path) != expected


def test_bos_is_observed_from_the_tokenizer(tiny_model_path: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    assert adds_bos(tokenizer) is True
    tokenizer.bos_token = None
    assert adds_bos(tokenizer) is None
