"""Fuzz target: the shared readers of discovery, ld.so.cache (discover/ldcache.py) and
ELF (discover/elf.py), over arbitrary bytes and over files that are nearly right.

Inputs: arbitrary bytes; caches with a real magic (new format, old format, old followed
by new) and random counts, offsets, flags and string tables; ELF files with a real
identification, random header fields (huge offsets and counts included), program
headers and a dynamic section.

Properties:
- parse_ld_so_cache returns entries or raises LdCacheError, its documented error;
- a Locator over a driver root holding those bytes as /etc/ld.so.cache never raises:
  an unreadable cache is a Problem, and lookups through whatever entries it read answer
  a path inside the root or None;
- read_elf answers an ElfInfo or None, never raises, and soname_of() a plain name.
"""

from __future__ import annotations

import shutil
import struct
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nri_accel.discover.elf import ElfInfo, read_elf
from nri_accel.discover.hostroot import HostRoot
from nri_accel.discover.ldcache import (
    ARCHES,
    FLAG_ELF_LIBC6,
    FLAG_X8664_LIB64,
    CacheEntry,
    LdCacheError,
    Locator,
    parse_ld_so_cache,
)

NEW_MAGIC = b"glibc-ld.so.cache1.1"
OLD_MAGIC = b"ld.so-1.7.0\0"
u32 = st.one_of(st.integers(0, 300), st.integers(0, 2**32 - 1))
flags = st.one_of(st.just(FLAG_ELF_LIBC6 | FLAG_X8664_LIB64), st.integers(-(2**31), 2**31 - 1))
names = st.sampled_from((b"libcuda.so.1", b"libnvidia-ml.so.1", b"/usr/lib/libcuda.so.1",
                         b"/lib/x86_64-linux-gnu/libcuda.so.550.54.15", b"../../etc/shadow",
                         b"/loop", b"", b"\xff\xfe", b"a" * 5000))


@st.composite
def new_cache(draw: st.DrawFn) -> bytes:
    strings = draw(st.lists(names, max_size=4))
    table = b"".join(s + b"\0" for s in strings)
    n = draw(st.integers(0, 4))
    header_size = 48
    first_string = header_size + 24 * n
    offsets = [first_string + sum(len(s) + 1 for s in strings[:i]) for i in range(len(strings))]
    offset = st.one_of(st.sampled_from(offsets or [0]), u32)
    nlibs = draw(st.one_of(st.just(n), u32))
    header = struct.pack("<20sIIB3xI12x", NEW_MAGIC, nlibs, len(table),
                         draw(st.sampled_from((0, 1, 2, 3))), 0)
    entries = b"".join(struct.pack("<iIIIQ", draw(flags), draw(offset), draw(offset), 0, 0)
                       for _ in range(n))
    return header + entries + table + draw(st.binary(max_size=8))


@st.composite
def old_cache(draw: st.DrawFn) -> bytes:
    strings = draw(st.lists(names, max_size=4))
    table = b"".join(s + b"\0" for s in strings)
    n = draw(st.integers(0, 4))
    nlibs = draw(st.one_of(st.just(n), u32))
    offset = st.one_of(st.sampled_from([0, *(sum(len(s) + 1 for s in strings[:i])
                                            for i in range(len(strings)))]), u32)
    entries = b"".join(struct.pack("<iII", draw(flags), draw(offset), draw(offset))
                       for _ in range(n))
    data = OLD_MAGIC + struct.pack("<I", nlibs) + entries
    if draw(st.booleans()):
        data += b"\0" * (-len(data) % 8) + draw(new_cache())
    return data + table


cache_bytes = st.one_of(st.binary(max_size=200), new_cache(), old_cache(),
                        st.builds(lambda m, b: m + b, st.sampled_from((NEW_MAGIC, OLD_MAGIC)),
                                  st.binary(max_size=100)))


@given(cache_bytes)
def test_parse_ld_so_cache(data: bytes) -> None:
    try:
        entries = parse_ld_so_cache(data)
    except LdCacheError:
        return
    assert all(isinstance(e, CacheEntry) for e in entries)


@pytest.fixture(scope="module")
def driver_root() -> Iterator[HostRoot]:
    """A driver root with a library, a symlink to it and a symlink loop."""
    base = Path(tempfile.mkdtemp(prefix="nri-accel-fuzz-ldcache-"))
    lib = base / "usr/lib/x86_64-linux-gnu"
    lib.mkdir(parents=True)
    (lib / "libcuda.so.550.54.15").write_bytes(b"")
    (lib / "libcuda.so.1").symlink_to("libcuda.so.550.54.15")
    (base / "loop").symlink_to("/loop")
    (base / "etc").mkdir()
    yield HostRoot.at(base)
    shutil.rmtree(base)


@given(cache_bytes)
def test_locator_over_any_cache(driver_root: HostRoot, data: bytes) -> None:
    Path(driver_root.local("/etc/ld.so.cache")).write_bytes(data)
    locator = Locator(driver_root, ARCHES["x86_64"])
    assert all(p.source == "/etc/ld.so.cache" for p in locator.problems)
    for found in (locator.find_soname("libcuda.so.1"),
                  locator.find_versioned("libcuda.so", "550.54.15"),
                  locator.find_soname("libnvidia-ml.so.1")):
        assert found is None or found.startswith("/")
    if found := locator.find_soname("libcuda.so.1"):
        assert "/" not in locator.soname_of(found)


# ---- ELF ------------------------------------------------------------------------------

u64 = st.one_of(st.integers(0, 400), st.integers(0, 2**64 - 1))
u16 = st.one_of(st.integers(0, 8), st.integers(0, 0xFFFF))


@st.composite
def elf(draw: st.DrawFn) -> bytes:
    bits = draw(st.sampled_from((1, 2, 0, 3)))
    order = draw(st.sampled_from((1, 2, 0)))
    end = ">" if order == 2 else "<"
    ident = b"\x7fELF" + bytes((bits, order, 1)) + b"\0" * 9
    is64 = bits != 1
    phoff = draw(st.one_of(st.just(64 if is64 else 52), u64 if is64 else u32))
    phentsize = draw(st.one_of(st.just(56 if is64 else 32), u16))
    phnum = draw(u16)
    if is64:
        header = struct.pack(end + "HHIQQQIHHHHHH", 3, 62, 1, 0, phoff, 0, 0, 64, phentsize,
                             phnum, 64, 0, 0)
    else:
        header = struct.pack(end + "HHIIIIIHHHHHH", 3, 3, 1, 0, phoff & 0xFFFFFFFF, 0, 0, 52,
                             phentsize, phnum, 40, 0, 0)
    body = b""
    for _ in range(draw(st.integers(0, 3))):
        p_type = draw(st.sampled_from((1, 2, 6, 0)))
        off, vaddr, size = draw(u64), draw(u64), draw(u64)
        if is64:
            body += struct.pack(end + "IIQQQQQQ", p_type, 5, off, vaddr, vaddr, size, size, 0)
        else:
            m = 0xFFFFFFFF
            body += struct.pack(end + "IIIIIIII", p_type, off & m, vaddr & m, vaddr & m,
                                size & m, size & m, 5, 0)
    dyn_fmt = end + ("qQ" if is64 else "iI")
    dyn = b"".join(struct.pack(dyn_fmt, draw(st.sampled_from((0, 5, 14, 1, -1))),
                               draw(u64 if is64 else u32))
                   for _ in range(draw(st.integers(0, 4))))
    tail = draw(st.binary(max_size=64))
    return ident + header + body + dyn + b"libcuda.so.1\0\xff\xfe\0" + tail


elf_bytes = st.one_of(st.binary(max_size=200), elf(),
                      st.builds(lambda b: b"\x7fELF" + b, st.binary(max_size=100)))


@given(elf_bytes)
def test_read_elf(driver_root: HostRoot, data: bytes) -> None:
    target = Path(driver_root.local("/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15"))
    target.write_bytes(data)
    info = read_elf(str(target))
    assert info is None or isinstance(info, ElfInfo)
    locator = Locator(driver_root, ARCHES["x86_64"])
    name = locator.soname_of("/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15")
    assert name and "/" not in name
