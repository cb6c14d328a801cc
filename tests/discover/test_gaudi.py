"""Intel Gaudi profile: the gaudi2-hls fake root, both driver layouts, the error paths,
the HABANA_VISIBLE_DEVICES grammar, the container env and the change probe."""

from __future__ import annotations

from pathlib import Path

import pytest
from fakes.roots import materialise
from hosttree import HostTree

from nri_accel.discover.base import Found
from nri_accel.inventory import Device, DeviceNode
from nri_accel.vendors import gaudi

CTRL = 509  # the fake "habanalabs" control major
PROC_DEVICES = "Character devices:\n226 drm\n231 infiniband_verbs\n261 accel\n509 habanalabs\n\n" \
               "Block devices:\n  8 sd\n"


def _pci(tree: HostTree, bdf: str, *, numa: int = 0, status: str = "Operational",
         module: str | None = "0", pci_addr: bool = True) -> str:
    """A Gaudi2 PCI function with the driver's attributes; returns its sysfs directory."""
    pdir = f"/sys/devices/pci0000:00/0000:00:01.0/{bdf}"
    tree.file(f"{pdir}/numa_node", f"{numa}\n")
    tree.file(f"{pdir}/status", f"{status}\n")
    tree.file(f"{pdir}/device_type", "GAUDI2\n")
    if module is not None:
        tree.file(f"{pdir}/module_id", f"{module}\n")
    if pci_addr:
        tree.file(f"{pdir}/pci_addr", f"{bdf}\n")
    tree.symlink(f"{pdir}/driver", "../../../../bus/pci/drivers/habanalabs")
    tree.symlink(f"/sys/bus/pci/devices/{bdf}", f"../../../devices/pci0000:00/0000:00:01.0/{bdf}")
    return pdir


def _accel(tree: HostTree, index: int, bdf: str, **kwargs: object) -> None:
    """One Gaudi as the DRM-accel driver shows it: sysfs, class link, both nodes."""
    pdir = _pci(tree, bdf, **kwargs)  # type: ignore[arg-type]
    tree.symlink(f"{pdir}/accel/accel{index}/device", f"../../../{bdf}")
    tree.symlink(f"/sys/class/accel/accel{index}",
                 f"../../devices/pci0000:00/0000:00:01.0/{bdf}/accel/accel{index}")
    tree.chardev(f"/dev/accel/accel{index}", 261, index)
    tree.chardev(f"/dev/accel/accel_controlD{index}", CTRL, index)


def _tree(tmp_path: Path, count: int = 2) -> HostTree:
    tree = HostTree(tmp_path / "node")
    tree.file("/proc/devices", PROC_DEVICES)
    tree.file("/sys/module/habanalabs/version", "1.18.0-ee698fb\n")
    for i in range(count):
        _accel(tree, i, f"0000:{0x33 + i:02x}:00.0", module=str(count - 1 - i))
    return tree


def _problems(found: Found) -> dict[str, str]:
    return {p.source: p.message for p in found.problems}


# ---- the fake HLS-Gaudi2 node ----------------------------------------------------------

def test_gaudi2_hls_root_devices_identities_health_and_the_refused_decoy(tmp_path: Path) -> None:
    found = gaudi.discover(materialise("gaudi2-hls", tmp_path / "node"))
    # accel7 is a symlink planted where the node should be: refused, never followed
    assert [(p.source, "symlink" in p.message) for p in found.problems] == [
        ("/dev/accel/accel7", True)]
    assert [d.name for d in found.devices] == [str(i) for i in range(7)]
    modules = {d.name: d.attributes["module_id"] for d in found.devices}
    assert modules == {"0": "3", "1": "1", "2": "0", "3": "2", "4": "7", "5": "5", "6": "4"}
    d0 = found.devices[0]
    assert d0.qualified_name == "habana.ai/gaudi=0"
    assert (d0.uuid, d0.pci_bus_id, d0.numa_node) == ("", "0000:4d:00.0", 0)
    assert d0.aliases == ("accel0", "0000:4d:00.0")
    assert d0.vendor == "gaudi" and d0.healthy
    assert d0.edits.device_nodes == (
        DeviceNode("/dev/accel/accel0", 261, 0),
        DeviceNode("/dev/accel/accel_controlD0", CTRL, 0),
        DeviceNode("/dev/infiniband/uverbs0", 231, 192),
    )
    assert dict(d0.attributes) == {"device_type": "GAUDI2", "driver_version": "1.18.0-ee698fb",
                                   "module_id": "3", "status": "Operational"}
    assert [d.numa_node for d in found.devices] == [0, 0, 0, 0, 1, 1, 1]
    unhealthy = [(d.name, d.attributes["health"]) for d in found.devices if not d.healthy]
    assert unhealthy == [("5", "Needs reset")]
    (driver,) = found.drivers
    # no /sys/module/habanalabs/version on this node: the devices' driver_ver is used
    assert (driver.vendor, driver.version, dict(driver.capabilities)) == (
        "gaudi", "1.18.0-ee698fb", {})
    # no two devices share a node
    paths = [n.path for d in found.devices for n in d.edits.device_nodes]
    assert len(paths) == len(set(paths))


# ---- discovery paths on small trees ------------------------------------------------------

def test_no_habanalabs_means_nothing_and_no_problem(tmp_path: Path) -> None:
    tree = HostTree(tmp_path / "node")
    tree.chardev("/dev/null", 1, 3)
    assert gaudi.discover(tree.root) == Found()


def test_other_accel_drivers_share_dev_accel_and_are_left_alone(tmp_path: Path) -> None:
    tree = _tree(tmp_path, 0)
    _accel(tree, 1, "0000:33:00.0")
    # an Intel NPU (intel_vpu) is accel0 on the same node
    tree.chardev("/dev/accel/accel0", 261, 0)
    npu = "/sys/devices/pci0000:00/0000:00:0b.0"
    tree.file(f"{npu}/accel/accel0/dev", "261:0\n")
    tree.symlink(f"{npu}/driver", "../../../bus/pci/drivers/intel_vpu")
    tree.symlink(f"{npu}/accel/accel0/device", "../../../0000:00:0b.0")
    tree.symlink("/sys/class/accel/accel0", "../../devices/pci0000:00/0000:00:0b.0/accel/accel0")
    found = gaudi.discover(tree.root)
    assert [d.name for d in found.devices] == ["1"]
    assert found.problems == ()


def test_node_without_any_sysfs_entry_is_not_claimed(tmp_path: Path) -> None:
    tree = _tree(tmp_path, 1)
    tree.chardev("/dev/accel/accel4", 261, 4)
    found = gaudi.discover(tree.root)
    assert [d.name for d in found.devices] == ["0"]
    assert list(_problems(found)) == ["/dev/accel/accel4"]


@pytest.mark.parametrize(("path", "major", "minor", "message"), [
    ("/dev/accel/accel_controlD1", 261, 1, "not the 'habanalabs' major"),
    ("/dev/accel/accel1", CTRL, 1, "not the 'accel' major"),
    ("/dev/accel/accel1", 261, 0, "minor 0 is not the expected 1"),
    ("/dev/accel/accel_controlD1", CTRL, 7, "minor 7 is not the expected 1"),
])
def test_nodes_with_the_wrong_numbers_are_refused(tmp_path: Path, path: str, major: int,
                                                 minor: int, message: str) -> None:
    tree = _tree(tmp_path)
    tree.chardev(path, major, minor)
    found = gaudi.discover(tree.root)
    assert [d.name for d in found.devices] == ["0"]
    assert message in _problems(found)[path]


@pytest.mark.parametrize("make", ["missing", "regular file", "symlink"])
def test_a_control_node_that_is_not_a_device_node_is_refused(tmp_path: Path, make: str) -> None:
    tree = _tree(tmp_path)
    path = "/dev/accel/accel_controlD1"
    tree.remove(path)
    if make == "regular file":
        tree.file(path, "")
    elif make == "symlink":
        tree.symlink(path, "accel_controlD0")
    found = gaudi.discover(tree.root)
    assert [d.name for d in found.devices] == ["0"]
    assert {"missing": "does not exist", "regular file": "not a character or block device",
            "symlink": "is a symlink"}[make] in _problems(found)[path]


def test_majors_are_not_checked_when_proc_devices_is_unreadable(tmp_path: Path) -> None:
    tree = _tree(tmp_path, 1)
    tree.remove("/proc/devices")
    found = gaudi.discover(tree.root)
    assert [d.name for d in found.devices] == ["0"]
    assert list(_problems(found)) == ["/proc/devices"]


def test_a_missing_driver_in_proc_devices_refuses_its_nodes(tmp_path: Path) -> None:
    tree = _tree(tmp_path, 1)
    tree.file("/proc/devices", "Character devices:\n261 accel\n\nBlock devices:\n509 habanalabs\n")
    found = gaudi.discover(tree.root)
    assert found.devices == ()
    assert "no 'habanalabs' character major" in _problems(found)["/dev/accel/accel_controlD0"]


@pytest.mark.parametrize(("status", "healthy", "health"), [
    ("Operational", True, None),
    ("In reset", False, "In reset"),
    ("Disabled", False, "Disabled"),
    ("In device creation", False, "In device creation"),
    ("In reset after device release", False, "In reset after device release"),
])
def test_status_other_than_operational_is_unhealthy(tmp_path: Path, status: str, healthy: bool,
                                                   health: str | None) -> None:
    tree = HostTree(tmp_path / "node")
    tree.file("/proc/devices", PROC_DEVICES)
    _accel(tree, 0, "0000:33:00.0", status=status)
    (d,) = gaudi.discover(tree.root).devices
    assert (d.healthy, d.attributes.get("health"), d.attributes["status"]) == (
        healthy, health, status)


def test_unreadable_status_is_unhealthy_and_a_problem(tmp_path: Path) -> None:
    tree = _tree(tmp_path, 1)
    tree.remove("/sys/devices/pci0000:00/0000:00:01.0/0000:33:00.0/status")
    found = gaudi.discover(tree.root)
    assert (found.devices[0].healthy, found.devices[0].attributes["health"]) == (
        False, "status unknown")
    assert list(_problems(found)) == ["/sys/class/accel/accel0/device/status"]


def test_pci_address_falls_back_to_the_device_link(tmp_path: Path) -> None:
    tree = HostTree(tmp_path / "node")
    tree.file("/proc/devices", PROC_DEVICES)
    _accel(tree, 0, "0000:b3:00.0", pci_addr=False, numa=1)
    found = gaudi.discover(tree.root)
    (d,) = found.devices
    assert (d.pci_bus_id, d.numa_node, d.aliases) == ("0000:b3:00.0", 1, ("accel0", "0000:b3:00.0"))
    assert found.problems == ()


def test_module_id_problems_missing_malformed_duplicate(tmp_path: Path) -> None:
    tree = HostTree(tmp_path / "node")
    tree.file("/proc/devices", PROC_DEVICES)
    _accel(tree, 0, "0000:33:00.0", module="2")
    _accel(tree, 1, "0000:34:00.0", module="2")
    _accel(tree, 2, "0000:35:00.0", module="two")
    _accel(tree, 3, "0000:36:00.0", module=None)  # older drivers have no module_id
    found = gaudi.discover(tree.root)
    assert [d.attributes.get("module_id") for d in found.devices] == ["2", "2", None, None]
    assert _problems(found) == {
        "/sys/class/accel/accel2/device/module_id": "not a number: 'two'",
        "gaudi": "devices 0 and 1 report the same module_id 2: HABANA_VISIBLE_MODULES is "
                 "ambiguous",
    }


def test_verbs_node_is_added_when_the_nic_has_one(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    pdir = "/sys/devices/pci0000:00/0000:00:01.0"
    tree.file(f"{pdir}/0000:33:00.0/infiniband_verbs/uverbs3/dev", "231:195\n")
    tree.chardev("/dev/infiniband/uverbs3", 231, 195)
    tree.file(f"{pdir}/0000:34:00.0/infiniband_verbs/uverbs4/dev", "231:196\n")
    tree.symlink("/dev/infiniband/uverbs4", "uverbs3")
    found = gaudi.discover(tree.root)
    assert [n.path for n in found.devices[0].edits.device_nodes][-1] == "/dev/infiniband/uverbs3"
    assert len(found.devices[1].edits.device_nodes) == 2  # the symlinked one is not given
    assert "symlink" in _problems(found)["/dev/infiniband/uverbs4"]


def test_compat_driver_layout_without_drm_accel(tmp_path: Path) -> None:
    """The out-of-tree driver on a kernel without CONFIG_DRM_ACCEL: accel<N> is a virtual
    device and "device" is an attribute group (a directory), not a link."""
    tree = HostTree(tmp_path / "node")
    tree.file("/proc/devices", "Character devices:\n508 accel\n509 habanalabs\n")
    base = "/sys/devices/virtual/accel/accel0"
    tree.file(f"{base}/device/pci_addr", "0000:19:00.0\n")
    tree.file(f"{base}/device/status", "Operational\n")
    tree.file(f"{base}/device/device_type", "GAUDI2\n")
    tree.file(f"{base}/device/module_id", "6\n")
    tree.symlink("/sys/class/accel/accel0", "../../devices/virtual/accel/accel0")
    tree.file("/sys/bus/pci/devices/0000:19:00.0/numa_node", "1\n")
    tree.chardev("/dev/accel/accel0", 508, 0)
    tree.chardev("/dev/accel/accel_controlD0", CTRL, 0)
    found = gaudi.discover(tree.root)
    (d,) = found.devices
    assert (d.pci_bus_id, d.numa_node, d.attributes["module_id"]) == ("0000:19:00.0", 1, "6")
    assert [(n.major, n.minor) for n in d.edits.device_nodes] == [(508, 0), (CTRL, 0)]
    assert found.problems == ()


def test_legacy_hl_layout(tmp_path: Path) -> None:
    tree = HostTree(tmp_path / "node")
    tree.file("/proc/devices", "Character devices:\n510 habanalabs\n")
    for i, bdf in enumerate(("0000:19:00.0", "0000:1a:00.0")):
        base = f"/sys/class/habanalabs/hl{i}"
        tree.file(f"{base}/pci_addr", f"{bdf}\n")
        tree.file(f"{base}/status", "Operational\n")
        tree.file(f"{base}/device_type", "GAUDI\n")
        tree.file(f"/sys/bus/pci/devices/{bdf}/numa_node", "-1\n")
        tree.chardev(f"/dev/hl{i}", 510, 2 * i)
        tree.chardev(f"/dev/hl_controlD{i}", 510, 2 * i + 1)
    tree.chardev("/dev/hl_controlD1", 510, 2)  # swapped with hl1's minor: refused
    found = gaudi.discover(tree.root)
    (d,) = found.devices
    assert (d.name, d.aliases, d.pci_bus_id, d.numa_node) == (
        "0", ("hl0", "0000:19:00.0"), "0000:19:00.0", None)
    assert d.edits.device_nodes == (DeviceNode("/dev/hl0", 510, 0),
                                    DeviceNode("/dev/hl_controlD0", 510, 1))
    assert "minor 2 is not the expected 3" in _problems(found)["/dev/hl_controlD1"]


def _legacy(tree: HostTree, i: int, bdf: str, *, pci_addr: bool, link: bool) -> None:
    base = f"/sys/class/habanalabs/hl{i}"
    if pci_addr:
        tree.file(f"{base}/pci_addr", f"{bdf}\n")
    if link:
        tree.file(f"/sys/devices/pci0000:00/{bdf}/numa_node", "0\n")
        tree.symlink(f"{base}/device", f"../../../devices/pci0000:00/{bdf}")
    tree.file(f"{base}/status", "Operational\n")
    tree.chardev(f"/dev/hl{i}", 510, 2 * i)
    tree.chardev(f"/dev/hl_controlD{i}", 510, 2 * i + 1)


def test_legacy_hl_layout_without_pci_addr_goes_by_the_device_link_or_is_left_out(
        tmp_path: Path) -> None:
    # Without a PCI address only its index would name a device, and after a driver
    # reload in which an earlier one does not come up, another device has that index:
    # a grant recorded under it would follow the wrong device.
    tree = HostTree(tmp_path / "node")
    tree.file("/proc/devices", "Character devices:\n510 habanalabs\n")
    _legacy(tree, 0, "0000:19:00.0", pci_addr=False, link=True)
    _legacy(tree, 1, "0000:1a:00.0", pci_addr=False, link=False)
    found = gaudi.discover(tree.root)
    (d,) = found.devices
    assert (d.name, d.pci_bus_id, d.key) == ("0", "0000:19:00.0", "habana.ai/gaudi=0000:19:00.0")
    assert "no PCI function behind the device: it is left out" in _problems(found)[
        "/sys/class/habanalabs/hl1/pci_addr"]


def test_loaded_driver_without_devices_is_a_problem(tmp_path: Path) -> None:
    tree = HostTree(tmp_path / "node")
    tree.file("/sys/module/habanalabs/version", "1.18.0-ee698fb\n")
    found = gaudi.discover(tree.root)
    assert found.devices == ()
    assert found.drivers[0].version == "1.18.0-ee698fb"
    assert "loaded but has no device" in _problems(found)["gaudi"]


def test_module_version_wins_over_driver_ver(tmp_path: Path) -> None:
    tree = _tree(tmp_path, 1)
    tree.file("/sys/devices/pci0000:00/0000:00:01.0/0000:33:00.0/driver_ver", "1.17.0-0\n")
    found = gaudi.discover(tree.root)
    assert found.drivers[0].version == "1.18.0-ee698fb"
    assert found.devices[0].attributes["driver_version"] == "1.17.0-0"


# ---- HABANA_VISIBLE_DEVICES -------------------------------------------------------------

@pytest.mark.parametrize(("value", "expected"), [
    ("", None),
    ("none", None),
    ("void", None),
    ("all", "all"),
    ("0", ("0",)),
    ("3,1", ("3", "1")),
    ("0,0,1", ("0", "1")),
    ("07", ("7",)),
    ("10,2", ("10", "2")),
])
def test_visible_devices_grammar(value: str, expected: object) -> None:
    assert gaudi.parse_visible(value) == expected


@pytest.mark.parametrize(("value", "fragment"), [
    ("ALL", "'ALL' is not a device index"),
    ("None", "'None' is not a device index"),
    ("0,", "empty element"),
    (",0", "empty element"),
    ("0,,1", "empty element"),
    ("0, 1", "' 1' has spaces"),
    ("0-3", "'0-3' is not a device index"),  # the habana runtime has no ranges
    ("GPU-1", "'GPU-1' is not a device index"),
    ("all,0", "'all' cannot be combined"),
    ("0,none", "'none' cannot be combined"),
    ("-1", "'-1' is not a device index"),
    ("+1", "'+1' is not a device index"),
    ("123456789", "out of range"),
])
def test_visible_devices_errors_name_the_bad_element(value: str, fragment: str) -> None:
    with pytest.raises(ValueError, match=r"expected|cannot") as e:
        gaudi.parse_visible(value)
    assert fragment in str(e.value)


def test_visible_none_grants_nothing() -> None:
    assert gaudi.parse_visible(gaudi.VISIBLE_NONE) is None


@pytest.mark.parametrize("env", [
    {"HABANA_VISIBLE_MODULES": "5,4,7,6"},
    {"HABANA_VISIBLE_PCI_BUS_IDS": "0000:4d:00.0"},
    {"HABANA_VISIBLE_MODULES": ""},
])
def test_the_runtimes_other_selectors_imply_the_visibility_variable(
        env: dict[str, str]) -> None:
    # The Intel Gaudi container runtime (HabanaAI/gaudi-container-runtime, specs.go,
    # filterDevicesByENV) mounts the devices these name when HABANA_VISIBLE_DEVICES is
    # unset: a container granted no Gaudi must get HABANA_VISIBLE_DEVICES=none, which
    # the runtime reads first, so that it grants nothing either. They ask nothing here.
    ask = gaudi.PROFILE.read_env(env)
    assert (ask.visible, ask.sources) == (True, ())
    assert set(env) <= gaudi.PROFILE.env_names  # the request parser hands them over


# ---- container env and the change probe -------------------------------------------------

def _device(name: str, module: str | None, kind: str = gaudi.KIND) -> Device:
    attrs = {"module_id": module} if module is not None else {}
    return Device(kind=kind, name=name, attributes=attrs)  # type: ignore[arg-type]


def test_container_env_lists_indices_and_their_modules_in_the_same_order(tmp_path: Path) -> None:
    found = gaudi.discover(materialise("gaudi2-hls", tmp_path / "node"))
    by_name = {d.name: d for d in found.devices}
    env = gaudi.container_env([by_name["2"], by_name["0"], by_name["4"]])
    assert env == {"HABANA_VISIBLE_DEVICES": "2,0,4", "HABANA_VISIBLE_MODULES": "0,3,7"}


@pytest.mark.parametrize(("granted", "expected"), [
    ([], {}),
    ([_device("1", "5"), _device("1", "5")], {"HABANA_VISIBLE_DEVICES": "1",
                                              "HABANA_VISIBLE_MODULES": "5"}),
    ([_device("1", "5"), _device("0", None)], {"HABANA_VISIBLE_DEVICES": "1,0"}),
    ([_device("0", "0", kind="aws.amazon.com/neuron")], {}),
])
def test_container_env_cases(granted: list[Device], expected: dict[str, str]) -> None:
    assert gaudi.container_env(granted) == expected


def test_probe_changes_when_nodes_or_status_change(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    first = gaudi.probe(tree.root)
    assert gaudi.probe(tree.root) == first
    paths = [p for p, _ in first]
    assert "/dev/accel/accel_controlD1" in paths
    assert "/sys/class/accel/accel1/device/status" in paths

    tree.chardev("/dev/accel/accel2", 261, 2)  # a node appears
    appeared = gaudi.probe(tree.root)
    assert appeared != first
    tree.remove("/dev/accel/accel2")  # and goes again
    assert gaudi.probe(tree.root) == first
    tree.remove("/dev/accel/accel_controlD1")
    assert gaudi.probe(tree.root) != first
    tree.chardev("/dev/accel/accel_controlD1", CTRL, 1)
    recreated = gaudi.probe(tree.root)
    tree.file("/sys/devices/pci0000:00/0000:00:01.0/0000:34:00.0/status", "In reset\n")
    assert gaudi.probe(tree.root) != recreated
    tree.file("/sys/module/habanalabs/version", "1.19.0-0\n")
    tree.chardev("/dev/hl0", 510, 0)
    later = dict(gaudi.probe(tree.root))
    assert later["/sys/module/habanalabs/version"] == "1.19.0-0\n"
    assert "/dev/hl0" in later
