"""Inventory model: ordering, lookups, edits merging, JSON round trip and validation."""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import msgspec
import pytest

import nri_accel.demo
from nri_accel.cli import main
from nri_accel.errors import InventoryError
from nri_accel.inventory import (
    MAX_INVENTORY_BYTES,
    ContainerEdits,
    Device,
    DeviceNode,
    Driver,
    Inventory,
    Mount,
    Problem,
    format_pci_bus_id,
    identity_collisions,
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


def _node(major: object, minor: object) -> str:
    return json.dumps({"path": "/dev/x", "major": major, "minor": minor})


def _one_device(extra: str) -> str:
    return '{"schema_version": 1, "devices": [{"kind": "a/b", "name": "x"' + extra + "}]}"


def _one_node(major: object, minor: object) -> str:
    return _one_device(f', "edits": {{"device_nodes": [{_node(major, minor)}]}}')


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ("[]", "top level: expected an object, got list"),
        ('{"schema_version": 99}', "schema_version: unsupported version 99 (this build reads 1)"),
        ('{"schema_version": true}',
         "schema_version: unsupported version True (this build reads 1)"),
        ('{"devices": []}', "schema_version: unsupported version None (this build reads 1)"),
        ('{"schema_version": 1, "device": []}', "top level: unknown field 'device'"),
        ('{"schema_version": 1, "devices": 3}', "devices: expected a list, got int"),
        ('{"schema_version": 1, "drivers": 5}', "drivers: expected a list, got int"),
        ('{"schema_version": 1, "problems": null}', "problems: expected a list, got null"),
        ('{"schema_version": 1, "drivers": {}}', "drivers: expected a list, got object"),
        ('{"schema_version": 1, "devices": [[]]}', "devices[0]: expected an object, got list"),
        ('{"schema_version": 1, "devices": [{"kind": "a/b"}]}',
         "devices[0]: Missing required argument 'name'"),
        (_one_device(', "bogus": 1'), "devices[0]: unknown field 'bogus'"),
        ('{"schema_version": 1, "devices": [{"kind": "a/b", "name": 3}]}',
         "devices[0].name: expected str, got int"),
        (_one_device(', "aliases": "y"'), "devices[0].aliases: expected a list, got str"),
        (_one_device(', "attributes": []'), "devices[0].attributes: expected an object, got list"),
        (_one_node(True, 1),
         "devices[0].edits.device_nodes[0].major: expected int, got bool"),
        (_one_node(-1, 1),
         "devices[0].edits.device_nodes[0].major: -1 is not a device major (0 to 4095)"),
        (_one_node(1, -2),
         "devices[0].edits.device_nodes[0].minor: -2 is not a device minor (0 to 1048575)"),
        (_one_node(4096, 0),
         "devices[0].edits.device_nodes[0].major: 4096 is not a device major (0 to 4095)"),
        ('{"schema_version": 1, "drivers": [{"vendor": "v", "capabilities": {"": '
         f'{{"device_nodes": [{_node(195, -1)}]}}}}}}]}}',
         "drivers[0].capabilities..device_nodes[0].minor: -1 is not a device minor "
         "(0 to 1048575)"),
        ('{"schema_version": 1, "devices": [{"kind": "", "name": ""}]}',
         "devices[0].kind: '' is not a device kind (vendor/class, such as nvidia.com/gpu)"),
        ('{"schema_version": 1, "devices": [{"kind": "gpu", "name": "0"}]}',
         "devices[0].kind: 'gpu' is not a device kind (vendor/class, such as nvidia.com/gpu)"),
        ('{"schema_version": 1, "devices": [{"kind": "a/b", "name": ""}]}',
         "devices[0].name: empty: a device needs a name"),
        (_one_device(', "aliases": ["y", ""]'), "devices[0].aliases[1]: empty"),
        (_one_device(', "pci_bus_id": "GPU-1"'),
         "devices[0].pci_bus_id: 'GPU-1' is not a PCI bus id (domain:bus:device.function, "
         "such as 0000:3b:00.0)"),
        ('{"schema_version": 1, "drivers": [{"vendor": ""}]}',
         "drivers[0].vendor: empty: a driver needs a vendor"),
        ('{"schema_version": 1, "drivers": [{"vendor": "v"}, {"vendor": "w"}, {"vendor": "v"}]}',
         "drivers[2].vendor: 'v' is already the vendor of drivers[0]"),
        ("{not json", "not valid JSON: Expecting property name enclosed in double quotes: "
                      "line 1 column 2 (char 1)"),
        # "npu::1" would be read as a time-slicing replica of "npu" (select.resolve)
        ('{"schema_version": 1, "devices": [{"kind": "acme.example/npu", "name": "npu::1"}]}',
         "devices[0].name: 'npu::1' holds '::', which kubelet's time-slicing replica ids use"),
    ],
)
def test_bad_inventory_json_names_the_file_then_the_json_path(doc: str, message: str) -> None:
    with pytest.raises(InventoryError) as err:
        Inventory.from_json(doc, origin="node.json")
    assert (err.value.source, err.value.message) == ("node.json", message)
    assert str(err.value) == f"node.json: {message}"  # the file once, then the JSON path


# ---- identities: what names a device belongs to one device --------------------------

GOLDEN = Path(__file__).parent / "golden"
H100 = GOLDEN / "discover" / "h100.json"  # devices[0..3]: GPUs 0..3, each aliased by its bus
UUID0 = "GPU-74106407-f32f-0663-90a7-a1acf7eb04ae"


def _h100(change) -> dict:
    doc = json.loads(H100.read_text())
    assert [d["name"] for d in doc["devices"]] == ["0", "1", "2", "3"]
    assert doc["devices"][0]["uuid"] == UUID0
    assert doc["devices"][0]["aliases"] == [doc["devices"][0]["pci_bus_id"]] == ["0000:19:00.0"]
    change(doc["devices"])
    return doc


def _set(i: int, **fields):
    def change(devices: list) -> None:
        devices[i].update(fields)
    return change


def _add(**device):
    return lambda devices: devices.append(device)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        # The audit's case: explain of nvidia.com/gpu=0,1 granted GPU 0's UUID twice.
        (_set(1, uuid=UUID0), f"devices[1].uuid: '{UUID0}' is also devices[0].uuid"),
        (_set(3, uuid=UUID0.upper()),  # UUIDs compare case-insensitively, as find()
         f"devices[3].uuid: '{UUID0.upper()}' is also devices[0].uuid"),
        (_set(2, name="0"), "devices[2].name: '0' is also devices[0].name"),
        (_set(2, aliases=["0"]), "devices[2].aliases[0]: '0' is also devices[0].name"),
        (_set(1, aliases=["x", UUID0]),
         f"devices[1].aliases[1]: '{UUID0}' is also devices[0].uuid"),
        (_set(1, aliases=["0000:19:00.0"]),
         "devices[1].aliases[0]: '0000:19:00.0' is also devices[0].aliases[0]"),
        # The same PCI function in another padding and case is the same device.
        (_set(1, aliases=["00000000:19:00.0"]),
         "devices[1].aliases[0]: '00000000:19:00.0' is also devices[0].aliases[0]"),
        (_set(1, pci_bus_id="0:19:0.0"),
         "devices[1].pci_bus_id: '0:19:0.0' is also devices[0].aliases[0]"),
        # A UUID names one piece of hardware, whatever kind lists it.
        (_add(kind="acme.example/npu", name="npu0", uuid=UUID0),
         f"devices[4].uuid: '{UUID0}' is also devices[0].uuid"),
        (_add(kind="nvidia.com/gpu", name="0000:19:00.0"),
         "devices[4].name: '0000:19:00.0' is also devices[0].aliases[0]"),
        (_add(kind="nvidia.com/gpu", name="9", uuid="0000:19:00.0"),
         "devices[4].uuid: '0000:19:00.0' is also devices[0].aliases[0]"),
    ],
)
def test_two_devices_with_one_identity_are_refused_at_load(tmp_path, change, message) -> None:
    path = tmp_path / "node.json"
    path.write_text(json.dumps(_h100(change)))
    with pytest.raises(InventoryError) as err:
        Inventory.load(path)
    assert err.value.source == str(path)
    assert err.value.message == f"{message} (nvidia.com/gpu=0): two devices with one identity"


def test_the_audits_duplicate_uuid_fails_explain_naming_file_path_and_device(
        tmp_path, capsys) -> None:
    inventory = tmp_path / "node.json"
    inventory.write_text(json.dumps(_h100(_set(1, uuid=UUID0))))
    pod = tmp_path / "pod.yaml"
    pod.write_text("apiVersion: v1\nkind: Pod\nmetadata:\n  name: p\n  annotations:\n"
                   "    devices.nri-accel.io: nvidia.com/gpu=0,1\n"
                   "spec:\n  containers:\n  - name: c\n    image: x\n")
    assert main(["explain", "--inventory", str(inventory), "--pod", str(pod)]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err == (f"nri-accel: {inventory}: devices[1].uuid: '{UUID0}' is also "
                       "devices[0].uuid (nvidia.com/gpu=0): two devices with one identity\n")


def test_what_discovery_shares_still_loads() -> None:
    """MIG devices carry their GPU's PCI bus id, AMD compute partitions one GPU's (none
    answers to it; a partition index each); one name in two kinds; a device's id
    repeated on itself."""
    mig = Inventory.load(GOLDEN / "discover" / "a100-mig.json").of_kind("nvidia.com/mig")
    assert len(mig) > len({d.pci_bus_id for d in mig}) > 0
    doc = {"schema_version": 1, "devices": [
        {"kind": "amd.com/gpu", "name": "0", "aliases": ["renderD128"],
         "pci_bus_id": "0000:11:00.0", "partition": 0},
        {"kind": "amd.com/gpu", "name": "1", "aliases": ["renderD129"],
         "pci_bus_id": "0000:11:00.0", "partition": 1},
        {"kind": "aws.amazon.com/neuron", "name": "0", "aliases": ["neuron0", "NEURON0"]},
        {"kind": "aws.amazon.com/neuroncore", "name": "0", "parent": "0"},
        {"kind": "acme.example/npu", "name": "0000:11:00.0",
         "pci_bus_id": "0000:11:00.0", "aliases": ["0:11:0.0"]},
    ]}
    inv = Inventory.from_dict(doc)
    assert [d.qualified_name for d in inv.devices] == [
        "acme.example/npu=0000:11:00.0", "amd.com/gpu=0", "amd.com/gpu=1",
        "aws.amazon.com/neuron=0", "aws.amazon.com/neuroncore=0"]
    assert [d.key for d in inv.of_kind("amd.com/gpu")] == [
        "amd.com/gpu=0000:11:00.0-p0", "amd.com/gpu=0000:11:00.0-p1"]
    assert inv.find("amd.com/gpu", "0000:11:00.0-P1").name == "1"  # as find() compares
    assert Inventory.from_json(inv.to_json()) == inv


def _partitions(*devices: dict) -> dict:
    base = {"kind": "amd.com/gpu", "pci_bus_id": "0000:11:00.0"}
    return {"schema_version": 1, "devices": [{**base, **d} for d in devices]}


@pytest.mark.parametrize(("devices", "message"), [
    # What discovery wrote before partitions had an index: one key for both, so holding
    # one made the other look held, and a grant could not say which it was.
    (({"name": "0"}, {"name": "1"}),
     "devices[1].pci_bus_id: '0000:11:00.0' is also devices[0].pci_bus_id "
     "(amd.com/gpu=0), neither with a UUID or a partition index to tell them apart"),
    (({"name": "0", "partition": 2}, {"name": "1", "partition": 2}),
     "devices[1].partition: '0000:11:00.0-p2' is also devices[0].partition "
     "(amd.com/gpu=0)"),
    (({"name": "0", "partition": 2}, {"name": "1", "partition": 2, "pci_bus_id": "0:11:0.0"}),
     "devices[1].partition: '0:11:0.0-p2' is also devices[0].partition (amd.com/gpu=0), "
     "the same partition"),
    (({"name": "0", "partition": 1}, {"name": "1", "aliases": ["0000:11:00.0-p1"]}),
     "devices[1].aliases[0]: '0000:11:00.0-p1' is also devices[0].partition "
     "(amd.com/gpu=0)"),
])
def test_partitions_sharing_a_key_are_refused_at_load(devices, message) -> None:
    with pytest.raises(InventoryError) as err:
        Inventory.from_dict(_partitions(*devices))
    assert err.value.message == f"{message}: two devices with one identity"


@pytest.mark.parametrize(("device", "message"), [
    ({"partition": -1}, "devices[0].partition: -1 is not a partition index (0 to 255)"),
    ({"partition": 256}, "devices[0].partition: 256 is not a partition index (0 to 255)"),
    ({"partition": True}, "devices[0].partition: expected int, got bool"),
    ({"partition": 0, "pci_bus_id": ""}, "devices[0].partition: a partition needs the "
     "pci_bus_id of the PCI function it is a partition of"),
])
def test_a_partition_index_is_checked_at_load(device, message) -> None:
    with pytest.raises(InventoryError) as err:
        Inventory.from_dict(_partitions({"name": "0", **device}))
    assert err.value.message == message


def test_identity_collisions_lists_each_later_device_against_those_kept() -> None:
    """All collisions, not the first: each later device once, judged against the
    devices kept (one that collides is dropped, so a third like it collides with the
    first, never with the dropped one)."""
    gpu = partial(Device, "nvidia.com/gpu")
    devices = [gpu("0", uuid="GPU-a"), gpu("1", uuid="GPU-A"), gpu("2", uuid="GPU-b",
               aliases=("GPU-a",)), gpu("3", uuid="GPU-c"), gpu("1", uuid="GPU-d")]
    found = identity_collisions(devices)
    assert [(c.index, c.what, c.value, c.other, c.other_what) for c in found] == [
        (1, "uuid", "GPU-A", 0, "uuid"), (2, "aliases[0]", "GPU-a", 0, "uuid")]
    assert [c.describe(devices, origin="nvidia") for c in found] == [
        "UUID 'GPU-A' is also the UUID of nvidia.com/gpu=0 (from nvidia): two devices "
        "with one identity",
        "alias 'GPU-a' is also the UUID of nvidia.com/gpu=0 (from nvidia): two devices "
        "with one identity"]
    assert identity_collisions(devices[:1] + devices[3:]) == []


def _saved_inventories() -> list[Path]:
    demo = Path(nri_accel.demo.__file__).parent
    found = sorted(GOLDEN.glob("discover/*.json")) + sorted(demo.rglob("inventory.json"))
    assert len(found) >= 13  # 11 fake nodes' discover goldens, 2 demo nodes
    return found


@pytest.mark.parametrize("path", _saved_inventories(), ids=lambda p: p.parent.name + "/" + p.name)
def test_every_saved_inventory_loads_and_round_trips(path: Path) -> None:
    inv = Inventory.load(path)
    assert Inventory.from_json(inv.to_json()) == inv


# ---- the file ------------------------------------------------------------------------

def test_load_refuses_a_file_over_the_limit_by_its_size(tmp_path) -> None:
    path = tmp_path / "huge.json"
    with path.open("wb") as f:  # sparse: no disk, and load must not read it
        f.truncate(MAX_INVENTORY_BYTES + 1)
    with pytest.raises(InventoryError) as err:
        Inventory.load(path)
    assert (err.value.source, err.value.message) == (
        str(path), "larger than 16 MiB: not an inventory")


def test_load_of_an_endless_stream_stops_at_the_limit() -> None:
    with pytest.raises(InventoryError) as err:
        Inventory.load("/dev/zero")  # no size; read whole, it would never end
    assert str(err.value) == "/dev/zero: larger than 16 MiB: not an inventory"


def test_load_reads_a_file_of_exactly_the_limit(tmp_path) -> None:
    path = tmp_path / "full.json"
    path.write_bytes(b"{}".ljust(MAX_INVENTORY_BYTES))  # JSON whitespace after the object
    with pytest.raises(InventoryError) as err:
        Inventory.load(path)
    assert str(err.value) == (f"{path}: schema_version: unsupported version None "
                              "(this build reads 1)")


def test_load_refuses_bytes_that_are_not_utf8_naming_the_offset(tmp_path) -> None:
    path = tmp_path / "latin1.json"
    raw = b'{"schema_version": 1, "problems": [{"source": "caf\xe9", "message": "x"}]}'
    path.write_bytes(raw)
    with pytest.raises(InventoryError) as err:
        Inventory.load(path)
    assert str(err.value) == f"{path}: not UTF-8 text: byte 0xe9 at offset 50"
    assert raw.index(b"\xe9") == 50


def test_load_of_deeply_nested_json_is_an_inventory_error(tmp_path) -> None:
    path = tmp_path / "deep.json"
    path.write_text("[" * 100_000)
    with pytest.raises(InventoryError) as err:
        Inventory.load(path)
    assert str(err.value) == f"{path}: not valid JSON: nested too deeply"


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
