"""Every ttrpc frame of the real containerd NRI captures decodes as the Go side decoded it.

The captures (shared/nri-wire, see its README) hold the byte streams between
containerd 2.3.4 (ttrpc v1.2.8) and reference Go plugins, wrapped in the NRI
multiplexer; ttrpc_testing strips that wrapping. Our encoder must also produce the
very same bytes for each message, so what we send is what Go peers send.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from ttrpc_testing import capture_decoded, capture_names, capture_streams

from nri_accel.ttrpc import (
    Code,
    Connection,
    FrameDecoder,
    FrameType,
    RequestReceived,
    ResponseReceived,
    encode_frame,
    ttrpc_pb2,
)

CAPTURES = [
    "containerd-2.3.4-e2e",
    "create-devinj",
    "crio-1.36.3-failed-create",
    "crio-1.36.3-lifecycle",
    "crio-1.36.3-restart-sync",
    "lifecycle-all-events",
    "split-sync-1500-containers",
    "sync-300-containers",
]


def test_every_capture_is_covered(nri_wire_dir: Path) -> None:
    assert capture_names(nri_wire_dir) == CAPTURES


@pytest.mark.parametrize("name", CAPTURES)
def test_capture_frames_decode_like_the_go_side(nri_wire_dir: Path, name: str) -> None:
    streams = capture_streams(nri_wire_dir, name)
    expected = capture_decoded(nri_wire_dir, name)
    assert sorted(streams) == sorted(expected)
    for key, data in streams.items():
        frames = FrameDecoder().feed(data)
        events = Connection().receive(data)
        records = expected[key]
        assert len(frames) == len(events) == len(records), key
        for frame, event, rec in zip(frames, events, records, strict=True):
            where = (key, rec["ttrpc_stream_id"], rec["method"])
            assert frame.stream_id == event.stream_id == rec["ttrpc_stream_id"], where
            assert frame.flags == rec["ttrpc_flags"], where
            assert len(frame.payload) == rec["ttrpc_len"], where
            assert len(event.payload) == rec["payload_len"], where
            if rec["ttrpc_type"] == "request":
                assert frame.type == FrameType.REQUEST
                assert isinstance(event, RequestReceived), where
                assert (event.service, event.method) == (rec["service"], rec["method"])
                assert event.timeout_nano == rec["timeout_nano"], where
                assert ["=".join(kv) for kv in event.metadata] == (
                    [rec["metadata"]] if "metadata" in rec else []
                ), where
            else:
                assert frame.type == FrameType.RESPONSE
                assert isinstance(event, ResponseReceived), where
                assert rec["status"] == "<nil>"
                assert event.code == Code.OK


@pytest.mark.parametrize("name", CAPTURES)
def test_our_encoding_of_every_captured_message_is_byte_identical(
    nri_wire_dir: Path, name: str
) -> None:
    for key, data in capture_streams(nri_wire_dir, name).items():
        rebuilt = []
        for event in Connection().receive(data):
            if isinstance(event, RequestReceived):
                msg = ttrpc_pb2.Request(
                    service=event.service,
                    method=event.method,
                    payload=event.payload,
                    timeout_nano=event.timeout_nano,
                    metadata=[ttrpc_pb2.KeyValue(key=k, value=v) for k, v in event.metadata],
                )
                body = msg.SerializeToString()
                rebuilt.append(encode_frame(event.stream_id, FrameType.REQUEST, body))
            else:
                assert isinstance(event, ResponseReceived)
                rebuilt.append(Connection().response(event.stream_id, event.payload))
        assert b"".join(rebuilt) == data, key


def test_client_requests_match_go_client_bytes(nri_wire_dir: Path) -> None:
    # The plugin's RegisterPlugin call as the Go stub sent it, rebuilt with Connection.request.
    data = capture_streams(nri_wire_dir, "create-devinj")[(1, "plugin->runtime", 2)]
    (first, *_) = Connection().receive(data)
    assert isinstance(first, RequestReceived)
    sid, frame = Connection().request(
        first.service, first.method, first.payload, timeout_nano=first.timeout_nano
    )
    assert sid == first.stream_id == 1
    assert data.startswith(frame)
