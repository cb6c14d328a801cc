"""The NRI multiplexer: framing, reassembly across reads, limits, and the asyncio protocol."""

from __future__ import annotations

import asyncio
import random
import socket
from pathlib import Path

import pytest
from wire import CAPTURES, RUNTIME_TO_PLUGIN, frames, relay_conns, stream

from nri_accel.nri.mux import (
    HEADER_SIZE,
    PROTOCOL_MAX_PAYLOAD,
    WRITE_FRAME_SIZE,
    Demux,
    MuxError,
    MuxProtocol,
    encode,
)


def _reference(data: bytes) -> dict[int, bytes]:
    """Each connection's bytes of a whole stream, by the test's own reading of the header."""
    out: dict[int, bytearray] = {}
    pos = 0
    for conn, length in frames(data):
        out.setdefault(conn, bytearray()).extend(data[pos + 8:pos + 8 + length])
        pos += 8 + length
    return {k: bytes(v) for k, v in out.items()}


def _collect(chunks: list[tuple[int, bytes]], into: dict[int, bytearray]) -> None:
    for conn, chunk in chunks:
        into.setdefault(conn, bytearray()).extend(chunk)


@pytest.mark.parametrize("capture", CAPTURES)
def test_captured_runtime_streams_demultiplex_in_any_chunking(
    nri_wire_dir: Path, capture: str
) -> None:
    rng = random.Random(capture)
    for conn in relay_conns(nri_wire_dir, capture):
        data = stream(nri_wire_dir, capture, conn, RUNTIME_TO_PLUGIN)
        expected = _reference(data)
        assert set(expected) <= {1, 2}
        for _ in range(3):
            demux, got, pos = Demux(), {}, 0
            while pos < len(data):
                step = rng.choice((1, 3, 7, 8, 9, 4095, 4096, 4104, 65536))
                _collect(demux.feed(data[pos:pos + step]), got)
                pos += step
            assert {k: bytes(v) for k, v in got.items()} == expected


def test_split_at_every_offset_of_a_small_stream() -> None:
    data = encode(1, b"configure" * 3) + encode(2, b"") + encode(2, b"register") + encode(1, b"x")
    expected = {1: b"configure" * 3 + b"x", 2: b"register"}
    for cut in range(len(data) + 1):
        for cut2 in range(cut, len(data) + 1):
            demux, got = Demux(), {}
            for piece in (data[:cut], data[cut:cut2], data[cut2:]):
                _collect(demux.feed(piece), got)
            assert {k: bytes(v) for k, v in got.items()} == expected, (cut, cut2)


def test_one_read_of_many_frames_of_one_connection_is_one_chunk() -> None:
    data = encode(1, bytes(range(256)) * 64)  # 16 KiB in four frames
    assert len(list(frames(data))) == 4
    assert Demux().feed(data) == [(1, bytes(range(256)) * 64)]


def test_encode_never_writes_frames_over_the_go_read_buffer() -> None:
    payload = random.Random(1).randbytes(3 * WRITE_FRAME_SIZE + 17)
    data = encode(2, payload)
    lengths = [length for _, length in frames(data)]
    assert max(lengths) == WRITE_FRAME_SIZE and sum(lengths) == len(payload)
    assert _reference(data) == {2: payload}
    assert encode(1, b"abc") == b"\0\0\0\1\0\0\0\3abc"


def test_oversize_frame_is_a_protocol_error_naming_the_sizes() -> None:
    header = (1).to_bytes(4, "big") + (PROTOCOL_MAX_PAYLOAD + 1).to_bytes(4, "big")
    demux = Demux()
    assert demux.feed(header[:5]) == []
    sizes = rf"{PROTOCOL_MAX_PAYLOAD + 1} bytes.*{PROTOCOL_MAX_PAYLOAD}"
    with pytest.raises(MuxError, match=sizes):
        demux.feed(header[5:])


def test_largest_legal_frame_is_accepted() -> None:
    header = (1).to_bytes(4, "big") + PROTOCOL_MAX_PAYLOAD.to_bytes(4, "big")
    demux = Demux()
    assert demux.feed(header) == []
    assert demux.feed(b"\0" * 10) == [(1, b"\0" * 10)]


def test_chunks_are_copies_so_the_read_buffer_can_be_reused() -> None:
    buffer = bytearray(encode(1, b"first") + encode(2, b"second"))
    demux = Demux()
    chunks = demux.feed(memoryview(buffer)[:10])  # a view of the reused read buffer
    chunks += demux.feed(memoryview(buffer)[10:])
    buffer[:] = b"\xff" * len(buffer)  # the next read lands in the same buffer
    assert chunks == [(1, b"fi"), (1, b"rst"), (2, b"second")]
    assert all(type(data) is bytes for _, data in chunks)


async def _pair() -> tuple[MuxProtocol, MuxProtocol, list[tuple[int, bytes]], list[object]]:
    loop = asyncio.get_running_loop()
    a, b = socket.socketpair()
    left, right = MuxProtocol(serving=False), MuxProtocol(serving=False)
    received: list[tuple[int, bytes]] = []
    lost: list[object] = []
    for conn in (1, 2):
        right.attach(conn, lambda d, c=conn: received.append((c, d)), lost.append)
    await loop.create_unix_connection(lambda: left, sock=a)
    await loop.create_unix_connection(lambda: right, sock=b)
    return left, right, received, lost


async def test_protocol_routes_connections_and_reports_loss() -> None:
    left, right, received, lost = await _pair()
    left.sender(2)(b"to-runtime")
    left.sender(1)(b"to-plugin" * 1000)
    left.sender(7)(b"nobody listens")  # dropped, as the Go multiplexer does
    left.sender(1)(b"!")
    while sum(len(d) for _, d in received) < len(b"to-runtime") + 9000 + 1:
        await asyncio.sleep(0.001)
    by_conn: dict[int, bytearray] = {}
    _collect(received, by_conn)
    assert by_conn == {2: bytearray(b"to-runtime"), 1: bytearray(b"to-plugin" * 1000 + b"!")}
    left.close()
    assert await asyncio.wait_for(right.lost, 5) is None
    assert lost == [None, None]
    with pytest.raises(ConnectionResetError):
        left.sender(1)(b"late")


async def test_protocol_error_closes_the_socket_and_tells_every_connection() -> None:
    left, right, received, lost = await _pair()
    left.write_raw(b"\0\0\0\1\xff\xff\xff\xff")
    error = await asyncio.wait_for(right.lost, 5)
    assert isinstance(error, MuxError)
    assert lost == [error, error]
    assert received == []
    await asyncio.wait_for(left.lost, 5)


def test_header_size_is_eight() -> None:
    assert HEADER_SIZE == 8
