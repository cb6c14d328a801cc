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
from nri_accel.ttrpc import MAX_MESSAGE_SIZE


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
    data = encode(1, bytes(range(256)) * 64) + encode(1, b"next")  # 16 KiB in two frames
    assert len(list(frames(data))) == 3
    assert Demux().feed(data) == [(1, bytes(range(256)) * 64 + b"next")]


def test_encode_frames_a_message_as_the_go_writer_does() -> None:
    """Its first 4096 bytes, then the rest in one frame (containerd's ttrpc writes through
    a 4096-byte bufio.Writer), never a frame of 4096 bytes after another."""
    payload = random.Random(1).randbytes(3 * WRITE_FRAME_SIZE + 17)
    data = encode(2, payload)
    assert [length for _, length in frames(data)] == [WRITE_FRAME_SIZE, 2 * WRITE_FRAME_SIZE + 17]
    assert _reference(data) == {2: payload}
    assert [n for _, n in frames(encode(1, bytes(WRITE_FRAME_SIZE)))] == [WRITE_FRAME_SIZE]
    assert [n for _, n in frames(encode(1, bytes(WRITE_FRAME_SIZE + 1)))] == [WRITE_FRAME_SIZE, 1]
    assert encode(1, b"abc") == b"\0\0\0\1\0\0\0\3abc"


def test_encode_frames_the_captured_runtime_messages_byte_for_byte(nri_wire_dir: Path) -> None:
    """The runtime's own framing of its 1.17 MB Synchronize (a frame of 4096 bytes, one of
    the rest) and of every other message it sent, re-encoded from the ttrpc frames."""
    data = stream(nri_wire_dir, "sync-300-containers", 1, RUNTIME_TO_PLUGIN)
    for conn, joined in _reference(data).items():
        framed = b"".join(data[pos:pos + 8 + n] for pos, n in _frame_spans(data)
                          if data[pos:pos + 4] == conn.to_bytes(4, "big"))
        messages, pos = [], 0
        while pos < len(joined):  # its ttrpc frames: a 10-byte header, their length first
            end = pos + 10 + int.from_bytes(joined[pos:pos + 4], "big")
            messages.append(joined[pos:end])
            pos = end
        assert b"".join(encode(conn, m) for m in messages) == framed
    assert max(n for _, n in frames(data)) > 1_000_000


class GoPeerReader:
    """Stands for how containerd reads a logical connection of the mux: containerd/nri's
    pkg/net/multiplex queues each frame (at most 256 per connection, readQueueLen,
    else it closes the socket) and its Read fails with ENOMEM where a frame does not
    fit the buffer it reads into; containerd/ttrpc's channel reads a message's 10-byte
    header, then its payload into a buffer of the payload's size, through a 4096-byte
    bufio.Reader, which reads straight into the caller's buffer when its own is empty and
    the caller asks for 4096 bytes or more, and else reads a frame into its own."""

    QUEUE, BUFFER = 256, 4096

    def __init__(self, stream_bytes: bytes) -> None:
        self.frames = [stream_bytes[pos + 8:pos + 8 + n] for pos, n in _frame_spans(stream_bytes)]
        self.buffered = b""

    def _conn_read(self, capacity: int) -> bytes:
        frame = self.frames.pop(0)
        if capacity < len(frame):
            raise OSError(f"ENOMEM: a frame of {len(frame)} bytes read into {capacity}")
        return frame

    def _read_full(self, n: int) -> bytes:
        out = b""
        while len(out) < n:
            need = n - len(out)
            if not self.buffered:
                if need >= self.BUFFER:
                    out += self._conn_read(need)
                    continue
                self.buffered = self._conn_read(self.BUFFER)
            out, self.buffered = out + self.buffered[:need], self.buffered[need:]
        return out

    def messages(self) -> list[bytes]:
        out = []
        while self.frames or self.buffered:
            header = self._read_full(10)
            out.append(header + self._read_full(int.from_bytes(header[:4], "big")))
        return out


def _frame_spans(data: bytes) -> list[tuple[int, int]]:
    spans, pos = [], 0
    for _, length in frames(data):
        spans.append((pos, length))
        pos += 8 + length
    return spans


@pytest.mark.parametrize("size", [0, 1, 4085, 4086, 4087, 4096, 8181, 8182, 8183, 8192,
                                  65_536, 1_048_576, MAX_MESSAGE_SIZE])
def test_the_go_peer_reads_every_message_size_as_encode_frames_it(size: int) -> None:
    rng = random.Random(size)
    messages = [size.to_bytes(4, "big") + bytes(6) + rng.randbytes(size),
                (3).to_bytes(4, "big") + bytes(6) + b"end"]  # and one right after it
    data = b"".join(encode(1, m) for m in messages)
    assert len(list(frames(encode(1, messages[0])))) <= 2 < GoPeerReader.QUEUE
    assert GoPeerReader(data).messages() == messages


def test_the_go_peer_model_refuses_what_its_mux_refuses() -> None:
    """The model can fail: a frame of 4097 bytes read for a ttrpc header is ENOMEM."""
    message = (4087).to_bytes(4, "big") + bytes(6) + bytes(4087)
    with pytest.raises(OSError, match="ENOMEM"):
        GoPeerReader(encode(1, message, frame_size=4097)).messages()


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
