"""Every exception the server side defines derives from :class:`nnqueue.errors.NNqueueError`."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import nnqueue
from nnqueue.errors import NNqueueError

# The client (and nnqueue.harvest, its streaming reader) has its own base (it never imports the server); the
# migrations run on import.
NOT_SERVER = ("nnqueue.client", "nnqueue.harvest", "nnqueue.db.migrations")


def server_modules() -> list[str]:
    names = [info.name for info in pkgutil.walk_packages(nnqueue.__path__, "nnqueue.")]
    return [name for name in names if not name.startswith(NOT_SERVER)]


def test_every_server_exception_derives_from_the_common_base() -> None:
    defined = {}
    for name in server_modules():
        module = importlib.import_module(name)
        for value in vars(module).values():
            if inspect.isclass(value) and issubclass(value, BaseException) and value.__module__ == name:
                defined[f"{name}.{value.__qualname__}"] = value
    assert len(defined) >= 10, sorted(defined)  # the walk found them (it must be able to fail)
    assert {name for name, cls in defined.items() if not issubclass(cls, NNqueueError)} == set()
