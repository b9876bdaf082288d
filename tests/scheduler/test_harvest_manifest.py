"""A harvest's manifest from its rows: the model named without an absolute path, whether the prompts began with
BOS (text prompts as the tokenizer and the spec say, inline token ids as checked), generated rows and the outlier
option's counts added up over the shards."""

from __future__ import annotations

import uuid
from typing import Any

import pytest

from nnqueue.db.models import Harvest, HarvestChunk
from nnqueue.scheduler.harvest_manifest import build_manifest


def harvest(dataset: dict[str, Any], **spec: Any) -> Harvest:
    return Harvest(
        id=uuid.uuid4(),
        owner="alice",
        model_key="m",
        spec={"dataset": dataset, "captures": [{"module": "model.layers.1"}], **spec},
        dataset_key="harvests/x/dataset.jsonl",
        dataset_digest="0" * 64,
        prompts=4,
        weights_pin=None,
    )


def chunk(index: int, generated: int, outliers: dict[str, Any] | None) -> HarvestChunk:
    return HarvestChunk(
        index=index,
        first_prompt=2 * index,
        prompts=2,
        rows=10,
        bytes=100,
        sha256="a" * 64,
        tokens=12,
        offsets=[0, 5, 10],
        stats=None,
        weights_version=None,
        generated_rows=generated,
        outliers=outliers,
    )


def engine(model: dict[str, Any], adds_bos: bool | None = True) -> dict[str, Any]:
    tokenizer = {"class": "T", "bos_token_id": 1, "adds_bos_token": adds_bos, "sha256": "b" * 64}
    provenance = {"model": model, "tokenizer": tokenizer, "engine_dtype": "float32"}
    return {"model": "/srv/models/mine", "revision": None, "versions": {}, "provenance": provenance}


LOCAL = {"name": "mine", "path": None, "sha256": "c" * 64}


def test_the_model_is_named_by_repository_or_relative_path_never_absolute() -> None:
    text = harvest({"prompts": ["a", "b"]})
    assert build_manifest(text, [], engine(LOCAL))["model"] == "mine"
    assert build_manifest(text, [], engine({**LOCAL, "path": "models/mine"}))["model"] == "models/mine"
    assert build_manifest(text, [], engine({"repository": "org/m", "revision": "r"}))["model"] == "org/m"


@pytest.mark.parametrize(
    ("dataset", "spec", "adds_bos", "expected"),
    [
        ({"prompts": ["a"]}, {}, True, True),
        ({"prompts": ["a"]}, {"add_special_tokens": False}, True, False),
        ({"prompts": ["a"]}, {}, False, False),
        ({"token_ids": [[1, 5], [1, 7]]}, {}, True, True),
        ({"token_ids": [[1, 5], [5, 7]]}, {}, True, False),  # one prompt without the BOS token
    ],
)
def test_whether_the_prompts_began_with_bos(
    dataset: dict[str, Any], spec: dict[str, Any], adds_bos: bool, expected: bool
) -> None:
    provenance = build_manifest(harvest(dataset, **spec), [], engine(LOCAL, adds_bos))["provenance"]
    assert provenance["prompts_start_with_bos"] is expected


def test_generated_rows_and_outliers_add_up_over_the_shards() -> None:
    option = {"action": "drop", "max_norm": None, "times_median": 10.0}
    spent = [
        chunk(0, 3, {"limits": {"k": 9.0}, "over": {"k": 2}, "dropped_rows": 2}),
        chunk(1, 4, {"limits": {"k": 11.0}, "over": {"k": 1}, "dropped_rows": 1}),
    ]
    manifest = build_manifest(harvest({"prompts": ["a"]}, outliers=option), spent, engine(LOCAL))
    assert manifest["format"] == "nnqueue-harvest/2" and manifest["generated_rows"] == 7
    assert manifest["outliers"] == {**option, "over": {"k": 3}, "dropped_rows": 3}
    assert [shard["outliers"]["limits"] for shard in manifest["shards"]] == [{"k": 9.0}, {"k": 11.0}]
    assert build_manifest(harvest({"prompts": ["a"]}), spent, engine(LOCAL))["outliers"] is None
