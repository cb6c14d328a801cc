"""Hostile host files: long paths, FIFOs, huge or non-ASCII numbers, out-of-range
capability fields, huge or odd ld.so.cache files. Each is a Problem naming the file; the
rest of the family is kept and nothing hangs."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from fakes.roots import ld_so_cache_bytes, materialise

from nri_accel.discover import kernel
from nri_accel.discover.hostroot import PATH_MAX, HostRoot, UnreadableFile, walk_in_root
from nri_accel.discover.ldcache import ARCHES, Locator
from nri_accel.vendors import amd, gaudi
from nri_accel.vendors.neuron import KIND_CORE, MAX_CORES, discover_neuron
from nri_accel.vendors.nvidia import KIND_MIG
from nri_accel.vendors.nvidia.discover import MIG_MINORS, discover_nvidia

KFD_NODES = "/sys/class/kfd/kfd/topology/nodes"
GI2 = "/proc/driver/nvidia/capabilities/gpu0/mig/gi2"


def msgs(found) -> dict[str, str]:
    return {p.source: p.message for p in found.problems}


# ---- walk_in_root / read_text ----------------------------------------------------------


def test_paths_over_path_max_are_refused(tmp_path: Path) -> None:
    with pytest.raises(OSError, match="longer than 4096"):
        walk_in_root(str(tmp_path), "/a" * (PATH_MAX // 2 + 1), must_exist=False)
    assert walk_in_root(str(tmp_path), "/a" * (PATH_MAX // 2), must_exist=False) \
        == "/a" * (PATH_MAX // 2)


def test_components_below_a_missing_one_are_kept_and_dotdot_comes_back(tmp_path) -> None:
    (tmp_path / "usr").mkdir()
    os.symlink("/etc", tmp_path / "usr" / "lnk")
    path = "/missing/x/y/../../../usr/lnk/z"  # back above the missing part: links again
    assert walk_in_root(str(tmp_path), path, must_exist=False) == "/etc/z"
    with pytest.raises(FileNotFoundError):
        walk_in_root(str(tmp_path), path)


def test_a_file_in_the_middle_is_not_a_directory(tmp_path: Path) -> None:
    (tmp_path / "f").write_text("x")
    with pytest.raises(NotADirectoryError):
        walk_in_root(str(tmp_path), "/f/x")
    assert walk_in_root(str(tmp_path), "/f/x", must_exist=False) == "/f/x"
    assert walk_in_root(str(tmp_path), "/f/../f") == "/f"


def test_read_text_refuses_a_fifo_without_blocking_and_caps_the_size(tmp_path) -> None:
    os.mkfifo(tmp_path / "fifo")
    (tmp_path / "big").write_bytes(b"1" * (64 << 10 | 1))
    r = HostRoot.at(tmp_path)
    with pytest.raises(UnreadableFile, match=r"a pipe \(FIFO\), not a regular file"):
        r.read_text("/fifo")
    with pytest.raises(UnreadableFile, match="larger than"):
        r.read_text("/big")
    assert len(r.read_text("/big", limit=1 << 20)) == 64 << 10 | 1


def test_read_text_follows_a_last_symlink_inside_the_root(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "real").write_text("inside")
    os.symlink("/etc/real", tmp_path / "etc" / "link")
    assert HostRoot.at(tmp_path).read_text("/etc/link") == "inside"


@pytest.mark.parametrize("text,value", [
    ("42\n", 42), ("0", 0), ("²", None), ("-7", None), ("+7", None), ("1_0", None),
    ("9" * 5000, None), ("", None), ("٣", None)])
def test_parse_uint(text: str, value: int | None) -> None:
    assert kernel.parse_uint(text) == value


def test_proc_devices_skips_bad_majors(tmp_path: Path) -> None:
    (tmp_path / "proc").mkdir()
    (tmp_path / "proc" / "devices").write_text(
        "Character devices:\n  1 mem\n² kfd\n" + "9" * 5000 + " drm\n 226 drm\n")
    assert kernel.proc_devices(HostRoot.at(tmp_path)) == {"mem": frozenset({1}),
                                                          "drm": frozenset({226})}


# ---- families ----------------------------------------------------------------------------


def test_amd_fifo_generation_id_and_bad_numbers_are_problems(tmp_path: Path) -> None:
    root = materialise("mi300x", tmp_path / "node")
    before = len(amd.discover(root).devices)
    gen = Path(root.local("/sys/devices/virtual/kfd/kfd/topology/generation_id"))
    gen.unlink()
    os.mkfifo(gen)
    nodes = sorted(os.listdir(root.local(KFD_NODES)), key=int)
    gpu_nodes = [n for n in nodes if os.path.exists(root.local(f"{KFD_NODES}/{n}/gpu_id"))
                 and "simd_count 0\n" not in Path(root.local(
                     f"{KFD_NODES}/{n}/properties")).read_text()]
    bad = gpu_nodes[0]
    Path(root.local(f"{KFD_NODES}/{bad}/gpu_id")).write_text("²\n")
    props = Path(root.local(f"{KFD_NODES}/{gpu_nodes[1]}/properties"))
    props.write_text(props.read_text() + "max_engine_clk_fcompute " + "9" * 5000 + "\n")
    found = amd.discover(root)
    assert len(found.devices) == before
    problems = msgs(found)
    assert [m for s, m in problems.items() if s.endswith("/generation_id")] == [
        "unreadable: a pipe (FIFO), not a regular file"]
    assert problems[f"{KFD_NODES}/{bad}/gpu_id"] == "not a number: '²'"
    assert "not a number" in problems[f"{KFD_NODES}/{gpu_nodes[1]}/properties"]


def test_neuron_huge_or_superscript_core_counts_are_problems(tmp_path: Path) -> None:
    root = materialise("trn1", tmp_path / "trn1")
    sysfs = "/sys/class/neuron_device"
    Path(root.local(f"{sysfs}/neuron3/core_count")).write_text("1000000\n")
    Path(root.local(f"{sysfs}/neuron4/core_count")).write_text("²\n")
    Path(root.local(f"{sysfs}/neuron5/connected_devices")).write_text("1, ²\n")
    found = discover_neuron(root)
    assert len([d for d in found.devices if d.kind != KIND_CORE]) == 16
    assert len([d for d in found.devices if d.kind == KIND_CORE]) == 6  # up to neuron3
    p = msgs(found)
    assert f"more than the {MAX_CORES}" in p[f"{sysfs}/neuron3/core_count"]
    assert p[f"{sysfs}/neuron4/core_count"] == "not a number: '²'"
    assert "not a list" in p[f"{sysfs}/neuron5/connected_devices"]


def test_gaudi_superscript_module_id_is_a_problem(tmp_path: Path) -> None:
    root = materialise("gaudi2-hls", tmp_path / "node")
    before = gaudi.discover(root)
    first = before.devices[0]
    paths = [p for p in Path(root.root).rglob("module_id")]
    paths[0].write_text("²\n")
    found = gaudi.discover(root)
    assert len(found.devices) == len(before.devices) and first is not None
    assert "not a number: '²'" in msgs(found).values()


@pytest.mark.parametrize("minor,mode", [("-7", "292"), ("99999999999", "292"),
                                        ("21", "-1"), ("21", "99999")])
def test_nvidia_cap_fields_out_of_range_are_problems(fake_root, minor, mode) -> None:
    root = fake_root("a100-mig-nocaps")
    os.unlink(root.local(MIG_MINORS))
    Path(root.local(f"{GI2}/ci0/access")).write_text(
        f"DeviceFileMinor: {minor}\nDeviceFileMode: {mode}\nDeviceFileModify: 1\n")
    found = discover_nvidia(root)
    migs = {d.name for d in found.devices if d.kind == KIND_MIG}
    assert "0:0" not in migs and len(migs) == 6  # the other MIG devices, and the GPUs
    assert "is left out" in msgs(found)[f"{GI2}/ci0/access"]
    assert all(n.minor >= 0 for d in found.devices for n in d.edits.device_nodes)


# ---- ld.so.cache -------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["fifo", "dir"])
def test_an_ld_so_cache_that_is_no_file_is_a_problem(tmp_path: Path, kind: str) -> None:
    (tmp_path / "etc").mkdir()
    (os.mkfifo if kind == "fifo" else os.mkdir)(tmp_path / "etc" / "ld.so.cache")
    loc = Locator(HostRoot.at(tmp_path), ARCHES["x86_64"])
    assert [p.source for p in loc.problems] == ["/etc/ld.so.cache"]
    assert loc.cache == ()


def test_ld_so_cache_over_16_mib_is_refused(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "ld.so.cache").write_bytes(
        ld_so_cache_bytes([("libx.so.1", "x86-64", "/lib/libx.so.1")]).ljust(17 << 20, b"\0"))
    loc = Locator(HostRoot.at(tmp_path), ARCHES["x86_64"])
    assert "larger than" in loc.problems[0].message


def test_the_cache_index_matches_names_and_their_dotted_prefixes(tmp_path: Path) -> None:
    lib = tmp_path / "usr" / "lib64"
    lib.mkdir(parents=True)
    for n in ("libcuda.so.1", "libcudart.so.12"):
        (lib / n).write_text("placeholder")
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc" / "ld.so.cache").write_bytes(ld_so_cache_bytes([
        ("libcudart.so.12", "x86-64", "/usr/lib64/libcudart.so.12"),
        ("libcuda.so.1", "x86-64", "/usr/lib64/libcuda.so.1")]))
    loc = Locator(HostRoot.at(tmp_path), ARCHES["x86_64"])
    assert list(loc._candidates("libcuda.so", loc.arch)) == ["/usr/lib64/libcuda.so.1"]
    assert list(loc._candidates("libcuda", loc.arch)) == ["/usr/lib64/libcuda.so.1"]
    assert list(loc._candidates("libcuda.so.1", loc.arch)) == ["/usr/lib64/libcuda.so.1"]
    assert list(loc._candidates("libcu", loc.arch)) == []
