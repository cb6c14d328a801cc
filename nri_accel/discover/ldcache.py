"""Finding driver files inside a root the way the node's dynamic loader would.

Owns: glibc's ld.so.cache formats (`parse_ld_so_cache`), `resolve_in_root` (the
hostroot resolver for files that must exist), and `Locator`, which finds libraries
(by soname, or the exact `<name>.so.<driver version>` file), binaries and other files
under the driver root. Imports the standard library, msgspec, nri_accel.discover.elf,
nri_accel.discover.hostroot and nri_accel.inventory (Problem).

ld.so.cache formats (glibc elf/cache.c, sysdeps/generic/dl-cache.h):
- new, "glibc-ld.so.cache1.1" (what ldconfig has written alone since glibc 2.32):
  48-byte header (magic, version, nlibs, len_strings, flags, extension offset), then
  nlibs 24-byte entries (flags, key, value, osversion, hwcap); key/value are offsets
  of NUL-terminated strings counted from the start of the new-format header.
- old, "ld.so-1.7.0": 16-byte header, then nlibs 12-byte entries (flags, key, value)
  with offsets counted from the end of the entries; glibc < 2.32 wrote it followed by
  a new-format cache, which is then used instead.
An entry's flags hold the type (FLAG_ELF_LIBC6 = 3) and the architecture in bits 8-15.

Every path is resolved with symlinks interpreted as if the root were "/": an absolute
link target restarts at the root, ".." stops at the root. Nothing outside is touched.
The cache is read only from a regular file of at most 16 MiB, its strings are at most
PATH_MAX long, and a DT_SONAME names the file in the container only when it is a plain
file name extending the library's own (soname_of).
"""

from __future__ import annotations

import os
import platform
import re
import stat
import struct
from collections.abc import Iterator

from msgspec import Struct

from nri_accel.discover.elf import read_elf
from nri_accel.discover.hostroot import HostRoot, walk_in_root
from nri_accel.files import PATH_MAX, read_regular
from nri_accel.inventory import Problem

LD_SO_CACHE = "/etc/ld.so.cache"
_NEW_MAGIC = b"glibc-ld.so.cache1.1"
_OLD_MAGIC = b"ld.so-1.7.0\0"
_NEW_HEADER = struct.Struct("<20sIIB3xI12x")
_NEW_ENTRY = struct.Struct("<iIIIQ")
_OLD_ENTRY = struct.Struct("<iII")
# A large distribution's ld.so.cache (thousands of libraries) is under 2 MiB; 16 MiB
# (about 130,000 entries) is room to spare, and bounds the parse to about a second.
_MAX_CACHE_BYTES = 16 << 20
_FILE_NAME_RE = re.compile(r"[A-Za-z0-9_+-][A-Za-z0-9_.+-]*")

FLAG_ELF_LIBC6 = 0x0003
FLAG_X8664_LIB64 = 0x0300
FLAG_POWERPC_LIB64 = 0x0500
FLAG_AARCH64_LIB64 = 0x0A00


class LdCacheError(ValueError):
    """The ld.so.cache bytes are not a cache this module can read."""


class CacheEntry(Struct, frozen=True):
    """One ld.so.cache entry: the library's soname (key), its path, the raw flags."""

    key: str
    path: str
    flags: int


class Arch(Struct, frozen=True):
    """A library ABI on the node: the ld.so.cache flags and the standard directories."""

    name: str
    cache_flags: int
    elf_bits: int
    elf_machine: int
    dirs: tuple[str, ...]


ARCHES = {
    "x86_64": Arch("x86_64", FLAG_ELF_LIBC6 | FLAG_X8664_LIB64, 64, 62,
                   ("/lib64", "/usr/lib64", "/lib/x86_64-linux-gnu",
                    "/usr/lib/x86_64-linux-gnu", "/usr/lib", "/lib")),
    "aarch64": Arch("aarch64", FLAG_ELF_LIBC6 | FLAG_AARCH64_LIB64, 64, 183,
                    ("/lib64", "/usr/lib64", "/lib/aarch64-linux-gnu",
                     "/usr/lib/aarch64-linux-gnu", "/usr/lib", "/lib")),
    "ppc64le": Arch("ppc64le", FLAG_ELF_LIBC6 | FLAG_POWERPC_LIB64, 64, 21,
                    ("/lib64", "/usr/lib64", "/lib/powerpc64le-linux-gnu",
                     "/usr/lib/powerpc64le-linux-gnu", "/usr/lib", "/lib")),
    "i386": Arch("i386", FLAG_ELF_LIBC6, 32, 3,
                 ("/lib32", "/usr/lib32", "/lib/i386-linux-gnu", "/usr/lib/i386-linux-gnu")),
}
# The 32-bit ABI served by `compat32` on each native architecture.
COMPAT32 = {"x86_64": "i386"}
BIN_DIRS = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")


_MACHINE_ALIASES = {"amd64": "x86_64", "arm64": "aarch64"}


def native_arch() -> Arch:
    """The node's architecture (this process runs on the node's kernel); the drivers
    NVIDIA ships are for x86_64, aarch64 and ppc64le, anything else is read as x86_64."""
    machine = platform.machine()
    return ARCHES.get(_MACHINE_ALIASES.get(machine, machine), ARCHES["x86_64"])


def parse_ld_so_cache(data: bytes) -> tuple[CacheEntry, ...]:
    """Entries of an ld.so.cache file in file order (the loader's preference order)."""
    if data.startswith(_NEW_MAGIC):
        return _parse_new(data, 0)
    if data.startswith(_OLD_MAGIC):
        if len(data) < 16:
            raise LdCacheError("truncated old-format header")
        (nlibs,) = struct.unpack_from("<I", data, 12)
        entries_end = 16 + nlibs * _OLD_ENTRY.size
        if entries_end > len(data):
            raise LdCacheError(f"old-format cache claims {nlibs} entries, file too short")
        new_at = (entries_end + 7) & ~7
        if data[new_at:new_at + len(_NEW_MAGIC)] == _NEW_MAGIC:
            return _parse_new(data, new_at)
        out = []
        for i in range(nlibs):
            flags, key, value = _OLD_ENTRY.unpack_from(data, 16 + i * _OLD_ENTRY.size)
            out.append(CacheEntry(_cstr(data, entries_end + key),
                                  _cstr(data, entries_end + value), flags))
        return tuple(out)
    raise LdCacheError("not an ld.so.cache (unknown magic)")


def _parse_new(data: bytes, base: int) -> tuple[CacheEntry, ...]:
    if len(data) < base + _NEW_HEADER.size:
        raise LdCacheError("truncated header")
    _magic, nlibs, _len_strings, endian, _ext = _NEW_HEADER.unpack_from(data, base)
    if endian == 3:
        raise LdCacheError("big-endian cache on a little-endian reader")
    first = base + _NEW_HEADER.size
    if first + nlibs * _NEW_ENTRY.size > len(data):
        raise LdCacheError(f"cache claims {nlibs} entries, file too short")
    out = []
    for i in range(nlibs):
        flags, key, value, _osv, _hwcap = _NEW_ENTRY.unpack_from(data, first + i * _NEW_ENTRY.size)
        out.append(CacheEntry(_cstr(data, base + key), _cstr(data, base + value), flags))
    return tuple(out)


def _cstr(data: bytes, offset: int) -> str:
    end = data.find(b"\0", offset, offset + PATH_MAX)
    if offset >= len(data) or end < 0:
        raise LdCacheError(f"string at offset {offset} is outside the file or longer than "
                           f"{PATH_MAX} bytes")
    return data[offset:end].decode("utf-8", errors="surrogateescape")


def resolve_in_root(base: str, path: str, start: str = "/") -> str | None:
    """hostroot.walk_in_root for a file that must exist: the resolved path inside the
    root, with no symlink left in it, or None if it does not exist there (or loops)."""
    try:
        return walk_in_root(base, path, start)
    except OSError:
        return None


class Locator:
    """Finds files under `root`'s driver root. Paths it returns are inside the driver
    root ("/usr/bin/nvidia-smi"); `host_path()` turns them into host paths and
    `local_path()` into paths this process can open."""

    def __init__(self, root: HostRoot, arch: Arch | None = None) -> None:
        self.root = root
        self.arch = arch or native_arch()
        # The driver root as the host resolves it (a link there followed inside the
        # root, never out of it): mount sources are host paths the runtime resolves.
        driver_root = root.resolve(root.driver_root)
        self.base = root.local(driver_root)
        self._local_prefix = self.base.rstrip("/")
        self._host_prefix = driver_root.rstrip("/")
        self._resolved: dict[str, str | None] = {}  # one Locator per discovery: no staleness
        self._listings: dict[str, list[str]] = {}
        self.problems: list[Problem] = []
        self.cache = self._read_cache()
        # key prefix (the key itself, or a part of it before a ".") -> entries, in file
        # order: every lookup is one dict access, however large the cache.
        self._by_prefix: dict[str, list[CacheEntry]] = {}
        for e in self.cache:
            for i, c in enumerate(e.key):
                if c == ".":
                    self._by_prefix.setdefault(e.key[:i], []).append(e)
            self._by_prefix.setdefault(e.key, []).append(e)

    def _read_cache(self) -> tuple[CacheEntry, ...]:
        where = self.host_path(LD_SO_CACHE)
        resolved = self.resolve(LD_SO_CACHE)
        if resolved is None:
            return ()  # no cache: the standard directories
        try:  # never waiting on a FIFO nor reading a device (resolved: no symlink left)
            data = read_regular(self.local_path(resolved), _MAX_CACHE_BYTES, follow=False)
            return parse_ld_so_cache(data)
        except (OSError, LdCacheError) as e:
            why = e.strerror if isinstance(e, OSError) and e.strerror else e
            self.problems.append(Problem(where, f"cannot read the loader cache ({why}); "
                                                "searching the standard directories only"))
            return ()

    def host_path(self, path: str) -> str:
        """Host path of `path`, a path this Locator resolved (absolute, no "..")."""
        return self._host_prefix + path

    def local_path(self, path: str) -> str:
        """Where this process opens `path`, a path this Locator resolved."""
        return self._local_prefix + path

    def resolve(self, path: str) -> str | None:
        """resolve_in_root for an absolute `path`, memoised by directory."""
        if path in self._resolved:
            return self._resolved[path]
        parent, _, name = path.rstrip("/").rpartition("/")
        if not name or name in (".", "..") or "/." in parent:
            result = resolve_in_root(self.base, path)
        else:
            start = self.resolve(parent) if parent else "/"
            result = None if start is None else resolve_in_root(self.base, name, start)
        self._resolved[path] = result
        return result

    def listdir(self, path: str) -> list[str]:
        """Names in the resolved directory `path` (memoised; [] if unreadable)."""
        if path not in self._listings:
            try:
                self._listings[path] = sorted(os.listdir(self.local_path(path)))
            except OSError:
                self._listings[path] = []
        return self._listings[path]

    def regular_file(self, path: str) -> str | None:
        """`path` resolved inside the root if it is a regular file there, else None."""
        resolved = self.resolve(path)
        if resolved is None:
            return None
        try:
            return resolved if stat.S_ISREG(os.lstat(self.local_path(resolved)).st_mode) else None
        except OSError:
            return None

    def _library_ok(self, path: str | None, arch: Arch) -> bool:
        """A regular file of the right ABI (files that are not ELF pass: placeholders)."""
        if path is None:
            return False
        info = read_elf(self.local_path(path))
        return info is None or (info.bits == arch.elf_bits and info.machine == arch.elf_machine)

    def _candidates(self, prefix: str, arch: Arch) -> Iterator[str]:
        """Cache entries of `arch` whose key is `prefix` or starts with `prefix.`."""
        for e in self._by_prefix.get(prefix, ()):
            if e.flags == arch.cache_flags:
                yield e.path

    def find_soname(self, soname: str, arch: Arch | None = None) -> str | None:
        """The file the loader would load for `soname`: ld.so.cache, then standard dirs."""
        arch = arch or self.arch
        for p in self._candidates(soname, arch):
            if p.rpartition("/")[2] == soname:
                found = self.regular_file(p)
                if self._library_ok(found, arch):
                    return found
        for d in arch.dirs:
            found = self.regular_file(f"{d}/{soname}")
            if self._library_ok(found, arch):
                return found
        return None

    def find_versioned(self, name: str, version: str, arch: Arch | None = None) -> str | None:
        """The exact `<name>.<version>` file ("libcuda.so" + "550.54.15"), looked up
        through the cache entries for `name` and then in the standard dirs."""
        arch = arch or self.arch
        want = f"{name}.{version}"
        for p in self._candidates(name, arch):
            found = self.regular_file(p)
            if found is not None and found.rpartition("/")[2] == want \
                    and self._library_ok(found, arch):
                return found
        for d in arch.dirs:
            found = self.regular_file(f"{d}/{want}")
            if self._library_ok(found, arch):
                return found
        return None

    def find_binary(self, name: str) -> str | None:
        for d in BIN_DIRS:
            found = self.regular_file(f"{d}/{name}")
            if found is not None:
                return found
        return None

    def soname_of(self, path: str) -> str:
        """A library's soname: its ELF DT_SONAME, else the name of a symlink beside it
        that resolves to it and whose name extends the unversioned one (libcuda.so.1
        for libcuda.so.550.54.15), else its file name. The soname names the file in the
        container, so a DT_SONAME is used only when it is a plain file name extending
        the unversioned one (never "../x" or "libc.so.6" for libcuda)."""
        parent, _, name = path.rpartition("/")
        stem = name.split(".so.", 1)[0] + ".so."
        info = read_elf(self.local_path(path))
        if info is not None and info.soname.startswith(stem) \
                and _FILE_NAME_RE.fullmatch(info.soname):
            return info.soname
        links = [n for n in self.listdir(parent or "/")
                 if n != name and n.startswith(stem) and self.resolve(f"{parent}/{n}") == path]
        return min(links, key=lambda n: (len(n), n)) if links else name
