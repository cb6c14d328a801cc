"""Locating NVIDIA driver files like the loader: ld.so.cache formats (checked against
glibc's own ldconfig where present), resolution that never leaves the root, the
Locator's choices, and ELF soname reading."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from fakes.roots import ld_so_cache_bytes

from nri_accel.discover.elf import read_elf
from nri_accel.discover.hostroot import HostRoot
from nri_accel.discover.ldcache import (
    ARCHES,
    CacheEntry,
    LdCacheError,
    Locator,
    parse_ld_so_cache,
    resolve_in_root,
)

LDCONFIG = shutil.which("ldconfig") or ("/sbin/ldconfig" if os.path.exists("/sbin/ldconfig")
                                        else None)
needs_ldconfig = pytest.mark.skipif(LDCONFIG is None, reason="glibc's ldconfig not installed")
X86 = ARCHES["x86_64"]


def tree(base: Path, files: dict[str, str | bytes | None]) -> Path:
    """Create files (str/bytes: content; None: empty) and symlinks ("-> target")."""
    for path, content in files.items():
        p = base / path.lstrip("/")
        p.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(content, str) and content.startswith("-> "):
            os.symlink(content[3:], p)
        elif isinstance(content, bytes):
            p.write_bytes(content)
        else:
            p.write_text(content or "")
    return base


# ---- ld.so.cache -----------------------------------------------------------------------


@needs_ldconfig
@pytest.mark.parametrize("fmt", ["new", "old", "compat"])
def test_parse_caches_written_by_ldconfig(tmp_path: Path, fake_nvml_lib: Path,
                                          fmt: str) -> None:
    tree(tmp_path, {"/etc/ld.so.conf": "/usr/lib64\n",
                    "/usr/lib64/libnvidia-ml.so.550.54.15": fake_nvml_lib.read_bytes()})
    subprocess.run([LDCONFIG, "-r", str(tmp_path), "-c", fmt, "-C", "/etc/ld.so.cache"],
                   check=True, capture_output=True)
    entries = parse_ld_so_cache((tmp_path / "etc/ld.so.cache").read_bytes())
    assert entries == (CacheEntry("libnvidia-ml.so.1", "/usr/lib64/libnvidia-ml.so.1",
                                  X86.cache_flags),)


@needs_ldconfig
def test_parse_the_hosts_cache_like_ldconfig_prints_it() -> None:
    if not os.path.exists("/etc/ld.so.cache"):
        pytest.skip("no /etc/ld.so.cache on this machine")
    printed = subprocess.run([LDCONFIG, "-p"], check=True, capture_output=True,
                             text=True).stdout
    want = [m.groups() for m in re.finditer(r"^\s+(\S+) \((.*?)\) => (\S+)$", printed, re.M)]
    with open("/etc/ld.so.cache", "rb") as f:
        got = parse_ld_so_cache(f.read())
    assert [(e.key, e.path) for e in got] == [(k, p) for k, _, p in want]


def test_writer_and_parser_agree() -> None:
    entries = [("libcuda.so.1", "x86-64", "/lib/x86_64-linux-gnu/libcuda.so.1"),
               ("libcuda.so.1", "i386", "/lib/i386-linux-gnu/libcuda.so.1"),
               ("libnvidia-ml.so.1", "aarch64", "/usr/lib/aarch64-linux-gnu/libnvidia-ml.so.1")]
    parsed = parse_ld_so_cache(ld_so_cache_bytes(entries))
    assert [(e.key, e.path, e.flags) for e in parsed] == [
        ("libcuda.so.1", "/lib/x86_64-linux-gnu/libcuda.so.1", 0x0303),
        ("libcuda.so.1", "/lib/i386-linux-gnu/libcuda.so.1", 0x0003),
        ("libnvidia-ml.so.1", "/usr/lib/aarch64-linux-gnu/libnvidia-ml.so.1", 0x0A03)]


@pytest.mark.parametrize("data", [
    b"", b"garbage" * 10, b"glibc-ld.so.cache1.1", b"ld.so-1.7.0\0\xff\x00\x00\x00",
    ld_so_cache_bytes([("libx.so.1", "x86-64", "/lib/libx.so.1")])[:60],
])
def test_malformed_caches_are_rejected(data: bytes) -> None:
    with pytest.raises(LdCacheError):
        parse_ld_so_cache(data)


def test_unreadable_cache_is_a_problem_and_the_standard_dirs_still_work(tmp_path: Path) -> None:
    tree(tmp_path, {"/etc/ld.so.cache": "not a cache",
                    "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15": None})
    loc = Locator(HostRoot.at(tmp_path), X86)
    assert [(p.source, p.message.split(" (")[0]) for p in loc.problems] == [
        ("/etc/ld.so.cache", "cannot read the loader cache")]
    assert loc.find_versioned("libcuda.so", "550.54.15") == \
        "/usr/lib/x86_64-linux-gnu/libcuda.so.550.54.15"


# ---- resolution inside a root ----------------------------------------------------------


def test_resolve_in_root_keeps_symlinks_inside(tmp_path: Path) -> None:
    outside = tmp_path / "secret"
    outside.write_text("host file")
    root = tree(tmp_path / "root", {
        "/lib": "-> usr/lib",
        "/usr/lib/a.so.1": "-> /usr/lib/real/a.so.1.2",
        "/usr/lib/real/a.so.1.2": None,
        "/usr/lib/up": "-> ../../../../../secret",
        "/usr/lib/abs": f"-> {outside}",
        "/usr/lib/loop": "-> loop",
    })
    base = str(root)
    assert resolve_in_root(base, "/lib/a.so.1") == "/usr/lib/real/a.so.1.2"
    assert resolve_in_root(base, "/lib/../lib/./real/a.so.1.2") == "/usr/lib/real/a.so.1.2"
    assert resolve_in_root(base, "/usr/lib/up") is None  # ".." stops at the root
    assert resolve_in_root(base, "/usr/lib/abs") is None  # absolute: restarts at the root
    assert resolve_in_root(base, "/usr/lib/loop") is None
    assert resolve_in_root(base, "/usr/lib/real/a.so.1.2/x") is None
    (root / "secret").write_text("inside")
    assert resolve_in_root(base, "/usr/lib/up") == "/secret"


# ---- Locator ---------------------------------------------------------------------------


def test_locator_prefers_the_cache_then_standard_dirs(tmp_path: Path) -> None:
    cache = ld_so_cache_bytes([("libcuda.so.1", "x86-64", "/opt/nv/libcuda.so.1")])
    tree(tmp_path, {
        "/etc/ld.so.cache": cache,
        "/opt/nv/libcuda.so.1": "-> libcuda.so.550.54.15",
        "/opt/nv/libcuda.so.550.54.15": None,
        "/usr/lib64/libcuda.so.550.54.15": None,
        "/usr/lib64/libcuda.so.1": "-> libcuda.so.550.54.15",
        "/usr/lib64/libnvidia-ml.so.1": "-> libnvidia-ml.so.550.54.15",
        "/usr/lib64/libnvidia-ml.so.550.54.15": None,
        "/usr/lib64/libnvidia-cfg.so.535.104.05": None,
    })
    loc = Locator(HostRoot.at(tmp_path), X86)
    assert loc.find_soname("libcuda.so.1") == "/opt/nv/libcuda.so.550.54.15"
    assert loc.find_versioned("libcuda.so", "550.54.15") == "/opt/nv/libcuda.so.550.54.15"
    assert loc.find_soname("libnvidia-ml.so.1") == "/usr/lib64/libnvidia-ml.so.550.54.15"
    assert loc.find_versioned("libnvidia-cfg.so", "550.54.15") is None  # stale version only
    assert loc.problems == []


def test_locator_skips_libraries_of_another_abi(tmp_path: Path, fake_nvml_lib: Path) -> None:
    elf64 = fake_nvml_lib.read_bytes()
    tree(tmp_path, {"/usr/lib/i386-linux-gnu/libnvidia-ml.so.550.54.15": elf64,
                    "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.550.54.15": elf64})
    loc = Locator(HostRoot.at(tmp_path), X86)
    assert loc.find_versioned("libnvidia-ml.so", "550.54.15", ARCHES["i386"]) is None
    assert loc.find_versioned("libnvidia-ml.so", "550.54.15") == \
        "/usr/lib/x86_64-linux-gnu/libnvidia-ml.so.550.54.15"


def test_soname_from_elf_then_symlink_then_file_name(tmp_path: Path,
                                                     fake_nvml_lib: Path) -> None:
    d = "/usr/lib64"
    tree(tmp_path, {
        f"{d}/libnvidia-ml.so.550.54.15": fake_nvml_lib.read_bytes(),  # DT_SONAME .so.1
        f"{d}/libcuda.so.550.54.15": None,
        f"{d}/libcuda.so.1": "-> libcuda.so.550.54.15",
        f"{d}/libcuda.so": "-> libcuda.so.1",
        f"{d}/libnvidia-glcore.so.550.54.15": None,
    })
    loc = Locator(HostRoot.at(tmp_path), X86)
    assert loc.soname_of(f"{d}/libnvidia-ml.so.550.54.15") == "libnvidia-ml.so.1"
    assert loc.soname_of(f"{d}/libcuda.so.550.54.15") == "libcuda.so.1"
    assert loc.soname_of(f"{d}/libnvidia-glcore.so.550.54.15") == \
        "libnvidia-glcore.so.550.54.15"


def test_binaries_are_found_in_the_usual_dirs(tmp_path: Path) -> None:
    tree(tmp_path, {"/usr/sbin/nvidia-persistenced": None, "/bin": "-> usr/bin",
                    "/usr/bin/nvidia-smi": None})
    loc = Locator(HostRoot.at(tmp_path), X86)
    assert loc.find_binary("nvidia-persistenced") == "/usr/sbin/nvidia-persistenced"
    assert loc.find_binary("nvidia-smi") == "/usr/bin/nvidia-smi"
    assert loc.find_binary("nvidia-debugdump") is None


# ---- ELF -------------------------------------------------------------------------------


def test_read_elf(tmp_path: Path, fake_nvml_lib: Path) -> None:
    info = read_elf(str(fake_nvml_lib))
    assert info is not None
    assert (info.bits, info.soname) == (64, "libnvidia-ml.so.1")
    data = fake_nvml_lib.read_bytes()
    for name, content in (("text", b"just text"), ("empty", b""), ("head", data[:70]),
                          ("half", data[: len(data) // 2])):
        (tmp_path / name).write_bytes(content)
        got = read_elf(str(tmp_path / name))
        assert got is None or got.soname in ("", "libnvidia-ml.so.1"), name
    assert read_elf(str(tmp_path / "missing")) is None
