"""The HTTP client for the nnqueue job API.

    client = Client("http://127.0.0.1:8000", api_key)        # or Client.from_env()
    job = client.submit("smollm2-135m", payload)              # payload: backend.build_payload(tracer)
    saves = job.result()                                      # waits (with a progress display), downloads, loads

Most users never build payloads themselves: ``model.trace(..., backend=client.backend())`` does it and
puts the saved values in the trace's variables (see :mod:`nnqueue.client.backend`).
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import platform
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
from rich.console import Console

from nnqueue.client.errors import AmbiguousIdError, APIError, NotFoundError
from nnqueue.client.harvest import Harvest
from nnqueue.client.job import Job
from nnqueue.client.settings import ClientSettings
from nnqueue.client.steering import Steering, vectors_file
from nnqueue.client.transport import Transport

if TYPE_CHECKING:
    from nnqueue.client.backend import NNqueueBackend

# Called with every Job a Client in this process submits (`nnqueue submit` lists a script's jobs this way).
submit_hooks: list[Callable[[Job], None]] = []
# The listing that `Client.whole_id` searches, its key in the API's answer and what it holds; the matches an
# AmbiguousIdError names.
COLLECTION_KEYS = {"steering": "jobs"}
COLLECTION_NOUNS = {"jobs": "job", "harvests": "harvest", "steering": "steering job"}
AMBIGUOUS_SHOWN = 5
# A job's spec goes in a header (the payload is then the whole body) up to this length; a longer one (much
# metadata) in a multipart form with the payload: proxies limit a header's size (nginx: 8 KiB by default).
SPEC_HEADER_MAX_BYTES = 4096


def client_versions() -> dict[str, str]:
    """What the job spec's ``client`` field reports: the worker names them when it cannot rebuild a trace."""
    try:
        nnsight = importlib.metadata.version("nnsight")
    except importlib.metadata.PackageNotFoundError:  # a payload built elsewhere, submitted from a thin client
        nnsight = "not installed"
    return {"nnsight": nnsight, "python": platform.python_version()}


class Client:
    """A connection to one nnqueue API with one API key. Usable as a context manager (closes its connections)."""

    def __init__(
        self,
        url: str,
        api_key: str | None,
        timeout: float = 60.0,
        *,
        inline_results: bool = False,
        blocking: bool | None = None,
        http_transport: httpx.BaseTransport | None = None,
        console: Console | None = None,
    ) -> None:
        """``timeout``: seconds for one HTTP request. ``inline_results``: fetch results through the API
        (``?inline=1``) rather than from the presigned object-store URL it redirects to. ``blocking``: the
        default of `backend`'s ``blocking`` (None: ``NNQUEUE_BLOCKING``, which ``nnqueue submit`` sets, else
        true). ``http_transport``: an httpx transport for the API (tests pass a mock one); a result redirect to
        another host (a presigned object-store URL) uses neither it nor the API key."""
        self.transport = Transport(url, api_key, timeout, inline_results=inline_results, http_transport=http_transport)
        self.url = self.transport.url
        self.blocking = ClientSettings().blocking if blocking is None else blocking
        self.console = console or Console(stderr=True)
        # Whether the API takes a raw payload with the spec in a header (an older one reads only forms: _post_job).
        self._raw_submissions = True

    @classmethod
    def from_env(cls, **overrides: Any) -> Client:
        """A client from ``NNQUEUE_URL``, ``NNQUEUE_API_KEY`` (and ``.env``); keyword arguments win."""
        settings = ClientSettings()
        options: dict[str, Any] = {
            "url": settings.url,
            "api_key": settings.api_key.get_secret_value() if settings.api_key else None,
            "timeout": settings.http_timeout_s,
            "inline_results": settings.inline_results,
            "blocking": settings.blocking,
        }
        options.update({name: value for name, value in overrides.items() if value is not None})
        return cls(**options)

    def close(self) -> None:
        self.transport.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<nnqueue Client {self.url}>"

    # -- jobs -----------------------------------------------------------------------------------

    def submit(
        self,
        model_key: str,
        payload: bytes,
        *,
        timeout_s: float | None = None,
        priority: int = 0,
        metadata: dict[str, Any] | None = None,
        kind: str = "trace",
        weights_version: str | None = None,
        safetensors: bool = False,
    ) -> Job:
        """Queue a trace for ``model_key``'s workers: a prebuilt payload (:func:`nnqueue.client.backend.build_payload`)
        or an nnsight serialized one (``RequestModel.serialize(tracer)`` bytes).

        ``timeout_s``: the job's run-time limit on the worker (server default when None). Higher
        ``priority`` runs earlier among its owner's jobs (owners take turns). ``metadata``: free-form JSON kept with the job. ``weights_version``: run only on
        an engine serving this weights version, or ``"latest"`` (the newest served now); None: any.
        ``safetensors``: also write the result as safetensors (``job.download(format="safetensors")``), when
        every saved value is a tensor.
        """
        spec = {
            "model_key": model_key,
            "kind": kind,
            "priority": priority,
            "timeout_s": timeout_s,
            "metadata": metadata or {},
            "client": client_versions(),
        }
        if weights_version is not None:  # left out otherwise: an API without weights versions refuses the field
            spec["weights_version"] = weights_version
        if safetensors:  # likewise
            spec["safetensors"] = True
        job = self._job(self._post_job(json.dumps(spec), payload).json())
        for hook in list(submit_hooks):
            hook(job)
        return job

    def _post_job(self, spec: str, payload: bytes) -> httpx.Response:
        """``POST /v1/jobs``: the payload as the body, the spec (ASCII JSON) in the ``Nnqueue-Spec`` header, which the
        API reads without parsing a form; a multipart form of the two when the spec is too long for a header, or
        when the API predates the header (it answers 422, both form fields missing, and nothing was stored)."""
        if self._raw_submissions and len(spec) <= SPEC_HEADER_MAX_BYTES:
            headers = {"Content-Type": "application/octet-stream", "Nnqueue-Spec": spec}
            try:
                return self.transport.request("POST", "/v1/jobs", content=payload, headers=headers)
            except APIError as error:
                if not _form_fields_missing(error):
                    raise
                self._raw_submissions = False
        files = {"payload": ("payload", payload, "application/octet-stream")}
        return self.transport.request("POST", "/v1/jobs", data={"spec": spec}, files=files)

    def job(self, job_id: str) -> Job:
        """The job with this id, or the one whose id starts with these characters (`whole_id`); 404
        :class:`NotFoundError` if it is not one of this key's owner's."""
        return self._job(self.transport.get_json(f"/v1/jobs/{self.whole_id('jobs', job_id)}"))

    def jobs(
        self, status: str | None = None, model_key: str | None = None, *, page_size: int | None = None
    ) -> Iterator[Job]:
        """This owner's jobs, newest first, across all pages (fetched as the iterator advances)."""
        params: dict[str, Any] = {}
        if status:
            params["status"] = status
        if model_key:
            params["model_key"] = model_key
        if page_size:
            params["limit"] = page_size
        while True:
            page = self.transport.get_json("/v1/jobs", params=params)
            for info in page.get("jobs", []):
                yield self._job(info)
            cursor = page.get("next_cursor")
            if not cursor:
                return
            params["cursor"] = cursor

    def models(self) -> list[dict[str, Any]]:
        """Models with live workers: ``[{"model_key", "workers", "capacity", "engine", "weights_versions", "taps"}]``."""
        return list(self.transport.get_json("/v1/models").get("models", []))

    def model_weights(self, model_key: str) -> dict[str, Any]:
        """The weights version each live worker of ``model_key`` serves, and the model's checkpoint swaps."""
        return dict(self.transport.get_json(f"/v1/models/{model_key}/weights"))

    def update_weights(self, model_key: str, source: str, tensors: list[str] | None = None) -> dict[str, Any]:
        """Swap ``model_key``'s checkpoint (an admin key): ``source`` ``s3://<bucket>/<key>`` or a path on the
        workers' hosts; ``tensors`` only these (None: all). Returns the update's view; each worker applies it at
        its next heartbeat (follow with :meth:`model_weights`)."""
        body = {"source": source, "tensors": tensors}
        return dict(self.transport.request("POST", f"/v1/models/{model_key}/weights", json=body).json())

    def taps(self, model_key: str) -> list[str] | None:
        """The locations ``model_key``'s workers serve with CUDA graphs on (``nnqueue worker --taps``); a trace
        touching any other fails. None: its workers run eagerly and serve every location (or none is live).
        Build the meta model with them, ``VLLM(path, taps=client.taps(key))``, and a trace's own declared taps
        are checked against them when it is submitted (docs/user/taps.md)."""
        for model in self.models():
            if model.get("model_key") == model_key:
                return model.get("taps")
        return None

    # -- harvests and schedules -----------------------------------------------------------------

    def harvest(
        self, spec: dict[str, Any] | str | os.PathLike[str], dataset: str | os.PathLike[str] | None = None
    ) -> Harvest:
        """Submit a harvest: ``spec`` a dict, or a YAML/JSON file's path; ``dataset`` a local JSONL, Parquet or
        text file to upload with it (kept under your prefix ``users/<you>/uploads/``)."""
        files = None
        if dataset is not None:
            path = Path(dataset)
            files = {"dataset": (path.name, path.read_bytes(), "application/octet-stream")}
        response = self.transport.request(
            "POST", "/v1/harvests", data={"spec": json.dumps(load_spec(spec), allow_nan=False)}, files=files
        )
        return self._harvest(response.json())

    def estimate_harvest(
        self, spec: dict[str, Any] | str | os.PathLike[str], dataset: str | os.PathLike[str] | None = None
    ) -> dict[str, Any]:
        """A dry run of `harvest`: its tokens, rows, bytes, shards and estimated duration; nothing is queued."""
        files = None
        if dataset is not None:
            path = Path(dataset)
            files = {"dataset": (path.name, path.read_bytes(), "application/octet-stream")}
        body = {"spec": json.dumps(load_spec(spec), allow_nan=False)}
        return self.transport.request("POST", "/v1/harvests/estimate", data=body, files=files).json()

    def get_harvest(self, harvest_id: str) -> Harvest:
        """The harvest with this id, or the one whose id starts with these characters (`whole_id`)."""
        return self._harvest(self.transport.get_json(f"/v1/harvests/{self.whole_id('harvests', harvest_id)}"))

    def harvests(self, status: str | None = None, limit: int = 50) -> list[Harvest]:
        """Your harvests, newest first."""
        params: dict[str, Any] = {"limit": limit, **({"status": status} if status else {})}
        return [self._harvest(info) for info in self.transport.get_json("/v1/harvests", params=params)["harvests"]]

    def create_schedule(self, name: str, cron: str, spec: dict[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
        """A recurring harvest: ``spec`` runs at each time ``cron`` names (e.g. ``"0 3 * * *"``, UTC)."""
        body = {"name": name, "cron": cron, "spec": load_spec(spec)}
        return self.transport.request("POST", "/v1/schedules", json=body).json()

    def schedules(self) -> list[dict[str, Any]]:
        return list(self.transport.get_json("/v1/schedules")["schedules"])

    def pause_schedule(self, schedule_id: int) -> dict[str, Any]:
        return self.transport.request("POST", f"/v1/schedules/{schedule_id}/pause").json()

    def resume_schedule(self, schedule_id: int) -> dict[str, Any]:
        return self.transport.request("POST", f"/v1/schedules/{schedule_id}/resume").json()

    def delete_schedule(self, schedule_id: int) -> None:
        self.transport.request("DELETE", f"/v1/schedules/{schedule_id}")

    def health(self) -> dict[str, Any]:
        return self.transport.get_json("/healthz")

    def ready(self) -> dict[str, Any]:
        return self.transport.get_json("/readyz")

    def backend(
        self,
        model_key: str | None = None,
        blocking: bool | None = None,
        *,
        progress: bool = True,
        wait_timeout: float | None = None,
        **submit_options: Any,
    ) -> NNqueueBackend:
        """An nnsight backend that runs a trace as a job here: ``model.trace(..., backend=client.backend())``.

        ``model_key`` defaults to the traced model's own key (the repo id or path it was built from).
        Blocking (the default), the trace waits for the job and its saved values land in the trace's
        variables; non-blocking, it only submits, and ``backend.job`` is the :class:`Job`.
        ``submit_options`` go to `submit` (``timeout_s``, ``priority``, ``metadata``, ``safetensors``...).
        """
        from nnqueue.client.backend import NNqueueBackend

        return NNqueueBackend(
            self,
            model_key=model_key,
            blocking=self.blocking if blocking is None else blocking,
            progress=progress,
            wait_timeout=wait_timeout,
            **submit_options,
        )

    # -- steering --------------------------------------------------------------------------------

    def steer(
        self,
        spec: dict[str, Any] | str | os.PathLike[str],
        vectors: dict[str, Any] | str | os.PathLike[str] | None = None,
        dataset: str | os.PathLike[str] | None = None,
    ) -> Steering:
        """Submit a steering job (``harvest`` scope): ``spec`` a dict, or a YAML/JSON file's path; ``vectors`` the
        vectors its edits name (name -> 1-D tensor or array, or a ``.safetensors`` file's path); ``dataset`` a
        local JSONL, Parquet or text file of prompts. See docs/user/steering.md."""
        files: dict[str, Any] = {}
        if vectors is not None:
            data = vectors_file(vectors) if isinstance(vectors, dict) else Path(vectors).read_bytes()
            files["vectors"] = ("vectors.safetensors", data, "application/octet-stream")
        if dataset is not None:
            path = Path(dataset)
            files["dataset"] = (path.name, path.read_bytes(), "application/octet-stream")
        body = {"spec": json.dumps(load_spec(spec), allow_nan=False)}
        response = self.transport.request("POST", "/v1/steering", data=body, files=files or None)
        return Steering(self.transport, response.json())

    def get_steering(self, job_id: str) -> Steering:
        """The steering job with this id, or the one whose id starts with these characters (`whole_id`)."""
        return Steering(self.transport, self.transport.get_json(f"/v1/steering/{self.whole_id('steering', job_id)}"))

    def steering_jobs(self, status: str | None = None, limit: int = 50) -> list[Steering]:
        """Your steering jobs, newest first."""
        params: dict[str, Any] = {"limit": limit, **({"status": status} if status else {})}
        return [
            Steering(self.transport, info) for info in self.transport.get_json("/v1/steering", params=params)["jobs"]
        ]

    def whole_id(self, collection: str, ident: str) -> str:
        """``ident`` if it is a whole id; else the one id in ``collection`` (``jobs``, ``harvests``, ``steering``)
        of this key's owner that starts with these characters (dashes ignored), as git reads a commit's.
        :class:`NotFoundError` if none does, :class:`AmbiguousIdError` if several do."""
        try:
            return str(uuid.UUID(ident))
        except ValueError:
            pass
        noun = COLLECTION_NOUNS[collection]
        page = self.transport.get_json(f"/v1/{collection}", params={"id_prefix": ident, "limit": AMBIGUOUS_SHOWN + 1})
        digits = ident.replace("-", "").lower()
        # Checked here too: an API that predates id_prefix ignores it and lists the newest of all.
        found = [item["id"] for item in page[COLLECTION_KEYS.get(collection, collection)]]
        found = [whole for whole in found if whole.replace("-", "").startswith(digits)]
        if not found:
            raise NotFoundError(404, f"no {noun} of yours starts with {ident!r}", method="GET", url=f"/v1/{collection}")
        if len(found) > 1:
            raise AmbiguousIdError(noun, ident, found[:AMBIGUOUS_SHOWN], len(found) > AMBIGUOUS_SHOWN)
        return str(found[0])

    def _job(self, info: dict[str, Any]) -> Job:
        return Job(self.transport, info, self.console)

    def _harvest(self, info: dict[str, Any]) -> Harvest:
        return Harvest(self.transport, info, self.console)


def load_spec(spec: dict[str, Any] | str | os.PathLike[str]) -> dict[str, Any]:
    """A harvest or steering spec from a dict, or from a YAML or JSON file (YAML is a superset of JSON)."""
    if isinstance(spec, dict):
        return spec
    import yaml

    loaded = yaml.safe_load(Path(spec).read_text())
    if not isinstance(loaded, dict):
        raise ValueError(f"{spec} does not hold a harvest spec (a mapping), but {type(loaded).__name__}")
    return loaded


def _form_fields_missing(error: APIError) -> bool:
    """Whether a submission was refused for lacking the multipart form's payload field: the answer of an API that
    reads only forms (a raw payload is, to it, a form with no fields)."""
    if error.status_code != 422 or not isinstance(error.detail, list):
        return False
    missing = {"type": "missing", "loc": ["body", "payload"]}
    return any(isinstance(item, dict) and item.items() >= missing.items() for item in error.detail)
