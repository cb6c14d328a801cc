"""Fake host roots: materialise a checked-in node description into a real directory tree.

Owns: the fake-root layout below and `materialise`. Imports the standard library, the
fake NVML build helper (fakes.nvml.build) and nri_accel.discover.hostroot.

Each fake root stands for a real node (its README.md says which) and lives in
tests/fakes/roots/<name>/:

    README.md     which real node it mimics
    tree/         files copied verbatim (symlinks kept as symlinks): driver libraries as
                  empty placeholder files with their real names and soname symlinks,
                  /proc and /sys excerpts, firmware, binaries
    devices.txt   what git cannot hold, one per line (# comments):
                    c MAJ MIN /dev/path      character device node (os.mknod; needs root)
                    b MAJ MIN /dev/path      block device node
                    l /dev/path -> target    symbolic link
                    s /path                  unix socket file (nvidia-persistenced's socket)
                    d /path                  empty directory (the MPS pipe directory)
    ldcache.txt   optional: entries of the driver root's /etc/ld.so.cache, written there
                  in glibc's binary format ("glibc-ld.so.cache1.1"), one per line:
                    <key (soname)> <x86-64|aarch64|i386> <host path>
    nvml.conf     optional: the fake libnvidia-ml's node description (see
                  tests/fakes/nvml/README.md). When present, every placeholder
                  libnvidia-ml.so.<driver version> in the tree is replaced by the compiled
                  fake library and nvml.conf is installed beside it as fake_nvml.conf,
                  where the fake reads it at nvmlInit (FAKE_NVML_CONFIG overrides).
                  Nothing else is needed: pynvml loads the library discovery locates.
                  Tests inject NVML events (XIDs, ECC errors, lost GPUs) by appending
                  to fake_nvml.events in the same directory (fakes/nvml/node.py).
    root.toml     optional: driver_root = "/run/nvidia/driver" (host path of the
                  driver's files, as with the GPU operator), nvml_variant = "omit-numa"
                  (which fake NVML build the root needs; see fakes.nvml.build.VARIANTS)

Use from tests: ``materialise("a100-mig", tmp_path / "root")`` returns the HostRoot to
discover. From a shell: ``PYTHONPATH=tests python -m fakes.roots a100-mig /tmp/node``
then ``nri-accel discover --root /tmp/node`` (it prints the driver root to use).
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import struct
import sys
import tomllib
from pathlib import Path

from fakes.nvml import build as nvml_build

from nri_accel.discover.hostroot import HostRoot

ROOTS_DIR = Path(__file__).resolve().with_name("roots")
FAKE_NVML_CONF_NAME = "fake_nvml.conf"

# glibc's ld.so.cache entry flags (elf/ldconfig.h): FLAG_ELF_LIBC6 | architecture.
_LDCACHE_FLAGS = {"i386": 0x0003, "x86-64": 0x0303, "aarch64": 0x0A03}
_ROOT_TOML_KEYS = {"driver_root", "nvml_variant"}


class FakeRootError(RuntimeError):
    """A fake root is malformed or cannot be materialised here (names the file and line)."""


def names() -> list[str]:
    """Names of every checked-in fake root."""
    return sorted(p.name for p in ROOTS_DIR.iterdir() if (p / "tree").is_dir())


def materialise(name: str, dest: Path, *, nvml_lib: Path | None = None) -> HostRoot:
    """Build fake root `name` at `dest` (which must not exist) and return its HostRoot.

    `nvml_lib`: the compiled fake library to install; by default the build named by the
    root's `nvml_variant`, compiled once per process.
    """
    src = ROOTS_DIR / name
    if not (src / "tree").is_dir():
        raise FakeRootError(f"{src}: no such fake root (known: {', '.join(names())})")
    meta = _read_root_toml(src / "root.toml")
    shutil.copytree(src / "tree", dest, symlinks=True)
    _owner_writable_only(dest)
    devices = src / "devices.txt"
    if devices.exists():
        _make_special_files(devices, dest)
    driver_root = meta.get("driver_root", "/")
    ldcache = src / "ldcache.txt"
    if ldcache.exists():
        target = _under(dest, driver_root, str(src / "root.toml")) / "etc" / "ld.so.cache"
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(ld_so_cache_bytes(_read_ldcache_txt(ldcache)))
    conf = src / "nvml.conf"
    if conf.exists():
        lib = nvml_lib or nvml_build.library(meta.get("nvml_variant", ""))
        _install_fake_nvml(dest, lib, conf, src)
    return HostRoot.at(dest, driver_root=driver_root)


def ld_so_cache_bytes(entries: list[tuple[str, str, str]]) -> bytes:
    """glibc's new-format ld.so.cache (as ldconfig >= 2.32 writes it) holding `entries`
    of (key, arch, path) in the given order; offsets count from the start of the file."""
    header_size, entry_size = 48, 24
    strings = bytearray()
    offsets: dict[str, int] = {}
    base = header_size + entry_size * len(entries)

    def offset(s: str) -> int:
        if s not in offsets:
            offsets[s] = base + len(strings)
            strings.extend(s.encode() + b"\0")
        return offsets[s]

    body = b"".join(
        struct.pack("<iIIIQ", _LDCACHE_FLAGS[arch], offset(key), offset(path), 0, 0)
        for key, arch, path in entries
    )
    header = struct.pack(
        "<17s3sIIB3xI12x", b"glibc-ld.so.cache", b"1.1", len(entries), len(strings), 2, 0
    )
    return header + body + bytes(strings)


def _read_root_toml(path: Path) -> dict[str, str]:
    if not path.exists():
        return {}
    data = tomllib.loads(path.read_text())
    unknown = set(data) - _ROOT_TOML_KEYS
    if unknown:
        raise FakeRootError(f"{path}: unknown keys {sorted(unknown)}")
    return {k: str(v) for k, v in data.items()}


def _under(dest: Path, host_path: str, where: str) -> Path:
    if not host_path.startswith("/") or ".." in host_path.split("/"):
        raise FakeRootError(f"{where}: path must be absolute without '..': {host_path!r}")
    return dest / host_path.lstrip("/")


def _owner_writable_only(tree: Path) -> None:
    """Take group and others' write bits off what copytree copied: a checkout made under
    umask 002 has them, a real host's driver and CDI files do not (nri-accel refuses a
    CDI spec a group or others could write)."""
    for path in (tree, *tree.rglob("*")):
        if not path.is_symlink():
            mode = path.stat().st_mode
            if mode & 0o022:
                os.chmod(path, stat.S_IMODE(mode) & ~0o022)


def _make_special_files(devices: Path, dest: Path) -> None:
    for lineno, raw in enumerate(devices.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{devices}:{lineno}"
        fields = line.split()
        kind = fields[0]
        if kind in ("c", "b") and len(fields) == 4:
            path = _under(dest, fields[3], where)
            mode = (stat.S_IFCHR if kind == "c" else stat.S_IFBLK) | 0o666
            _mknod(path, mode, os.makedev(int(fields[1]), int(fields[2])), where)
        elif kind == "l" and len(fields) == 4 and fields[2] == "->":
            path = _under(dest, fields[1], where)
            path.parent.mkdir(parents=True, exist_ok=True)
            os.symlink(fields[3], path)
        elif kind == "s" and len(fields) == 2:
            _mknod(_under(dest, fields[1], where), stat.S_IFSOCK | 0o666, 0, where)
        elif kind == "d" and len(fields) == 2:
            _under(dest, fields[1], where).mkdir(parents=True, exist_ok=True)
        else:
            raise FakeRootError(f"{where}: cannot parse {raw!r}")


def _mknod(path: Path, mode: int, dev: int, where: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mknod(path, mode, dev)
        os.chmod(path, stat.S_IMODE(mode))  # exact modes whatever the umask
    except PermissionError as e:
        raise FakeRootError(
            f"{where}: mknod {path} not permitted ({e.strerror}): fake roots need root "
            "(CAP_MKNOD), as in CI"
        ) from e
    except OSError as e:
        if e.errno == errno.EEXIST:
            raise FakeRootError(f"{where}: {path} already exists") from e
        raise


def _read_ldcache_txt(path: Path) -> list[tuple[str, str, str]]:
    entries = []
    for lineno, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        fields = line.split()
        if len(fields) != 3 or fields[1] not in _LDCACHE_FLAGS:
            raise FakeRootError(f"{path}:{lineno}: expected '<key> <arch> <path>': {raw!r}")
        entries.append((fields[0], fields[1], fields[2]))
    return entries


def _install_fake_nvml(dest: Path, lib: Path, conf: Path, src: Path) -> None:
    placeholders = sorted(
        p for p in dest.rglob("libnvidia-ml.so.*")
        if p.name != "libnvidia-ml.so.1" and p.is_file() and not p.is_symlink()
    )
    if not placeholders:
        raise FakeRootError(f"{src}: nvml.conf given but tree/ holds no libnvidia-ml.so.<ver>")
    for p in placeholders:
        shutil.copyfile(lib, p)
        shutil.copyfile(conf, p.with_name(FAKE_NVML_CONF_NAME))


if __name__ == "__main__":
    if len(sys.argv) != 3:
        sys.exit(f"usage: python -m fakes.roots NAME DEST   (names: {', '.join(names())})")
    root = materialise(sys.argv[1], Path(sys.argv[2]))
    print(f"root={root.root} driver_root={root.driver_root}")
