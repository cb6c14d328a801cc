"""Neuron discovery: the trn1 fake root and the error paths of /dev and sysfs."""

from __future__ import annotations

from pathlib import Path

from fakes.roots import materialise
from hosttree import HostTree

from nri_accel.discover.base import Found
from nri_accel.inventory import Device, DeviceNode
from nri_accel.vendors.neuron import KIND as KIND_NEURON
from nri_accel.vendors.neuron import KIND_CORE, discover_neuron

SYSFS = "/sys/class/neuron_device"


def whole(found: Found) -> list[Device]:
    """The Neuron devices, without their NeuronCores."""
    return [d for d in found.devices if d.kind == KIND_NEURON]


def cores(found: Found) -> list[Device]:
    return [d for d in found.devices if d.kind == KIND_CORE]


def _neuron_node(tree: HostTree, i: int, *, cores: str = "2", links: str = "") -> None:
    tree.chardev(f"/dev/neuron{i}", 241, i)
    tree.file(f"{SYSFS}/neuron{i}/core_count", cores)
    tree.file(f"{SYSFS}/neuron{i}/connected_devices", links + "\n")


def _tree(tmp_path: Path, count: int = 3) -> HostTree:
    tree = HostTree(tmp_path / "node")
    tree.file("/sys/module/neuron/version", "2.21.37.0\n")
    for i in range(count):
        others = ", ".join(str(j) for j in range(count) if j != i)
        _neuron_node(tree, i, links=others)
    return tree


def test_trn1_root_has_16_trainium_devices_in_a_torus(tmp_path: Path) -> None:
    found = discover_neuron(materialise("trn1", tmp_path / "trn1"))
    assert found.problems == ()
    devices = whole(found)
    assert [d.name for d in devices] == [str(i) for i in range(16)]
    d5 = devices[5]
    assert d5.kind == KIND_NEURON
    assert d5.qualified_name == "aws.amazon.com/neuron=5"
    assert d5.aliases == ("neuron5",)
    assert d5.vendor == "neuron"
    assert d5.edits.device_nodes == (DeviceNode("/dev/neuron5", 241, 5),)
    assert dict(d5.attributes) == {"cores": "2", "arch": "v2", "name": "Trainium1",
                                   "instance_type": "Trn1"}
    assert d5.links == ("1", "4", "6", "9")
    assert all(len(d.links) == 4 for d in devices)
    # connectivity is symmetric in a torus
    assert all(d.name in devices[int(p)].links for d in devices for p in d.links)
    (driver,) = found.drivers
    assert (driver.vendor, driver.version) == ("neuron", "2.19.64.0")


def test_each_neuroncore_is_a_part_of_its_device_numbered_node_wide(tmp_path: Path) -> None:
    found = discover_neuron(materialise("trn1", tmp_path / "trn1"))
    parts = cores(found)
    assert [c.name for c in parts] == [str(i) for i in range(32)]  # 16 Trainium x 2 cores
    c11 = parts[11]  # device 5's second core: 5 * 2 + 1
    assert (c11.kind, c11.parent, dict(c11.attributes), c11.vendor) == (
        KIND_CORE, "5", {"core": "1"}, "neuron")
    assert c11.qualified_name == "aws.amazon.com/neuroncore=11"
    # its device's node, and its own number for a CDI request of that core alone
    assert c11.edits.device_nodes == (DeviceNode("/dev/neuron5", 241, 5),)
    assert c11.edits.env == ("NEURON_RT_VISIBLE_CORES=11",)


def test_cores_are_numbered_only_while_every_earlier_count_is_known(tmp_path: Path) -> None:
    tree = _tree(tmp_path, 3)
    tree.file(f"{SYSFS}/neuron0/core_count", "4")
    tree.file(f"{SYSFS}/neuron1/core_count", "x")
    found = discover_neuron(tree.root)
    assert [(c.name, c.parent) for c in cores(found)] == [
        ("0", "0"), ("1", "0"), ("2", "0"), ("3", "0")]  # device 2's numbers would be guesses


def test_no_neuron_driver_means_nothing_and_no_problem(tmp_path: Path) -> None:
    tree = HostTree(tmp_path / "node")
    tree.chardev("/dev/null", 1, 3)
    found = discover_neuron(tree.root)
    assert (found.devices, found.drivers, found.problems) == ((), (), ())


def test_symlinked_device_node_is_refused_and_links_to_it_dropped(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    tree.remove("/dev/neuron1")
    tree.chardev("/dev/real-neuron1", 241, 1)
    tree.symlink("/dev/neuron1", "real-neuron1")
    found = discover_neuron(tree.root)
    assert [d.name for d in whole(found)] == ["0", "2"]
    assert whole(found)[0].links == ("2",)
    assert [(p.source, "symlink" in p.message) for p in found.problems] == [
        ("/dev/neuron1", True)]


def test_device_node_that_is_a_regular_file_is_refused(tmp_path: Path) -> None:
    tree = _tree(tmp_path, 1)
    tree.remove("/dev/neuron0")
    tree.file("/dev/neuron0", "")
    found = discover_neuron(tree.root)
    assert found.devices == ()
    assert found.problems[0].source == "/dev/neuron0"
    assert "not a character or block device" in found.problems[0].message


def test_missing_sysfs_keeps_the_device_without_facts(tmp_path: Path) -> None:
    tree = _tree(tmp_path, 2)
    for name in ("core_count", "connected_devices"):
        tree.remove(f"{SYSFS}/neuron1/{name}")
    tree.path(f"{SYSFS}/neuron1").rmdir()
    found = discover_neuron(tree.root)
    d1 = found.devices[1]
    assert (d1.name, dict(d1.attributes), d1.links) == ("1", {}, ())
    assert found.devices[0].links == ("1",)
    assert [p.source for p in found.problems] == [f"{SYSFS}/neuron1"]


def test_malformed_sysfs_values_are_problems(tmp_path: Path) -> None:
    tree = _tree(tmp_path, 2)
    tree.file(f"{SYSFS}/neuron0/core_count", "two")
    tree.file(f"{SYSFS}/neuron1/connected_devices", "0, x\n")
    found = discover_neuron(tree.root)
    assert "cores" not in found.devices[0].attributes
    assert found.devices[1].links == ()
    assert {p.source: p.message for p in found.problems} == {
        f"{SYSFS}/neuron0/core_count": "not a number: 'two'",
        f"{SYSFS}/neuron1/connected_devices": "not a list of device indices: '0, x'",
    }


def test_empty_connected_devices_means_no_links(tmp_path: Path) -> None:
    tree = HostTree(tmp_path / "node")
    tree.file("/sys/module/neuron/version", "2.21.37.0\n")
    _neuron_node(tree, 0, links="")
    found = discover_neuron(tree.root)
    assert found.devices[0].links == ()
    assert found.problems == ()


def test_sysfs_device_without_node_and_loaded_driver_without_devices(tmp_path: Path) -> None:
    tree = HostTree(tmp_path / "node")
    tree.file("/sys/module/neuron/version", "2.21.37.0\n")
    tree.file(f"{SYSFS}/neuron0/core_count", "4")
    found = discover_neuron(tree.root)
    assert found.devices == ()
    assert found.drivers[0].version == "2.21.37.0"
    assert [p.source for p in found.problems] == ["/dev/neuron0", "neuron"]
    assert "device node is missing" in found.problems[0].message
    assert "no /dev/neuronN" in found.problems[1].message


def test_unknown_driver_version_is_a_problem(tmp_path: Path) -> None:
    tree = HostTree(tmp_path / "node")
    _neuron_node(tree, 0)
    found = discover_neuron(tree.root)
    assert [d.name for d in whole(found)] == ["0"]
    assert found.drivers[0].version == ""
    assert [p.source for p in found.problems] == ["neuron"]
    assert "/sys/module/neuron/version" in found.problems[0].message


def test_device_order_is_natural_not_lexical(tmp_path: Path) -> None:
    tree = _tree(tmp_path, 12)
    found = discover_neuron(tree.root)
    assert [d.name for d in whole(found)] == [str(i) for i in range(12)]
    assert whole(found)[0].links[-2:] == ("10", "11")
    assert [c.name for c in cores(found)][-3:] == ["21", "22", "23"]
