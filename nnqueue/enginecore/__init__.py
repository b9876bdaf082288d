"""Code that runs inside the processes that run users' code: vLLM's engine processes (the EngineCore and its
model-runner workers), the transformers engine and the trace builders' sandbox.

Most of it is imported by vLLM in a process that nnqueue did not start directly: the worker class vLLM builds
(``worker_cls``), the hooks on its model runner, and the threads they start. The other children that run
users' code, and the worker's side of their pipes, are :mod:`nnqueue.enginecore.child_process`'s. Nothing here
may import the database, the broker or the object store: these processes run users' code.
"""
