"""Every frame of the real containerd captures decodes through our mux, ttrpc and nri_pb2.

Both directions are checked: what the runtime sends must decode to the type the Go
side named, with no field our api/nri.proto does not know (a missing or renumbered
field would show up as an unknown field); what the Go plugins sent is the reference
for what our own encoder must produce.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from google.protobuf import unknown_fields
from wire import (
    CAPTURES,
    PLUGIN_TO_RUNTIME,
    RUNTIME_TO_PLUGIN,
    decoded,
    payload_type,
    relay_conns,
    stream,
)

from nri_accel.nri import nri_pb2 as pb
from nri_accel.nri.mux import Demux
from nri_accel.ttrpc import Frame, FrameDecoder, FrameType, ttrpc_pb2


def messages(data: bytes) -> list[tuple[int, Frame]]:
    """(mux conn, ttrpc frame) of a whole captured stream, via Demux and FrameDecoder."""
    decoders: dict[int, FrameDecoder] = {}
    out = []
    for conn, chunk in Demux().feed(data):
        for frame in decoders.setdefault(conn, FrameDecoder()).feed(chunk):
            assert isinstance(frame, Frame)
            out.append((conn, frame))
    assert all(d.buffered == 0 for d in decoders.values()), "stream ends inside a frame"
    return out


def nri_payload(frame: Frame) -> bytes:
    if frame.type == FrameType.REQUEST:
        return ttrpc_pb2.Request.FromString(frame.payload).payload
    response = ttrpc_pb2.Response.FromString(frame.payload)
    assert not response.HasField("status"), response.status
    return response.payload


def unknown_field_paths(msg: Any, path: str = "") -> list[str]:
    """Where `msg` (recursively) holds fields api/nri.proto does not define."""
    found = [f"{path}#{f.field_number}" for f in unknown_fields.UnknownFieldSet(msg)]
    for fd, value in msg.ListFields():
        if fd.message_type is None:
            continue
        if fd.message_type.GetOptions().map_entry:
            if fd.message_type.fields_by_name["value"].message_type is not None:
                for key, item in value.items():
                    found += unknown_field_paths(item, f"{path}.{fd.name}[{key}]")
        elif fd.is_repeated:
            for i, item in enumerate(value):
                found += unknown_field_paths(item, f"{path}.{fd.name}[{i}]")
        else:
            found += unknown_field_paths(value, f"{path}.{fd.name}")
    return found


def has_map_entries(msg: Any) -> bool:
    for fd, value in msg.ListFields():
        if fd.message_type is None:
            continue
        if fd.message_type.GetOptions().map_entry:
            return True
        items = value if fd.is_repeated else [value]
        if any(has_map_entries(item) for item in items):
            return True
    return False


def decoded_frames(wire_dir: Path, capture: str):
    """(Go's record, our frame, our nri payload) for every ttrpc message of a capture."""
    ours = {}
    for relay in relay_conns(wire_dir, capture):
        for direction in (RUNTIME_TO_PLUGIN, PLUGIN_TO_RUNTIME):
            for conn, frame in messages(stream(wire_dir, capture, relay, direction)):
                key = (relay, direction, conn, frame.stream_id, frame.type)
                assert key not in ours
                ours[key] = frame
    records = decoded(wire_dir, capture)
    assert len(records) == len(ours)
    for rec in records:
        ftype = FrameType.REQUEST if rec["ttrpc_type"] == "request" else FrameType.RESPONSE
        frame = ours[(rec["conn"], rec["dir"], rec["mux_conn_id"], rec["ttrpc_stream_id"], ftype)]
        assert len(frame.payload) == rec["ttrpc_len"]
        yield rec, frame, nri_payload(frame)


@pytest.mark.parametrize("capture", CAPTURES)
def test_every_message_decodes_to_the_type_go_named_with_no_unknown_field(
    nri_wire_dir: Path, capture: str
) -> None:
    seen = 0
    for rec, frame, payload in decoded_frames(nri_wire_dir, capture):
        if frame.type == FrameType.REQUEST:
            envelope = ttrpc_pb2.Request.FromString(frame.payload)
            assert (envelope.service, envelope.method) == (rec["service"], rec["method"])
            assert envelope.timeout_nano == rec["timeout_nano"]
        msg = getattr(pb, payload_type(rec)).FromString(payload)
        assert len(payload) == rec["payload_len"]
        assert unknown_field_paths(msg) == [], (rec["method"], payload_type(rec))
        seen += 1
    assert seen > 0


@pytest.mark.parametrize("capture", CAPTURES)
def test_our_encoding_matches_go(nri_wire_dir: Path, capture: str) -> None:
    """Byte-identical where Go's encoding is canonical (no maps: Go writes map entries in
    random order); with maps, the same size and the same message."""
    for rec, _, payload in decoded_frames(nri_wire_dir, capture):
        msg_type = getattr(pb, payload_type(rec))
        msg = msg_type.FromString(payload)
        ours = msg.SerializeToString(deterministic=True)
        if has_map_entries(msg):
            assert len(ours) == len(payload) and msg_type.FromString(ours) == msg
        else:
            assert ours == payload, (rec["method"], payload_type(rec))


def test_the_captures_show_what_the_docs_say(nri_wire_dir: Path) -> None:
    """Facts the stub and the simulator rely on, read off the real runtime."""
    recs = decoded(nri_wire_dir, "containerd-2.3.4-e2e")
    by_method = {r["method"]: r for r in recs if r["ttrpc_type"] == "request"}
    configure = pb.ConfigureRequest.FromString(
        next(p for r, _, p in decoded_frames(nri_wire_dir, "containerd-2.3.4-e2e")
             if r["method"] == "Configure" and r["ttrpc_type"] == "request"))
    assert (configure.runtime_name, configure.NRI_version) == ("containerd", "v0.12.0")
    assert (configure.registration_timeout, configure.request_timeout) == (5000, 2000)
    assert by_method["Configure"]["mux_conn_id"] == 1
    assert by_method["RegisterPlugin"]["mux_conn_id"] == 2
    assert by_method["CreateContainer"]["metadata"] == "containerd-namespace-ttrpc=k8s.io"
    assert 1.5e9 < by_method["CreateContainer"]["timeout_nano"] <= 2e9
