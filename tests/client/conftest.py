"""Client tests: the real API (uvicorn on a free port, in a thread: ``api_server``, with ``secret`` and ``client``
from tests/conftest.py) on the suite's Postgres, Redis and S3, with real ``nnqueue worker`` processes for the
tiny model: the session's shared ones (``worker``, ``path_worker``) in the modules marked ``shared_worker``, which
then run on the shared service namespace; the other modules get their own (``services``: a database, a Redis
database and a bucket).

Results live in S3 (SeaweedFS, which checks signatures), so result downloads follow the API's redirect
to a presigned URL unless a test asks for ``inline``.
"""
