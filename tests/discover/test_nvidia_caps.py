"""MIG devices on a node whose /dev/nvidia-caps nodes nothing has created yet: the
capability minors from /proc/driver/nvidia-caps/mig-minors, grants without host nodes,
and (only when the config allows it) the nodes and /dev/char links created on the host.

The fake root a100-mig-nocaps stands for the DGX A100 of a100-mig right after a reboot
(its README); the real pynvml drives the fake libnvidia-ml as in test_nvidia.py.
"""

from __future__ import annotations

import asyncio
import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest

from nri_accel.config import Config, DiscoveryConfig, parse_config
from nri_accel.discover import discover
from nri_accel.discover.base import Found
from nri_accel.discover.hostroot import HostRoot
from nri_accel.discover.watch import Refresher, nodes_match, watch_state
from nri_accel.inventory import Device, Inventory
from nri_accel.vendors.nvidia import KIND_MIG
from nri_accel.vendors.nvidia.discover import MIG_MINORS, discover_nvidia, parse_mig_minors

FakeRoot = Callable[[str], HostRoot]
CAPS = "/dev/nvidia-caps"
GI2 = "/proc/driver/nvidia/capabilities/gpu0/mig/gi2"
CREATE = Config(discovery=DiscoveryConfig(create_device_nodes=True))


def migs(found: Found | Inventory) -> dict[str, Device]:
    return {d.name: d for d in found.devices if d.kind == KIND_MIG}


def cap_nodes(d: Device) -> list[tuple[str, int, int, int | None]]:
    return [(n.path, n.major, n.minor, n.file_mode) for n in d.edits.device_nodes[1:]]


def problems(found: Found | Inventory) -> dict[str, str]:
    return {p.source: p.message for p in found.problems}


# internal/nvcaps/nvcaps_test.go (NVIDIA/nvidia-container-toolkit), TestProcessMinorsFile
# and TestProcessMigMinorsLine: "<capability> <minor>" lines; config, monitor,
# gpuN/giG/access and gpuN/giG/ciC/access; anything else skipped.
@pytest.mark.parametrize(("lines", "expected"), [
    ([], {}),
    (["invalidLine"], {}),
    (["config 1"], {"config": 1}),
    (["monitor 2"], {"monitor": 2}),
    (["gpu0/gi0/access 3"], {"gpu0/gi0/access": 3}),
    (["gpu0/gi0/ci0/access 4"], {"gpu0/gi0/ci0/access": 4}),
    (["config 1", "invalidLine"], {"config": 1}),
    (["config 1", "gpu0/gi0/ci0/access 4"], {"config": 1, "gpu0/gi0/ci0/access": 4}),
    (["notconfig 99"], {}),
    (["config notanint"], {}),
    ([""], {}),
    # beyond the upstream table: no negative, huge or non-ASCII minors, no paths
    (["config -1", "monitor 99999999", "gpu0/gi0/access \uff13"], {}),
    (["gpu0/gi0/../access 3", "/gpu0/gi0/access 3", "gpu0/gi0/access 3 4"], {}),
])
def test_parse_mig_minors(lines: list[str], expected: dict[str, int]) -> None:
    assert parse_mig_minors("\n".join(lines)) == expected


def test_mig_devices_without_cap_nodes_are_granted_anyway(fake_root: FakeRoot) -> None:
    root = fake_root("a100-mig-nocaps")
    found = discover_nvidia(root)
    by = migs(found)
    assert list(by) == ["0:0", "0:1", "0:2", "0:3", "1:0", "1:1", "1:2"]
    # minors from mig-minors (3 + 135 x gpu + 9 x gi [+ 1 + ci]), major 236 from
    # /proc/devices, mode the capability file's DeviceFileMode 292 = 0444
    assert cap_nodes(by["0:0"]) == [(f"{CAPS}/nvidia-cap21", 236, 21, 0o444),
                                    (f"{CAPS}/nvidia-cap22", 236, 22, 0o444)]
    assert cap_nodes(by["1:1"]) == [(f"{CAPS}/nvidia-cap147", 236, 147, 0o444),
                                    (f"{CAPS}/nvidia-cap149", 236, 149, 0o444)]
    assert all(n.type == "c" and n.host_path == "" for d in by.values()
               for n in d.edits.device_nodes)
    (drv,) = found.drivers
    assert [(n.path, n.minor) for n in drv.capabilities["mig-config"].device_nodes] == [
        (f"{CAPS}/nvidia-cap1", 1)]
    # each missing node is a Problem saying how the device is still granted
    msg = problems(found)[f"{CAPS}/nvidia-cap21"]
    assert msg.startswith("missing: MIG device 0:0 (MIG-46403463-e963-3405-3e03-74a2cd8feaf9)"
                          " is granted anyway as char 236:21, which the runtime creates in "
                          "the container")
    assert f"nvidia-modprobe -f {GI2}/access" in msg
    assert "create_device_nodes = true" in msg
    assert len(problems(found)) == 15  # 13 MIG capability nodes, config, monitor
    assert not os.path.lexists(root.local(CAPS))  # nothing was written


def test_created_nodes_and_links_when_the_config_allows_it(fake_root: FakeRoot) -> None:
    root = fake_root("a100-mig-nocaps")
    found = discover_nvidia(root, create_device_nodes=True)
    assert found.problems == ()
    st = os.lstat(root.local(f"{CAPS}/nvidia-cap22"))
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(236, 22)
    assert stat.S_IMODE(st.st_mode) == 0o444  # the capability file's DeviceFileMode
    assert stat.S_IMODE(os.lstat(root.local(CAPS)).st_mode) == 0o755
    assert os.readlink(root.local("/dev/char/236:22")) == "../nvidia-caps/nvidia-cap22"
    assert os.readlink(root.local("/dev/char/236:1")) == "../nvidia-caps/nvidia-cap1"
    # what is granted is what a node that had the nodes gets
    assert cap_nodes(migs(found)["0:0"]) == [(f"{CAPS}/nvidia-cap21", 236, 21, 0o444),
                                             (f"{CAPS}/nvidia-cap22", 236, 22, 0o444)]
    # a second discovery finds them and changes nothing
    assert discover_nvidia(root, create_device_nodes=True) == found
    assert discover_nvidia(root) == found


def test_missing_dev_char_links_are_created_only_when_allowed(fake_root: FakeRoot) -> None:
    root = fake_root("h100")
    os.unlink(root.local("/dev/char/195:1"))
    assert "/dev/char/195:1" in problems(discover_nvidia(root))
    assert not os.path.lexists(root.local("/dev/char/195:1"))
    assert discover_nvidia(root, create_device_nodes=True).problems == ()
    assert os.readlink(root.local("/dev/char/195:1")) == "../nvidia1"


def test_a_missing_uvm_node_of_a_loaded_driver_is_granted_and_made_only_when_allowed(
        fake_root: FakeRoot) -> None:
    # nvidia-uvm loaded (/proc/devices lists its major, 509) but no /dev/nvidia-uvm yet,
    # which CUDA cannot start without: nvidia-modprobe -u makes it, and so does
    # libnvidia-container on every container start. Granted as char 509:0 (the runtime
    # makes it in the container), and made on the host with create_device_nodes.
    root = fake_root("h100")
    os.unlink(root.local("/dev/nvidia-uvm"))
    os.unlink(root.local("/dev/char/509:0"))
    found = discover_nvidia(root)
    (compute,) = [found.drivers[0].capabilities["compute"]]
    assert [(n.path, n.major, n.minor, n.file_mode) for n in compute.device_nodes] == [
        ("/dev/nvidia-uvm", 509, 0, 0o666), ("/dev/nvidia-uvm-tools", 509, 1, 0o666)]
    assert problems(found)["/dev/nvidia-uvm"].startswith(
        "missing: /dev/nvidia-uvm (compute) is granted anyway as char 509:0")
    assert "nvidia-modprobe -u -c=0" in problems(found)["/dev/nvidia-uvm"]
    assert not os.path.lexists(root.local("/dev/nvidia-uvm"))
    made = discover_nvidia(root, create_device_nodes=True)
    st = os.lstat(root.local("/dev/nvidia-uvm"))
    assert stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(509, 0)
    assert os.readlink(root.local("/dev/char/509:0")) == "../nvidia-uvm"
    assert made.problems == ()
    assert made.drivers[0].capabilities["compute"].device_nodes == compute.device_nodes


def test_a_wrong_link_is_reported_never_replaced(fake_root: FakeRoot) -> None:
    root = fake_root("h100")
    os.unlink(root.local("/dev/char/195:1"))
    os.symlink("../nvidia0", root.local("/dev/char/195:1"))
    found = discover_nvidia(root, create_device_nodes=True)
    assert problems(found)["/dev/char/195:1"].startswith("points to ../nvidia0")
    assert os.readlink(root.local("/dev/char/195:1")) == "../nvidia0"


def test_creation_refused_in_a_symlinked_directory(fake_root: FakeRoot,
                                                   tmp_path: Path) -> None:
    # /dev/nvidia-caps planted as a link elsewhere: nothing is created through it, and
    # the devices are still granted without their host nodes.
    root = fake_root("a100-mig-nocaps")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    os.symlink(str(elsewhere), root.local(CAPS))
    found = discover_nvidia(root, create_device_nodes=True)
    assert list(elsewhere.iterdir()) == []
    assert len(migs(found)) == 7
    msg = problems(found)[f"{CAPS}/nvidia-cap21"]
    assert msg.startswith("missing, and cannot create it (not a directory (or a symlink)): "
                          "MIG device 0:0")


def test_an_existing_wrong_cap_node_is_refused_not_replaced(fake_root: FakeRoot) -> None:
    root = fake_root("a100-mig-nocaps")
    os.makedirs(root.local(CAPS))
    os.mknod(root.local(f"{CAPS}/nvidia-cap21"), stat.S_IFCHR | 0o444, os.makedev(236, 99))
    found = discover_nvidia(root, create_device_nodes=True)
    assert "0:0" not in migs(found)
    assert problems(found)[f"{CAPS}/nvidia-cap21"] == (
        "is device 236:99, expected 236:21: MIG device 0:0 "
        "(MIG-46403463-e963-3405-3e03-74a2cd8feaf9) is left out")
    assert os.lstat(root.local(f"{CAPS}/nvidia-cap21")).st_rdev == os.makedev(236, 99)


def test_minor_falls_back_to_the_capability_file(fake_root: FakeRoot) -> None:
    # A driver without mig-minors (or a table without the entry): DeviceFileMinor of the
    # capability file, as libnvidia-container reads it.
    root = fake_root("a100-mig-nocaps")
    os.unlink(root.local(MIG_MINORS))
    found = discover_nvidia(root)
    assert cap_nodes(migs(found)["0:0"])[0][:3] == (f"{CAPS}/nvidia-cap21", 236, 21)
    assert len(migs(found)) == 7


def test_table_and_capability_file_disagreeing_is_refused(fake_root: FakeRoot) -> None:
    root = fake_root("a100-mig-nocaps")
    Path(root.local(f"{GI2}/ci0/access")).write_text(
        "DeviceFileMinor: 31\nDeviceFileMode: 292\nDeviceFileModify: 1\n")
    found = discover_nvidia(root)
    assert "0:0" not in migs(found)
    assert problems(found)[f"{GI2}/ci0/access"] == (
        f"says minor 31 but {MIG_MINORS} says 22 for gpu0/gi2/ci0/access: MIG device 0:0 "
        "(MIG-46403463-e963-3405-3e03-74a2cd8feaf9) is left out")


def test_no_minor_anywhere_leaves_the_device_out(fake_root: FakeRoot) -> None:
    root = fake_root("a100-mig-nocaps")
    os.unlink(root.local(MIG_MINORS))
    os.unlink(root.local(f"{GI2}/access"))
    found = discover_nvidia(root)
    assert "0:0" not in migs(found) and "0:1" in migs(found)
    assert problems(found)[f"{GI2}/access"] == (
        f"missing or unreadable, and {MIG_MINORS} has no gpu0/gi2/access: MIG device 0:0 "
        "(MIG-46403463-e963-3405-3e03-74a2cd8feaf9) is left out")


def test_the_config_key(tmp_path: Path) -> None:
    assert Config().discovery.create_device_nodes is False
    cfg = parse_config({"discovery": {"create_device_nodes": True}})
    assert cfg.discovery.create_device_nodes is True


def test_discover_creates_only_with_the_config(fake_root: FakeRoot) -> None:
    root = fake_root("a100-mig-nocaps")
    discover(root, Config())
    assert not os.path.lexists(root.local(CAPS))
    inv = discover(root, CREATE)
    assert os.path.exists(root.local(f"{CAPS}/nvidia-cap157"))
    assert not [p for p in inv.problems if p.source.startswith(CAPS)]


def test_refresh_is_quiet_while_granted_nodes_stay_missing(fake_root: FakeRoot) -> None:
    # A node recorded as missing (a Problem names it) still matches while it is missing;
    # once something creates it, the probe sees /dev/nvidia-caps change and discovery
    # picks the node up.
    root = fake_root("a100-mig-nocaps")
    state = watch_state(root, Config())
    inv = discover(root, Config())
    assert nodes_match(root, inv)
    calls: list[Inventory] = []
    refresher = Refresher(root, Config(), inv, calls.append, state=state)
    assert asyncio.run(refresher.check()) is None
    os.makedirs(root.local(CAPS))
    os.mknod(root.local(f"{CAPS}/nvidia-cap21"), stat.S_IFCHR | 0o444, os.makedev(236, 21))
    new = asyncio.run(refresher.check())
    assert new is not None and f"{CAPS}/nvidia-cap21" not in problems(new)
    # a granted node that disappears is a change, as before
    os.unlink(root.local(f"{CAPS}/nvidia-cap21"))
    assert not nodes_match(root, new)
