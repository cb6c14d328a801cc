"""Inventory model: ordering, lookups, edits merging, JSON round trip and validation."""

from __future__ import annotations

import json

import msgspec
import pytest

from nri_accel.errors import InventoryError
from nri_accel.inventory import (
    ContainerEdits,
    Device,
    DeviceNode,
    Driver,
    Inventory,
    Mount,
    Problem,
    format_pci_bus_id,
    merge_edits,
    natural_key,
    parse_pci_bus_id,
)


def _gpu(i: int, **kw) -> Device:
    return Device(kind="nvidia.com/gpu", name=str(i), uuid=f"GPU-{i:04x}",
                  aliases=(f"0000:{i:02x}:00.0",),
                  edits=ContainerEdits(device_nodes=(DeviceNode(f"/dev/nvidia{i}", 195, i),)),
                  vendor="nvidia", **kw)


def test_devices_sorted_naturally_and_indexed() -> None:
    inv = Inventory(devices=(_gpu(10), _gpu(2), _gpu(1)))
    assert [d.name for d in inv.of_kind("nvidia.com/gpu")] == ["1", "2", "10"]
    assert inv.find("nvidia.com/gpu", "gpu-000a").name == "10"  # UUIDs are case-insensitive
    assert inv.find("nvidia.com/gpu", "0000:02:00.0").name == "2"
    assert inv.find("nvidia.com/gpu", "3") is None
    assert inv.find("aws.amazon.com/neuron", "1") is None


def test_parse_pci_bus_id_reads_every_padding_and_case() -> None:
    assert parse_pci_bus_id("00000000:3B:00.0") == parse_pci_bus_id("0:3b:0.0") == (
        0, 0x3B, 0, 0)
    assert format_pci_bus_id(parse_pci_bus_id("00000001:3B:1F.7")) == "0001:3b:1f.7"
    for bad in ("GPU-1", "7:1", "x:y:z.0", "0:3b:00.8", "0:100:00.0", "0:3b:00.0 ",
                "0:+3b:00.0", "0:3_b:00.0", "0:0x3b:00.0"):
        assert parse_pci_bus_id(bad) is None, bad


def test_natural_key_orders_mig_names() -> None:
    names = ["0:10", "0:2", "1:0", "0:1", "10:0", "2:0"]
    assert sorted(names, key=natural_key) == ["0:1", "0:2", "0:10", "1:0", "2:0", "10:0"]


def test_merge_edits_dedups_first_wins() -> None:
    a = ContainerEdits(env=("A=1", "B=2"), device_nodes=(DeviceNode("/dev/x", 1, 1),),
                       mounts=(Mount("/h/lib.so.1", "/usr/lib/lib.so.1"),), additional_gids=(44,))
    b = ContainerEdits(env=("A=9", "C=3"), device_nodes=(DeviceNode("/dev/x", 9, 9),
                                                         DeviceNode("/dev/y", 1, 2)),
                       mounts=(Mount("/other", "/usr/lib/lib.so.1"),), additional_gids=(44, 45))
    m = merge_edits([a, b])
    assert m.env == ("A=1", "B=2", "C=3")
    assert [(n.path, n.major) for n in m.device_nodes] == [("/dev/x", 1), ("/dev/y", 1)]
    assert [x.host_path for x in m.mounts] == ["/h/lib.so.1"]
    assert m.additional_gids == (44, 45)
    assert a.merged(b) == m
    assert not ContainerEdits() and m


def test_json_round_trip_is_lossless_and_stable() -> None:
    inv = Inventory(
        devices=(_gpu(0, numa_node=0, attributes={"brand": "tesla"}, links=("1",)), _gpu(1)),
        drivers={"nvidia": Driver("nvidia", "550.54.15", "12.4", {
            "": ContainerEdits(device_nodes=(DeviceNode("/dev/nvidiactl", 195, 255),)),
            "compute": ContainerEdits(mounts=(Mount("/usr/lib/libcuda.so.550.54.15",
                                                    "/usr/local/nvidia/lib64/libcuda.so.1"),)),
        })},
        problems=(Problem("/dev/char/195:1", "missing"),),
    )
    text = inv.to_json()
    again = Inventory.from_json(text)
    assert again == inv
    assert again.to_json() == text
    assert again.find("nvidia.com/gpu", "0").attributes["brand"] == "tesla"
    assert json.loads(text)["schema_version"] == 1


@pytest.mark.parametrize(
    ("doc", "fragment"),
    [
        ("[]", "top level"),
        ('{"schema_version": 99}', "unsupported schema_version 99"),
        ('{"schema_version": 1, "devices": [{"kind": "a/b"}]}', "devices[0]"),
        ('{"schema_version": 1, "devices": [{"kind": "a/b", "name": "x", "bogus": 1}]}',
         "unknown field 'bogus'"),
        ('{"schema_version": 1, "devices": [{"kind": "a/b", "name": 3}]}',
         "devices[0].name: expected str"),
        ('{"schema_version": 1, "devices": [{"kind": "a/b", "name": "x", "edits": '
         '{"device_nodes": [{"path": "/dev/x", "major": true, "minor": 1}]}}]}',
         "major: expected int, got bool"),
        ("{not json", "not valid JSON"),
    ],
)
def test_bad_inventory_json_names_the_place(doc: str, fragment: str) -> None:
    with pytest.raises(InventoryError) as err:
        Inventory.from_json(doc, origin="node.json")
    assert "node.json" in str(err.value)
    assert fragment in str(err.value)


def test_load_missing_file_names_it(tmp_path) -> None:
    with pytest.raises(InventoryError, match=r"nope\.json"):
        Inventory.load(tmp_path / "nope.json")


def test_edits_hash_by_value_once_and_a_replaced_copy_hashes_anew() -> None:
    node = DeviceNode("/dev/nvidia0", 195, 0)
    a = ContainerEdits(env=("A=1",), device_nodes=(node,))
    b = ContainerEdits(env=("A=1",), device_nodes=(DeviceNode("/dev/nvidia0", 195, 0),))
    assert a == b and hash(a) == hash(b) == hash(a)  # the second hash(a): the cached one
    changed = msgspec.structs.replace(a, env=("A=2",))
    assert changed != a and hash(changed) == hash(ContainerEdits(env=("A=2",),
                                                                 device_nodes=(node,)))
    assert "_hash" not in json.dumps(Inventory(devices=(Device("k/x", "0", edits=a),))
                                     .to_dict())
