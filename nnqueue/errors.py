"""The base of every exception that nnqueue's server side raises on purpose.

Each exception lives beside the code that raises it (``InvalidTransition`` in :mod:`nnqueue.db.lifecycle`,
``ObjectNotFound`` in :mod:`nnqueue.storage.object_store`, ...) and derives from :class:`NNqueueError`,
so a caller (an HTTP error handler, the CLI) can tell "nnqueue refused or could not do this, and says why"
from a bug. Most also keep the built-in base they had (``ValueError``, ``LookupError``, ``RuntimeError``),
so code that catches those still does.

Standard library only: every layer imports it, the code in vLLM's engine processes included. The client
has its own base (:class:`nnqueue.client.errors.NNqueueError`): it never imports the server's modules.
"""

from __future__ import annotations


class NNqueueError(Exception):
    """Base class of nnqueue's server-side exceptions."""
