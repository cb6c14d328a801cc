"""nri.fields.runs: a message's encoding cut into runs of whole fields, which decoded one
after the other read as the whole (protobuf's merge), on real messages, on damaged and
arbitrary bytes (it refuses only what protobuf refuses), and in runs of 1 to 4 fields."""

from __future__ import annotations

from typing import Any

import pytest
from google.protobuf.empty_pb2 import Empty
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet
from hypothesis import given
from hypothesis import strategies as st

from nri_accel.nri import fields
from nri_accel.nri import nri_pb2 as pb
from nri_accel.nri.fields import runs, values

_text = st.text(max_size=6)


@st.composite
def _containers(draw: st.DrawFn) -> bytes:
    """Two Containers' encodings (nri_pb2, as the runtime writes one: a few of its fields
    of each wire type) joined, which reads as one Container (protobuf's merge), maybe an
    unknown group or fixed-size field between them."""
    return draw(_container()) + draw(st.sampled_from([
        b"",
        b"\xfb\x06\x08\x01\xfc\x06",  # field 111, a group holding a varint
        b"\xfb\x06\xfb\x06\xfc\x06\xfc\x06",  # a group in a group
        b"\xf9\x06" + b"\x00" * 8,  # field 111, fixed64
        b"\xfd\x06" + b"\x00" * 4,  # field 111, fixed32
        b"\xf8\x06\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01",  # a 10-byte varint
    ])) + draw(_container())


@st.composite
def _container(draw: st.DrawFn) -> bytes:
    ctr = pb.Container(id=draw(_text), name=draw(_text), env=draw(st.lists(_text, max_size=5)),
                       args=draw(st.lists(_text, max_size=2)),
                       pid=draw(st.integers(0, 2**32 - 1)),
                       annotations=draw(st.dictionaries(_text, _text, max_size=3)))
    for path in draw(st.lists(_text, max_size=3)):
        ctr.linux.devices.add(path=path, major=draw(st.integers(0, 300)))
    return ctr.SerializeToString()


def _merged(parts: list[bytes]) -> pb.Container:
    out = pb.Container()
    for part in parts:
        out.MergeFromString(part)
    return out


@given(_containers(), st.integers(1, 4))
def test_the_runs_join_to_the_encoding_and_decode_as_the_whole(data: bytes, most: int) -> None:
    with pytest.MonkeyPatch.context() as m:
        m.setattr(fields, "RUN_FIELDS", most)
        parts = list(runs(data))
    assert b"".join(parts) == data
    assert all(part for part in parts)
    whole = pb.Container.FromString(data)
    assert _merged(parts) == whole
    assert len(parts) == _expected_runs(data, most)


def _expected_runs(data: bytes, most: int) -> int:
    """The runs of `data` as protobuf counts its fields (an empty message's unknown
    fields): a run ends once `most` are walked, a group's own counted."""
    def walked(field: Any) -> int:
        return 1 + (sum(map(walked, field.data)) if field.wire_type == 3 else 0)

    count = ended = 0
    for field in UnknownFieldSet(Empty.FromString(data)):
        count += walked(field)
        if count >= most:
            ended, count = ended + 1, 0
    return ended + (count > 0)


@given(st.binary(max_size=64), st.integers(1, 3))
def test_it_refuses_only_bytes_protobuf_refuses(data: bytes, most: int) -> None:
    """Bytes the cut refuses do not decode; bytes it cuts decode, run by run, to the
    whole message exactly when the whole decodes."""
    with pytest.MonkeyPatch.context() as m:
        m.setattr(fields, "RUN_FIELDS", most)
        try:
            parts = list(runs(data))
        except DecodeError:
            with pytest.raises(DecodeError):
                pb.Container.FromString(data)
            return
    try:
        whole = pb.Container.FromString(data)
    except DecodeError:
        with pytest.raises(DecodeError):
            _merged(parts)
        return
    assert b"".join(parts) == data and _merged(parts) == whole


@pytest.mark.parametrize("data, error", [
    (b"\x0a\x05abc", "runs 2 bytes past the end"),  # a string cut short
    (b"\x08", "cut short"),  # a varint tag's value missing
    (b"\x08" + b"\xff" * 10 + b"\x01", "over 10 bytes"),
    (b"\x00\x01", "invalid field tag 0"),  # field 0
    (b"\x0e", "wire type 6"),
    (b"\x0c", "wire type 4"),  # the end of a group never started
    (b"\x0b\x08\x01", "group 1 has no end"),
    (b"\x0b" * 101 + b"\x0c" * 101, "nested more than 100 deep"),
    (b"\x0b" + b"\x10\x00" * 1000 + b"\x0c", "group 1 holds more than 1000 fields"),
    (b"\x0b\x13" + b"\x10\x00" * 999 + b"\x14\x0c", "group 1 holds more than 1000 fields"),
])
def test_bytes_that_are_not_whole_fields_are_refused_as_protobuf_refuses_them(
        data: bytes, error: str) -> None:
    with pytest.raises(DecodeError, match=error):
        list(runs(data))
    if "holds more than" in error:  # a bound of the cut's own: protobuf skips the group
        pb.Container.FromString(data)
    else:
        with pytest.raises(DecodeError):
            pb.Container.FromString(data)


def test_a_message_of_more_fields_than_values_may_walk_is_refused() -> None:
    # a CreateContainerRequest's pod and container, then 2 million one-byte fields: all
    # walked in one go, which took 4.9 s; refused at the 65th
    request = b"\x0a\x00\x12\x00" + b"\x18\x00" * 2_000_000
    with pytest.raises(DecodeError, match="more than 64 fields, where this message has 2"):
        values(request, frozenset((1, 2)), 64)
    found = values(request[:4 + 2 * 62], frozenset((1, 2)), 64)
    assert [bytes(v) for number in (1, 2) for v in found[number]] == [b"", b""]


def test_a_million_one_byte_entries_are_cut_into_runs_of_run_fields() -> None:
    # 4 MiB of env entries of one character: protobuf builds them in one call of ~47 ms
    data = b"\x42\x01A" * 1_000_000
    parts = list(runs(data))
    assert len(parts) == 1_000_000 // fields.RUN_FIELDS
    assert {len(p) for p in parts} == {3 * fields.RUN_FIELDS}
    assert list(pb.Container.FromString(parts[0]).env) == ["A"] * fields.RUN_FIELDS
