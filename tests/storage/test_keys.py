"""Object keys for payloads and results, and the names they refuse."""

from __future__ import annotations

import uuid

import pytest

from nnqueue.storage.keys import payload_key, result_key


def test_payload_key() -> None:
    job = uuid.UUID("12345678-1234-5678-1234-567812345678")
    assert payload_key(job) == "payloads/12345678-1234-5678-1234-567812345678"
    assert payload_key(42) == "payloads/42"


def test_result_key() -> None:
    assert result_key("job-1", "logits.safetensors") == "results/job-1/logits.safetensors"


@pytest.mark.parametrize("name", ["", "a/b", "..", "../x", "x..y", "/", "a\x00"])
def test_result_key_rejects_unsafe_names(name: str) -> None:
    with pytest.raises(ValueError, match="invalid result name"):
        result_key("job-1", name)


@pytest.mark.parametrize("job_id", ["", "a/b", ".."])
def test_keys_reject_unsafe_job_ids(job_id: str) -> None:
    with pytest.raises(ValueError, match="invalid job id"):
        payload_key(job_id)
    with pytest.raises(ValueError, match="invalid job id"):
        result_key(job_id, "logits")
