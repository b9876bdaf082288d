"""``python -m nnqueue`` is the ``nnqueue`` command."""

from nnqueue.cli import main

if __name__ == "__main__":
    main()
