"""Static devices from the config: nodes from lstat, refusals, duplicates."""

from __future__ import annotations

from pathlib import Path

from hosttree import HostTree

from nri_accel.config import StaticDevice, parse_config
from nri_accel.inventory import DeviceNode
from nri_accel.vendors.cdi.static import discover_static


def _tree(tmp_path: Path) -> HostTree:
    tree = HostTree(tmp_path / "node")
    tree.chardev("/dev/npu0", 240, 0)
    tree.chardev("/dev/npu-ctl", 240, 255)
    tree.blockdev("/dev/nvme9n1", 259, 7)
    return tree


def test_config_entries_become_devices_with_host_numbers(tmp_path: Path) -> None:
    config = parse_config({"static": {"devices": [
        {"kind": "acme.example/npu", "name": "npu0",
         "device_nodes": ["/dev/npu0", "/dev/npu-ctl"], "env": ["ACME_VISIBLE=0"]},
        {"kind": "acme.example/disk", "name": "scratch", "device_nodes": ["/dev/nvme9n1"]},
    ]}})
    found = discover_static(_tree(tmp_path).root, config.static_devices)
    assert found.problems == ()
    npu, disk = found.devices
    assert npu.qualified_name == "acme.example/npu=npu0"
    assert npu.edits.env == ("ACME_VISIBLE=0",)
    assert npu.edits.device_nodes == (DeviceNode("/dev/npu0", 240, 0),
                                      DeviceNode("/dev/npu-ctl", 240, 255))
    assert npu.vendor == ""
    assert npu.attributes["origin"] == "config"
    assert disk.edits.device_nodes == (DeviceNode("/dev/nvme9n1", 259, 7, type="b"),)


def test_entry_with_a_symlinked_missing_or_plain_node_is_left_out_whole(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    tree.symlink("/dev/npu/by-id/0", "../../npu0")
    tree.file("/dev/npu-log", "")
    entries = [
        StaticDevice("acme.example/npu", "a", ("/dev/npu0", "/dev/npu/by-id/0")),
        StaticDevice("acme.example/npu", "b", ("/dev/npu7",)),
        StaticDevice("acme.example/npu", "c", ("/dev/npu-log",)),
        StaticDevice("acme.example/npu", "d", ("/dev/npu0",)),
    ]
    found = discover_static(tree.root, entries)
    assert [d.name for d in found.devices] == ["d"]
    assert [(p.source, p.message) for p in found.problems] == [
        ("/dev/npu/by-id/0", "static device acme.example/npu=a left out: is a symlink; "
                             "device nodes must be the node itself"),
        ("/dev/npu7", "static device acme.example/npu=b left out: device node does not exist"),
        ("/dev/npu-log", "static device acme.example/npu=c left out: is not a character "
                         "or block device"),
    ]


def test_entry_the_safety_rules_refuse_is_left_out_before_anything_is_read(
        tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    # A real character device under /sys: only the rule (nodes live under /dev) stops it.
    tree.chardev("/sys/devices/virtual/acme/npu0", 240, 0)
    config = parse_config({"static": {"devices": [
        {"kind": "acme.example/npu", "name": "sys", "device_nodes": [
            "/dev/npu0", "/sys/devices/virtual/acme/npu0"]},
        {"kind": "acme.example/npu", "name": "preload", "device_nodes": ["/dev/npu0"],
         "env": ["LD_PRELOAD=/opt/acme/shim.so"]},
        {"kind": "acme.example/npu", "name": "ok", "device_nodes": ["/dev/npu0"]},
    ]}})
    found = discover_static(tree.root, config.static_devices)
    assert [d.name for d in found.devices] == ["ok"]
    assert [(p.source, p.message) for p in found.problems] == [
        ("static device acme.example/npu=sys",
         "left out: device node '/sys/devices/virtual/acme/npu0' is not under /dev"),
        ("static device acme.example/npu=preload",
         "left out: env LD_PRELOAD may not be set by nri-accel"),
    ]


def test_a_name_declared_twice_keeps_the_first(tmp_path: Path) -> None:
    entries = [StaticDevice("acme.example/npu", "npu0", ("/dev/npu0",), ("N=first",)),
               StaticDevice("acme.example/npu", "npu0", ("/dev/npu-ctl",), ("N=second",))]
    found = discover_static(_tree(tmp_path).root, entries)
    assert [d.edits.env for d in found.devices] == [("N=first",)]
    assert found.problems[0].source == "static device acme.example/npu=npu0"


def test_no_entries_no_devices(tmp_path: Path) -> None:
    found = discover_static(_tree(tmp_path).root, ())
    assert (found.devices, found.problems) == ((), ())
