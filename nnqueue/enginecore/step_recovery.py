"""A malformed intervention fails its trace, not the engine: the step runs again without the step's traces.

nnsight defers an exception raised inside a trace's own code to its request (``defer_exceptions``), but not one
that vLLM's code raises on a value a trace handed it: a ``.skip()`` or an ``.output`` swap of the wrong shape
makes a later layer, the logits' gather or the sampler fail, vLLM's engine core dies, and every request on it
with it (issue 34: a wrong-shape ``.skip()`` cost three restarts for two jobs). In the model runner, at the three
places where the values traces handed over flow back into vLLM's code:

* the forward (`StepRecoveryMixin._model_forward`, vLLM's override point around ``self.model(...)``): when a
  forward in which traces ran raises, or returns hidden states of another shape, dtype or device than the model
  makes (``[tokens, hidden size]``), each trace of the step is ended (its worker unwound, its request given
  an error, and nnsight's runner forces its end of sequence as for any erred trace) and the forward runs again
  with no trace in it, after the guards put back what the traces changed (a broken attribute would fail the clean
  run too). Recomputing the step writes the same KV-cache slots with the same values; a harvest's
  captures and a steering job's edits are made again (each write overwrites its first). When the forward fails
  again without traces, the error is the engine's and goes on as before (:mod:`nnqueue.enginecore.crash_report`).
* the logits (`StepRecoveryMixin.sample_tokens`, below nnsight's, which has swapped in the logits traces set):
  logits of another shape, dtype or device than the model computed are computed again from the step's hidden
  states, and the step's traces ended.
* the sampled tokens (`SampleCheckMixin._sample`, above nnsight's, which has swapped in the tokens traces set):
  tokens of another shape, dtype or device, or outside the vocabulary, are put back to what the sampler drew.

A trace alone in the step fails with the error (its type and message: the trace's own mistake, which cost the
others nothing but the step's recomputation); traces that shared the step each run again alone
(``StateModifiedInSharedStep``, as for a state change: :mod:`nnqueue.enginecore.weights_guard`), so only the one
that fails alone is failed.

nnsight internals relied on (0.8.1): ``Requests.requests`` and each ``Request``'s ``mediator`` and ``error``, a
mediator's ``alive``, ``worker``, ``exception`` and ``pending``, and the interleaver's ``mediators`` and
``reindex``; the runner's ``execute_model_state`` (vLLM 0.32).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from greenlet import GreenletExit

from nnqueue.enginecore import private_inputs, weights_guard
from nnqueue.errors import NNqueueError

log = logging.getLogger(__name__)


class MalformedIntervention(NNqueueError, RuntimeError):
    """What traces handed vLLM made the step fail or come out malformed (the step was run again without them)."""


class StepRecoveryMixin:
    """Below nnsight's runner in the bases (its ``super()`` calls reach these); see the module doc."""

    model: Any  # vLLM's runner's
    model_config: Any
    execute_model_state: Any
    # Set by the worker's guards (nnqueue.enginecore.weights_guard): verify and put back the engine's state.
    nnqueue_restore_state: Callable[[], Any] | None = None

    _nnqueue_logits: tuple[Any, ...] | None = None  # shape, dtype, device of the logits vLLM computed this step
    _nnqueue_sampled: Any = None  # the tokens vLLM's sampler drew this step (before nnsight's swap)

    def _model_forward(self, *args: Any, **kwargs: Any) -> Any:
        traced = [request for request in _traced(self) if request.mediator.alive]  # a finished block acts no more
        if not traced:
            return super()._model_forward(*args, **kwargs)  # type: ignore[misc]
        if self.model_config.enforce_eager:  # no graph reads the persistent buffers (nnqueue.enginecore.private_inputs)
            kwargs = private_inputs.private(kwargs)
        try:
            output = super()._model_forward(*args, **kwargs)  # type: ignore[misc]
            _check_hidden(self, output, args, kwargs)
            return output
        except Exception as error:  # noqa: BLE001 - ended below; the clean run's own failure is the engine's
            end_traces(self, traced, error)
        if self.nnqueue_restore_state is not None:
            self.nnqueue_restore_state()  # what the traces changed before failing, put back before the clean run
        return super()._model_forward(*args, **kwargs)  # type: ignore[misc]

    def execute_model(self, *args: Any, **kwargs: Any) -> Any:
        self._nnqueue_logits = None
        output = super().execute_model(*args, **kwargs)  # type: ignore[misc]
        state = getattr(self, "execute_model_state", None)
        logits = getattr(state, "logits", None)
        if isinstance(logits, torch.Tensor):
            self._nnqueue_logits = (logits.shape, logits.dtype, logits.device)
        return output

    def sample_tokens(self, *args: Any, **kwargs: Any) -> Any:
        state = getattr(self, "execute_model_state", None)
        logits = getattr(state, "logits", None)
        expected = self._nnqueue_logits
        if expected is not None and (
            not isinstance(logits, torch.Tensor) or (logits.shape, logits.dtype, logits.device) != expected
        ):
            assert state is not None
            error = MalformedIntervention(f"the logits were set to {_describe(logits)}, not {_describe_spec(expected)}")
            end_traces(self, _traced(self), error)
            computed = self.model.compute_logits(state.sample_hidden_states)
            self.execute_model_state = type(state)(**{**state._asdict(), "logits": computed})
        return super().sample_tokens(*args, **kwargs)  # type: ignore[misc]

    def _sample(self, *args: Any, **kwargs: Any) -> Any:
        output = super()._sample(*args, **kwargs)  # type: ignore[misc]
        self._nnqueue_sampled = output.sampled_token_ids
        return output


class SampleCheckMixin:
    """Above nnsight's runner in the bases (it sees the tokens after nnsight's swap); see the module doc."""

    model_config: Any  # vLLM's runner's

    _nnqueue_sampled: Any = None

    def _sample(self, *args: Any, **kwargs: Any) -> Any:
        output = super()._sample(*args, **kwargs)  # type: ignore[misc]
        drawn, now = self._nnqueue_sampled, output.sampled_token_ids
        if drawn is None or now is drawn:
            return output
        problem = _token_problem(now, drawn, self.model_config.get_vocab_size())
        if problem is not None:
            end_traces(self, _traced(self), MalformedIntervention(f"the sampled tokens were set to {problem}"))
            output.sampled_token_ids = drawn
        return output


def _traced(runner: Any) -> list[Any]:
    """The step's requests that carry a trace (nnsight's ``Request``s with a mediator), in batch order."""
    requests = getattr(getattr(runner, "nnsight_requests", None), "requests", None)
    if not requests:
        return []
    batch = runner.input_batch
    step = batch.req_ids[: batch.num_reqs]
    return [request for request_id in step if (request := requests.get(request_id)) is not None and request.mediator]


def end_traces(runner: Any, requests: list[Any], error: Exception) -> None:
    """End the traces of ``requests``: their workers unwound and dropped from the step, their requests failed with
    ``error`` when a single trace ran in the step, else each marked to run again alone."""
    traces = {weights_guard.trace_of(request) for request in requests}
    log.error("a step with trace(s) %s failed on what they handed vLLM (%r); ending them", sorted(traces), error)
    if len(traces) == 1:
        deferred = {
            "type_name": type(error).__name__,
            "message": (
                f"{error} -- vLLM's code failed on a value this trace handed it (a .skip() or an .output of "
                "another shape than the module's, say); the engine ran the step again without the trace"
            ),
            "traceback": "",
            "is_control_flow": False,
        }
    else:
        verified = weights_guard.Verified(state=[f"a failed step ({type(error).__name__}: {error})"[:300]])
        deferred = weights_guard.shared_error(verified, len(traces))
    interleaver = runner.nnsight_model.interleaver
    ended = set()
    for request in requests:
        mediator = request.mediator
        ended.add(id(mediator))
        if request.error is None:
            request.error = dict(deferred)
        if mediator.alive:
            try:
                mediator.worker.throw(GreenletExit)
            except BaseException:  # its finally blocks raised: the trace has failed already
                log.debug("unwinding an ended trace raised", exc_info=True)
        mediator.exception = error  # nnsight's runner forces its end of sequence (``_finish_erred``)
        mediator.pending = None
    interleaver.mediators = [mediator for mediator in interleaver.mediators if id(mediator) not in ended]
    interleaver.reindex()


def _check_hidden(runner: Any, output: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise when a forward's hidden states are not ``[tokens, hidden size]`` of the model's dtype and device (the last
    stage's output; another stage's intermediate tensors, or a model with auxiliary outputs, are not checked)."""
    if not isinstance(output, torch.Tensor):
        return
    positions = kwargs.get("positions", args[1] if len(args) > 1 else None)
    if not isinstance(positions, torch.Tensor):
        return
    config = runner.model_config
    expected = ((int(positions.shape[-1]), config.get_hidden_size()), config.dtype, positions.device)
    if (tuple(output.shape), output.dtype, output.device.type) != (expected[0], expected[1], expected[2].type):
        raise MalformedIntervention(f"the model's output was {_describe(output)}, not {_describe_spec(expected)}")


def _token_problem(now: Any, drawn: torch.Tensor, vocabulary: int) -> str | None:
    if not isinstance(now, torch.Tensor) or (now.shape, now.dtype, now.device) != (
        drawn.shape,
        drawn.dtype,
        drawn.device,
    ):
        return f"{_describe(now)}, not {_describe(drawn)}"
    if now.numel() and (bool((now < 0).any()) or bool((now >= vocabulary).any())):
        return f"ids outside the vocabulary of {vocabulary}"
    return None


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {tuple(value.shape)} {value.dtype} tensor on {value.device}"
    return f"a {type(value).__name__}"


def _describe_spec(spec: tuple[Any, ...]) -> str:
    shape, dtype, device = spec
    return f"a {tuple(shape)} {dtype} tensor on {device}"
