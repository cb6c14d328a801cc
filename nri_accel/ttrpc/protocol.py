"""One ttrpc connection's protocol state, sans-IO: bytes in, events out; calls in, bytes out.

Owns: the meaning of frame payloads (the Request/Response/Status envelope of
api/ttrpc.proto), the rules a peer's frames must follow (odd, increasing stream ids
for requests; size limit; well-formed envelope) and stream id allocation for the
requests this side sends. It never touches a socket or a clock: the asyncio
Endpoint (endpoint.py) drives it. Imports this package's codec, errors and the
generated ttrpc_pb2 (the only importer of it besides tests).

Every frame a peer sends becomes exactly one event:
- RequestReceived / ResponseReceived: a well-formed unary request or response;
- StreamError: the frame was refused; a server answers a refused *request* with
  `code`/`message` on its stream and carries on (a refused *response* fails the
  call waiting on that stream);
- FrameIgnored: a frame with nothing to answer (stream data, unknown type).
Streaming RPCs (data frames) are not supported: a request opening a client stream is
refused with UNIMPLEMENTED.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

from google.protobuf.message import DecodeError
from msgspec import Struct

from . import ttrpc_pb2
from .codec import (
    MAX_MESSAGE_SIZE,
    MAX_STREAM_ID,
    Bytes,
    Flags,
    Frame,
    FrameDecoder,
    FrameType,
    OversizeFrame,
    encode_frame,
    too_large,
)
from .errors import Code, TtrpcError, known_code

Metadata = tuple[tuple[str, str], ...]

_REQUEST = int(FrameType.REQUEST)
_RESPONSE = int(FrameType.RESPONSE)
_DATA = int(FrameType.DATA)
_REMOTE_OPEN = int(Flags.REMOTE_OPEN)


class RequestReceived(Struct, frozen=True):
    """A unary request from the peer. `timeout_nano` 0 means no deadline."""

    stream_id: int
    service: str
    method: str
    payload: bytes
    timeout_nano: int
    metadata: Metadata


class ResponseReceived(Struct, frozen=True):
    """The peer's answer on `stream_id`; `code` is OK or the error status."""

    stream_id: int
    code: Code
    message: str
    payload: bytes
    details: tuple[Any, ...]


class StreamError(Struct, frozen=True):
    """The peer's frame on `stream_id` (of `frame_type`) was refused with code/message."""

    stream_id: int
    frame_type: int
    code: Code
    message: str


class FrameIgnored(Struct, frozen=True):
    """A frame with nothing to answer (stream data, unknown type); `reason` says why."""

    stream_id: int
    frame_type: int
    reason: str


Event = RequestReceived | ResponseReceived | StreamError | FrameIgnored


class Connection:
    """Protocol state of one ttrpc connection; either side may send requests."""

    __slots__ = ("_decoder", "_last_peer_request", "_max", "_next_stream_id")

    def __init__(self, max_message_size: int = MAX_MESSAGE_SIZE) -> None:
        self._decoder = FrameDecoder(max_message_size)
        self._max = max_message_size
        self._next_stream_id = 1
        self._last_peer_request = 0

    def receive(self, data: Bytes) -> list[Event]:
        """Consume bytes from the peer (cut anywhere; a reused buffer's view is fine);
        return one event per frame they completed."""
        return [self._event(f) for f in self._decoder.feed(data)]

    def request(
        self,
        service: str,
        method: str,
        payload: bytes,
        *,
        timeout_nano: int = 0,
        metadata: Iterable[tuple[str, str]] = (),
    ) -> tuple[int, bytes]:
        """Encode a unary request on the next odd stream id; return (stream id, frame).

        Raises TtrpcError(RESOURCE_EXHAUSTED) if the request is over the size limit
        (no stream id is used up then), TtrpcError(UNAVAILABLE) once the 32-bit
        stream ids are spent.
        """
        if len(payload) > self._max:  # the body holds the payload: not worth encoding
            raise too_large(f"request {service}/{method} payload", len(payload), self._max)
        msg = ttrpc_pb2.Request(
            service=service, method=method, payload=payload, timeout_nano=timeout_nano
        )
        for key, value in metadata:
            msg.metadata.add(key=key, value=value)
        body = msg.SerializeToString()
        if len(body) > self._max:
            raise too_large(f"request {service}/{method}", len(body), self._max)
        stream_id = self._next_stream_id
        if stream_id > MAX_STREAM_ID:
            raise TtrpcError(Code.UNAVAILABLE, "ttrpc stream ids of this connection are spent")
        self._next_stream_id = stream_id + 2
        return stream_id, encode_frame(stream_id, _REQUEST, body, max_message_size=self._max)

    def response(
        self,
        stream_id: int,
        payload: bytes = b"",
        *,
        code: Code = Code.OK,
        message: str = "",
        details: Sequence[Any] = (),
    ) -> bytes:
        """Encode the response frame of `stream_id`: OK with `payload`, or an error status.

        An OK response carries no status, so an empty OK response is 0 bytes, as Go
        ttrpc peers send it. Raises TtrpcError(RESOURCE_EXHAUSTED) when over the limit.
        """
        if code == Code.OK and not message and not details:
            if not payload:  # the commonest answer: an empty Response encodes to nothing
                return encode_frame(stream_id, _RESPONSE, b"")
            msg = ttrpc_pb2.Response(payload=payload)
        else:
            msg = ttrpc_pb2.Response(
                status=ttrpc_pb2.Status(code=code, message=message, details=details),
                payload=payload,
            )
        body = msg.SerializeToString()
        if len(body) > self._max:
            raise too_large(f"response on stream {stream_id}", len(body), self._max)
        return encode_frame(stream_id, _RESPONSE, body, max_message_size=self._max)

    def _event(self, frame: Frame | OversizeFrame) -> Event:
        ftype = frame.type
        sid = frame.stream_id
        if type(frame) is OversizeFrame:
            return StreamError(
                sid,
                ftype,
                Code.RESOURCE_EXHAUSTED,
                f"message length {frame.length} exceeds maximum message size of {self._max}",
            )
        if ftype == _REQUEST:
            return self._request_event(frame)
        if ftype == _RESPONSE:
            return _response_event(frame)
        if ftype == _DATA:
            return FrameIgnored(sid, ftype, "stream data frames are not supported")
        return FrameIgnored(sid, ftype, f"unknown frame type {ftype}")

    def _request_event(self, frame: Frame) -> Event:
        sid = frame.stream_id
        if not sid & 1:
            return StreamError(
                sid, _REQUEST, Code.INVALID_ARGUMENT,
                f"stream id {sid} is even: client-initiated stream ids must be odd",
            )
        if sid <= self._last_peer_request:
            return StreamError(
                sid, _REQUEST, Code.INVALID_ARGUMENT,
                f"stream id {sid} is not above the previous request's "
                f"{self._last_peer_request}: stream ids cannot be re-used and must increase",
            )
        self._last_peer_request = sid
        if frame.flags & _REMOTE_OPEN:
            return StreamError(
                sid, _REQUEST, Code.UNIMPLEMENTED, "ttrpc streaming requests are not supported"
            )
        try:
            msg = ttrpc_pb2.Request.FromString(frame.payload)
        except DecodeError as exc:
            return StreamError(
                sid, _REQUEST, Code.INVALID_ARGUMENT, f"malformed ttrpc request: {exc}"
            )
        md = msg.metadata
        return RequestReceived(
            sid,
            msg.service,
            msg.method,
            msg.payload,
            msg.timeout_nano,
            # md[:], a list: iterating the repeated field itself ends on an IndexError
            # that protobuf formats a message for (0.2 us a request)
            tuple([(kv.key, kv.value) for kv in md[:]]) if md else (),
        )


def _response_event(frame: Frame) -> Event:
    sid = frame.stream_id
    try:
        msg = ttrpc_pb2.Response.FromString(frame.payload)
    except DecodeError as exc:
        return StreamError(sid, _RESPONSE, Code.INTERNAL, f"malformed ttrpc response: {exc}")
    if not msg.HasField("status"):
        return ResponseReceived(sid, Code.OK, "", msg.payload, ())
    status = msg.status
    code, message = known_code(status.code, status.message)
    return ResponseReceived(sid, code, message, msg.payload, tuple(status.details))
