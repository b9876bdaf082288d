"""HTTP to one nnqueue API with one key: what :class:`~nnqueue.client.client.Client` and
:class:`~nnqueue.client.job.Job` both talk through.

Every request maps a failure to the client's errors (:mod:`nnqueue.client.errors`): an unreachable API is
:class:`APIConnectionError`, an error status the matching :class:`APIError`. A result download follows
the API's redirect to a presigned object-store URL without the API key (S3 refuses a request that is
authorized twice, and the key must not travel to another host).
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx

from nnqueue.client.errors import APIConnectionError, api_error


class Transport:
    """One API, one key. ``http_transport``: an httpx transport for the API (tests pass a mock one); a
    result redirect to another host (a presigned object-store URL) uses neither it nor the API key."""

    def __init__(
        self,
        url: str,
        api_key: str | None,
        timeout: float = 60.0,
        *,
        inline_results: bool = False,
        http_transport: httpx.BaseTransport | None = None,
    ) -> None:
        self.url = url.rstrip("/")
        self.timeout = timeout
        self.inline_results = inline_results
        headers = {"User-Agent": f"nnqueue-client/{_version()}"}
        if api_key:
            headers["Authorization"] = f"Bearer {api_key}"
        self._http = httpx.Client(
            base_url=self.url, headers=headers, timeout=httpx.Timeout(timeout, connect=10.0), transport=http_transport
        )
        self._plain: httpx.Client | None = None

    def auth_headers(self) -> dict[str, str]:
        """The headers that authorize a request to the API (for readers that make their own connections)."""
        authorization = self._http.headers.get("Authorization")
        return {"Authorization": authorization} if authorization else {}

    def close(self) -> None:
        self._http.close()
        if self._plain is not None:
            self._plain.close()

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = self._http.request(method, path, **kwargs)
        except httpx.TransportError as error:
            raise APIConnectionError(f"cannot reach the nnqueue API at {self.url}: {error}") from error
        _check(response)
        return response

    def get_json(self, path: str, params: dict[str, Any] | None = None) -> dict[str, Any]:
        return self.request("GET", path, params=params).json()

    @contextmanager
    def result_stream(
        self,
        job_id: str,
        *,
        inline: bool | None = None,
        format: str = "torch",  # noqa: A002 - the API's name
    ) -> Iterator[httpx.Response]:
        """The result's bytes (``format``: ``torch`` or ``safetensors``) as a streaming response: through the API,
        or from where it redirects to."""
        inline = self.inline_results if inline is None else inline
        params: dict[str, Any] = {"format": format} if format != "torch" else {}
        if inline:
            params["inline"] = 1
        try:
            with self._http.stream("GET", f"/v1/jobs/{job_id}/result", params=params or None) as response:
                if not response.is_redirect:
                    _check(response)
                    yield response
                    return
                target = response.url.join(response.headers["location"])
        except httpx.TransportError as error:
            raise APIConnectionError(f"cannot reach the nnqueue API at {self.url}: {error}") from error
        # A presigned URL carries its own authorization: the API key must not travel to the object store
        # (S3 also refuses a request that is authorized twice). A same-origin redirect stays on the API.
        same_origin = (target.scheme, target.host, target.port) == (
            response.url.scheme,
            response.url.host,
            response.url.port,
        )
        http = self._http if same_origin else self._plain_http()
        try:
            with http.stream("GET", target) as redirected:
                _check(redirected)
                yield redirected
        except httpx.TransportError as error:
            raise APIConnectionError(f"cannot download the result from {target.host}: {error}") from error

    @contextmanager
    def download(self, url: str, params: dict[str, Any] | None = None) -> Iterator[httpx.Response]:
        """GET a file as a streaming response: an API path (``/v1/...``, streamed through the API with this key,
        with the query ``params``) or a presigned URL (without the key)."""
        api = url.startswith("/")
        http = self._http if api else self._plain_http()
        try:
            with http.stream("GET", url, params={**(params or {}), "inline": 1} if api else None) as response:
                _check(response)
                yield response
        except httpx.TransportError as error:
            raise APIConnectionError(f"cannot download {url.split('?')[0]}: {error}") from error

    def _plain_http(self) -> httpx.Client:
        if self._plain is None:
            self._plain = httpx.Client(timeout=httpx.Timeout(self.timeout, connect=10.0), follow_redirects=True)
        return self._plain


def _check(response: httpx.Response) -> None:
    if response.is_success:
        return
    if not response.is_stream_consumed:
        response.read()
    try:
        body = response.json()
        detail = body.get("detail", body) if isinstance(body, dict) else body
    except ValueError:
        detail = response.text.strip()[:2000] or response.reason_phrase
    raise api_error(response.status_code, detail, method=response.request.method, url=str(response.request.url))


def _version() -> str:
    try:
        return importlib.metadata.version("nnqueue")
    except importlib.metadata.PackageNotFoundError:  # a source checkout that was never installed
        return "0"
