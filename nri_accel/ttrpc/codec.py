"""ttrpc framing, sans-IO: bytes in, frames out; frames in, bytes out.

Owns: the 10-byte frame header (4-byte big-endian payload length, 4-byte big-endian
stream id, 1-byte type, 1-byte flags), the message size limit, the incremental
FrameDecoder and encode_frame. No sockets, no asyncio, no protobuf: what a frame's
payload means is protocol.py's business. Imports only the standard library and
this package's errors.

The decoder gives the same frames whatever way the byte stream is cut into chunks.
A frame whose declared length is over the limit is never buffered: the decoder
reports it (OversizeFrame, with its stream id) as soon as its header is complete and
then skips its payload as it streams past, so the connection stays usable, which is
what the Go implementation does too (it answers RESOURCE_EXHAUSTED on that stream).
"""

from __future__ import annotations

import enum
import struct

from msgspec import Struct

from .errors import Code, TtrpcError

HEADER_SIZE = 10
MAX_MESSAGE_SIZE = 4 << 20
"""Largest payload a frame may carry (4 MiB), the limit of containerd/ttrpc."""

_HEADER = struct.Struct(">IIBB")

Bytes = bytes | bytearray | memoryview
"""What the decoders accept; they only read it during the call (what they keep, they copy)."""
MAX_STREAM_ID = 0xFFFFFFFF
"""Largest stream id the 32-bit header field holds."""


# Frames, events and call contexts are frozen msgspec Structs: values, built in C (two
# thirds of a slots dataclass's instructions; three are built per request) and defined
# without the code generation a dataclass does at import.


class FrameType(enum.IntEnum):
    REQUEST = 1
    RESPONSE = 2
    DATA = 3


class Flags(enum.IntFlag):
    """Stream flags of request and data frames (responses carry none)."""

    REMOTE_CLOSED = 1
    REMOTE_OPEN = 2
    NO_DATA = 4


class Frame(Struct, frozen=True):
    """One complete frame. `type` and `flags` are the raw bytes (unknown types exist)."""

    stream_id: int
    type: int
    flags: int
    payload: bytes


class OversizeFrame(Struct, frozen=True):
    """A frame whose payload (`length` bytes) exceeds the limit; its payload is skipped."""

    stream_id: int
    type: int
    flags: int
    length: int


class FrameDecoder:
    """Incremental frame decoder: feed() it bytes cut anywhere, get whole frames back.

    It holds at most one partial frame (never more than the limit plus a header) and
    nothing of an oversize frame's payload.
    """

    __slots__ = ("_buf", "_max", "_skip")

    def __init__(self, max_message_size: int = MAX_MESSAGE_SIZE) -> None:
        self._buf = bytearray()
        self._max = max_message_size
        self._skip = 0  # bytes of an oversize payload still to be skipped

    @property
    def buffered(self) -> int:
        """Bytes held for a frame not yet complete (0 between frames)."""
        return len(self._buf)

    def feed(self, data: Bytes) -> list[Frame | OversizeFrame]:
        """Consume `data`; return the frames (and oversize notices) it completed, in order.

        `data` may be a view of a buffer the caller reuses once feed() returns.
        """
        out: list[Frame | OversizeFrame] = []
        buf = self._buf
        if buf:
            buf += data
            src: Bytes = buf
        else:
            src = data
        end = len(src)
        pos = 0
        limit = self._max
        unpack = _HEADER.unpack_from
        with memoryview(src) as view:
            while True:
                if self._skip:
                    take = min(self._skip, end - pos)
                    pos += take
                    self._skip -= take
                    if self._skip:
                        break
                if end - pos < HEADER_SIZE:
                    break
                length, stream_id, ftype, flags = unpack(view, pos)
                if length > limit:
                    out.append(OversizeFrame(stream_id, ftype, flags, length))
                    pos += HEADER_SIZE
                    self._skip = length
                    continue
                start = pos + HEADER_SIZE
                stop = start + length
                if stop > end:
                    break
                out.append(Frame(stream_id, ftype, flags, bytes(view[start:stop])))
                pos = stop
        if buf:
            del buf[:pos]
        elif pos < end:
            buf += memoryview(data)[pos:]
        return out


def encode_frame(
    stream_id: int,
    frame_type: int,
    payload: bytes,
    flags: int = 0,
    *,
    max_message_size: int = MAX_MESSAGE_SIZE,
) -> bytes:
    """Header and payload as one bytes object (one write per frame).

    Raises TtrpcError(RESOURCE_EXHAUSTED) when the payload is over the limit, before
    anything is produced, and ValueError for a stream id, type or flags that do not
    fit their header fields.
    """
    n = len(payload)
    if n > max_message_size:
        raise too_large("message", n, max_message_size)
    if not (0 <= stream_id <= MAX_STREAM_ID and 0 <= frame_type <= 0xFF and 0 <= flags <= 0xFF):
        raise ValueError(
            f"frame header out of range: stream id {stream_id}, type {frame_type}, flags {flags}"
        )
    return _HEADER.pack(n, stream_id, frame_type, flags) + payload


def too_large(what: str, size: int, max_message_size: int) -> TtrpcError:
    """The RESOURCE_EXHAUSTED error for an outgoing `what` of `size` bytes over the limit."""
    return TtrpcError(
        Code.RESOURCE_EXHAUSTED,
        f"{what} of {size} bytes exceeds the maximum message size of {max_message_size} bytes",
    )
