"""The sans-IO Connection: envelope encoding, peer rules, one event per frame."""

from __future__ import annotations

import struct

import pytest
from google.protobuf import any_pb2

from nri_accel.ttrpc import (
    MAX_MESSAGE_SIZE,
    Code,
    Connection,
    Flags,
    FrameIgnored,
    FrameType,
    RequestReceived,
    ResponseReceived,
    StreamError,
    TtrpcError,
    encode_frame,
    ttrpc_pb2,
)


def _renumbered(frame: bytes, stream_id: int) -> bytes:
    """`frame` with its header's stream id replaced."""
    return frame[:4] + struct.pack(">I", stream_id) + frame[8:]


def test_request_round_trip_keeps_every_field_and_metadata_order() -> None:
    client, server = Connection(), Connection()
    md = [("containerd-namespace-ttrpc", "k8s.io"), ("k", "1"), ("k", "2")]
    sid, frame = client.request(
        "svc.Svc", "Do", b"\x08\x01", timeout_nano=2_000_000_000, metadata=md
    )
    assert server.receive(frame) == [
        RequestReceived(sid, "svc.Svc", "Do", b"\x08\x01", 2_000_000_000, tuple(md))
    ]


def test_client_stream_ids_are_odd_and_increase_by_two() -> None:
    conn = Connection()
    assert [conn.request("s", "m", b"")[0] for _ in range(4)] == [1, 3, 5, 7]


def test_empty_ok_response_has_an_empty_payload() -> None:
    assert Connection().response(5) == b"\0\0\0\0" + b"\0\0\0\x05" + b"\x02\x00"


def test_ok_and_error_responses_decode() -> None:
    client, server = Connection(), Connection()
    ok = server.response(1, b"answer")
    err = server.response(3, code=Code.NOT_FOUND, message="no such container")
    assert client.receive(ok + err) == [
        ResponseReceived(1, Code.OK, "", b"answer", ()),
        ResponseReceived(3, Code.NOT_FOUND, "no such container", b"", ()),
    ]


def test_status_details_pass_through() -> None:
    detail = any_pb2.Any(type_url="type.example/x", value=b"\x01\x02")
    frame = Connection().response(1, code=Code.ABORTED, message="m", details=[detail])
    (event,) = Connection().receive(frame)
    assert event.details == (detail,)


def test_unknown_status_code_becomes_unknown_and_keeps_its_number() -> None:
    body = ttrpc_pb2.Response(status=ttrpc_pb2.Status(code=99, message="odd")).SerializeToString()
    (event,) = Connection().receive(encode_frame(1, FrameType.RESPONSE, body))
    assert event.code == Code.UNKNOWN
    assert event.message == "odd (status code 99)"


def test_malformed_request_is_refused_and_the_next_one_decodes() -> None:
    server = Connection()
    events = server.receive(
        encode_frame(1, FrameType.REQUEST, b"\xff\xff\xff")
        + _renumbered(Connection().request("s", "m", b"")[1], 3)
    )
    assert len(events) == 2
    assert isinstance(events[0], StreamError)
    assert (events[0].stream_id, events[0].frame_type, events[0].code) == (
        1, FrameType.REQUEST, Code.INVALID_ARGUMENT
    )
    assert "malformed ttrpc request" in events[0].message
    assert events[1] == RequestReceived(3, "s", "m", b"", 0, ())


def test_request_with_invalid_utf8_service_is_malformed() -> None:
    body = b"\x0a\x02\xff\xfe"  # field 1 (service, a proto3 string) = invalid UTF-8
    (event,) = Connection().receive(encode_frame(1, FrameType.REQUEST, body))
    assert isinstance(event, StreamError)
    assert event.code == Code.INVALID_ARGUMENT


def test_malformed_response_fails_that_stream_with_internal() -> None:
    (event,) = Connection().receive(encode_frame(7, FrameType.RESPONSE, b"\xff"))
    assert event == StreamError(7, FrameType.RESPONSE, Code.INTERNAL, event.message)
    assert "malformed ttrpc response" in event.message


def test_even_and_reused_request_stream_ids_are_refused() -> None:
    server = Connection()
    good = Connection().request("s", "m", b"")[1]  # stream 1
    (e_even,) = server.receive(_renumbered(good, 4))
    assert (e_even.stream_id, e_even.code) == (4, Code.INVALID_ARGUMENT)
    assert "odd" in e_even.message
    assert isinstance(server.receive(good)[0], RequestReceived)
    (e_again,) = server.receive(good)
    assert (e_again.stream_id, e_again.code) == (1, Code.INVALID_ARGUMENT)
    assert "re-used" in e_again.message


def test_streaming_request_is_unimplemented_and_data_frames_are_ignored() -> None:
    server = Connection()
    body = ttrpc_pb2.Request(service="s", method="m").SerializeToString()
    events = server.receive(
        encode_frame(1, FrameType.REQUEST, body, Flags.REMOTE_OPEN)
        + encode_frame(1, FrameType.DATA, b"chunk", Flags.REMOTE_CLOSED)
        + encode_frame(3, 9, b"?")
    )
    assert events[0] == StreamError(1, 1, Code.UNIMPLEMENTED, events[0].message)
    assert events[1] == FrameIgnored(1, FrameType.DATA, "stream data frames are not supported")
    assert events[2] == FrameIgnored(3, 9, "unknown frame type 9")


def test_oversize_frame_becomes_resource_exhausted_on_its_stream() -> None:
    server = Connection(max_message_size=16)
    events = server.receive(encode_frame(9, FrameType.REQUEST, b"x" * 17, max_message_size=17))
    assert events == [
        StreamError(
            9, 1, Code.RESOURCE_EXHAUSTED, "message length 17 exceeds maximum message size of 16"
        )
    ]


@pytest.mark.parametrize("size", [MAX_MESSAGE_SIZE, MAX_MESSAGE_SIZE + 1, 100 << 20])
def test_oversize_request_raises_and_keeps_stream_ids(size: int) -> None:
    # At the limit the payload fits and the body with its header fields does not; over
    # it the payload alone is refused, before any of it is copied into a message.
    conn = Connection()
    with pytest.raises(TtrpcError) as info:
        conn.request("svc", "Big", b"\0" * size)
    assert info.value.code == Code.RESOURCE_EXHAUSTED
    assert "svc/Big" in info.value.message
    assert conn.request("svc", "Small", b"")[0] == 1


def test_oversize_response_raises() -> None:
    with pytest.raises(TtrpcError) as info:
        Connection().response(3, b"\0" * MAX_MESSAGE_SIZE)
    assert info.value.code == Code.RESOURCE_EXHAUSTED
    assert "stream 3" in info.value.message


def test_events_do_not_depend_on_how_the_bytes_are_split() -> None:
    client = Connection()
    stream = b"".join(
        [
            client.request("a", "b", b"p" * 10, timeout_nano=5, metadata=[("k", "v")])[1],
            encode_frame(3, FrameType.REQUEST, b"\xff"),
            encode_frame(5, FrameType.REQUEST, b"q" * 40),  # over the 32-byte limit below
            Connection().response(7, code=Code.INTERNAL, message="x"),
            _renumbered(client.request("c", "d", b"")[1], 9),
        ]
    )
    whole = Connection(32).receive(stream)
    assert [type(e).__name__ for e in whole] == [
        "RequestReceived", "StreamError", "StreamError", "ResponseReceived", "RequestReceived"
    ]
    for cut in range(len(stream) + 1):
        conn = Connection(32)
        assert conn.receive(stream[:cut]) + conn.receive(stream[cut:]) == whole, cut
