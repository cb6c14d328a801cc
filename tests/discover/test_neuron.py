"""Neuron discovery: the trn1 fake root and the error paths of /dev and sysfs."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
from engine.engine_testing import admit, container
from fakes.roots import materialise
from hosttree import HostTree

from nri_accel.config import Config, PolicyConfig
from nri_accel.discover.base import Found
from nri_accel.discover.hostroot import HostRoot
from nri_accel.engine import Engine
from nri_accel.errors import AllocationError
from nri_accel.health import carry_vanished
from nri_accel.inventory import Device, DeviceNode, Inventory
from nri_accel.nri.adjust import build_adjustment
from nri_accel.state import Grant
from nri_accel.vendors.neuron import KIND as KIND_NEURON
from nri_accel.vendors.neuron import KIND_CORE, discover_neuron

SYSFS = "/sys/class/neuron_device"
# /proc/devices of a host with the aws-neuron-driver loaded (its major is dynamic)
PROC_DEVICES = "Character devices:\n  1 mem\n241 neuron\n\nBlock devices:\n  8 sd\n"


def whole(found: Found) -> list[Device]:
    """The Neuron devices, without their NeuronCores."""
    return [d for d in found.devices if d.kind == KIND_NEURON]


def cores(found: Found) -> list[Device]:
    return [d for d in found.devices if d.kind == KIND_CORE]


def discover_inventory(root: HostRoot) -> Inventory:
    found = discover_neuron(root)
    return Inventory(devices=found.devices,
                     drivers={d.vendor: d for d in found.drivers})


def env_of(plan: Any) -> dict[str, str]:
    return dict(kv.partition("=")[::2] for kv in plan.edits.env)


def core_request(value: str, cid: str) -> Any:
    return container(pod_annotations={"devices.nri-accel.io": value}, cid=cid, pod=cid)


def _neuron_node(tree: HostTree, i: int, *, cores: str = "2", links: str = "") -> None:
    tree.chardev(f"/dev/neuron{i}", 241, i)
    tree.file(f"{SYSFS}/neuron{i}/core_count", cores)
    tree.file(f"{SYSFS}/neuron{i}/connected_devices", links + "\n")


def _tree(tmp_path: Path, count: int = 3) -> HostTree:
    tree = HostTree(tmp_path / "node")
    tree.file("/sys/module/neuron/version", "2.21.37.0\n")
    tree.file("/proc/devices", PROC_DEVICES)
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
    # what names it whatever the numbering: its device's index and its own within it
    assert (c11.uuid, c11.key) == ("neuron5-core1", "aws.amazon.com/neuroncore=neuron5-core1")
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


def test_a_cores_grant_follows_the_core_when_an_earlier_device_vanishes(tmp_path: Path) -> None:
    # neuron1 does not come up after a driver reload: its index is a gap, and the cores
    # of neuron2 are numbered 2-3 instead of 4-5. The container holding neuron2's core 0
    # keeps it: it goes to nobody else by its new number, nor neuron2 whole.
    tree = _tree(tmp_path, 3)
    before = discover_inventory(tree.root)
    engine = Engine(before, Config(policy=PolicyConfig("standalone")))
    plan = admit(engine, core_request("aws.amazon.com/neuroncore=4", "a"))
    assert env_of(plan)["NEURON_RT_VISIBLE_CORES"] == "4"
    tree.remove("/dev/neuron1")
    shutil.rmtree(tree.path(f"{SYSFS}/neuron1"))
    after = carry_vanished(before, discover_inventory(tree.root))
    engine.swap_inventory(after)
    moved = after.find(KIND_CORE, "2")
    assert moved is not None and (moved.parent, moved.uuid) == ("2", "neuron2-core0")
    for asked in ("aws.amazon.com/neuroncore=2", "aws.amazon.com/neuron=2"):
        with pytest.raises(AllocationError, match="is held by"):
            engine.plan(core_request(asked, "b"))
    # the device's other core, in the numbering the Neuron runtime uses now
    assert env_of(admit(engine, core_request("aws.amazon.com/neuroncore=3", "c"))) == {
        "AWS_NEURON_VISIBLE_DEVICES": "2", "NEURON_RT_VISIBLE_CORES": "3"}
    engine.release("a")
    engine.release("c")  # and the whole device's cores in that numbering
    assert env_of(admit(engine, core_request("aws.amazon.com/neuron=2", "d"))) == {
        "AWS_NEURON_VISIBLE_DEVICES": "2", "NEURON_RT_VISIBLE_CORES": "2-3"}


def test_a_core_granted_before_cores_had_ids_is_read_as_the_core_of_that_number(
        tmp_path: Path) -> None:
    # A grant annotation or checkpoint written before: "...neuroncore=4", a number.
    engine = Engine(discover_inventory(_tree(tmp_path, 3).root),
                    Config(policy=PolicyConfig("standalone")))
    engine.load_checkpoint([Grant("a", name="ns/p/a",
                                  exclusive=frozenset({"aws.amazon.com/neuroncore=4"}))],
                           known=True)
    assert [g.exclusive for g in engine.holdings.grants()] == [
        frozenset({"aws.amazon.com/neuroncore=neuron2-core0"})]
    with pytest.raises(AllocationError, match="neuron2-core0 is held by ns/p/a"):
        engine.plan(core_request("aws.amazon.com/neuroncore=4", "b"))
    old = container(cid="a", pod="a", annotations={
        "nri-accel.io/granted": "aws.amazon.com/neuroncore=5"})
    assert [g.exclusive for g in engine.grants_in([old])] == [
        frozenset({"aws.amazon.com/neuroncore=neuron2-core1"})]


@pytest.mark.parametrize("value", ["ALL", "0", "0-1"])
def test_an_untrusted_images_visibility_variable_is_rewritten_empty_never_removed(
        tmp_path: Path, value: str) -> None:
    # kubernetes mode: an image's env does not grant in namespace "default". From NRI
    # v0.10 the runtime drops a removal of a variable no plugin set (result.go,
    # adjustEnv), so the oci-neuron-hook would still read ALL: the value is rewritten
    # to one naming no device.
    engine = Engine(discover_inventory(_tree(tmp_path, 2).root),
                    Config(policy=PolicyConfig("kubernetes")))
    plan = admit(engine, container(env=(f"AWS_NEURON_VISIBLE_DEVICES={value}",)))
    assert plan.devices == ()
    assert env_of(plan) == {"AWS_NEURON_VISIBLE_DEVICES": ""}
    adjustment = build_adjustment(plan.edits, plan.annotations, plan.cdi_devices)
    assert [(e.key, e.value) for e in adjustment.env] == [("AWS_NEURON_VISIBLE_DEVICES", "")]


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


@pytest.mark.parametrize(("numbers", "why"), [
    ((241, 0), "minor 0 is not the expected 1"),  # a stale node: device 0's
    ((1, 3), "major 1 is not the 'neuron' major"),  # another driver's (/dev/null's)
])
def test_a_node_not_the_drivers_node_n_is_not_device_n(
        tmp_path: Path, numbers: tuple[int, int], why: str) -> None:
    # neuron_cdev.c: the region is one major named "neuron"; node N is its minor N.
    tree = _tree(tmp_path, 2)
    tree.remove("/dev/neuron1")
    tree.chardev("/dev/neuron1", *numbers)
    found = discover_neuron(tree.root)
    assert [d.name for d in whole(found)] == ["0"]
    assert [(p.source, why in p.message) for p in found.problems] == [("/dev/neuron1", True)]


def test_unreadable_proc_devices_is_a_problem_and_minors_still_checked(
        tmp_path: Path) -> None:
    tree = _tree(tmp_path, 2)
    tree.remove("/proc/devices")
    tree.remove("/dev/neuron1")
    tree.chardev("/dev/neuron1", 241, 0)
    found = discover_neuron(tree.root)
    assert [d.name for d in whole(found)] == ["0"]
    assert [p.source for p in found.problems] == ["/proc/devices", "/dev/neuron1"]


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
    tree.file("/proc/devices", PROC_DEVICES)
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
    tree.file("/proc/devices", PROC_DEVICES)
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


def test_trainium2s_logical_cores_are_not_numbered_and_a_device_grant_names_none(
        tmp_path: Path) -> None:
    """Trainium2 (arch_type v3): the driver counts 8 cores a device, its runtime 4 by
    default (NEURON_LOGICAL_NC_CONFIG=2), and NEURON_RT_VISIBLE_CORES counts the latter:
    no core is offered (a number would name another device's), a whole device's grant
    sets no NEURON_RT_VISIBLE_CORES (its runtime uses the devices it is given), and a
    Problem says so."""
    tree = _tree(tmp_path, 2)
    for i in range(2):
        tree.file(f"{SYSFS}/neuron{i}/core_count", "8")
        tree.file(f"{SYSFS}/neuron{i}/info/architecture/arch_type", "v3\n")
        tree.file(f"{SYSFS}/neuron{i}/info/architecture/device_name", "Trainium2\n")
    found = discover_neuron(tree.root)
    assert cores(found) == []
    assert [d.attributes["cores"] for d in whole(found)] == ["8", "8"]
    (problem,) = found.problems
    assert problem.message.startswith("NeuronCores of Trainium2 are not offered")
    engine = Engine(discover_inventory(tree.root), Config(policy=PolicyConfig("standalone")))
    plan = admit(engine, core_request("aws.amazon.com/neuron=1", "a"))
    env = env_of(plan)
    assert env["AWS_NEURON_VISIBLE_DEVICES"] == "1" and "NEURON_RT_VISIBLE_CORES" not in env
