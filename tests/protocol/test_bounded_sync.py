"""Synchronize parts over convert.SYNC_MAP_BYTES: decoded bare (the pods' and containers'
annotations left undecoded), and read by convert.synced() to the same result as the map
view gives, on any pods and containers, and on damaged bytes the map view accepts."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from google.protobuf.message import DecodeError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from steps import counted, finished

from nri_accel.nri import convert, fields
from nri_accel.nri import nri_pb2 as pb
from nri_accel.nri import nri_views_pb2 as views
from nri_accel.nri.fields import RUN_FIELDS
from nri_accel.nri.stub import Identity, Stub
from nri_accel.ttrpc import Code, TtrpcError

GRANTED, SHARED = "nri-accel.io/granted", "nri-accel.io/shared"
KEYS = (GRANTED, SHARED)
METADATA = '{"name": "from-crio"}'

_key = st.sampled_from([GRANTED, SHARED, convert.CRIO_METADATA, "nri-accel.io/", "a",
                        "nri-accel.io/grantedx", "io.kubernetes.pod.name"]) | st.text(max_size=12)
_value = st.sampled_from(["", "v", METADATA, GRANTED]) | st.text(max_size=12)
_annotations = st.lists(st.tuples(_key, _value), max_size=6)
_names = st.sampled_from(["", "c0", "ctr"])


@st.composite
def _parts(draw: Any) -> bytes:
    """A SynchronizeRequest as the runtime encodes it (nri_pb2), of a few pods and
    containers; map entries written as entries so that a key may come twice."""
    req = pb.SynchronizeRequest(more=draw(st.booleans()))
    for i in range(draw(st.integers(0, 3))):
        req.pods.add(id=f"p{i}", name=f"pod{i}", uid=f"u{i}", namespace="ns")
    for i in range(draw(st.integers(0, 4))):
        req.containers.add(id=f"c{i}", pod_sandbox_id=f"p{i % 2}", name=draw(_names),
                           state=draw(st.sampled_from([pb.CONTAINER_RUNNING,
                                                       pb.CONTAINER_STOPPED])),
                           env=["A=1"], args=["sleep"])
    payload = bytearray()
    # fields 1 (pods) and 2 (containers), each followed by its annotations (field 6)
    for number, items in ((1, req.pods), (2, req.containers)):
        for item in items:
            body = bytearray(item.SerializeToString())
            for k, v in draw(_annotations):
                entry = pb.PodSandbox.AnnotationsEntry(key=k, value=v).SerializeToString()
                body += b"\x32" + _varint(len(entry)) + entry
            payload += bytes([number << 3 | 2]) + _varint(len(body)) + body
    return bytes(payload) + (b"\x18\x01" if req.more else b"")


def _varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append(n & 0x7F | 0x80)
        n >>= 7
    return bytes(out + bytes([n]))


def _read(req: Any, ids: set[str] | None) -> Any:
    return finished(convert.synced(req.pods, req.containers, KEYS, ids)), req.more


def _through_the_map(payload: bytes, ids: set[str] | None) -> Any:
    return _read(views.SynchronizeRequest.FromString(payload), ids)


def _bounded(payload: bytes, ids: set[str] | None, monkeypatch: pytest.MonkeyPatch,
             map_bytes: int) -> Any:
    with monkeypatch.context() as m:
        m.setattr(convert, "SYNC_MAP_BYTES", map_bytes)
        return _read(views.BareSynchronizeRequest.FromString(payload), ids)


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=_parts(), ids=st.none() | st.sets(st.sampled_from(["c0", "c3", "x"])),
       damage=st.none() | st.tuples(st.integers(0, 10_000), st.integers(0, 255)),
       cut=st.none() | st.integers(0, 10_000))
def test_the_bare_view_reads_as_the_map_view(monkeypatch: pytest.MonkeyPatch, payload: bytes,
                                             ids: set[str] | None, damage: Any,
                                             cut: int | None) -> None:
    data = bytearray(payload)
    if damage is not None and data:
        data[damage[0] % len(data)] = damage[1]
    if cut is not None:
        data = data[:cut]
    data_bytes = bytes(data)
    try:
        expected = _through_the_map(data_bytes, ids)
    except DecodeError:
        return  # refused by the map view: the bare one may skip the damage it holds
    # the part bare; the annotations of a pod or container that holds a key read as
    # entries (over SYNC_MAP_BYTES = 0), or as a map (up to 1 MiB)
    for map_bytes in (0, 1 << 20):
        assert _bounded(data_bytes, ids, monkeypatch, map_bytes) == expected


class _Keeper:
    """A plugin keeping of a Synchronize what nri.convert.synced() keeps (the daemon's
    keep_synchronized), recording what synchronize() gets."""

    request_decoders = {"Synchronize": convert.decode_synchronize}

    def __init__(self) -> None:
        self.got: list[Any] = []

    def keep_synchronized(self, pods: Any, containers: Any) -> Any:
        return convert.synced(pods, containers, KEYS)

    def synchronize(self, pods: list[Any], containers: list[Any]) -> None:
        self.got.append((pods, containers))

    def create_container(self, pod: Any, container: Any) -> None:
        return None  # a plugin subscribes to one event at least


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(payload=_parts(), most=st.integers(1, 3), size=st.sampled_from([1, 64, 1 << 20]),
       damage=st.none() | st.tuples(st.integers(0, 10_000), st.integers(0, 255)))
def test_a_part_taken_a_run_of_fields_at_a_time_reads_as_the_whole(
        monkeypatch: pytest.MonkeyPatch, payload: bytes, most: int, size: int,
        damage: Any) -> None:
    """The stub decodes a part a run of fields at a time (nri.fields.runs), the loop free
    in between: the pods and containers kept, and whether more parts follow, are those
    of the whole part; a part the whole decoding refuses is refused, INVALID_ARGUMENT."""
    data = bytearray(payload)
    if damage is not None and data:
        data[damage[0] % len(data)] = damage[1]
    part = bytes(data)
    try:
        whole = convert.decode_synchronize(part)
    except DecodeError:
        whole = None
    plugin = _Keeper()
    stub = Stub(plugin, Identity("keeper", "50"), socket_path="/nonexistent")
    with monkeypatch.context() as m:
        m.setattr(fields, "RUN_FIELDS", most)
        m.setattr(fields, "RUN_BYTES", size)
        try:
            answer = asyncio.run(stub._synchronize(None, part))
        except TtrpcError as err:
            assert err.code == Code.INVALID_ARGUMENT
            assert err.message.startswith("malformed SynchronizeRequest: ")
            assert whole is None
            return
    assert whole is not None
    more = pb.SynchronizeResponse.FromString(answer).more
    assert more == whole.more
    assert plugin.got == ([] if more else [finished(convert.synced(
        whole.pods, whole.containers, KEYS))])


def test_a_part_over_sync_map_bytes_is_decoded_bare() -> None:
    def part(filler: int) -> bytes:
        pod = pb.PodSandbox(id="p", name="p", annotations={"filler": "x" * filler,
                                                           GRANTED: "nvidia.com/gpu=0"})
        ctr = pb.Container(id="c", pod_sandbox_id="p", name="c",
                           annotations={SHARED: "nvidia.com/gpu=1"})
        return pb.SynchronizeRequest(pods=[pod], containers=[ctr]).SerializeToString()

    size = convert.SYNC_MAP_BYTES
    at_limit = next(part(n) for n in range(size - 400, size) if len(part(n)) == size)
    over = part(at_limit.count(b"x") + 1)
    assert len(over) == size + 1
    small, large = convert.decode_synchronize(at_limit), convert.decode_synchronize(over)
    assert not convert.is_bare(small.pods[0]) and not convert.is_bare(small.containers[0])
    assert convert.is_bare(large.pods[0]) and convert.is_bare(large.containers[0])
    assert convert.REQUEST_DECODERS["Synchronize"] is convert.decode_synchronize
    pods, containers = finished(convert.synced(large.pods, large.containers, KEYS))
    assert [dict(p.annotations) for p in pods] == [{GRANTED: "nvidia.com/gpu=0"}]
    assert [dict(c.annotations) for c in containers] == [{SHARED: "nvidia.com/gpu=1"}]


def test_a_container_with_huge_annotations_comes_bare_and_keeps_its_grant() -> None:
    # 200,000 annotations: decoded as a map, 300-500 ms in one call; read entry by
    # entry, 60-100 ms: a run of RUN_FIELDS fields a step, the loop free between steps
    ctr = pb.Container(id="c", pod_sandbox_id="p", state=pb.CONTAINER_RUNNING,
                       annotations={f"k{i}": "v" for i in range(200_000)})
    ctr.annotations[GRANTED] = "nvidia.com/gpu=0"
    ctr.annotations[convert.CRIO_METADATA] = METADATA  # no NRI name: CRI-O's is read
    other = pb.Container(id="d", pod_sandbox_id="p", name="d",
                         annotations={f"k{i}": "v" for i in range(200_000)})
    payload = pb.SynchronizeRequest(containers=[ctr, other]).SerializeToString()
    req = convert.decode_synchronize(payload)
    assert [type(c) for c in req.containers] == [views.BareSyncedContainer] * 2
    (_, kept), steps = counted(convert.synced(req.pods, req.containers, KEYS, ids=set()))
    assert kept == [convert.SyncedContainer("c", "p", "from-crio", pb.CONTAINER_RUNNING,
                                            {GRANTED: "nvidia.com/gpu=0"})]
    # `other` holds no key synced() reads: its annotations are not decoded, no step
    fields = len(ctr.annotations) + 3  # and its id, pod_sandbox_id and state
    assert steps == -(-fields // RUN_FIELDS) == 201


def test_an_entry_with_an_unknown_field_is_set_aside_as_the_map_does() -> None:
    odd = b"\n\x14" + GRANTED.encode() + b"\x12\x01x\xd8\x01\x20"  # field 27 in the entry
    plain = pb.PodSandbox.AnnotationsEntry(key=GRANTED, value="y").SerializeToString()
    body = pb.Container(id="c", name="c").SerializeToString()
    for entry in (plain, odd):
        body += b"\x32" + bytes([len(entry)]) + entry
    payload = b"\x12" + _varint(len(body)) + body
    expected = finished(convert.synced(
        [], views.SynchronizeRequest.FromString(payload).containers, KEYS))
    assert [dict(c.annotations) for c in expected[1]] == [{GRANTED: "y"}]
    bare = views.BareSynchronizeRequest.FromString(payload).containers
    for map_bytes in (0, 1 << 20):
        with pytest.MonkeyPatch.context() as m:
            m.setattr(convert, "SYNC_MAP_BYTES", map_bytes)
            assert finished(convert.synced([], bare, KEYS)) == expected
