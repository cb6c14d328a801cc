"""Just enough ELF reading to name a shared library: class, machine and DT_SONAME.

Owns: `read_elf(path)`. Imports only the standard library and msgspec. Never raises for a file
that is not ELF or is malformed: it answers None, and the caller falls back to the
soname symlink or the file name (driver roots in tests hold empty placeholders).
Reads the headers and the dynamic section only, never the whole file.
"""

from __future__ import annotations

import struct
from typing import BinaryIO

from msgspec import Struct

_PT_LOAD = 1
_PT_DYNAMIC = 2
_DT_NULL = 0
_DT_STRTAB = 5
_DT_SONAME = 14
_MAX_PHNUM = 256
_MAX_DYNAMIC = 1 << 20


class ElfInfo(Struct, frozen=True):
    """Identity of an ELF file: 32 or 64 bits, e_machine (62 x86-64, 183 aarch64, 3 i386),
    and its DT_SONAME ("" when it has none)."""

    bits: int
    machine: int
    soname: str = ""


def read_elf(path: str) -> ElfInfo | None:
    """The ElfInfo of the file at `path`, or None if it is unreadable or not ELF."""
    try:
        with open(path, "rb") as f:
            return _parse(f)
    except (OSError, struct.error, ValueError, UnicodeDecodeError):
        return None


def _parse(f: BinaryIO) -> ElfInfo | None:
    ident = f.read(16)
    if len(ident) < 16 or ident[:4] != b"\x7fELF" or ident[4] not in (1, 2) \
            or ident[5] not in (1, 2):
        return None
    bits = 32 if ident[4] == 1 else 64
    end = "<" if ident[5] == 1 else ">"
    if bits == 64:
        hdr = struct.unpack(end + "HHIQQQIHHHHHH", f.read(48))
    else:
        hdr = struct.unpack(end + "HHIIIIIHHHHHH", f.read(36))
    machine, phoff, phentsize, phnum = hdr[1], hdr[4], hdr[8], hdr[9]
    if phnum > _MAX_PHNUM:
        return None
    loads: list[tuple[int, int, int]] = []  # (vaddr, offset, filesz)
    dynamic: tuple[int, int] | None = None
    for i in range(phnum):
        f.seek(phoff + i * phentsize)
        if bits == 64:
            p_type, _flags, off, vaddr, _paddr, filesz = struct.unpack(end + "IIQQQQ", f.read(40))
        else:
            p_type, off, vaddr, _paddr, filesz = struct.unpack(end + "IIIII", f.read(20))
        if p_type == _PT_LOAD:
            loads.append((vaddr, off, filesz))
        elif p_type == _PT_DYNAMIC:
            dynamic = (off, filesz)
    if dynamic is None:
        return ElfInfo(bits, machine)
    off, size = dynamic
    f.seek(off)
    data = f.read(min(size, _MAX_DYNAMIC))
    fmt, step = (end + "qQ", 16) if bits == 64 else (end + "iI", 8)
    strtab = soname_off = None
    for pos in range(0, len(data) - step + 1, step):
        tag, val = struct.unpack_from(fmt, data, pos)
        if tag == _DT_NULL:
            break
        if tag == _DT_STRTAB:
            strtab = val
        elif tag == _DT_SONAME:
            soname_off = val
    if strtab is None or soname_off is None:
        return ElfInfo(bits, machine)
    for vaddr, seg_off, filesz in loads:
        if vaddr <= strtab < vaddr + filesz:
            f.seek(seg_off + (strtab - vaddr) + soname_off)
            raw = f.read(256).split(b"\0", 1)[0]
            return ElfInfo(bits, machine, raw.decode("utf-8"))
    return ElfInfo(bits, machine)
