"""Fuzz target: the ttrpc codec (FrameDecoder) and a connection's protocol state
(Connection.receive), over arbitrary bytes and over valid frames cut anywhere.

Properties:
- whatever the bytes, the decoder returns Frames and OversizeFrames and a Connection one
  event per frame (RequestReceived, ResponseReceived, StreamError, FrameIgnored); no
  exception comes out (the library's own root, TtrpcError, is tolerated: none is raised
  on input today);
- it never holds more than one frame's worth of bytes: `buffered` stays below the header
  plus the message limit whatever arrives, and an oversize frame's payload is never kept;
- how the stream is cut into chunks changes nothing: the same frames, in order;
- decode(encode(frame)) == frame, for every frame and every split of the stream, and a
  request or response a Connection encodes is received with the same fields.
"""

from __future__ import annotations

from fuzz_inputs import chunked
from hypothesis import given
from hypothesis import strategies as st

from nri_accel.ttrpc import (
    HEADER_SIZE,
    Code,
    Connection,
    Frame,
    FrameDecoder,
    FrameIgnored,
    OversizeFrame,
    RequestReceived,
    ResponseReceived,
    StreamError,
    TtrpcError,
    encode_frame,
)

EVENTS = (RequestReceived, ResponseReceived, StreamError, FrameIgnored)
limit = st.one_of(st.integers(0, 64), st.just(4 << 20))
u32 = st.integers(0, 0xFFFFFFFF)
u8 = st.integers(0, 0xFF)


def frame_header(length: int, stream_id: int, ftype: int, flags: int) -> bytes:
    return length.to_bytes(4, "big") + stream_id.to_bytes(4, "big") + bytes((ftype, flags))


# Byte streams that look like ttrpc: headers with small, limit-sized and huge lengths
# followed by some payload, mixed with noise.
_piece = st.one_of(
    st.binary(max_size=40),
    st.builds(frame_header, st.one_of(st.integers(0, 80), u32), u32, u8, u8),
    st.builds(lambda sid, t, f, p: encode_frame(sid, t, p, f), u32, st.integers(1, 4), u8,
              st.binary(max_size=40)),
)
noisy_stream = st.lists(_piece, max_size=8).map(b"".join)


def feed_all(decoder: FrameDecoder, chunks: list[bytes], limit: int) -> list[object]:
    out: list[object] = []
    for chunk in chunks:
        out += decoder.feed(chunk)
        assert decoder.buffered < HEADER_SIZE + max(limit, 1)
    return out


@given(noisy_stream, limit, st.data())
def test_decoder_arbitrary_bytes(data: bytes, limit: int, draw: st.DataObject) -> None:
    whole = FrameDecoder(limit).feed(data)
    for f in whole:
        assert isinstance(f, Frame | OversizeFrame)
        if isinstance(f, Frame):
            assert len(f.payload) <= limit
        else:
            assert f.length > limit
    chunks = draw.draw(chunked(data))
    assert feed_all(FrameDecoder(limit), chunks, limit) == whole


@given(noisy_stream, limit, st.data())
def test_connection_arbitrary_bytes(data: bytes, limit: int, draw: st.DataObject) -> None:
    frames = FrameDecoder(limit).feed(data)
    conn = Connection(limit)
    events: list[object] = []
    try:
        for chunk in draw.draw(chunked(data)):
            events += conn.receive(chunk)
    except TtrpcError:
        return
    assert len(events) == len(frames)
    for event, frame in zip(events, frames, strict=True):
        assert isinstance(event, EVENTS)
        assert event.stream_id == frame.stream_id
        if isinstance(event, StreamError):
            assert isinstance(event.code, Code) and event.message


frame = st.builds(Frame, u32, u8, u8, st.binary(max_size=48))


@given(st.lists(frame, max_size=6))
def test_frames_split_at_every_offset(frames: list[Frame]) -> None:
    stream = b"".join(encode_frame(f.stream_id, f.type, f.payload, f.flags) for f in frames)
    assert FrameDecoder().feed(stream) == frames
    for cut in range(len(stream) + 1):
        decoder = FrameDecoder()
        got = decoder.feed(stream[:cut]) + decoder.feed(stream[cut:])
        assert got == frames
        assert decoder.buffered == 0


@given(st.lists(frame, max_size=6), st.integers(0, 32), st.data())
def test_oversize_frames_are_skipped_not_kept(frames: list[Frame], limit: int,
                                              draw: st.DataObject) -> None:
    stream = b"".join(frame_header(len(f.payload), f.stream_id, f.type, f.flags) + f.payload
                      for f in frames)
    expected = [f if len(f.payload) <= limit else
                OversizeFrame(f.stream_id, f.type, f.flags, len(f.payload)) for f in frames]
    got = feed_all(FrameDecoder(limit), draw.draw(chunked(stream)), limit)
    assert got == expected


text = st.text(st.characters(exclude_categories=("Cs",)), max_size=20)


@given(text, text, st.binary(max_size=64), st.integers(-(2**63), 2**63 - 1),  # int64
       st.lists(st.tuples(text, text), max_size=3), st.data())
def test_request_round_trip(service: str, method: str, payload: bytes, timeout: int,
                            metadata: list[tuple[str, str]], draw: st.DataObject) -> None:
    client, server = Connection(), Connection()
    sid, wire = client.request(service, method, payload, timeout_nano=timeout,
                               metadata=metadata)
    events = [e for c in draw.draw(chunked(wire)) for e in server.receive(c)]
    assert events == [RequestReceived(sid, service, method, payload, timeout,
                                      tuple(metadata))]


@given(u32, st.binary(max_size=64), st.sampled_from(list(Code)), text, st.data())
def test_response_round_trip(sid: int, payload: bytes, code: Code, message: str,
                             draw: st.DataObject) -> None:
    server, client = Connection(), Connection()
    wire = server.response(sid, payload, code=code, message=message)
    events = [e for c in draw.draw(chunked(wire)) for e in client.receive(c)]
    assert events == [ResponseReceived(sid, code, message, payload, ())]
