"""Code that runs inside vLLM's engine processes (the EngineCore and its model-runner workers).

Everything here is imported by vLLM in a process that nnqueue did not start directly: the worker
class vLLM builds (``worker_cls``), the hooks on its model runner, and the threads they start. Nothing
here may import the database, the broker or the object store: these processes run users' code.
"""
