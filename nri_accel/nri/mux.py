"""The NRI connection multiplexer: two logical byte streams over one socket.

Owns: the mux framing of containerd/nri pkg/net/multiplex (8-byte header: 4-byte
big-endian connection id, 4-byte big-endian payload length, then the payload), its
limits, the sans-IO Demux and encode(), and MuxProtocol, the asyncio protocol that
owns one NRI socket and routes each logical connection's bytes to a consumer (a ttrpc
Endpoint). Imports the standard library, nri_accel.log, the size constants of
nri_accel.ttrpc and its flow control (GatedReader).

Connection 1 carries the Plugin service (the runtime calls the plugin), connection 2
the Runtime service (the plugin calls the runtime); the same code serves both ends.
Mux frames do not align with the ttrpc messages inside them: a large message is cut
over several frames and one read often holds several frames, so the Demux hands out
each connection's bytes as they arrive and the ttrpc decoder reassembles messages.

Sizes. The Go peer refuses nothing on read, but its writer never sends a frame over
PROTOCOL_MAX_PAYLOAD (a ttrpc header plus the 4 MiB message limit), so a longer
frame is a protocol error here. Going the other way, encode() frames a message as
the Go peer's own writer does (a 4096-byte buffered writer: the captures show a
1.17 MB Synchronize as a frame of 4096 bytes and one of the rest), because of how the
Go peer reads:
- each logical connection through a 4096-byte buffered reader, which reads a frame
  into its own buffer when it is empty and asked for less than 4096 bytes (a ttrpc
  header, or the last bytes of a message), else straight into the message's buffer;
  its mux returns ENOMEM where a frame does not fit the buffer it is read into. A
  message's first WRITE_FRAME_SIZE (4096) bytes are one frame, the rest of it another,
  which the reader takes whole into the message's buffer.
- its mux queues at most 256 frames per connection (readQueueLen) and closes the
  socket, dropping the plugin, when one more comes while they wait. Cut into frames of
  4096 bytes, a 1 MiB answer would be 257 of them; framed as Go frames it, two.

Flow control (nri_accel.ttrpc.flow): on the plugin's side (`serving`), reading
stops while the socket's write buffer is over its high-water mark, that is while
the runtime does not take our answers, and resumes below the low-water mark:
whatever a runtime sends, the plugin holds bounded memory. The runtime's side keeps
reading, as containerd's Go reader does (two sides that both stop would deadlock).
Closing aborts the socket: nothing waits for a peer that does not read. `sent_at`
(the monotonic time of each connection's last write) lets an owner that is stopping
first wait for the peer to take the answers it just wrote (nri_accel.nri.stub: LINGER).

Reads land in one reused buffer (GatedReader): a plain asyncio.Protocol gets a fresh
256 KiB bytes object per read, which glibc serves with mmap, page faults, mremap and
munmap, about 20 us per message; the Demux copies out what it hands on.
"""

from __future__ import annotations

import asyncio
import struct
import time
from collections.abc import Callable, Hashable
from typing import cast

from nri_accel.log import get_logger
from nri_accel.ttrpc import HEADER_SIZE as TTRPC_HEADER_SIZE
from nri_accel.ttrpc import MAX_MESSAGE_SIZE
from nri_accel.ttrpc.flow import GatedReader

PLUGIN_SERVICE_CONN = 1
"""Logical connection of the Plugin service: the runtime calls, the plugin serves."""
RUNTIME_SERVICE_CONN = 2
"""Logical connection of the Runtime service: the plugin calls, the runtime serves."""

HEADER_SIZE = 8
PROTOCOL_MAX_PAYLOAD = TTRPC_HEADER_SIZE + MAX_MESSAGE_SIZE
"""Longest frame payload a conforming peer sends (containerd/nri maxPayloadSize)."""
WRITE_FRAME_SIZE = 4096
"""The first frame of a longer message (the read and write buffer size of Go ttrpc
peers); its rest follows as one frame (encode())."""
UNKNOWN_CONNS_LOGGED = 8
"""Distinct unknown connection ids warned about per socket (a peer may send 2**32)."""

_HEADER = struct.Struct(">II")
_now = time.monotonic

log = get_logger(__name__)


def _drop(data: bytes) -> None:
    """The sink of a connection whose bytes nobody takes any more (drop_incoming)."""


class MuxError(Exception):
    """The peer broke the mux framing; the socket cannot be used any more."""


class Demux:
    """Sans-IO demultiplexer: feed() bytes cut anywhere, get (conn id, bytes) chunks back.

    Chunks are pieces of each connection's byte stream in arrival order; consecutive
    pieces of one connection are joined, so a read carrying many frames of one
    message gives one chunk. Nothing is buffered but a partial 8-byte header: payload
    bytes are handed out as soon as they arrive. `data` may be a view of a buffer the
    caller reuses once feed() returns: chunks are copies.
    """

    __slots__ = ("_conn", "_header", "_max", "_remaining")

    def __init__(self, max_payload: int = PROTOCOL_MAX_PAYLOAD) -> None:
        self._max = max_payload
        self._header = b""  # bytes of a header not complete yet
        self._conn = 0  # connection of the frame being read
        self._remaining = 0  # its payload bytes not seen yet

    def feed(self, data: bytes | memoryview) -> list[tuple[int, bytes]]:
        """Consume `data`. Raises MuxError on a frame longer than the limit."""
        out: list[tuple[int, bytes]] = []
        parts: list[bytes] = []  # pieces of the current run of one connection
        run_conn = -1
        n = len(data)
        pos = 0
        view = memoryview(data)
        while pos < n:
            if self._remaining:
                take = min(self._remaining, n - pos)
                if self._conn != run_conn:
                    if parts:
                        out.append((run_conn, b"".join(parts)))
                        parts = []
                    run_conn = self._conn
                parts.append(view[pos:pos + take])
                pos += take
                self._remaining -= take
                continue
            if self._header or n - pos < HEADER_SIZE:  # a header cut between reads
                take = min(HEADER_SIZE - len(self._header), n - pos)
                self._header += bytes(view[pos:pos + take])
                pos += take
                if len(self._header) < HEADER_SIZE:
                    break
                conn, length = _HEADER.unpack(self._header)
                self._header = b""
            else:
                conn, length = _HEADER.unpack_from(view, pos)
                pos += HEADER_SIZE
            if length > self._max:
                raise MuxError(
                    f"mux frame for connection {conn} declares {length} bytes, "
                    f"over the {self._max}-byte limit"
                )
            self._conn = conn
            self._remaining = length
        if parts:
            out.append((run_conn, b"".join(parts)))
        return out


def encode(conn_id: int, data: bytes, frame_size: int = WRITE_FRAME_SIZE) -> bytes:
    """One message (`data`, a whole ttrpc frame) of logical connection `conn_id` as mux
    frames: one where it holds up to `frame_size` bytes, else its first `frame_size`
    bytes and then the rest, as the Go peer writes it (see the module docstring)."""
    n = len(data)
    if n <= frame_size:
        return _HEADER.pack(conn_id, n) + data
    view = memoryview(data)
    return b"".join((_HEADER.pack(conn_id, frame_size), view[:frame_size],
                     _HEADER.pack(conn_id, n - frame_size), view[frame_size:]))


Sink = Callable[[bytes], None]
LostHandler = Callable[[Exception | None], None]


class MuxProtocol(GatedReader):
    """Owns one NRI socket: routes each logical connection to its attached consumer.

    Attach consumers (normally ttrpc Endpoints: their data_received and
    connection_lost) before the transport connects, so that nothing the peer sends
    first is missed. Bytes for a connection nobody attached are dropped, as the Go
    multiplexer does. A framing error closes the socket and is passed to every
    consumer's connection_lost; `lost` resolves when the socket is gone, with the
    error or None. The owner, who knows what the connection was for, reports the
    error (the stub: once per outage while it retries); the mux logs it at debug.
    `serving`: stop reading while the write buffer is full (the plugin's side; see
    the module doc). hold_reading() pauses reading too.
    """

    def __init__(
        self,
        *,
        serving: bool,
        frame_size: int = WRITE_FRAME_SIZE,
        max_payload: int = PROTOCOL_MAX_PAYLOAD,
    ) -> None:
        super().__init__(serving=serving)
        self._demux = Demux(max_payload)
        self._frame_size = frame_size
        self._sinks: dict[int, Sink] = {}
        self._lost_handlers: dict[int, LostHandler] = {}
        self._transport: asyncio.Transport | None = None
        self._error: Exception | None = None
        self._dropped: set[int] = set()
        self.sent_at: dict[int, float] = {}
        """Connection id -> time.monotonic() of its last write."""
        self.lost: asyncio.Future[Exception | None] = asyncio.get_running_loop().create_future()

    def attach(self, conn_id: int, sink: Sink, on_lost: LostHandler) -> None:
        """Deliver connection `conn_id`'s bytes to `sink`; call `on_lost` when the socket ends."""
        self._sinks[conn_id] = sink
        self._lost_handlers[conn_id] = on_lost

    def sender(self, conn_id: int) -> Sink:
        """A function writing a message (a whole ttrpc frame, each call one) on logical
        connection `conn_id`, framed as the Go peer frames it (encode())."""
        sent_at = self.sent_at

        def send(data: bytes) -> None:
            transport = self._transport
            if transport is None or transport.is_closing():
                raise ConnectionResetError(f"NRI socket closed (connection {conn_id})")
            transport.write(encode(conn_id, data, self._frame_size))
            sent_at[conn_id] = _now()

        return send

    def drop_incoming(self) -> None:
        """Read on but deliver nothing more: the socket's end is still seen (an owner that
        is stopping waits for it), no new request reaches a consumer."""
        self._sinks = dict.fromkeys(self._sinks, _drop)

    def hold_reading(self, reason: Hashable, held: bool) -> None:
        """Stop reading the socket while `reason` is held (a runtime stalling, in tests)."""
        self._gate.hold(reason, held)

    @property
    def write_buffer_size(self) -> int:
        """Bytes written and not yet taken by the peer (0 when not connected)."""
        transport = self._transport
        return 0 if transport is None else transport.get_write_buffer_size()

    def write_raw(self, data: bytes) -> None:
        """Write bytes on the socket as they are, bypassing framing (fault injection)."""
        if self._transport is not None and not self._transport.is_closing():
            self._transport.write(data)

    def close(self) -> None:
        """Abort the socket: unsent bytes are dropped, connection_lost follows at once."""
        if self._transport is not None:
            self._transport.abort()

    # ---- asyncio.Protocol -------------------------------------------------------

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes | memoryview) -> None:
        """Route bytes read from the socket (a view of the reused read buffer is fine)."""
        try:
            chunks = self._demux.feed(data)
        except MuxError as exc:
            log.debug("mux_protocol_error", error=str(exc))
            self._error = exc
            chunks = []
            if self._transport is not None:
                self._transport.abort()
        for conn_id, chunk in chunks:
            sink = self._sinks.get(conn_id)
            if sink is not None:
                sink(chunk)
            elif conn_id not in self._dropped and len(self._dropped) < UNKNOWN_CONNS_LOGGED:
                self._dropped.add(conn_id)
                log.warning("mux_unknown_connection", conn_id=conn_id)

    def connection_lost(self, exc: Exception | None) -> None:
        error = self._error or exc
        for on_lost in self._lost_handlers.values():
            on_lost(error)
        if not self.lost.done():
            self.lost.set_result(error)
