"""Discovery of a driver root whose files an attacker may have shaped (a driver container's
filesystem, a world-writable /tmp): nothing it finds leads outside the root, names a
container path outside the library directory, or mounts through a planted symlink."""

from __future__ import annotations

import json
import os
import stat
import struct
from pathlib import Path

import pytest
from fakes.roots import ld_so_cache_bytes, materialise

from nri_accel.discover.base import host_device_node
from nri_accel.discover.hostroot import HostRoot
from nri_accel.discover.ldcache import ARCHES, LdCacheError, Locator, parse_ld_so_cache
from nri_accel.errors import DiscoveryError
from nri_accel.inventory import ContainerEdits
from nri_accel.vendors.cdi.spec import discover_cdi
from nri_accel.vendors.nvidia.discover import discover_nvidia

X86 = ARCHES["x86_64"]
LIB = "/usr/lib/x86_64-linux-gnu"


def elf_with_soname(soname: bytes) -> bytes:
    """A minimal x86-64 shared object: one PT_LOAD over the file, a PT_DYNAMIC holding
    DT_STRTAB and DT_SONAME (what read_elf reads; stands for a driver library)."""
    dyn_off, str_off = 176, 224
    strtab = b"\0" + soname + b"\0"
    size = str_off + len(strtab)
    ident = b"\x7fELF" + bytes([2, 1, 1]) + bytes(9)
    header = struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 64, 0, 0, 64, 56, 2, 0, 0, 0)
    load = struct.pack("<IIQQQQQQ", 1, 5, 0, 0, 0, size, size, 0x1000)
    dynamic = struct.pack("<IIQQQQQQ", 2, 6, dyn_off, dyn_off, dyn_off, 48, 48, 8)
    entries = struct.pack("<qQqQqQ", 5, str_off, 14, 1, 0, 0)
    return ident + header + load + dynamic + entries + strtab


@pytest.mark.parametrize("soname, expected", [
    (b"libcuda.so.1", "libcuda.so.1"),  # the real thing: DT_SONAME is used
    (b"../../../../etc/ld.so.preload", "libcuda.so.1"),  # falls back to the symlink
    (b"libcuda.so.1/../../../../../tmp/x", "libcuda.so.1"),
    (b"libc.so.6", "libcuda.so.1"),  # another library's name would shadow it
    (b"libcuda.so.1\n", "libcuda.so.1"),
])
def test_soname_names_only_a_file_in_the_library_directory(tmp_path: Path, soname: bytes,
                                                           expected: str) -> None:
    lib = tmp_path / LIB.lstrip("/")
    lib.mkdir(parents=True)
    (lib / "libcuda.so.550.54.15").write_bytes(elf_with_soname(soname))
    os.symlink("libcuda.so.550.54.15", lib / "libcuda.so.1")
    loc = Locator(HostRoot.at(tmp_path), X86)
    assert loc.soname_of(f"{LIB}/libcuda.so.550.54.15") == expected


def test_ld_so_cache_strings_and_counts_are_bounded() -> None:
    good = ld_so_cache_bytes([("libcuda.so.1", "x86-64", f"{LIB}/libcuda.so.1")])
    assert parse_ld_so_cache(good)[0].path == f"{LIB}/libcuda.so.1"
    unterminated = good[:-1] + b"a" * 10000  # the last string never ends within PATH_MAX
    with pytest.raises(LdCacheError, match="longer than"):
        parse_ld_so_cache(unterminated)
    lying = good[:20] + struct.pack("<I", 10**8) + good[24:]  # nlibs far beyond the file
    with pytest.raises(LdCacheError, match="file too short"):
        parse_ld_so_cache(lying)


def test_cache_entries_and_symlinks_never_leave_the_driver_root(tmp_path: Path) -> None:
    root, outside = tmp_path / "root", tmp_path / "outside"
    (outside).mkdir()
    (outside / "libnvidia-ml.so.1").write_bytes(b"")
    (root / "etc").mkdir(parents=True)
    (root / "usr/lib64").mkdir(parents=True)
    os.symlink("../../../outside/libnvidia-ml.so.1", root / "usr/lib64/libnvidia-ml.so.1")
    (root / "etc/ld.so.cache").write_bytes(ld_so_cache_bytes([
        ("libnvidia-ml.so.1", "x86-64", "/../../outside/libnvidia-ml.so.1"),
        ("libnvidia-ml.so.1", "x86-64", str(outside / "libnvidia-ml.so.1"))]))
    loc = Locator(HostRoot.at(root), X86)
    assert len(loc.cache) == 2
    assert loc.find_soname("libnvidia-ml.so.1") is None


def test_ipc_paths_are_never_followed_through_a_planted_symlink(tmp_path: Path) -> None:
    root = materialise("a100-mig", tmp_path / "node")
    before = _mount_sources(discover_nvidia(root).drivers[0].capabilities["compute"])
    assert "/tmp/nvidia-mps" in before  # the real directory is mounted
    base = Path(root.root)
    os.rmdir(base / "tmp/nvidia-mps")
    os.symlink("/etc", base / "tmp/nvidia-mps")  # any host user can do this in /tmp
    os.unlink(base / "run/nvidia-persistenced/socket")
    os.symlink("/run/containerd/containerd.sock", base / "run/nvidia-persistenced/socket")
    found = discover_nvidia(root)
    caps = found.drivers[0].capabilities
    sources = {s for edits in caps.values() for s in _mount_sources(edits)}
    assert not {"/etc", "/tmp/nvidia-mps", "/run/containerd/containerd.sock",
                "/run/nvidia-persistenced/socket"} & sources
    problems = {p.source: p.message for p in found.problems}
    assert "symlink is not followed" in problems["/tmp/nvidia-mps"]
    assert "symlink is not followed" in problems["/run/nvidia-persistenced/socket"]


def _mount_sources(edits: ContainerEdits) -> set[str]:
    return {m.host_path for m in edits.mounts}


def test_device_nodes_come_from_lstat_and_symlinks_are_refused(tmp_path: Path) -> None:
    (tmp_path / "dev").mkdir()
    os.symlink("/dev/null", tmp_path / "dev/nvidia0")
    (tmp_path / "dev/plain").write_text("")
    root = HostRoot.at(tmp_path)
    with pytest.raises(DiscoveryError, match="symlink"):
        host_device_node(root, "/dev/nvidia0")
    with pytest.raises(DiscoveryError, match="not a character or block device"):
        host_device_node(root, "/dev/plain")
    os.mknod(tmp_path / "dev/acc0", 0o600 | stat.S_IFCHR, os.makedev(240, 7))  # as root, as CI
    node = host_device_node(root, "/dev/acc0")
    assert (node.type, node.major, node.minor) == ("c", 240, 7)


_HOOK_SPEC = json.dumps({
    "cdiVersion": "0.6.0", "kind": "acme.example/npu",
    "devices": [{"name": "npu0", "containerEdits": {
        "mounts": [{"hostPath": "/etc/shadow", "containerPath": "/x"}],
        "hooks": [{"hookName": "createContainer", "path": "/tmp/evil"}]}}]})


@pytest.mark.parametrize("writable", ["file", "directory", "sticky directory",
                                      "directory a symlinked file leads to"])
def test_a_cdi_spec_anyone_but_root_could_write_is_not_read(tmp_path: Path,
                                                            writable: str) -> None:
    # A spec's mounts and hooks run with the runtime's privileges: one an unprivileged
    # host user (or a pod with a hostPath volume) could write would grant /etc/shadow or
    # a root hook. Upstream pkg/cdi reads any file in /etc/cdi and /var/run/cdi.
    spec_dir = tmp_path / "etc/cdi"
    spec_dir.mkdir(parents=True, mode=0o755)
    spec = spec_dir / "npu.json"
    if writable == "directory a symlinked file leads to":
        (tmp_path / "tmp").mkdir(mode=0o755)
        (tmp_path / "tmp/npu.json").write_text(_HOOK_SPEC)
        os.chmod(tmp_path / "tmp/npu.json", 0o644)
        os.symlink("/tmp/npu.json", spec)
    else:
        spec.write_text(_HOOK_SPEC)
        os.chmod(spec, 0o644)
    root = HostRoot.at(tmp_path)
    assert [d.name for d in discover_cdi(root, ["/etc/cdi"]).devices] == ["npu0"]

    target = {"file": spec, "directory": spec_dir, "sticky directory": spec_dir,
              "directory a symlinked file leads to": tmp_path / "tmp"}[writable]
    os.chmod(target, {"file": 0o666, "directory": 0o775, "sticky directory": 0o1777,
                      "directory a symlinked file leads to": 0o777}[writable])
    found = discover_cdi(root, ["/etc/cdi"])
    assert found.devices == ()
    assert found.drivers == ()
    assert len(found.problems) == 1
    assert "writable by its group or others" in found.problems[0].message


@pytest.mark.skipif(os.geteuid() != 0, reason="chown needs root")
def test_a_cdi_spec_owned_by_another_user_is_not_read(tmp_path: Path) -> None:
    (tmp_path / "etc/cdi").mkdir(parents=True, mode=0o755)
    spec = tmp_path / "etc/cdi/npu.json"
    spec.write_text(_HOOK_SPEC)
    os.chmod(spec, 0o644)
    os.chown(spec, 1000, -1)
    found = discover_cdi(HostRoot.at(tmp_path), ["/etc/cdi"])
    assert found.devices == ()
    assert "owned by uid 1000, not by root" in found.problems[0].message
