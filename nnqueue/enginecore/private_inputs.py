"""A step's inputs, as the traces in it see them: copies made for the step, not vLLM's persistent buffers.

vLLM's model runner keeps its inputs in buffers it allocates once and rewrites at every step (``input_ids``,
``positions``, ``inputs_embeds``, a pipeline stage's intermediate tensors), and hands the model slices of them.
nnsight serves a trace the values at a module as views (``VLLMBatcher.narrow``), so ``embed_tokens.input`` is a
view of the ``input_ids`` buffer: kept anywhere that outlives the step (a library function's attribute, say, which
no guard holds), it shows the tokens of whatever request later runs there. A third red-team round read another
trust domain's prompt that way. In an eager engine's step that runs a trace, the runner's forward gets copies of
them instead (:func:`private`), which nothing writes after the step: a kept view shows only its own step. A few
hundred bytes to a few megabytes per step, paid only in steps with a trace.

An engine that replays CUDA graphs (nnsight's taps) is left alone: its graphs read the persistent buffers
themselves, and the values at its taps live at addresses every step rewrites anyway (nnsight's rule there: clone
what you keep); under ``NNQUEUE_DOMAIN_SWITCH=verify`` a kept reference on such an engine reads later requests.

vLLM internals relied on (0.24-0.32): ``_model_forward``'s keyword arguments ``input_ids``, ``positions``,
``inputs_embeds`` and ``intermediate_tensors`` (an ``IntermediateTensors``, whose ``tensors`` dict is its state).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

INPUT_NAMES = ("input_ids", "positions", "inputs_embeds")


def private(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``_model_forward``'s keyword arguments with each input tensor (and a pipeline stage's intermediate tensors)
    replaced by a copy."""
    copied = dict(kwargs)
    for name in INPUT_NAMES:
        if isinstance(copied.get(name), torch.Tensor):
            copied[name] = copied[name].clone()
    intermediate = copied.get("intermediate_tensors")
    if intermediate is not None and isinstance(getattr(intermediate, "tensors", None), dict):
        fresh = copy.copy(intermediate)
        fresh.tensors = {key: value.clone() for key, value in intermediate.tensors.items()}
        copied["intermediate_tensors"] = fresh
    return copied
