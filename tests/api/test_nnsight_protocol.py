"""The pieces of nnsight's protocols that need no server: model keys, payload checks without unpickling, the
zstd bound, signed result URLs, and nnsight-serve's reply assembled around a stored result without loading it."""

from __future__ import annotations

import io
import json
import pickle
import time
import uuid
from pathlib import Path

import pytest
import zstandard

from nnqueue.api import nnsight_protocol as protocol
from nnqueue.api.serve_reply import UnexpectedResult, serve_reply
from nnqueue.db.models import EngineKind
from nnqueue.storage.local import LocalObjectStore


def test_nnsight_model_keys_map_to_nnqueue_model_keys_and_engines() -> None:
    vllm = protocol.resolve_model("nnsight.modeling.vllm.vllm.VLLM:meta-llama/Llama-3.1-8B")
    assert (vllm.model_key, vllm.engine) == ("meta-llama/Llama-3.1-8B", EngineKind.VLLM)
    spec = {"repo_id": "org/model", "revision": None, "task": "text-generation"}
    language = protocol.resolve_model("nnsight.modeling.transformers.TransformersModel:" + json.dumps(spec))
    assert (language.model_key, language.engine) == ("org/model", EngineKind.TRANSFORMERS)
    pinned = protocol.resolve_model(
        "nnsight.modeling.transformers.TransformersModel:" + json.dumps({**spec, "revision": "abc123"})
    )
    assert pinned.model_key == "org/model@abc123"
    for bad in ("nnsight.modeling.diffusion.DiffusionModel:x", "nnsight.modeling.vllm.vllm.VLLM:", "junk"):
        with pytest.raises(protocol.ProtocolError):
            protocol.resolve_model(bad)
    with pytest.raises(protocol.ProtocolError, match="task 'image-classification' is not served"):
        protocol.resolve_model(
            "nnsight.modeling.transformers.TransformersModel:" + json.dumps({**spec, "task": "image-classification"})
        )


def test_the_tracer_class_is_read_from_the_pickle_without_loading_it() -> None:
    from nnsight.intervention.tracer import InterleavingTracer
    from nnsight.tracing.tracer import Tracer

    for tracer in (InterleavingTracer, Tracer):
        payload = pickle.dumps((tracer, ("source", {}, {})), protocol=4)  # RequestModel.serialize's shape
        assert protocol.tracer_class(payload) == f"{tracer.__module__}.{tracer.__qualname__}"
    for not_a_trace in (b"", b"PK\x03\x04", pickle.dumps([1, 2, 3], protocol=4), pickle.dumps("x", protocol=2)):
        with pytest.raises(protocol.ProtocolError):
            protocol.tracer_class(not_a_trace)
    # Sessions run on both engines (vLLM: nnqueue.engines.sessions); a transformers trace does not run on vLLM.
    vllm = protocol.Target("m", EngineKind.VLLM, "VLLM")
    protocol.check_runnable(vllm, protocol.SESSION_TRACER)
    protocol.check_runnable(protocol.Target("m", EngineKind.TRANSFORMERS, "LanguageModel"), protocol.SESSION_TRACER)
    with pytest.raises(protocol.ProtocolError, match="a VLLM model runs VLLM traces"):
        protocol.check_runnable(vllm, "nnsight.intervention.tracer.InterleavingTracer")


def test_decompression_stops_at_the_limit() -> None:
    bomb = zstandard.ZstdCompressor().compress(b"\0" * 10_000_000)
    assert len(bomb) < 1000
    with pytest.raises(protocol.PayloadTooLarge, match="decompresses to more than 65536 bytes"):
        protocol.decompress(bomb, True, 65536)
    assert protocol.decompress(bomb, True, 10_000_000) == b"\0" * 10_000_000
    with pytest.raises(protocol.ProtocolError, match="not a zstd frame"):
        protocol.decompress(b"\x80\x04\x95", True, 100)


def test_result_urls_are_signed_per_job_and_expire() -> None:
    key, job_id = protocol.new_signing_key(), uuid.uuid4()
    expires = int(time.time()) + 60
    signature = protocol.sign_result(key, job_id, expires, True)
    assert protocol.verify_result(key, job_id, expires, True, signature)
    assert not protocol.verify_result(key, job_id, expires, False, signature)  # compression is signed too
    assert not protocol.verify_result(key, uuid.uuid4(), expires, True, signature)
    assert not protocol.verify_result(protocol.new_signing_key(), job_id, expires, True, signature)
    assert not protocol.verify_result(None, job_id, expires, True, signature)
    past = int(time.time()) - 1
    assert not protocol.verify_result(key, job_id, past, True, protocol.sign_result(key, job_id, past, True))


def test_the_serve_reply_wraps_the_stored_saves_and_the_error(tmp_path: Path) -> None:
    import torch

    store = LocalObjectStore(tmp_path)
    base = torch.arange(6.0).reshape(2, 3)
    saves = {"h": base, "view": base[0], "nested": [1, "a", (base, {"k": None})], "n": 3}
    buffer = io.BytesIO()
    torch.save(saves, buffer)
    store.put_bytes("results/j/saves.pt", buffer.getvalue())
    error = {"type_name": "ValueError", "message": "m", "traceback": "tb", "is_control_flow": False}

    for result_key, wanted_error in (("results/j/saves.pt", None), ("results/j/saves.pt", error), (None, error)):
        with serve_reply(store, result_key, wanted_error) as reply:
            loaded = torch.load(reply, weights_only=False)
        assert loaded["error"] == wanted_error
        if result_key is None:
            assert loaded["saves"] == {}
            continue
        assert set(loaded["saves"]) == set(saves) and loaded["saves"]["n"] == 3
        torch.testing.assert_close(loaded["saves"]["h"], base)
        torch.testing.assert_close(loaded["saves"]["nested"][2][0], base)
        assert loaded["saves"]["view"].data_ptr() == loaded["saves"]["h"].data_ptr()  # storage still shared

    store.put_bytes("results/k/saves.pt", b"not a zip")
    with pytest.raises(UnexpectedResult):
        serve_reply(store, "results/k/saves.pt", None)


def test_job_states_map_to_nnsights_statuses() -> None:
    from nnqueue.db.models import Job, JobStatus

    job = Job(id=uuid.uuid4(), status=JobStatus.QUEUED, progress_done=0, progress_total=None)
    cases = [
        ({"status": JobStatus.QUEUED}, 3, ("QUEUED", "position 3")),
        ({"status": JobStatus.RUNNING}, None, ("DISPATCHED", "running on a worker")),
        ({"status": JobStatus.RUNNING, "progress_done": 1, "progress_total": 2}, None, ("RUNNING", "1/2 invokes")),
        ({"status": JobStatus.COMPLETED}, None, ("COMPLETED", "done")),
        (
            {"status": JobStatus.FAILED, "error_type": "KeyError", "error_message": "'x'", "error_traceback": "tb\n"},
            None,
            ("ERROR", "KeyError: 'x'\n\nIntervention traceback:\ntb"),
        ),
        ({"status": JobStatus.CANCELLED}, None, ("ERROR", f"JobCancelled: job {job.id} was cancelled")),
    ]
    for fields, position, wanted in cases:
        blank = {"progress_done": 0, "progress_total": None, "error_type": None, "error_message": None}
        for name, value in {**blank, "error_traceback": None, **fields}.items():
            setattr(job, name, value)
        update = protocol.response(job, position=position)
        assert (update["status"], update["description"]) == wanted and update["id"] == str(job.id)
