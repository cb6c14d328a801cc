"""A protobuf message's encoding cut into runs of whole fields, for a reader that decodes
a huge message a run at a time with the event loop free in between, where protobuf
would decode it in one C call that keeps the GIL: a CreateContainer of 4 MiB of
one-byte env entries is 1.3 million fields, 47 ms in one call (protobuf builds each
element at 30-40 ns), and 1,000 of them 0.05 ms.

An encoding is its fields one after the other, and decoding two runs of them in turn
reads as decoding the whole: a repeated field's elements append, a singular field's
later occurrence wins, a message field's occurrences merge (protobuf's rule, which
lets a message be built by concatenating encodings). A reader that takes the runs in
order and keeps to the same rules reads what one decode would.

The cut reads each field's tag and length (varint tags; wire types 0 varint, 1
fixed64, 2 length-delimited, 5 fixed32, 3 and 4 the start and end of a group) in
Python, some 0.2 us a field: what a step bounded whatever the message costs. Bytes
that are not whole fields raise protobuf's DecodeError, as decoding them would: a field
number 0 where a field starts too (inside a group protobuf skips it, and so does the
cut); a string that is not UTF-8 is left to protobuf's decoding of the run.

Imports the standard library and protobuf only.
"""

from __future__ import annotations

from collections.abc import Iterator

from google.protobuf.message import DecodeError

RUN_FIELDS = 1_000
"""Fields in a run: 0.2-0.25 ms to cut, 0.05 ms for protobuf to decode, and at most as
many elements for the reader (1-2 us each where it keeps them: an annotation's key
and value read and stored)."""

RUN_BYTES = 128 * 1024
"""Bytes after which a run ends, at the end of the field that reaches them (a field
larger is a run of its own): 0.05-0.15 ms for protobuf to decode a run of a
Synchronize part, whose containers are some 3 KB each; at most two pods or containers
that hold the text of a key read and are decoded with their annotation map (128 KiB:
2-3 ms each, nri.convert.SYNC_MAP_BYTES)."""

MAX_GROUP_FIELDS = 1_000
"""Fields a group may hold, nested ones included: a field is never cut, so a group is
walked in one step (proto2's groups: no NRI message has one; protobuf skips it as an
unknown field). One that holds more is refused."""

MAX_GROUP_DEPTH = 100
"""Groups nested deeper are refused, as protobuf's decoder refuses them (its recursion
limit, 100)."""

_LENGTH_DELIMITED = 2
_START_GROUP = 3
_END_GROUP = 4
_FIXED_SIZE = {1: 8, 5: 4}


Encoding = bytes | memoryview
"""A message's encoding: bytes, or a view of some (no copy of a 4 MiB request)."""


def values(data: Encoding, numbers: frozenset[int], most: int) -> dict[int, list[memoryview]]:
    """Of the message `data`, the value of each occurrence of the length-delimited fields
    `numbers` (a message field's encoding), as views of `data`, by field number; the
    other fields skipped (one of `numbers` of another wire type too, as protobuf skips
    it). Its fields are walked in one go: a message of more than `most` is refused (a
    bound on that walk; a request of 2 fields padded to 4 MiB holds 2 million).
    Raises DecodeError as runs() does."""
    view = memoryview(data)
    found: dict[int, list[memoryview]] = {number: [] for number in numbers}
    pos, end, count = 0, len(data), 0
    while pos < end:
        tag, after = _varint(data, pos, end)
        if tag & 7 == _LENGTH_DELIMITED and tag >> 3 in found:
            length, start = _varint(data, after, end)
            pos = start + length
            found[tag >> 3].append(view[start:pos])
            count += 1
        else:
            pos, walked = _skip(data, pos, end, 0)
            count += walked
        if count > most:
            raise DecodeError(f"more than {most} fields, where this message has "
                              f"{len(numbers)} (not read)")
    if pos > end:
        raise DecodeError(f"a field runs {pos - end} bytes past the end of its message")
    return found


def runs(data: Encoding) -> Iterator[Encoding]:
    """`data`, a message's encoding, as runs of whole fields, in order (views of it,
    where it is a view): a run ends at RUN_FIELDS fields walked (a group's own
    counted, which can take it past) or at the field that reaches
    RUN_BYTES; nothing for an empty message. Raises DecodeError where a field is cut
    short or its tag is not one protobuf reads, or a group holds more than
    MAX_GROUP_FIELDS."""
    pos, start, end, count, most, size = 0, 0, len(data), 0, RUN_FIELDS, RUN_BYTES
    while pos < end:
        # the common field, inline: a one-byte tag of a length-delimited field (an env
        # entry, an annotation, a mount, a container of a Synchronize)
        if data[pos] & 0x87 == _LENGTH_DELIMITED and pos + 1 < end:
            length = data[pos + 1]
            if length < 0x80:
                pos += 2 + length
            else:
                length, pos = _varint(data, pos + 1, end)
                pos += length
            count += 1
        else:
            pos, walked = _skip(data, pos, end, 0)
            count += walked
        if count >= most or pos - start >= size:
            if pos > end:
                break
            yield data[start:pos]
            start, count = pos, 0
    if pos > end:
        raise DecodeError(f"a field runs {pos - end} bytes past the end of its message")
    if start < end:
        yield data[start:end]


def _skip(data: Encoding, pos: int, end: int, depth: int) -> tuple[int, int]:
    """Where the field at `pos` ends (it may be past `end`: the caller says so), and the
    fields walked: 1, and a group's fields (nested ones too; see MAX_GROUP_FIELDS)."""
    tag, pos = _varint(data, pos, end)
    number, wire_type = tag >> 3, tag & 7
    # Field number 0 is refused where a message's field starts; inside a group protobuf
    # (upb) skips it as any other, and so does this walk (the two views agree).
    if (number == 0 and not depth) or tag > 0xFFFFFFFF:
        raise DecodeError(f"invalid field tag {tag}")
    if wire_type == 0:
        return _varint(data, pos, end)[1], 1
    if wire_type == _LENGTH_DELIMITED:
        length, pos = _varint(data, pos, end)
        return pos + length, 1
    if wire_type in _FIXED_SIZE:
        return pos + _FIXED_SIZE[wire_type], 1
    if wire_type == _START_GROUP:
        if depth >= MAX_GROUP_DEPTH:
            raise DecodeError(f"groups nested more than {MAX_GROUP_DEPTH} deep")
        closing, walked = number << 3 | _END_GROUP, 1
        while True:
            if pos >= end:
                raise DecodeError(f"group {number} has no end")
            inner, after = _varint(data, pos, end)
            if inner == closing:
                return after, walked
            pos, inside = _skip(data, pos, end, depth + 1)
            walked += inside
            if walked > MAX_GROUP_FIELDS:
                raise DecodeError(f"group {number} holds more than {MAX_GROUP_FIELDS} "
                                  "fields (not read)")
    raise DecodeError(f"field {number}: wire type {wire_type} where a field starts")


def _varint(data: Encoding, pos: int, end: int) -> tuple[int, int]:
    """The varint at `pos` and where it ends (at most 10 bytes, as protobuf reads)."""
    value = shift = 0
    last = min(pos + 10, end)
    while pos < last:
        byte = data[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if byte < 0x80:
            return value, pos
        shift += 7
    raise DecodeError("a varint is cut short" if last == end else "a varint over 10 bytes")
