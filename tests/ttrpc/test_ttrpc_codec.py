"""The sans-IO frame codec: header layout, incremental decoding, the 4 MiB limit."""

from __future__ import annotations

import random
import struct

import pytest

from nri_accel.ttrpc import (
    HEADER_SIZE,
    MAX_MESSAGE_SIZE,
    Code,
    Frame,
    FrameDecoder,
    FrameType,
    OversizeFrame,
    TtrpcError,
    encode_frame,
)


def _decode_all(chunks, max_message_size: int = MAX_MESSAGE_SIZE) -> list:
    decoder = FrameDecoder(max_message_size)
    out = []
    for chunk in chunks:
        out.extend(decoder.feed(chunk))
    assert decoder.buffered == 0
    return out


def test_header_layout_is_big_endian_length_stream_type_flags() -> None:
    frame = encode_frame(0x01020304, FrameType.RESPONSE, b"abc", flags=0x05)
    assert frame == b"\x00\x00\x00\x03" + b"\x01\x02\x03\x04" + b"\x02" + b"\x05" + b"abc"
    assert len(frame) == HEADER_SIZE + 3


def test_round_trip_of_every_type_flags_and_empty_payload() -> None:
    frames = [
        Frame(1, 1, 0, b"request"),
        Frame(1, 2, 0, b""),
        Frame(3, 3, 4, b""),
        Frame(5, 3, 1, bytes(range(256))),
        Frame(0xFFFFFFFF, 0xFF, 0xFF, b"x"),
    ]
    stream = b"".join(encode_frame(f.stream_id, f.type, f.payload, f.flags) for f in frames)
    assert _decode_all([stream]) == frames


def _mixed_stream() -> tuple[bytes, list]:
    """Frames of several kinds, an oversize one (limit 64) among them, then a normal one."""
    big = b"\xab" * 100
    parts = [
        (encode_frame(1, 1, b"first"), Frame(1, 1, 0, b"first")),
        (encode_frame(3, 1, b""), Frame(3, 1, 0, b"")),
        (
            struct.pack(">IIBB", len(big), 5, 1, 0) + big,
            OversizeFrame(5, 1, 0, len(big)),
        ),
        (encode_frame(7, 2, b"y" * 64), Frame(7, 2, 0, b"y" * 64)),
        (struct.pack(">IIBB", 65, 9, 2, 0) + b"z" * 65, OversizeFrame(9, 2, 0, 65)),
        (encode_frame(11, 1, b"last"), Frame(11, 1, 0, b"last")),
    ]
    return b"".join(p[0] for p in parts), [p[1] for p in parts]


def test_split_at_every_offset_gives_the_same_frames() -> None:
    stream, expected = _mixed_stream()
    assert _decode_all([stream], 64) == expected
    for cut in range(len(stream) + 1):
        assert _decode_all([stream[:cut], stream[cut:]], 64) == expected, f"cut at {cut}"


def test_byte_by_byte_and_random_chunks_give_the_same_frames() -> None:
    stream, expected = _mixed_stream()
    assert _decode_all([stream[i : i + 1] for i in range(len(stream))], 64) == expected
    rng = random.Random(7)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(stream)), 5))
        chunks = [stream[a:b] for a, b in zip([0, *cuts], [*cuts, len(stream)], strict=True)]
        assert _decode_all(chunks, 64) == expected


def test_several_frames_in_one_chunk_and_bytes_like_input() -> None:
    stream, expected = _mixed_stream()
    assert _decode_all([bytearray(stream)], 64) == expected
    assert _decode_all([memoryview(stream)], 64) == expected


def test_oversize_frame_at_the_real_limit_is_reported_skipped_and_never_buffered() -> None:
    decoder = FrameDecoder()
    header = struct.pack(">IIBB", MAX_MESSAGE_SIZE + 1, 41, FrameType.REQUEST, 0)
    events = decoder.feed(header)
    assert events == [OversizeFrame(41, 1, 0, MAX_MESSAGE_SIZE + 1)]
    chunk = b"\0" * 65536
    remaining = MAX_MESSAGE_SIZE + 1
    while remaining > len(chunk):
        assert decoder.feed(chunk) == []
        assert decoder.buffered == 0
        remaining -= len(chunk)
    tail = encode_frame(43, FrameType.REQUEST, b"next")
    assert decoder.feed(b"\0" * remaining + tail) == [Frame(43, 1, 0, b"next")]
    assert decoder.buffered == 0


def test_a_frame_of_exactly_the_limit_is_accepted() -> None:
    payload = b"\x01" * MAX_MESSAGE_SIZE
    frame = encode_frame(1, FrameType.RESPONSE, payload)
    assert _decode_all([frame[:5], frame[5:1000], frame[1000:]]) == [Frame(1, 2, 0, payload)]


def test_truncated_input_is_held_until_complete() -> None:
    frame = encode_frame(1, FrameType.REQUEST, b"payload")
    decoder = FrameDecoder()
    assert decoder.feed(frame[:4]) == []
    assert decoder.buffered == 4
    assert decoder.feed(frame[4:-1]) == []
    assert decoder.buffered == len(frame) - 1
    assert decoder.feed(frame[-1:]) == [Frame(1, 1, 0, b"payload")]
    assert decoder.buffered == 0


def test_garbage_bytes_are_framed_not_judged() -> None:
    # The frame layer has no invalid header: an unknown type is still a frame, which
    # the protocol layer ignores; the bytes after it still decode.
    stream = encode_frame(1, 0x7F, b"\xff\xfe") + encode_frame(3, 1, b"ok")
    assert _decode_all([stream]) == [Frame(1, 0x7F, 0, b"\xff\xfe"), Frame(3, 1, 0, b"ok")]


def test_encoding_over_the_limit_raises_before_producing_anything() -> None:
    with pytest.raises(TtrpcError) as info:
        encode_frame(1, FrameType.REQUEST, b"\0" * (MAX_MESSAGE_SIZE + 1))
    assert info.value.code == Code.RESOURCE_EXHAUSTED
    assert str(MAX_MESSAGE_SIZE + 1) in info.value.message
    assert str(MAX_MESSAGE_SIZE) in info.value.message


@pytest.mark.parametrize(
    ("stream_id", "ftype", "flags"), [(-1, 1, 0), (1 << 32, 1, 0), (1, 256, 0), (1, 1, -1)]
)
def test_header_fields_out_of_range_are_refused(stream_id: int, ftype: int, flags: int) -> None:
    with pytest.raises(ValueError, match="out of range"):
        encode_frame(stream_id, ftype, b"", flags)


@pytest.mark.parametrize("size", [7, 40, 1000])
def test_views_of_a_reused_read_buffer_are_copied_not_aliased(size: int) -> None:
    # A BufferedProtocol hands the decoder views of one buffer it overwrites on each read.
    stream, expected = _mixed_stream()
    decoder = FrameDecoder(64)
    buffer = bytearray(size)
    out = []
    for i in range(0, len(stream), size):
        chunk = stream[i : i + size]
        buffer[: len(chunk)] = chunk
        out.extend(decoder.feed(memoryview(buffer)[: len(chunk)]))
        buffer[:] = b"\xee" * len(buffer)
    assert out == expected
