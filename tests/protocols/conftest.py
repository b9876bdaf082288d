"""nnsight's own clients against a real nnqueue: the API under uvicorn (a thread of the test process:
``api_server``, with ``secret`` and ``client``, from tests/conftest.py) on the
suite's Postgres, Redis and S3, and real ``nnqueue worker`` processes for the tiny model, registered under the
key nnsight's clients send (the model's path). The clients are nnsight 0.8.1's, unmodified: only their
configuration (``CONFIG.API``: host, key, compression) is set, as users set it."""

from __future__ import annotations

from typing import Any

import pytest

from nnqueue.embedded import ApiServer


@pytest.fixture
def ndif(monkeypatch: pytest.MonkeyPatch, api_server: ApiServer, secret: str) -> Any:
    """nnsight's CONFIG pointed at this nnqueue (what NDIF_HOST and NDIF_API_KEY set); returns CONFIG."""
    from nnsight import CONFIG

    monkeypatch.setattr(CONFIG.API, "HOST", f"{api_server.url}/ndif")
    monkeypatch.setattr(CONFIG.API, "APIKEY", secret)
    monkeypatch.setattr(CONFIG.API, "COMPRESS", True)
    monkeypatch.setattr(CONFIG.APP, "REMOTE_LOGGING", False)
    return CONFIG
