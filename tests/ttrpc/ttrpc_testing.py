"""Helpers for the ttrpc tests: an in-memory transport, a raw socket peer, capture reading.

- `async_test` runs a coroutine test function in its own event loop (no plugin needed).

- `memory_pair()` stands for a real byte transport between two Endpoints: each write
  is delivered to the peer's data_received on a later loop iteration, as a socket
  would, so nothing runs re-entrantly that could not run over a socket.
- `RawPeer` stands for a foreign (e.g. Go or misbehaving) ttrpc peer on a unix socket:
  it writes arbitrary bytes and decodes what comes back with the sans-IO Connection.
- `capture_streams()` reads the NRI runtime captures in shared/nri-wire: it rebuilds
  each direction's byte stream, strips the NRI multiplexer framing (8-byte header:
  big-endian conn id, big-endian length) and returns the ttrpc byte stream of every
  (relay connection, direction, mux conn id).
"""

from __future__ import annotations

import asyncio
import functools
import gzip
import json
import struct
from collections import defaultdict
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

from nri_accel.ttrpc import Connection, Endpoint, Services
from nri_accel.ttrpc.protocol import Event

HANG_GUARD_S = 20.0
"""A test that has not finished by then is hung: it fails instead of blocking the suite."""


def async_test(fn: Callable[..., Coroutine[Any, Any, None]]) -> Callable[..., None]:
    """Run an async test function in a fresh event loop (pytest fixtures still apply)."""

    @functools.wraps(fn)
    def run(*args: Any, **kwargs: Any) -> None:
        asyncio.run(asyncio.wait_for(fn(*args, **kwargs), HANG_GUARD_S))

    return run


def memory_pair(
    a_services: Services | None = None, b_services: Services | None = None
) -> tuple[Endpoint, Endpoint]:
    """Two Endpoints joined by an in-memory transport; closing one reaches the other."""
    loop = asyncio.get_running_loop()
    a: Endpoint
    b: Endpoint

    def a_send(data: bytes) -> None:
        loop.call_soon(b.data_received, data)

    def b_send(data: bytes) -> None:
        loop.call_soon(a.data_received, data)

    def a_close() -> None:
        loop.call_soon(a.connection_lost, None)
        loop.call_soon(b.connection_lost, None)

    def b_close() -> None:
        loop.call_soon(b.connection_lost, None)
        loop.call_soon(a.connection_lost, None)

    a = Endpoint(a_send, a_services, on_close=a_close)
    b = Endpoint(b_send, b_services, on_close=b_close)
    return a, b


class RawPeer:
    """A ttrpc client that writes whatever bytes it is told to and decodes the answers."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.conn = Connection()
        self._events: list[Event] = []

    @classmethod
    async def connect(cls, path: Path) -> RawPeer:
        reader, writer = await asyncio.open_unix_connection(str(path))
        return cls(reader, writer)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def next_event(self) -> Event:
        while not self._events:
            data = await self.reader.read(65536)
            if not data:
                raise ConnectionError("peer closed the connection")
            self._events.extend(self.conn.receive(data))
        return self._events.pop(0)

    async def close(self) -> None:
        self.writer.close()
        await self.writer.wait_closed()


_MUX_HEADER = struct.Struct(">II")


def _records(path: Path) -> Iterator[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        for line in f:
            if line.strip():
                yield json.loads(line)


def capture_names(wire_dir: Path) -> list[str]:
    """The capture names that have both a raw and a decoded file."""
    names = []
    for raw in sorted(wire_dir.glob("*.raw.jsonl*")):
        name = raw.name.split(".raw.jsonl")[0]
        if list(wire_dir.glob(f"{name}.decoded.jsonl*")):
            names.append(name)
    return names


def capture_streams(wire_dir: Path, name: str) -> dict[tuple[int, str, int], bytes]:
    """{(relay conn, direction, mux conn id): ttrpc bytes} of one capture's raw file."""
    raw_path = next(wire_dir.glob(f"{name}.raw.jsonl*"))
    directions: dict[tuple[int, str], bytearray] = defaultdict(bytearray)
    for rec in _records(raw_path):
        directions[(rec["conn"], rec["dir"])] += bytes.fromhex(rec["hex"])
    streams: dict[tuple[int, str, int], bytearray] = defaultdict(bytearray)
    for (conn, direction), data in directions.items():
        pos = 0
        while pos < len(data):
            mux_id, length = _MUX_HEADER.unpack_from(data, pos)
            pos += _MUX_HEADER.size
            assert pos + length <= len(data), f"{name}: truncated mux frame at {pos}"
            streams[(conn, direction, mux_id)] += data[pos : pos + length]
            pos += length
    return {key: bytes(value) for key, value in streams.items()}


def capture_decoded(wire_dir: Path, name: str) -> dict[tuple[int, str, int], list[dict]]:
    """The Go side's decoding of the same capture, grouped like capture_streams()."""
    decoded_path = next(wire_dir.glob(f"{name}.decoded.jsonl*"))
    grouped: dict[tuple[int, str, int], list[dict]] = defaultdict(list)
    for rec in _records(decoded_path):
        grouped[(rec["conn"], rec["dir"], rec["mux_conn_id"])].append(rec)
    return dict(grouped)
