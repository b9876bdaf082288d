"""``python -m nnqueue`` is the ``nnqueue`` command."""

from nnqueue.cli import app

if __name__ == "__main__":
    app()
