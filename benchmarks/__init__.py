"""nnqueue's benchmarks: scripts that print a ratio against a baseline measured in the same run.

Each script runs from a checkout (``python benchmarks/<script>.py``, which puts the repository root on
``sys.path``) or as a module (``python -m benchmarks.<script>``). What the GPU scripts share (model directories,
the engine, the queue, the stores) is in `benchmarks.common`, the profilers in `benchmarks.profiling`; results
and their history are in ``benchmarks/RESULTS.md`` and ``benchmarks/results/``.
"""
