"""Frames <-> messages: ``[WIRE_VERSION, KIND, TAG, body]`` in msgpack, decoded with bounds.

Decoding is in two stages, so that a receiver can judge a frame before paying for it:

1. :func:`read_envelope` reads the version, the kind and the tag (the step id of a
   plan or a result) and leaves the body unparsed: a wrong version, an unknown kind
   or a kind not accepted from this peer (``accept=``, e.g. only a handshake before
   it has registered) is refused here, and the scheduler checks a result's tag and
   size against the plan it answers before going on;
2. :func:`decode_body` parses the body typed (msgspec): each field is checked
   against its declaration (:mod:`pagedserve.wire.messages`, ``link_messages``) while it is parsed,
   so a malformed body stops at its first wrong element.

Every problem, whatever raised it (a msgspec error, a ``RecursionError`` on a frame
nested a thousand levels deep, a ``MemoryError``), is a :class:`WireError` naming
what is wrong (the field path, ``plan.new_seqs[0].token_ids[3]``, where known);
callers drop such a frame or the peer that sent it, they never crash on it.
"""

from __future__ import annotations

import re
from typing import NamedTuple

import msgspec

from pagedserve.wire import protocol as p
from pagedserve.wire.errors import WireError
from pagedserve.wire.messages import KIND_OF, BatchPlan, Message, StepResult

_ENCODER = msgspec.msgpack.Encoder()
_ANY_ENVELOPE = msgspec.msgpack.Decoder(list[msgspec.Raw])  # (only to name another version)


class Envelope(NamedTuple):
    """What a frame says of itself before its body is parsed."""

    kind: type  # the message class
    tag: int  # a plan's or result's step id; 0 for other kinds
    body: msgspec.Raw  # the unparsed body (a view of the frame)
    size: int  # bytes of the whole frame


class Codec:
    """Frames ``[version, KIND, TAG, body]`` of one protocol: its version, its message kinds, and
    the kinds whose tag is their ``step_id``. The executor link is one (this module's functions);
    the link between the scheduler's fronts and engine cores another (scheduler_svc/front/core_link.py, scheduler_svc/engine/front_link.py)."""

    def __init__(self, version: int, kind_of: dict[type, int], tagged: tuple[type, ...] = ()) -> None:
        self.version, self.kind_of, self.tagged = version, kind_of, tagged
        self._type_of = {k: t for t, k in kind_of.items()}
        self._envelope = msgspec.msgpack.Decoder(tuple[int, int, int, msgspec.Raw])
        self._body = {kind: msgspec.msgpack.Decoder(cls) for kind, cls in self._type_of.items()}

    def encode(self, msg) -> bytes:
        """Serialize a message to one frame."""
        cls = type(msg)
        return _ENCODER.encode((self.version, self.kind_of[cls], msg.step_id if cls in self.tagged else 0, msg))

    def decode(self, frame: bytes, accept: tuple[type, ...] | None = None, max_bytes: int = p.MAX_FRAME_BYTES):
        """Parse one frame; WireError on anything that is not a valid message.

        ``accept``: the message types allowed here (others are refused before their
        body is parsed); ``max_bytes``: the largest frame accepted.
        """
        return self.decode_body(self.read_envelope(frame, accept, max_bytes))

    def read_envelope(self, frame: bytes, accept: tuple[type, ...] | None = None,
                      max_bytes: int = p.MAX_FRAME_BYTES) -> Envelope:
        """The frame's kind and tag, its body left unparsed; WireError as :meth:`decode`."""
        if len(frame) > max_bytes:
            raise WireError(f"frame of {len(frame)} bytes exceeds the limit of {max_bytes}")
        try:
            version, kind, tag, body = self._envelope.decode(frame)
        except Exception as exc:  # noqa: BLE001  (msgspec, or RecursionError on deep nesting: all the peer's)
            raise WireError(self._not_an_envelope(frame, exc)) from None
        if version != self.version:
            raise WireError(f"wire version {version}, expected {self.version}")
        cls = self._type_of.get(kind)
        if cls is None:
            raise WireError(f"unknown message kind {kind}")
        if accept is not None and cls not in accept:
            raise WireError(f"a {cls.__name__} is not accepted here (expected "
                            f"{' or '.join(c.__name__ for c in accept)})")
        if tag < 0 or (tag and cls not in self.tagged):
            raise WireError(f"a {cls.__name__} frame with tag {tag}")
        return Envelope(cls, tag, body, len(frame))

    def decode_body(self, env: Envelope):
        """Parse the body :meth:`read_envelope` left; WireError naming the field at fault."""
        cls = env.kind
        try:
            msg = self._body[self.kind_of[cls]].decode(env.body)
        except msgspec.DecodeError as exc:
            raise WireError(f"malformed {cls.__name__}: {_named(cls, exc)}") from None
        except Exception as exc:  # noqa: BLE001  (RecursionError, MemoryError...: refused, never raised)
            raise WireError(f"malformed {cls.__name__}: {type(exc).__name__}: {_plain(exc)}") from None
        if cls in self.tagged and msg.step_id != env.tag:
            raise WireError(f"a {cls.__name__} of step {msg.step_id} in a frame tagged {env.tag}")
        return msg

    def _not_an_envelope(self, frame: bytes, exc: Exception) -> str:
        """Name another wire version when the frame has one; otherwise what is wrong with it."""
        try:
            head = _ANY_ENVELOPE.decode(frame)
            version = msgspec.msgpack.decode(head[0], type=int) if head else None
        except Exception:  # noqa: BLE001
            version = None
        if version is not None and version != self.version:
            return f"wire version {version}, expected {self.version}"
        detail = _plain(exc) if isinstance(exc, msgspec.DecodeError) else f"{type(exc).__name__}: {_plain(exc)}"
        return f"not a frame [version, kind, tag, body]: {detail}"


_WIRE = Codec(p.WIRE_VERSION, KIND_OF, (BatchPlan, StepResult))


def encode(msg: Message) -> bytes:
    """Serialize a message to one frame."""
    return _WIRE.encode(msg)


def decode(frame: bytes, accept: tuple[type, ...] | None = None, max_bytes: int = p.MAX_FRAME_BYTES) -> Message:
    """Parse one frame of the executor link; WireError on anything that is not a valid message."""
    return _WIRE.decode(frame, accept, max_bytes)


def read_envelope(frame: bytes, accept: tuple[type, ...] | None = None,
                  max_bytes: int = p.MAX_FRAME_BYTES) -> Envelope:
    """The frame's kind and tag, its body left unparsed; WireError as :func:`decode`."""
    return _WIRE.read_envelope(frame, accept, max_bytes)


def decode_body(env: Envelope) -> Message:
    """Parse the body :func:`read_envelope` left; WireError naming the field at fault."""
    return _WIRE.decode_body(env)


def _plain(exc: Exception) -> str:
    return str(exc).replace("$", "frame")


def _name(cls: type) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", cls.__name__).lower().replace("batch_plan", "plan") \
        .replace("step_result", "result")


def _named(cls: type, exc: Exception) -> str:
    """msgspec's ``... - at `$[3][0][1]``` with the indices turned into field names."""
    text = str(exc)
    m = re.search(r" - at `\$((?:\[\d+\])*)`$", text)
    if m is None:
        return f"{text} (in {_name(cls)})"
    indices = [int(i) for i in re.findall(r"\d+", m.group(1))]
    return f"{text[:m.start()]} (at {_field_path(cls, indices)})"


def _field_path(cls: type, indices: list[int]) -> str:
    info = msgspec.inspect.type_info(cls)
    path = _name(cls)
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
