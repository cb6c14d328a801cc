"""AMD Instinct profile: the mi300x fake root, KFD topology edge cases, the error paths,
the AMD_VISIBLE_DEVICES grammar, the container env and the change probe."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fakes.roots import materialise
from hosttree import HostTree

from nri_accel.config import Config, PolicyConfig
from nri_accel.container import ContainerInfo
from nri_accel.discover import assemble
from nri_accel.discover.base import Found
from nri_accel.discover.hostroot import HostRoot
from nri_accel.engine import Engine
from nri_accel.errors import AllocationError, NotFoundError
from nri_accel.health import carry_vanished
from nri_accel.inventory import Device, DeviceNode, Inventory
from nri_accel.state import Grant
from nri_accel.vendors import amd

KFD = 235
TOPO = "/sys/class/kfd/kfd/topology"
PROC_DEVICES = f"Character devices:\n  1 mem\n226 drm\n{KFD} kfd\n\nBlock devices:\n  8 sd\n"


def _node(tree: HostTree, n: int, gpu_id: int, **props: int) -> None:
    text = "".join(f"{k} {v}\n" for k, v in props.items())
    tree.file(f"{TOPO}/nodes/{n}/properties", text)
    tree.file(f"{TOPO}/nodes/{n}/gpu_id", f"{gpu_id}\n")


def _cpu(tree: HostTree, n: int) -> None:
    _node(tree, n, 0, cpu_cores_count=64, simd_count=0, location_id=0, domain=0,
          drm_render_minor=0)


def _gpu(tree: HostTree, n: int, bus: int, minor: int, *, uid: int | None = None,
         numa: int = 0, hive: int = 0, fn: int = 0, **extra: int) -> None:
    props = {"cpu_cores_count": 0, "simd_count": 1216, "gfx_target_version": 90402,
             "vendor_id": 4098, "device_id": 29857, "location_id": bus << 8 | fn,
             "domain": 0, "drm_render_minor": minor, "hive_id": hive,
             "unique_id": 0x1000 + n if uid is None else uid, **extra}
    _node(tree, n, 1000 + n, **props)
    tree.file(f"/sys/bus/pci/devices/0000:{bus:02x}:00.{fn}/numa_node", f"{numa}\n")
    tree.chardev(f"/dev/dri/renderD{minor}", 226, minor)


def _tree(tmp_path: Path, gpus: int = 2) -> HostTree:
    tree = HostTree(tmp_path / "node")
    tree.file("/proc/devices", PROC_DEVICES)
    tree.file("/sys/module/amdgpu/version", "6.10.5\n")
    tree.file(f"{TOPO}/generation_id", "1\n")
    tree.chardev("/dev/kfd", KFD, 0)
    _cpu(tree, 0)
    for i in range(gpus):
        _gpu(tree, i + 1, 0x11 + i, 128 + i)
    return tree


def _problems(found: Found) -> dict[str, str]:
    return {p.source: p.message for p in found.problems}


# ---- the fake MI300X node ------------------------------------------------------------

def test_mi300x_root_gpus_in_pci_order_with_rocm_uuids(tmp_path: Path) -> None:
    found = amd.discover(materialise("mi300x", tmp_path / "node"))
    assert found.problems == ()
    assert [d.name for d in found.devices] == ["0", "1", "2", "3"]
    # names follow PCI order (the container toolkit's); KFD order is kept as kfd_node
    assert [(d.pci_bus_id, d.attributes["kfd_node"]) for d in found.devices] == [
        ("0000:11:00.0", "3"), ("0000:2f:00.0", "4"), ("0000:c1:00.0", "2"), ("0000:e1:00.0", "5")]
    d2 = found.devices[2]
    assert d2.qualified_name == "amd.com/gpu=2"
    assert d2.uuid == "GPU-3a5c4e1f2b7d9086"
    assert d2.aliases == ("renderD128", "0000:c1:00.0", "0x3a5c4e1f2b7d9086")
    assert d2.numa_node == 1 and d2.healthy and d2.vendor == "amd"
    assert d2.edits.device_nodes == (DeviceNode("/dev/dri/renderD128", 226, 128),)
    assert dict(d2.attributes) == {
        "device_id": "0x74a1", "drm_render_minor": "128", "gfx_target_version": "90402",
        "gpu_id": "45510", "hive_id": "0x8bd2c3b1e9f30a41", "kfd_node": "2", "num_xcc": "8",
        "product_name": "AMD Instinct MI300X OAM", "simd_count": "1216",
        "unique_id": "0x3a5c4e1f2b7d9086"}
    assert [d.numa_node for d in found.devices] == [0, 0, 1, 1]
    # one XGMI hive: every GPU links to the three others
    assert [d.links for d in found.devices] == [("1", "2", "3"), ("0", "2", "3"),
                                                ("0", "1", "3"), ("0", "1", "2")]
    (driver,) = found.drivers
    assert (driver.vendor, driver.version) == ("amd", "6.10.5")
    assert dict(driver.capabilities) == {"": driver.capabilities[""]}
    assert driver.capabilities[""].device_nodes == (DeviceNode("/dev/kfd", KFD, 0),)
    # card (modesetting) nodes are never given
    assert not any("card" in n.path for d in found.devices for n in d.edits.device_nodes)


def test_visible_uuid_forms_name_the_discovered_uuid(tmp_path: Path) -> None:
    found = amd.discover(materialise("mi300x", tmp_path / "node"))
    d2 = found.devices[2]
    assert amd.parse_visible("0x3A5C4E1F2B7D9086") == (d2.uuid,)
    assert amd.parse_visible("3a5c4e1f2b7d9086") == (d2.uuid,)


# ---- topology and node paths on small trees -------------------------------------------

def test_no_amdgpu_means_nothing_and_no_problem(tmp_path: Path) -> None:
    tree = HostTree(tmp_path / "node")
    tree.chardev("/dev/null", 1, 3)
    assert amd.discover(tree.root) == Found()


def test_cpu_nodes_are_skipped_and_apus_count(tmp_path: Path) -> None:
    tree = _tree(tmp_path, 1)
    _cpu(tree, 2)
    # an APU node has CPU cores and SIMDs: ROCr makes it a GPU agent
    _gpu(tree, 3, 0x05, 130, cpu_cores_count=16)
    found = amd.discover(tree.root)
    assert [(d.name, d.attributes["kfd_node"]) for d in found.devices] == [("0", "3"), ("1", "1")]


def test_refused_render_node_keeps_the_other_names(tmp_path: Path) -> None:
    tree = _tree(tmp_path, 3)
    tree.remove("/dev/dri/renderD129")
    tree.symlink("/dev/dri/renderD129", "renderD128")
    found = amd.discover(tree.root)
    assert [d.name for d in found.devices] == ["0", "2"]
    assert "symlink" in _problems(found)["/dev/dri/renderD129"]


@pytest.mark.parametrize(("major", "minor", "message"), [
    (KFD, 128, "major 235 is not the 'drm' major (226)"),
    (226, 200, "minor 200 is not the expected 128"),
])
def test_render_node_with_wrong_numbers_is_refused(tmp_path: Path, major: int, minor: int,
                                                  message: str) -> None:
    tree = _tree(tmp_path, 1)
    tree.chardev("/dev/dri/renderD128", major, minor)
    found = amd.discover(tree.root)
    assert found.devices == ()
    assert message in _problems(found)["/dev/dri/renderD128"]


@pytest.mark.parametrize(("make", "message"), [
    ("missing", "does not exist"),
    ("wrong major", "major 236 is not the 'kfd' major (235)"),
    ("symlink", "is a symlink"),
])
def test_unusable_kfd_makes_every_gpu_unhealthy(tmp_path: Path, make: str, message: str) -> None:
    tree = _tree(tmp_path)
    tree.remove("/dev/kfd")
    if make == "wrong major":
        tree.chardev("/dev/kfd", 236, 0)
    elif make == "symlink":
        tree.symlink("/dev/kfd", "dri/renderD128")
    found = amd.discover(tree.root)
    assert [d.healthy for d in found.devices] == [False, False]
    assert message in found.devices[0].attributes["health"]
    assert message in _problems(found)["/dev/kfd"]
    assert dict(found.drivers[0].capabilities) == {}


def test_driver_missing_from_proc_devices_refuses_its_nodes(tmp_path: Path) -> None:
    tree = _tree(tmp_path, 1)
    tree.file("/proc/devices", "Character devices:\n235 kfd\n\nBlock devices:\n226 drm\n")
    found = amd.discover(tree.root)
    assert found.devices == ()
    assert "no 'drm' character major" in _problems(found)["/dev/dri/renderD128"]


def test_unreadable_proc_devices_is_a_problem_not_a_refusal(tmp_path: Path) -> None:
    tree = _tree(tmp_path, 1)
    tree.remove("/proc/devices")
    found = amd.discover(tree.root)
    assert [d.name for d in found.devices] == ["0"]
    assert list(_problems(found)) == ["/proc/devices"]


def test_zero_unique_id_old_kernel_keys_and_no_numa(tmp_path: Path) -> None:
    tree = _tree(tmp_path, 0)
    props = {"cpu_cores_count": 0, "simd_count": 416, "location_id": 0x6308,
             "drm_render_minor": 128, "unique_id": 0}  # no domain: an older kernel
    _node(tree, 1, 777, **props)
    tree.file("/sys/bus/pci/devices/0000:63:01.0/numa_node", "-1\n")
    tree.chardev("/dev/dri/renderD128", 226, 128)
    (d,) = amd.discover(tree.root).devices
    assert (d.uuid, d.pci_bus_id, d.numa_node, d.aliases) == (
        "", "0000:63:01.0", None, ("renderD128", "0000:63:01.0"))
    assert "unique_id" not in d.attributes and d.links == ()


def _cpx(tree: HostTree, first_node: int, bus: int, minor: int, uid: int, count: int,
         *, shift: int = 0) -> None:
    """One GPU in a partitioned mode: `count` KFD nodes with the GPU's unique_id, each
    with its own render node, and location_id = pci_dev_id | node_id (shift 0: the
    kernel's kfd_topology_add_device) or node_id << 28 (the reverted variant)."""
    for p in range(count):
        _gpu(tree, first_node + p, bus, minor + p, uid=uid, location_id=bus << 8 | p << shift)


@pytest.mark.parametrize("shift", [0, 28])
def test_compute_partitions_are_told_apart_by_their_index_in_the_gpu(tmp_path: Path,
                                                                     shift: int) -> None:
    """A GPU in CPX mode: its partitions share the GPU's unique_id (no UUID, no 0x alias)
    and PCI function (no PCI alias, and its NUMA node); each is named by its GPU's
    address and its index there, the kernel's node_id, which is its key."""
    tree = _tree(tmp_path, 0)
    _cpx(tree, 1, 0x11, 128, 0xABC, 8, shift=shift)
    _gpu(tree, 9, 0x2F, 136, uid=0xDEF)  # a whole GPU beside them
    tree.file("/sys/bus/pci/devices/0000:11:00.0/numa_node", "1\n")
    found = amd.discover(tree.root)
    assert found.problems == ()
    parts, whole = found.devices[:8], found.devices[8]
    assert [(d.name, d.pci_bus_id, d.partition, d.uuid, d.aliases) for d in parts] == [
        (str(p), "0000:11:00.0", p, "", (f"renderD{128 + p}",)) for p in range(8)]
    assert [d.key for d in parts] == [f"amd.com/gpu=0000:11:00.0-p{p}" for p in range(8)]
    assert {d.numa_node for d in parts} == {1}
    assert amd.PROFILE.partition(parts[3], None) == "partition 3 of 0000:11:00.0"
    assert (whole.name, whole.partition, whole.key) == (
        "8", None, "amd.com/gpu=GPU-0000000000000def")
    assert amd.PROFILE.partition(whole, None) == ""


@pytest.mark.parametrize("shift", [0, 28])
def test_partitions_with_a_unique_id_each_are_still_their_gpus(tmp_path: Path,
                                                               shift: int) -> None:
    """Linux 6.18 on: each partition's unique_id is its first XCD's, not its GPU's. The
    partitions are still told by their location_ids, which name their GPU's PCI
    function (bits 31:28) or functions that are not there (pci_dev_id | node_id), never
    GPUs of their own at 0000:11:00.1-3."""
    tree = _tree(tmp_path, 0)
    for p in range(4):
        _gpu(tree, 1 + p, 0x11, 128 + p, uid=0xA00 + p, location_id=0x11 << 8 | p << shift)
    _gpu(tree, 5, 0x2F, 132, uid=0xDEF)  # a whole GPU beside them
    tree.file("/sys/bus/pci/devices/0000:11:00.0/numa_node", "1\n")
    found = amd.discover(tree.root)
    assert found.problems == ()
    parts, whole = found.devices[:4], found.devices[4]
    assert [(d.pci_bus_id, d.partition, d.numa_node) for d in parts] == [
        ("0000:11:00.0", p, 1) for p in range(4)]
    assert [amd.PROFILE.partition(d, None) for d in parts] == [
        f"partition {p} of 0000:11:00.0" for p in range(4)]
    assert (whole.pci_bus_id, whole.partition) == ("0000:2f:00.0", None)


def test_gpus_at_two_functions_of_one_slot_stay_two_gpus(tmp_path: Path) -> None:
    # function 1 is there (sysfs): a GPU of its own, not a partition of function 0's
    tree = _tree(tmp_path, 0)
    _gpu(tree, 1, 0x11, 128, uid=0xA00)
    _gpu(tree, 2, 0x11, 129, uid=0xB00, fn=1)
    found = amd.discover(tree.root)
    assert [(d.pci_bus_id, d.partition) for d in found.devices] == [
        ("0000:11:00.0", None), ("0000:11:00.1", None)]


def test_partitions_keep_their_ids_when_the_kfd_order_or_the_render_minors_change(
        tmp_path: Path) -> None:
    """What names a partition is its GPU's address and its index, never the KFD node
    order or a render minor, which another boot may give out differently."""
    tree = _tree(tmp_path / "a", 0)
    _cpx(tree, 1, 0x11, 128, 0xABC, 4)
    _cpx(tree, 5, 0x2F, 132, 0xDEF, 4)
    other = _tree(tmp_path / "b", 0)
    _cpx(other, 1, 0x2F, 140, 0xDEF, 4)  # the other GPU probed first, other minors
    _cpx(other, 5, 0x11, 150, 0xABC, 4)
    ids = [sorted((d.stable_id, d.attributes["drm_render_minor"])
                  for d in amd.discover(t.root).devices) for t in (tree, other)]
    assert [i for i, _ in ids[0]] == [i for i, _ in ids[1]] == [
        f"0000:{bus}:00.0-p{p}" for bus in ("11", "2f") for p in range(4)]
    assert ids[0] != ids[1]


def test_partitions_whose_location_ids_cannot_tell_them_apart_go_by_render_minor(
        tmp_path: Path) -> None:
    """No kernel writes one location_id for two partitions, but should one: their GPU's
    PCI function, numbered in the order amdgpu creates them (render minor), and neither
    shared id as an alias."""
    tree = _tree(tmp_path, 0)
    _gpu(tree, 1, 0x11, 129, uid=0xABC)
    _gpu(tree, 2, 0x11, 128, uid=0xABC)
    _gpu(tree, 3, 0x2F, 130, uid=0xDEF)
    found = amd.discover(tree.root)
    assert [(d.name, d.attributes["drm_render_minor"], d.uuid, d.aliases, d.stable_id)
            for d in found.devices] == [
        ("0", "128", "", ("renderD128",), "0000:11:00.0-p0"),
        ("1", "129", "", ("renderD129",), "0000:11:00.0-p1"),
        ("2", "130", "GPU-0000000000000def", ("renderD130", "0000:2f:00.0",
                                             "0x0000000000000def"), "GPU-0000000000000def"),
    ]


def test_partitions_through_the_device_plugin_and_the_engine(tmp_path: Path) -> None:
    """The device plugin's IDs are the partitions' ids (one per partition, none left
    out), and what its Allocate grants, the Engine grants: those partitions, recorded
    under the same ids."""
    from nri_accel.deviceplugin.resources import allocate, resources_from_inventory

    tree = _tree(tmp_path, 0)
    _cpx(tree, 1, 0x11, 128, 0xABC, 8)
    inventory = assemble([("amd", True, amd.discover(tree.root))])
    assert inventory.problems == ()
    (resource,), problems = resources_from_inventory(inventory, Config())
    assert problems == ()
    assert [d.id for d in resource.devices] == [f"0000:11:00.0-p{p}" for p in range(8)]
    grant = allocate(resource, ["0000:11:00.0-p5", "0000:11:00.0-p2"])
    info = ContainerInfo(namespace="ns", pod_name="p", pod_uid="u", container_name="c",
                         container_id="c1", pod_annotations={},
                         container_annotations=grant.annotations, env=())
    engine = Engine(inventory, Config(policy=PolicyConfig(mode="kubernetes")))
    plan = engine.plan(info)
    assert [d.name for d in plan.devices] == ["2", "5"]
    assert plan.annotations["nri-accel.io/granted"] == (
        "amd.com/gpu=0000:11:00.0-p2,amd.com/gpu=0000:11:00.0-p5")


@pytest.mark.parametrize("ident", ["0xabc", "0x0000000000000ABC", "GPU-0000000000000abc"])
def test_a_partitioned_gpu_s_own_id_is_refused_saying_it_is_partitioned(
        tmp_path: Path, ident: str) -> None:
    # amd-container-runtime takes a unique id for all the GPU's partitions; here each
    # partition is a device of its own, and the GPU's ids name none: refused, saying why.
    tree = _tree(tmp_path, 0)
    _cpx(tree, 1, 0x11, 128, 0xABC, 8)
    engine = Engine(_amd_inventory(tree), Config(policy=PolicyConfig(mode="standalone")))
    with pytest.raises(NotFoundError) as refused:
        engine.plan(_asks(f"amd.com/gpu={ident}", "c1"))
    assert str(refused.value) == (
        f"annotation devices.nri-accel.io: unknown device amd.com/gpu={ident!r}: GPU "
        "0x0000000000000abc is split into 8 compute partitions, each a device of its own: "
        "name them (0000:11:00.0-p0, 0000:11:00.0-p1, ...) or ask for a count")
    with pytest.raises(NotFoundError, match=r"this node has amd\.com/gpu 0, 1, "):
        engine.plan(_asks("amd.com/gpu=0xdef", "c2"))  # no GPU's id: what the node has


def _amd_inventory(tree: HostTree) -> Inventory:
    return assemble([("amd", True, amd.discover(tree.root))])


def _spx_then_cpx(tmp_path: Path, *, own_ids: bool = False) -> tuple[Inventory, Inventory]:
    """One MI300X at 0000:11:00.0, whole (SPX), then in CPX mode: 8 partitions, the
    first of them on the whole GPU's render node. `own_ids`: as Linux 6.18 on, each
    partition's unique_id its first XCD's, the GPU's in its PCI function's unique_id."""
    spx, cpx = _tree(tmp_path / "spx", 0), _tree(tmp_path / "cpx", 0)
    _gpu(spx, 1, 0x11, 128, uid=0xABC)
    if own_ids:
        for p in range(8):
            _gpu(cpx, 1 + p, 0x11, 128 + p, uid=0xD00 + p, location_id=0x11 << 8 | p)
        for tree in (spx, cpx):
            tree.file("/sys/bus/pci/devices/0000:11:00.0/unique_id", "0000000000000abc\n")
    else:
        _cpx(cpx, 1, 0x11, 128, 0xABC, 8)
    return _amd_inventory(spx), _amd_inventory(cpx)


def _asks(value: str, cid: str) -> ContainerInfo:
    return ContainerInfo(namespace="ns", pod_name=cid, pod_uid=cid, container_name="c",
                         container_id=cid, pod_annotations={"devices.nri-accel.io": value},
                         container_annotations={}, env=())


@pytest.mark.parametrize("own_ids", [False, True], ids=["shared ids", "Linux 6.18"])
def test_a_change_of_partition_mode_keeps_the_gpu_with_its_holder(tmp_path: Path,
                                                                  own_ids: bool) -> None:
    """The whole GPU and its partitions share render nodes: whichever a container holds,
    after amd-smi changes the mode (a refresh, carry_vanished, Engine.swap_inventory)
    the other form of that GPU goes to nobody else until it ends. Neither form is
    carried as a vanished device: it was replaced on purpose. From Linux 6.18 the
    partitions' own unique_ids are their first XCDs': the GPU's, which keys it whole, is
    its PCI function's, and the partitions keep their partition ids."""
    spx, cpx = _spx_then_cpx(tmp_path, own_ids=own_ids)
    parts = cpx.of_kind(amd.KIND)
    assert [(d.uuid, d.stable_id, d.attributes["unique_id"]) for d in parts] == [
        ("", f"0000:11:00.0-p{p}", "0x0000000000000abc") for p in range(8)]
    assert [d.attributes.get("partition_unique_id") for d in parts] == [
        f"0x0000000000000d0{p}" if own_ids else None for p in range(8)]
    for before, after, held, other in ((spx, cpx, "amd.com/gpu=0", "amd.com/gpu=3"),
                                       (cpx, spx, "amd.com/gpu=3", "amd.com/gpu=0")):
        engine = Engine(before, Config(policy=PolicyConfig(mode="standalone")))
        engine.commit(engine.plan(_asks(held, "a")))
        refreshed = carry_vanished(before, after)
        assert refreshed == after
        engine.swap_inventory(refreshed)
        with pytest.raises(AllocationError, match=r"is held by ns/a/c"):
            engine.plan(_asks(other, "b"))
        engine.release("a")
        assert [d.name for d in engine.plan(_asks(other, "b")).devices] == [other[-1]]


def test_a_partition_granted_before_partitions_had_ids_holds_its_whole_gpu(
        tmp_path: Path) -> None:
    """Such a grant named the GPU's PCI address: restored, it holds every partition."""
    _, cpx = _spx_then_cpx(tmp_path)
    engine = Engine(cpx, Config(policy=PolicyConfig(mode="standalone")))
    engine.load_checkpoint([Grant("a", name="ns/a/c",
                                  exclusive=frozenset({"amd.com/gpu=0000:11:00.0"}))],
                           known=True)
    assert [g.exclusive for g in engine.holdings.grants()] == [
        frozenset({"amd.com/gpu=GPU-0000000000000abc"})]
    for p in ("0", "7"):
        with pytest.raises(AllocationError, match=r"\(its device amd\.com/gpu=GPU-"):
            engine.plan(_asks(f"amd.com/gpu={p}", "b"))


def test_gpu_nodes_without_render_minor_or_location_are_skipped(tmp_path: Path) -> None:
    tree = _tree(tmp_path, 1)
    _node(tree, 2, 5, simd_count=416, location_id=0x2000)
    _node(tree, 3, 6, simd_count=416, drm_render_minor=140)
    tree.file(f"{TOPO}/nodes/4/gpu_id", "7\n")  # no properties file
    found = amd.discover(tree.root)
    assert [d.name for d in found.devices] == ["0"]
    assert {k: v.split(" ")[0] for k, v in _problems(found).items()} == {
        f"{TOPO}/nodes/2/properties": "GPU", f"{TOPO}/nodes/3/properties": "GPU",
        f"{TOPO}/nodes/4/properties": "unreadable:"}


def test_missing_topology_or_cpu_only_topology_is_a_problem(tmp_path: Path) -> None:
    tree = HostTree(tmp_path / "node")
    tree.file("/proc/devices", PROC_DEVICES)
    tree.file("/sys/module/amdgpu/version", "6.10.5\n")
    tree.chardev("/dev/kfd", KFD, 0)
    found = amd.discover(tree.root)
    assert "amdkfd is not initialised" in _problems(found)[TOPO]
    _cpu(tree, 0)
    found = amd.discover(tree.root)
    assert _problems(found)[TOPO] == "no GPU node (only CPU nodes)"
    assert found.drivers[0].capabilities[""].device_nodes == (DeviceNode("/dev/kfd", KFD, 0),)


class _Flapping(HostRoot):
    """A HostRoot whose topology generation_id reads come from a script."""

    generations: list[str] = []  # set per test

    def read_text(self, host_path: str) -> str:
        if host_path.endswith("/generation_id") and type(self).generations:
            return type(self).generations.pop(0)
        return super().read_text(host_path)


@pytest.mark.parametrize(("generations", "settles"), [
    (["1", "2", "2", "2"], True),  # changed under the first read, stable for the second
    (["1", "2", "3", "4", "5", "6"], False),
])
def test_topology_is_read_between_equal_generations(tmp_path: Path, generations: list[str],
                                                    settles: bool) -> None:
    tree = _tree(tmp_path, 1)
    _Flapping.generations = list(generations)
    found = amd.discover(_Flapping(root=str(tree.base)))
    assert [d.name for d in found.devices] == ["0"]
    assert (f"{TOPO}/generation_id" in _problems(found)) is not settles


# ---- AMD_VISIBLE_DEVICES ---------------------------------------------------------------

@pytest.mark.parametrize(("value", "expected"), [
    ("", None),
    ("none", None),
    ("NONE", None),
    ("void", None),
    ("all", "all"),
    ("All", "all"),
    ("ALL", "all"),
    ("0", ("0",)),
    ("2,0,1", ("2", "0", "1")),
    ("0-3,5", ("0", "1", "2", "3", "5")),
    ("2-2", ("2",)),
    ("1,0-1", ("1", "0")),
    ("007", ("7",)),
    ("0xEF2C1799A1F3E2ED", ("GPU-ef2c1799a1f3e2ed",)),
    ("0Xab", ("GPU-00000000000000ab",)),
    ("ef2c1799a1f3e2ed", ("GPU-ef2c1799a1f3e2ed",)),
    ("123456789", ("GPU-0000000123456789",)),  # more than 8 hex digits: a unique id
    ("1,0xab,0Xab", ("1", "GPU-00000000000000ab")),
])
def test_visible_devices_grammar(value: str, expected: object) -> None:
    assert amd.parse_visible(value) == expected


@pytest.mark.parametrize(("value", "fragment"), [
    ("aLL", "reads only 'all', 'All' and 'ALL'"),
    ("0,", "empty element"),
    ("0, 1", "' 1' has spaces"),
    ("3-1", "range '3-1' runs backwards"),
    ("0-5000", "selects more than 1024 GPUs"),
    ("-1", "range start '' is not a device index"),
    ("1-", "range end '' is not a device index"),
    ("a-b", "range start 'a'"),
    ("0x", "'0x' is not a GPU unique id"),
    ("0xZZ", "'0xZZ' is not a GPU unique id"),
    ("0x" + "f" * 17, "is not a GPU unique id"),
    ("0x0", "unique id 0 names no GPU"),
    ("GPU-ef2c1799a1f3e2ed", "takes the unique id as '0xef2c1799a1f3e2ed'"),
    ("all,0", "'all' cannot be combined"),
    ("1e3", "'1e3' is not a device index"),
])
def test_visible_devices_errors_name_the_bad_element(value: str, fragment: str) -> None:
    with pytest.raises(ValueError) as e:
        amd.parse_visible(value)
    assert fragment in str(e.value)


def test_visible_none_grants_nothing() -> None:
    assert amd.parse_visible(amd.VISIBLE_NONE) is None


@pytest.mark.parametrize("env", [
    {"DOCKER_RESOURCE_AMD_GPU": "0,1"},
    {"DOCKER_RESOURCE_GPU": "all"},
])
def test_docker_resource_variables_imply_the_visibility_variable(
        env: dict[str, str], tmp_path: Path) -> None:
    # amd-container-runtime reads every DOCKER_RESOURCE_* variable as AMD_VISIBLE_DEVICES
    # (ROCm/container-toolkit internal/oci/oci.go, getAMDEnv): nri-accel grants nothing
    # for them, and a container granted no AMD GPU gets AMD_VISIBLE_DEVICES=none, and
    # each of them "none" too
    ask = amd.PROFILE.read_env(env)
    assert (ask.visible, ask.sources) == (True, ())
    plan = amd_plan(tmp_path, "kubernetes", env)
    assert plan.devices == ()
    (name,) = env
    assert sorted(plan.edits.env) == ["AMD_VISIBLE_DEVICES=none", f"{name}=none"]


def amd_plan(tmp_path: Path, mode: str, env: dict[str, str]) -> Any:
    """The Engine's plan, on the MI300X fake node, for a container of `env` alone."""
    inventory = assemble([("amd", True, amd.discover(materialise("mi300x", tmp_path / "n")))])
    engine = Engine(inventory, Config(policy=PolicyConfig(mode=mode)))
    info = ContainerInfo(namespace="ns", pod_name="p", pod_uid="u", container_name="c",
                         container_id="c1", pod_annotations={}, container_annotations={},
                         env=tuple(f"{k}={v}" for k, v in env.items()))
    return engine.plan(info)


@pytest.mark.parametrize("mode", ["standalone", "kubernetes"])
def test_a_docker_resource_variable_after_the_visible_devices_cannot_widen_the_grant(
        mode: str, tmp_path: Path) -> None:
    # The runtime reads them in the env's order, the last one winning: an image that sets
    # AMD_VISIBLE_DEVICES and then DOCKER_RESOURCE_GPU=all would get every GPU from a
    # co-installed amd-container-runtime, AMD_VISIBLE_DEVICES being rewritten in its
    # place. Each one set says what AMD_VISIBLE_DEVICES says: in whatever order, the
    # runtime reads the grant (standalone: GPU 1; kubernetes, env granting nothing: none).
    image = {"AMD_VISIBLE_DEVICES": "1", "DOCKER_RESOURCE_GPU": "all",
             "DOCKER_RESOURCE_AMD": "0-3"}
    plan = amd_plan(tmp_path, mode, image)
    granted = "1" if mode == "standalone" else "none"
    assert [d.qualified_name for d in plan.devices] == (
        ["amd.com/gpu=1"] if mode == "standalone" else [])
    # The runtime's env: the image's, each variable of the adjustment replacing its own
    # in place (an equal value is not written again).
    env = {**image, **dict(kv.split("=", 1) for kv in plan.edits.env)}
    assert list(env)[:3] == list(image)
    assert {k: env[k] for k in image} == dict.fromkeys(image, granted)


def test_docker_resource_variables_leave_the_visible_devices_request_alone() -> None:
    ask = amd.PROFILE.read_env({"AMD_VISIBLE_DEVICES": "1", "DOCKER_RESOURCE_X": "0"})
    assert [c.ids for s in ask.sources for c in s.claims] == [("1",)]


# ---- container env and the change probe -----------------------------------------------

@pytest.mark.parametrize(("names", "expected"), [
    ([], {}),
    (["3", "1"], {"AMD_VISIBLE_DEVICES": "3,1"}),
    (["0", "0"], {"AMD_VISIBLE_DEVICES": "0"}),
])
def test_container_env_sets_only_the_visible_devices(names: list[str],
                                                     expected: dict[str, str]) -> None:
    granted = [Device(kind=amd.KIND, name=n) for n in names]
    granted.append(Device(kind="nvidia.com/gpu", name="7"))
    env = amd.container_env(granted)
    assert env == expected
    # ROCm numbers the injected GPUs itself: no ROCR_/HIP_VISIBLE_DEVICES
    assert not {"ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"} & set(env)


def test_probe_changes_when_nodes_or_the_topology_change(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    first = amd.probe(tree.root)
    assert amd.probe(tree.root) == first
    assert {p for p, _ in first} >= {"/dev/kfd", "/dev/dri/renderD128", "/dev/dri/renderD129",
                                     f"{TOPO}/generation_id", "/sys/module/amdgpu/version"}
    tree.chardev("/dev/dri/renderD130", 226, 130)  # appears
    assert amd.probe(tree.root) != first
    tree.remove("/dev/dri/renderD130")  # disappears again
    assert amd.probe(tree.root) == first
    tree.remove("/dev/kfd")
    no_kfd = amd.probe(tree.root)
    assert dict(no_kfd)["/dev/kfd"] is None
    tree.file(f"{TOPO}/generation_id", "2\n")
    assert amd.probe(tree.root) != no_kfd
    tree.chardev("/dev/dri/card1", 226, 1)  # card nodes are not watched
    assert "/dev/dri/card1" not in dict(amd.probe(tree.root))
