"""A submitted steering job as the client sees it: its state, waiting for it, its generations.

job = client.steer("steer.yaml", vectors={"happy": tensor})   # or a dict spec; vectors: a dict or a .safetensors
job.wait()
for generation in job.result():                               # one per prompt, in order
    print(generation["text"], generation["token_ids"])
job.download_activations("activations.safetensors")            # a spec with captures: what they recorded
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from nnqueue.client.errors import IntegrityError, SteeringFailed
from nnqueue.client.resource import Resource
from nnqueue.client.waiting import wait_until_ended

RESULT_FORMAT = "nnqueue-steer-result/1"


class Steering(Resource):
    """One steering job. ``info`` is the API's last answer about it (a job's fields); `refresh` updates it."""

    PATH = "/v1/steering"

    def wait(self, timeout: float | None = None, *, poll_interval: float | None = None) -> Steering:
        """Poll until it ends; returns it once COMPLETED, raises :class:`SteeringFailed` (failed or cancelled) or
        :class:`~nnqueue.client.errors.WaitTimeout`."""
        wait_until_ended(self, timeout, lambda _info: None, poll_interval=poll_interval)
        if self.status != "completed":
            raise SteeringFailed(self.info)
        return self

    def result(self) -> list[dict[str, Any]]:
        """The generations, one per prompt in order: ``token_ids``, ``text``, ``finish_reason``, and when asked
        ``logprobs`` (the chosen tokens') and ``top_logprobs`` (token id -> log-probability, per token). Checked
        against the sha256 the worker recorded."""
        pieces: list[bytes] = []
        self._download("generations", pieces.append)
        body = json.loads(b"".join(pieces))
        if body.get("format") != RESULT_FORMAT:
            raise ValueError(f"steering job {self.id}'s result is not {RESULT_FORMAT}")
        return list(body["generations"])

    def download_activations(self, path: str | os.PathLike[str]) -> Path:
        """Write what the spec's ``captures`` recorded while steering to ``path`` (a harvest shard's safetensors:
        ``prompt_index``, ``token_position``, ``token_id`` and a ``[rows, features]`` tensor per capture, named
        ``module.io``), checked against the sha256 the worker recorded; ``path``. A job without captures has none
        (:class:`~nnqueue.client.errors.APIError` 409)."""
        target = Path(path)
        partial = target.with_name(target.name + ".partial")
        try:
            with partial.open("wb") as file:
                self._download("activations", file.write)
            partial.replace(target)
        finally:
            partial.unlink(missing_ok=True)
        return target

    def _download(self, name: str, write: Callable[[bytes], Any]) -> None:
        """Stream result file ``name`` (generations or activations) to ``write``, checked against the sha256 the
        worker recorded."""
        if self.status != "completed":
            self.wait()
        result = self.info.get("result") or {}
        expected = (result.get("safetensors") or {}).get("sha256") if name == "activations" else result.get("sha256")
        digest = hashlib.sha256()
        with self.transport.download(f"/v1/steering/{self.id}/result", {"file": name}) as response:
            for piece in response.iter_bytes():
                digest.update(piece)
                write(piece)
        if expected and digest.hexdigest() != expected:
            raise IntegrityError(
                f"steering job {self.id}'s {name}", f"sha256 {expected}", f"sha256 {digest.hexdigest()}"
            )


def vectors_file(vectors: dict[str, Any]) -> bytes:
    """A safetensors file of ``vectors`` (name -> a 1-D tensor or array), as float32."""
    import numpy as np
    from safetensors.numpy import save

    arrays = {}
    for name, value in vectors.items():
        array = value.detach().float().cpu().numpy() if hasattr(value, "detach") else np.asarray(value, np.float32)
        arrays[name] = np.ascontiguousarray(array, dtype=np.float32)
    return save(arrays)
