"""Flow control of one asyncio transport: when to stop reading from the peer.

Owns: ReadGate, which keeps a transport's reading paused while anything holds it
(on a serving side: its write buffer over the high-water mark) and resumes it when
nothing does, and the write buffer limits it sets; and GatedReader, the stream
protocol the socket adapters (unix.py here, the NRI multiplexer) build on: it reads
into one reused buffer and gates its transport. Imports asyncio only.

Why reading stops when writing waits: on a connection that serves requests, what
this side writes are answers to what it read. A peer that sends requests and does
not read the answers fills our write buffer; we stop reading, its own writes block
in the kernel, and we hold bounded memory however much it sends. Only the serving
side may do this: two sides that both stop reading while their writes wait deadlock
as soon as both buffers fill, so a side that mostly calls (a client; the NRI
runtime, whose Go reader never stops) keeps reading.
"""

from __future__ import annotations

import asyncio
from collections.abc import Hashable
from typing import cast

WRITE_BUFFER_HIGH = 256 * 1024
"""Bytes queued for the peer above which asyncio calls pause_writing()."""
WRITE_BUFFER_LOW = 64 * 1024
"""Bytes queued for the peer below which asyncio calls resume_writing()."""

READ_BUFFER_SIZE = 256 * 1024
"""Bytes a GatedReader reads at most at once."""

_WRITE_BUFFER_FULL = "write buffer full"


class ReadGate:
    """Pauses a transport's reading while at least one hold is on it.

    `serving`: the write buffer over its high-water mark is a hold (see the module
    doc). Any other hashable reason can be held too (a test's stalled peer). Holds
    put on before the transport connects apply once it does; nothing happens once
    it is closing.
    """

    __slots__ = ("_holds", "_serving", "_transport")

    def __init__(self, *, serving: bool) -> None:
        self._serving = serving
        self._transport: asyncio.Transport | None = None
        self._holds: set[Hashable] = set()

    def connect(self, transport: asyncio.Transport) -> None:
        """Gate `transport` from now on, with this module's write buffer limits."""
        transport.set_write_buffer_limits(high=WRITE_BUFFER_HIGH, low=WRITE_BUFFER_LOW)
        self._transport = transport
        self._apply()

    def writes_waiting(self, waiting: bool) -> None:
        """The write buffer went over the high-water mark (True) or below the low one."""
        if self._serving:
            self.hold(_WRITE_BUFFER_FULL, waiting)

    def hold(self, reason: Hashable, held: bool) -> None:
        """Put (`held` True) or take off (False) the hold `reason`."""
        if held:
            self._holds.add(reason)
        else:
            self._holds.discard(reason)
        self._apply()

    def _apply(self) -> None:
        transport = self._transport
        if transport is None or transport.is_closing():
            return
        if self._holds:
            if transport.is_reading():
                transport.pause_reading()
        elif not transport.is_reading():
            transport.resume_reading()


class GatedReader(asyncio.BufferedProtocol):
    """A stream protocol whose reads land in one reused buffer (asyncio.Protocol would
    allocate a fresh READ_BUFFER_SIZE bytes object per read) and whose transport a
    ReadGate holds: `serving`, reading stops while the write buffer is full (see the
    module doc). Subclasses take each read in data_received(), a view of the buffer
    valid until it returns (copy what is kept), and call super().connection_made()."""

    def __init__(self, *, serving: bool) -> None:
        self._gate = ReadGate(serving=serving)
        self._buffer = memoryview(bytearray(READ_BUFFER_SIZE))

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # Any loop's stream transport: uvloop's do not subclass asyncio.Transport.
        self._gate.connect(cast(asyncio.Transport, transport))

    def pause_writing(self) -> None:
        self._gate.writes_waiting(True)

    def resume_writing(self) -> None:
        self._gate.writes_waiting(False)

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._buffer

    def buffer_updated(self, nbytes: int) -> None:
        self.data_received(self._buffer[:nbytes])

    def data_received(self, data: memoryview) -> None:
        raise NotImplementedError
