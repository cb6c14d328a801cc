"""Fuzz target: the NRI connection multiplexer's sans-IO Demux over arbitrary bytes, and
encode() -> Demux over valid frames.

Properties:
- whatever the bytes, feed() returns (connection id, bytes) chunks or raises MuxError
  (a frame over the limit: the socket is then closed); nothing else comes out;
- how the stream is cut into reads changes nothing: each connection gets the same bytes,
  and a stream refused whole is refused however it is cut;
- what encode() frames for each connection comes out unchanged, in order, whatever the
  frame size and the cuts.
"""

from __future__ import annotations

from collections import defaultdict

from fuzz_inputs import chunked
from hypothesis import given
from hypothesis import strategies as st

from nri_accel.nri.mux import HEADER_SIZE, Demux, MuxError, encode

u32 = st.integers(0, 0xFFFFFFFF)
max_payload = st.one_of(st.integers(0, 64), st.just(10 + (4 << 20)))
_piece = st.one_of(
    st.binary(max_size=40),
    st.builds(lambda c, n: c.to_bytes(4, "big") + n.to_bytes(4, "big"),
              st.one_of(st.integers(0, 3), u32), st.one_of(st.integers(0, 80), u32)),
)
noisy_stream = st.lists(_piece, max_size=8).map(b"".join)


def per_connection(demux: Demux, chunks: list[bytes]) -> dict[int, bytes] | MuxError:
    out: dict[int, bytearray] = defaultdict(bytearray)
    try:
        for chunk in chunks:
            for conn, data in demux.feed(chunk):
                assert isinstance(conn, int) and isinstance(data, bytes) and data
                out[conn] += data
    except MuxError as exc:
        return exc
    return {c: bytes(b) for c, b in out.items()}


@given(noisy_stream, max_payload, st.data())
def test_demux_arbitrary_bytes(data: bytes, limit: int, draw: st.DataObject) -> None:
    whole = per_connection(Demux(limit), [data])
    cut = per_connection(Demux(limit), draw.draw(chunked(data)))
    if isinstance(whole, MuxError):
        assert isinstance(cut, MuxError)
        assert str(cut) == str(whole)
    else:
        assert cut == whole


@given(st.lists(st.tuples(st.integers(1, 3), st.binary(min_size=1, max_size=100)),
                max_size=6), st.integers(1, 32), st.data())
def test_encode_demux_round_trip(messages: list[tuple[int, bytes]], frame_size: int,
                                 draw: st.DataObject) -> None:
    stream = b"".join(encode(conn, data, frame_size) for conn, data in messages)
    assert len(stream) <= sum(len(d) + HEADER_SIZE * (1 + len(d) // frame_size)
                              for _, d in messages)
    expected: dict[int, bytes] = defaultdict(bytes)
    for conn, data in messages:
        expected[conn] += data
    assert per_connection(Demux(), draw.draw(chunked(stream))) == dict(expected)
