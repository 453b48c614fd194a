"""Frames <-> messages: ``[WIRE_VERSION, KIND, body]`` in msgpack, decoded with bounds.

Decoding is typed (msgspec): each field is checked against its declaration in
:mod:`pagedserve.wire.messages` while it is parsed, so a malformed frame stops
at its first wrong element instead of being materialised first. The envelope
is read before the body: a wrong version or an unexpected kind is refused
without parsing the body at all (``accept=`` narrows the kinds a peer may send,
e.g. only a handshake before it has registered). Every problem is a
:class:`WireError` naming the field path (``plan.new_seqs[0].token_ids[3]``);
callers log and drop such a frame, they never crash on it.
"""

from __future__ import annotations

import re

import msgspec

from pagedserve.wire import protocol as p
from pagedserve.wire.messages import KIND_OF, Message

_TYPE_OF: dict[int, type] = {k: t for t, k in KIND_OF.items()}
_ENCODER = msgspec.msgpack.Encoder()
_ENVELOPE = msgspec.msgpack.Decoder(tuple[int, int, msgspec.Raw])
_BODY = {kind: msgspec.msgpack.Decoder(cls) for kind, cls in _TYPE_OF.items()}
_NAMES = {cls: re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__).lower().replace("batch_plan", "plan")
          .replace("step_result", "result") for cls in KIND_OF}


class WireError(ValueError):
    """A frame that is not a valid message of this wire version."""


def encode(msg: Message) -> bytes:
    """Serialize a message to one frame."""
    return _ENCODER.encode((p.WIRE_VERSION, KIND_OF[type(msg)], msg))


def decode(frame: bytes, accept: tuple[type, ...] | None = None, max_bytes: int = p.MAX_FRAME_BYTES) -> Message:
    """Parse one frame; WireError on anything that is not a valid message.

    ``accept``: the message types allowed here (others are refused before their
    body is parsed); ``max_bytes``: the largest frame accepted.
    """
    if len(frame) > max_bytes:
        raise WireError(f"frame of {len(frame)} bytes exceeds the limit of {max_bytes}")
    try:
        version, kind, body = _ENVELOPE.decode(frame)
    except msgspec.DecodeError as exc:
        raise WireError(f"not a frame [version, kind, body]: {_plain(exc)}") from None
    if version != p.WIRE_VERSION:
        raise WireError(f"wire version {version}, expected {p.WIRE_VERSION}")
    cls = _TYPE_OF.get(kind)
    if cls is None:
        raise WireError(f"unknown message kind {kind}")
    if accept is not None and cls not in accept:
        raise WireError(f"a {cls.__name__} is not accepted here (expected "
                        f"{' or '.join(c.__name__ for c in accept)})")
    try:
        return _BODY[kind].decode(body)
    except msgspec.DecodeError as exc:
        raise WireError(f"malformed {cls.__name__}: {_named(cls, exc)}") from None


def _plain(exc: Exception) -> str:
    return str(exc).replace("$", "frame")


def _named(cls: type, exc: Exception) -> str:
    """msgspec's ``... - at `$[3][0][1]``` with the indices turned into field names."""
    text = str(exc)
    m = re.search(r" - at `\$((?:\[\d+\])*)`$", text)
    if m is None:
        return f"{text} (in {_NAMES[cls]})"
    indices = [int(i) for i in re.findall(r"\d+", m.group(1))]
    return f"{text[:m.start()]} (at {_field_path(cls, indices)})"


def _field_path(cls: type, indices: list[int]) -> str:
    info = msgspec.inspect.type_info(cls)
    path = _NAMES[cls]
    for i in indices:
        info = _unwrap(info)
        if isinstance(info, msgspec.inspect.StructType):
            if i >= len(info.fields):
                return f"{path}[{i}]"
            field = info.fields[i]
            path, info = f"{path}.{field.name}", field.type
        elif isinstance(info, msgspec.inspect.ListType):
            path, info = f"{path}[{i}]", info.item_type
        elif isinstance(info, msgspec.inspect.TupleType) and i < len(info.item_types):
            path, info = f"{path}[{i}]", info.item_types[i]
        else:
            return f"{path}[{i}]"
    return path


def _unwrap(info):
    """A union with None (an optional field) stands for its other member."""
    if isinstance(info, msgspec.inspect.UnionType):
        rest = [t for t in info.types if not isinstance(t, msgspec.inspect.NoneType)]
        if len(rest) == 1:
            return rest[0]
    return info
