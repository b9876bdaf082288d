"""The prebuilt trace payload: a trace's vLLM requests, in a format a server reads without unpickling.

The nnqueue client runs nnsight's own request building (``tracer.prepare`` + ``VLLM._attach_mediators``)
on its meta model and submits the result in this format; the worker's sandboxed builders turn raw nnsight
payloads (``RequestModel.serialize``) into it too. A worker parses it with :func:`decode`, which only
reads JSON and slices bytes, so payload bytes never reach ``pickle`` in a process that holds secrets:
the mediator bytes are unpickled by nnsight inside vLLM's engine process, which runs users' code anyway.

Layout::

    MAGIC (8 bytes) | header length (8 bytes, big-endian) | header (UTF-8 JSON) | blobs

The header is ``{"format": 2, "nnsight": str, "python": str, "envoys": tree | null, "invokes": [invoke, ...]}``
and each invoke ``{"prompt": {"prompt": str} | {"prompt_token_ids": [int, ...]}, "sampling": {name: value},
"mediator": [offset, length], "edits": [str, ...] | null}``: one vLLM request per nnsight invoke, with
its ``SamplingParams`` as plain JSON (every non-default field but ``extra_args``, after nnsight filled in
the trace-level settings the invoke did not name), the mediator bytes nnsight puts in
``extra_args["nnsight_mediator"]`` (a blob range) and the edit names it puts in ``extra_args["nnsight_edits"]``.
Blobs are back to back (the tree's first, then the invokes' in order) and must exactly fill the rest of the payload.

The model's envoy tree (``tree``: ``{"sha256": hex, "blob": [0, length]}``). nnsight pickles each invoke's
mediator with the whole tree of envoys it refers to, which the engine unpickled for every request, on the thread
that steps the model (issue 36: about 12% of that thread for one-prompt jobs on an 8B model). A payload of
format 2 (`from_vllm_trace`) carries the tree once, pickled as nnsight pickles it, and the mediators refer to its
envoys by persistent id (`envoy_pid`: the tree's sha256 and the envoy's path); the engine gives each request a
tree of its own, unpickled from those bytes ahead of time (:mod:`nnqueue.enginecore.envoy_trees`). Format 1 (no
``envoys``: every mediator holds its own tree) is still read.

Stdlib only at import: the client and every server process import it. :func:`from_vllm_trace` (which the client
and the builders call) imports ``msgspec``, which vLLM already requires, and nnsight.
"""

from __future__ import annotations

import io
import json
import pickletools
import platform
import struct
from dataclasses import dataclass
from typing import Any

from nnqueue.errors import NNqueueError

MAGIC = b"NNQTRACE"
FORMAT_VERSION = 2  # what `encode` writes when the trace carries its envoy tree (format 1 otherwise)
READ_FORMATS = (1, 2)
# Persistent ids of the tree's envoys in a format 2 mediator: ENVOY_PID + the tree's sha256 + ":" + the envoy's path.
ENVOY_PID = "nnqueue_envoy:"
_LENGTH = struct.Struct(">Q")
# What an nnsight serialized trace starts with: nnsight pickles with protocol 4 (a PROTO opcode, then a
# FRAME opcode), and RequestModel.serialize(compress=True) wraps that in a zstd frame.
PICKLE_PROTOCOL_4 = b"\x80\x04\x95"
# How far into a raw payload's pickle its tracer's class must have been named (`tracer_class`).
TRACER_OPCODES = 64
# The tracer class of a session's raw payload (``model.session()``: nnsight's plain ``Tracer``).
SESSION_TRACER = "nnsight.tracing.tracer.Tracer"
ZSTD_MAGIC = b"\x28\xb5\x2f\xfd"

MAX_HEADER_BYTES = 64 * 1024 * 1024
MAX_INVOKES = 65536
MAX_PROMPT_TOKENS = 1 << 20
MAX_TOKEN_ID = 2**31 - 1
MAX_EDITS = 1024
MAX_NAME_LENGTH = 1024
PROMPT_KEYS = frozenset({"prompt", "prompt_token_ids"})
# Keys of a request's extra_args that only nnqueue itself sets (harvest capture tags), never a user's trace.
RESERVED_PREFIX = "nnqueue_"


class PayloadError(NNqueueError, ValueError):
    """The bytes are not a valid prebuilt trace; the message says what is wrong."""


class UnsupportedTrace(NNqueueError, ValueError):
    """The trace uses something the prebuilt format cannot carry (a LoRA adapter, a multimodal prompt)."""


@dataclass(frozen=True)
class Invoke:
    """One vLLM request: its prompt (vLLM's prompt dict), sampling settings, nnsight mediator and edits."""

    prompt: dict[str, Any]
    sampling: dict[str, Any]
    mediator: bytes
    edits: list[str] | None = None


@dataclass(frozen=True)
class EnvoyTree:
    """The model's envoy tree as nnsight pickles it, which the mediators refer to (`envoy_pid`), and its sha256."""

    sha256: str
    data: bytes


@dataclass(frozen=True)
class PrebuiltTrace:
    invokes: list[Invoke]
    nnsight: str = ""
    python: str = ""
    envoys: EnvoyTree | None = None


def envoy_pid(tree_sha256: str, path: str) -> str:
    """The persistent id a format 2 mediator refers to the envoy at ``path`` of its tree by."""
    return f"{ENVOY_PID}{tree_sha256}:{path}"


def parse_envoy_pid(pid: Any) -> tuple[str, str] | None:
    """``(tree sha256, envoy path)`` of an `envoy_pid`; None for any other persistent id."""
    if not isinstance(pid, str) or not pid.startswith(ENVOY_PID):
        return None
    digest, _, path = pid[len(ENVOY_PID) :].partition(":")
    return digest, path


def tracer_class(payload: bytes) -> str | None:
    """``module.QualName`` of the tracer an uncompressed raw nnsight payload holds (its pickle's first global
    reference: ``RequestModel.serialize`` pickles ``(tracer, (source, globals, locals))``), or None when it names
    none near its start. Only opcodes are parsed (``pickletools.genops``): nothing is built or imported."""
    if not payload.startswith(PICKLE_PROTOCOL_4):
        return None
    strings: list[str] = []
    try:
        for index, (opcode, argument, _) in enumerate(pickletools.genops(io.BytesIO(payload))):
            if opcode.name in ("SHORT_BINUNICODE", "BINUNICODE", "UNICODE"):
                strings.append(str(argument))
            elif opcode.name == "STACK_GLOBAL" and len(strings) >= 2:
                return f"{strings[-2]}.{strings[-1]}"
            elif opcode.name == "GLOBAL":
                module, name = str(argument).split(" ", 1)
                return f"{module}.{name}"
            if index >= TRACER_OPCODES:
                break
    except (ValueError, EOFError):
        pass
    return None


def payload_kind(data: bytes) -> str | None:
    """``"prebuilt"``, ``"nnsight"`` (a serialized nnsight trace, maybe zstd-compressed), or None.

    Reads only the first bytes: cheap enough for the API to reject anything else at submit.
    """
    if data.startswith(MAGIC):
        return "prebuilt"
    if data.startswith(ZSTD_MAGIC):
        return "nnsight"
    if data.startswith(PICKLE_PROTOCOL_4) and len(data) >= 11:
        frame = int.from_bytes(data[3:11], "little")
        if frame <= len(data) - 11:
            return "nnsight"
    return None


def encode(trace: PrebuiltTrace) -> bytes:
    invokes, blobs, offset = [], [], 0
    tree = None
    if trace.envoys is not None:
        tree = {"sha256": trace.envoys.sha256, "blob": [0, len(trace.envoys.data)]}
        blobs.append(trace.envoys.data)
        offset = len(trace.envoys.data)
    for invoke in trace.invokes:
        invokes.append(
            {
                "prompt": invoke.prompt,
                "sampling": invoke.sampling,
                "mediator": [offset, len(invoke.mediator)],
                "edits": invoke.edits,
            }
        )
        blobs.append(invoke.mediator)
        offset += len(invoke.mediator)
    header: dict[str, Any] = {"format": 1, "nnsight": trace.nnsight, "python": trace.python, "invokes": invokes}
    if tree is not None:
        header |= {"format": FORMAT_VERSION, "envoys": tree}
    encoded = json.dumps(header, separators=(",", ":"), allow_nan=False).encode()
    return b"".join([MAGIC, _LENGTH.pack(len(encoded)), encoded, *blobs])


def decode(data: bytes) -> PrebuiltTrace:
    """Parse and validate a prebuilt payload (types, sizes, blob ranges); raises :class:`PayloadError`."""
    header = read_header(data)
    blobs = memoryview(data)[len(MAGIC) + _LENGTH.size + _header_length(data) :]
    envoys, expected = _envoys(header.get("envoys"), blobs), 0
    if envoys is not None:
        expected = len(envoys.data)
    invokes = []
    for index, raw in enumerate(header["invokes"]):
        where = f"invoke {index}"
        if not isinstance(raw, dict) or set(raw) != {"prompt", "sampling", "mediator", "edits"}:
            raise PayloadError(f"{where}: must be an object with prompt, sampling, mediator and edits")
        span = raw["mediator"]
        if not (isinstance(span, list) and len(span) == 2 and all(_is_int(value) for value in span)):
            raise PayloadError(f"{where}: mediator must be [offset, length]")
        offset, length = span
        if offset != expected or length <= 0 or offset + length > len(blobs):
            raise PayloadError(f"{where}: mediator bytes [{offset}, {offset + length}) are not the next blob")
        expected = offset + length
        invokes.append(
            Invoke(
                prompt=_prompt(raw["prompt"], where),
                sampling=_sampling(raw["sampling"], where),
                mediator=bytes(blobs[offset:expected]),
                edits=_edits(raw["edits"], where),
            )
        )
    if expected != len(blobs):
        raise PayloadError(f"{len(blobs) - expected} bytes after the last mediator")
    return PrebuiltTrace(invokes, nnsight=header["nnsight"], python=header["python"], envoys=envoys)


def read_header(data: bytes) -> dict[str, Any]:
    """The validated header (without checking the invokes' contents); raises :class:`PayloadError`."""
    if not data.startswith(MAGIC):
        raise PayloadError("not a prebuilt nnqueue trace (wrong magic)")
    length = _header_length(data)
    start = len(MAGIC) + _LENGTH.size
    if length > MAX_HEADER_BYTES or start + length > len(data):
        raise PayloadError(f"header length {length} is past the payload's end or over {MAX_HEADER_BYTES} bytes")
    try:
        header = json.loads(bytes(data[start : start + length]), parse_constant=_no_constant)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as error:
        raise PayloadError(f"header is not JSON: {error}") from None
    if not isinstance(header, dict):
        raise PayloadError("header must be a JSON object")
    if not _is_int(header.get("format")) or header["format"] not in READ_FORMATS:
        raise PayloadError(
            f"prebuilt trace format {header.get('format')!r} is not supported by this server (it reads formats"
            f" {', '.join(map(str, READ_FORMATS))}): update nnqueue on the older side"
        )
    if header["format"] == 1 and "envoys" in header:
        raise PayloadError("a format 1 header has no 'envoys'")
    for name in ("nnsight", "python"):
        if not isinstance(header.get(name), str) or len(header[name]) > 64:
            raise PayloadError(f"header field {name!r} must be a version string")
    invokes = header.get("invokes")
    if not isinstance(invokes, list) or not 1 <= len(invokes) <= MAX_INVOKES:
        raise PayloadError(f"header field 'invokes' must be a list of 1 to {MAX_INVOKES} invokes")
    return header


def from_vllm_requests(prompts: list[Any], params: list[Any], lora_requests: list[Any]) -> PrebuiltTrace:
    """The prebuilt form of what ``VLLM._attach_mediators`` left on a trace's requests.

    ``prompts``, ``params`` and ``lora_requests`` are ``tracer.prepare``'s call arguments, after
    ``_attach_mediators`` put each invoke's mediator (and edits) in its params' ``extra_args``.
    """
    import msgspec
    import nnsight

    invokes = []
    for index, (prompt, param, lora) in enumerate(zip(prompts, params, lora_requests, strict=True)):
        if lora is not None:
            raise UnsupportedTrace(f"invoke {index} names a LoRA adapter, which nnqueue workers do not load")
        extra = dict(param.extra_args or {})
        mediator = extra.pop("nnsight_mediator", None)
        edits = extra.pop("nnsight_edits", None)
        if not isinstance(mediator, bytes):
            raise UnsupportedTrace(f"invoke {index} carries no nnsight mediator")
        if extra:
            _refuse_reserved(extra, f"invoke {index}", UnsupportedTrace)
            raise UnsupportedTrace(f"invoke {index} sets extra_args {sorted(extra)}, which nnqueue does not carry")
        param.extra_args = None  # the mediator rides as a blob, not base64 in the JSON
        try:
            sampling = msgspec.to_builtins(param)
        except (TypeError, msgspec.EncodeError) as error:
            raise UnsupportedTrace(f"invoke {index}'s sampling settings are not plain data: {error}") from None
        finally:
            param.extra_args = {"nnsight_mediator": mediator, **({} if edits is None else {"nnsight_edits": edits})}
        sampling = {name: value for name, value in sampling.items() if not name.startswith("_")}
        invokes.append(Invoke(_prompt_of(prompt, index), sampling, mediator, None if edits is None else list(edits)))
    return PrebuiltTrace(invokes, nnsight=nnsight.__version__, python=platform.python_version())


def from_vllm_trace(
    model: Any,
    prompts: list[Any],
    params: list[Any],
    lora_requests: list[Any],
    forward_kwargs: dict[str, Any],
    root: Any = None,
) -> PrebuiltTrace:
    """The prebuilt form (format 2) of a prepared trace on ``model`` (a ``VLLM``): ``tracer.prepare``'s call
    arguments and keyword arguments. Pickles the envoy tree the trace's code refers to (``root``: the tracer's
    model, ``model`` unless the trace was deserialized against it) once, as nnsight pickles it into each mediator
    (``dumps``), then has ``model``'s ``VLLM._attach_mediators`` serialize the mediators with each envoy of that
    tree as `envoy_pid` instead."""
    import hashlib

    from nnsight.intervention.serialization import dumps

    root = model if root is None else root
    tree = dumps(root)
    digest = hashlib.sha256(tree).hexdigest()
    envoys = list(root.modules())
    try:
        for envoy in envoys:  # nnsight's pickler writes an object with a _persistent_id as that id
            envoy.__dict__["_persistent_id"] = envoy_pid(digest, envoy.path)
        model._attach_mediators(params, **forward_kwargs)
    finally:
        for envoy in envoys:
            envoy.__dict__.pop("_persistent_id", None)
    trace = from_vllm_requests(prompts, params, lora_requests)
    return PrebuiltTrace(trace.invokes, trace.nnsight, trace.python, EnvoyTree(digest, tree))


def _prompt_of(prompt: Any, index: int) -> dict[str, Any]:
    if isinstance(prompt, str):
        return {"prompt": prompt}
    if isinstance(prompt, dict) and set(prompt) <= PROMPT_KEYS and len(prompt) == 1:
        if "prompt_token_ids" in prompt:
            return {"prompt_token_ids": [int(token) for token in prompt["prompt_token_ids"]]}
        return {"prompt": prompt["prompt"]}
    shown = sorted(prompt) if isinstance(prompt, dict) else type(prompt).__name__
    raise UnsupportedTrace(
        f"invoke {index}'s prompt ({shown}) is not a string or token ids, the prompts nnqueue carries"
        " (multimodal prompts are not supported)"
    )


def _envoys(raw: Any, blobs: memoryview) -> EnvoyTree | None:
    """The header's envoy tree, its bytes the first blob; None when the mediators carry their own."""
    if raw is None:
        return None
    if not isinstance(raw, dict) or set(raw) != {"sha256", "blob"}:
        raise PayloadError("envoys must be null or an object with sha256 and blob")
    digest, span = raw["sha256"], raw["blob"]
    if not isinstance(digest, str) or len(digest) != 64 or digest.strip("0123456789abcdef"):
        raise PayloadError("envoys: sha256 must be 64 lowercase hex digits")
    if not (isinstance(span, list) and len(span) == 2 and all(_is_int(value) for value in span)):
        raise PayloadError("envoys: blob must be [offset, length]")
    if span[0] != 0 or span[1] <= 0 or span[1] > len(blobs):
        raise PayloadError(f"envoys: bytes [{span[0]}, {span[0] + span[1]}) are not the first blob")
    return EnvoyTree(digest, bytes(blobs[: span[1]]))


def _header_length(data: bytes) -> int:
    start = len(MAGIC)
    if len(data) < start + _LENGTH.size:
        raise PayloadError("payload ends before its header length")
    return int(_LENGTH.unpack_from(data, start)[0])


def _prompt(raw: Any, where: str) -> dict[str, Any]:
    if not isinstance(raw, dict) or len(raw) != 1 or not set(raw) <= PROMPT_KEYS:
        raise PayloadError(f"{where}: prompt must be {{'prompt': str}} or {{'prompt_token_ids': [int, ...]}}")
    if "prompt" in raw:
        if not isinstance(raw["prompt"], str):
            raise PayloadError(f"{where}: prompt must be a string")
        return raw
    tokens = raw["prompt_token_ids"]
    if (
        not isinstance(tokens, list)
        or not 1 <= len(tokens) <= MAX_PROMPT_TOKENS
        or not all(_is_int(token) and 0 <= token <= MAX_TOKEN_ID for token in tokens)
    ):
        raise PayloadError(f"{where}: prompt_token_ids must be 1 to {MAX_PROMPT_TOKENS} token ids")
    return raw


def _sampling(raw: Any, where: str) -> dict[str, Any]:
    if not isinstance(raw, dict) or not all(isinstance(name, str) and not name.startswith("_") for name in raw):
        raise PayloadError(f"{where}: sampling must be an object of public SamplingParams fields")
    if "extra_args" in raw:
        _refuse_reserved(raw["extra_args"], where, PayloadError)
        raise PayloadError(f"{where}: sampling must not carry extra_args")
    return raw


def _refuse_reserved(extra_args: Any, where: str, error: type[Exception]) -> None:
    """Raise ``error`` naming the ``nnqueue_*`` keys of a user's ``extra_args``: that prefix tags nnqueue's own
    requests inside the engine (a harvest's capture tag, ``nnqueue_harvest``), which a trace must never set."""
    if not isinstance(extra_args, dict):
        return
    reserved = sorted(key for key in extra_args if isinstance(key, str) and key.startswith(RESERVED_PREFIX))
    if reserved:
        raise error(
            f"{where}: extra_args {reserved} use the {RESERVED_PREFIX!r} prefix, reserved for nnqueue's own"
            " requests (harvest capture); a trace cannot set them"
        )


def _edits(raw: Any, where: str) -> list[str] | None:
    if raw is None:
        return None
    if (
        not isinstance(raw, list)
        or len(raw) > MAX_EDITS
        or not all(isinstance(name, str) and len(name) <= MAX_NAME_LENGTH for name in raw)
    ):
        raise PayloadError(f"{where}: edits must be null or a list of edit names")
    return raw


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _no_constant(name: str) -> Any:
    raise PayloadError(f"header holds {name}, which JSON does not allow")
