"""Pure decisions of the device plugin: resources, device IDs, grants, preferred allocation."""

from __future__ import annotations

from types import MappingProxyType

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from msgspec.structs import replace

from nri_accel.config import Config, DevicePluginConfig, DevicesConfig
from nri_accel.container import ContainerInfo
from nri_accel.deviceplugin.resources import (
    KUBELET_MAX_MESSAGE,
    PluginDevice,
    Resource,
    allocate,
    extended_resource_name_error,
    listed_bytes,
    preferred_allocation,
    resources_from_inventory,
)
from nri_accel.deviceplugin.server import _device_list, advertised
from nri_accel.errors import AllocationError, NotFoundError, RequestError
from nri_accel.inventory import Device, Inventory
from nri_accel.policy import Policy
from nri_accel.select import DeviceIndex, choose
from nri_accel.syntax import MAX_IDS, MAX_VALUE_BYTES
from nri_accel.vendors.nvidia import KIND_GPU, KIND_MIG

from .conftest import GPU0, GPU1, GPU2, MIG_A, MIG_B, MIG_C, NODE_CONFIG, node_inventory


def _settings(**kw: object) -> Config:
    return replace(NODE_CONFIG, device_plugin=DevicePluginConfig(**kw))  # type: ignore[arg-type]


def _served(inventory: Inventory, config: Config) -> dict[str, list[str]]:
    return {r.name: [d.id for d in r.devices]
            for r in resources_from_inventory(inventory, config)[0]}


def _by_name(resources: tuple[Resource, ...]) -> dict[str, Resource]:
    return {r.name: r for r in resources}


def test_one_resource_per_kind_and_mig_profile() -> None:
    resources, problems = resources_from_inventory(node_inventory(), NODE_CONFIG)
    assert [r.name for r in resources] == [
        "acme.example/fpga", "acme.example/npu", "aws.amazon.com/neuron",
        "nvidia.com/gpu", "nvidia.com/mig-1g.10gb", "nvidia.com/mig-2g.20gb",
    ]
    assert problems == ()
    r = _by_name(resources)
    # GPU 1 is in MIG mode: only its MIG devices are advertised.
    assert [d.id for d in r["nvidia.com/gpu"].devices] == [GPU0, GPU2]
    assert [d.id for d in r["nvidia.com/mig-1g.10gb"].devices] == [MIG_A, MIG_B]
    assert [d.id for d in r["nvidia.com/mig-2g.20gb"].devices] == [MIG_C]
    # Devices without a UUID are known by their name.
    assert [d.id for d in r["aws.amazon.com/neuron"].devices] == ["0", "1"]
    assert [d.id for d in r["acme.example/npu"].devices] == ["npu0", "npu1"]


def test_device_facts_health_numa_links_and_qualified_names() -> None:
    r = _by_name(resources_from_inventory(node_inventory(), NODE_CONFIG)[0])
    gpu0, gpu2 = r["nvidia.com/gpu"].devices
    assert (gpu0.qualified_name, gpu0.healthy, gpu0.numa_node) == (
        f"nvidia.com/gpu={GPU0}", True, 0)
    assert (gpu2.healthy, gpu2.numa_node) == (False, 1)
    # A MIG device without its own NUMA node takes its parent GPU's.
    mig = r["nvidia.com/mig-1g.10gb"].devices[0]
    assert (mig.qualified_name, mig.numa_node) == (f"nvidia.com/mig={MIG_A}", 1)
    n0, n1 = r["aws.amazon.com/neuron"].devices
    assert (n0.links, n1.links, n0.numa_node) == (("1",), ("0",), None)


def test_resource_names_rename_kinds_and_an_empty_one_leaves_a_kind_out() -> None:
    config = _settings(resource_names=(("nvidia.com/gpu", "nri-accel.io/gpu"),
                                       ("nvidia.com/mig", "nri-accel.io/mig"),
                                       ("acme.example/npu", ""),
                                       ("aws.amazon.com/neuron", "example.com/inferentia")))
    assert _served(node_inventory(), config) == {
        "acme.example/fpga": ["fpga0"],
        "example.com/inferentia": ["0", "1"],
        "nri-accel.io/gpu": [GPU0, GPU2],
        "nri-accel.io/mig-1g.10gb": [MIG_A, MIG_B],
        "nri-accel.io/mig-2g.20gb": [MIG_C],
    }


def test_mig_strategies_name_the_resources_as_nvidias_plugin_does() -> None:
    inv = node_inventory(with_neuron=False)
    nvidia = {n: d for n, d in _served(inv, _settings()).items() if n.startswith("nvidia")}
    assert nvidia == {"nvidia.com/gpu": [GPU0, GPU2], "nvidia.com/mig-1g.10gb": [MIG_A, MIG_B],
                      "nvidia.com/mig-2g.20gb": [MIG_C]}  # mixed, the default
    resources, problems = resources_from_inventory(inv, _settings(mig_strategy="none"))
    assert [(r.name, [d.id for d in r.devices]) for r in resources
            if r.name.startswith("nvidia")] == [("nvidia.com/gpu", [GPU0, GPU2])]
    assert [(p.source, "mig_strategy \"none\"" in p.message) for p in problems] == [
        ("nvidia.com/gpu=1", True)]
    # single: GPUs in and out of MIG mode, and two profiles: nothing NVIDIA, one reason.
    resources, problems = resources_from_inventory(inv, _settings(mig_strategy="single"))
    assert not [r for r in resources if r.name.startswith("nvidia")]
    assert [p.source for p in problems] == ["nvidia"]
    assert "GPU 0, 2 is not" in problems[0].message
    assert "same migEnabled value" in problems[0].message


def _all_mig(*profiles: str, empty_gpu: bool = False) -> Inventory:
    devices = [Device(KIND_GPU, "0", uuid=GPU0, attributes=MappingProxyType(
        {"mig_mode": "enabled"}))]
    devices += [Device(KIND_MIG, f"0:{i}", uuid=f"MIG-{i}", parent="0",
                       attributes=MappingProxyType({"mig_profile": p}))
                for i, p in enumerate(profiles)]
    if empty_gpu:
        devices.append(Device(KIND_GPU, "1", uuid=GPU1, attributes=MappingProxyType(
            {"mig_mode": "enabled"})))
    return Inventory(devices=tuple(devices))


def test_single_strategy_serves_uniform_mig_devices_as_the_gpu_resource() -> None:
    single = _settings(mig_strategy="single",
                       resource_names=(("nvidia.com/gpu", "nri-accel.io/gpu"),))
    assert _served(_all_mig("1g.10gb", "1g.10gb"), single) == {
        "nri-accel.io/gpu": ["MIG-0", "MIG-1"]}
    for inv, why in ((_all_mig("1g.10gb", "2g.20gb"), "more than one MIG device type"),
                     (_all_mig("1g.10gb", empty_gpu=True), "GPU 1 is in MIG mode with no "
                                                           "MIG devices")):
        resources, problems = resources_from_inventory(inv, single)
        assert resources == ()
        assert why in problems[0].message
    # A node with no GPU in MIG mode is served whole under "single" too.
    assert _served(Inventory(devices=(Device(KIND_GPU, "0", uuid=GPU0),)), single) == {
        "nri-accel.io/gpu": [GPU0]}


def test_time_slicing_advertises_each_device_n_times_with_its_health() -> None:
    config = _settings(replicas=(("nvidia.com/gpu", 2), ("nvidia.com/mig-2g.20gb", 3)))
    r = _by_name(resources_from_inventory(node_inventory(), config)[0])
    gpus = r["nvidia.com/gpu"]
    assert gpus.replicas == 2
    assert [(d.id, d.qualified_name, d.healthy, d.links) for d in gpus.devices] == [
        (f"{GPU0}::0", f"nvidia.com/gpu={GPU0}::0", True, ()),
        (f"{GPU0}::1", f"nvidia.com/gpu={GPU0}::1", True, ()),
        (f"{GPU2}::0", f"nvidia.com/gpu={GPU2}::0", False, ()),
        (f"{GPU2}::1", f"nvidia.com/gpu={GPU2}::1", False, ())]
    assert [d.id for d in r["nvidia.com/mig-2g.20gb"].devices] == [
        f"{MIG_C}::0", f"{MIG_C}::1", f"{MIG_C}::2"]
    assert [d.id for d in r["nvidia.com/mig-1g.10gb"].devices] == [MIG_A, MIG_B]  # not shared
    grant = allocate(gpus, [f"{GPU0}::1"])
    assert dict(grant.annotations) == {
        "devices.nri-accel.io/resource.nvidia.com_gpu": f"nvidia.com/gpu={GPU0}::1"}


def test_replica_ids_over_63_characters_are_not_advertised() -> None:
    name = "n" * 60  # fits alone, not with "::10"
    inv = Inventory(devices=(Device("acme.example/npu", name),))
    config = _settings(replicas=(("acme.example/npu", 11),))
    resources, problems = resources_from_inventory(inv, config)
    assert resources == ()
    assert f"device ID '{name}::10' is longer than 63" in problems[0].message
    assert _served(inv, _settings(replicas=(("acme.example/npu", 10),)))[
        "acme.example/npu"][-1] == name + "::9"


def test_the_listed_size_is_the_answer_protobuf_encodes_failing_closed() -> None:
    # listed_bytes() counts what _device_list() sends with every device Unhealthy: NUMA
    # nodes absent, 0 (a varint protobuf leaves out), small and large, IDs of any length.
    devices = tuple(PluginDevice(id=name, qualified_name="", numa_node=numa)
                    for name in ("a", "GPU-" + "f" * 36, "x" * 63, "é" * 20)
                    for numa in (None, 0, 1, 127, 128, 300, 1 << 40, -1))
    resource = Resource("acme.example/npu", devices, 1)
    assert listed_bytes(devices) == _device_list(resource, closed=True).ByteSize()
    assert listed_bytes(devices) > _device_list(resource, closed=False).ByteSize()


def test_a_resource_kubelet_could_not_read_failing_closed_is_not_advertised() -> None:
    # 16 Trainium2 devices of 8 NeuronCores each, 1024 replicas a core: 131,072 IDs that
    # fit kubelet's 4 MiB while Healthy, not once every one is Unhealthy (`run` away),
    # when kubelet would drop the stream and the resource with it.
    inv = Inventory(devices=tuple(Device("acme.example/npu", f"neuron{i}-core{j}")
                                  for i in range(16) for j in range(8)))
    resources, problems = resources_from_inventory(
        inv, _settings(replicas=(("acme.example/npu", 1024),)))
    assert resources == ()
    assert problems[0].source == "acme.example/npu"
    assert "131072 device IDs list in" in problems[0].message
    assert f"over the {KUBELET_MAX_MESSAGE} kubelet reads" in problems[0].message
    (fewer,), _ = resources_from_inventory(inv, _settings(replicas=(("acme.example/npu", 512),)))
    assert listed_bytes(fewer.devices) <= KUBELET_MAX_MESSAGE


def test_two_kinds_renamed_into_one_resource_keep_their_ids_apart() -> None:
    inv = Inventory(devices=(Device("a.example/x", "d0"), Device("a.example/x", "d1"),
                             Device("b.example/y", "d0")))
    config = _settings(resource_names=(("b.example/y", "a.example/x"),))
    resources, problems = resources_from_inventory(inv, config)
    assert [(r.name, [d.qualified_name for d in r.devices]) for r in resources] == [
        ("a.example/x", ["a.example/x=d0", "a.example/x=d1"])]
    assert [(p.source, "has a device with ID 'd0' already (a.example/x=d0)" in p.message)
            for p in problems] == [("b.example/y=d0", True)]


def test_a_health_watch_marks_devices_unhealthy_by_key() -> None:
    inv = node_inventory()
    gpu0 = inv.find(KIND_GPU, "0")
    assert gpu0 is not None
    r = _by_name(resources_from_inventory(inv, NODE_CONFIG, {gpu0.key: "XID 79"})[0])
    assert [(d.id, d.healthy) for d in r["nvidia.com/gpu"].devices] == [
        (GPU0, False), (GPU2, False)]
    assert all(d.healthy for d in r["nvidia.com/mig-1g.10gb"].devices)


def test_links_are_translated_to_kubelet_ids_within_the_resource() -> None:
    inv = Inventory(devices=(
        Device(KIND_GPU, "0", uuid="GPU-a", links=("1", "3", "0", "9")),
        Device(KIND_GPU, "1", uuid="GPU-b", links=("0",)),
        Device(KIND_GPU, "3", uuid="GPU-c", links=("0",),
               attributes=MappingProxyType({"mig_mode": "enabled"})),
    ))
    (gpus,), _ = resources_from_inventory(inv, Config())
    # Self, unknown (9) and MIG-mode (3) peers are dropped.
    assert [(d.id, d.links) for d in gpus.devices] == [("GPU-a", ("GPU-b",)),
                                                       ("GPU-b", ("GPU-a",))]


def test_devices_that_cannot_be_advertised_are_reported() -> None:
    long_name = "n" * 64
    inv = Inventory(devices=(
        Device(KIND_MIG, "0:0", uuid="MIG-x"),  # no profile
        Device(KIND_MIG, "0:1", uuid="MIG-y",
               attributes=MappingProxyType({"mig_profile": "1g.10gb ?"})),
        Device(KIND_MIG, "0:2", uuid="MIG-z",
               attributes=MappingProxyType({"mig_profile": "1g.10gb+me"})),
        Device("acme.example/npu", long_name),
        Device("acme.example/npu", "ok"),
    ))
    resources, problems = resources_from_inventory(inv, Config())
    assert [(r.name, [d.id for d in r.devices]) for r in resources] == [
        ("acme.example/npu", ["ok"]), ("nvidia.com/mig-1g.10gb.me", ["MIG-z"])]
    assert [p.source for p in problems] == [
        "acme.example/npu=" + long_name, "nvidia.com/mig=0:0", "nvidia.com/mig=0:1"]
    assert "longer than 63" in problems[0].message
    assert "mig_profile" in problems[1].message
    assert "'mig-1g.10gb ?'" in problems[2].message


@pytest.mark.parametrize(("name", "fragment"), [
    ("nvidia.com/gpu", ""),
    ("nvidia.com/mig-1g.10gb", ""),
    ("acme.example/npu_x.1", ""),
    ("gpu", "no domain prefix"),
    ("Acme.example/npu", "not a DNS subdomain"),
    ("kubernetes.io/gpu", "kubernetes.io domain"),
    ("foo.kubernetes.io/gpu", "kubernetes.io domain"),
    ("acme.example/-npu", "1-63"),
    ("acme.example/" + "x" * 64, "1-63"),
    ("acme.example/", "1-63"),
])
def test_extended_resource_names(name: str, fragment: str) -> None:
    err = extended_resource_name_error(name)
    assert (fragment in err) if fragment else err == ""
    assert bool(err) == bool(fragment)


def test_cdi_passthrough_names_only_cdi_spec_devices() -> None:
    on = Config(devices=DevicesConfig(cdi_passthrough=True),
                static_devices=NODE_CONFIG.static_devices)
    r = _by_name(resources_from_inventory(node_inventory(), on)[0])
    assert [d.cdi_name for d in r["acme.example/npu"].devices] == [
        "acme.example/npu=npu0", "acme.example/npu=npu1"]
    # Static devices have no spec; NVIDIA and Neuron are nri-accel's own discoveries.
    assert [d.cdi_name for d in r["acme.example/fpga"].devices] == [""]
    assert {d.cdi_name for d in r["nvidia.com/gpu"].devices} == {""}
    off = _by_name(resources_from_inventory(node_inventory(), NODE_CONFIG)[0])
    assert {d.cdi_name for d in off["acme.example/npu"].devices} == {""}


# ---- grants -------------------------------------------------------------------------


def test_grant_lists_qualified_names_in_inventory_order_once() -> None:
    r = _by_name(resources_from_inventory(node_inventory(), NODE_CONFIG)[0])
    grant = allocate(r["acme.example/npu"], ["npu1", "npu0", "npu1"])
    assert dict(grant.annotations) == {
        "devices.nri-accel.io/resource.acme.example_npu":
            "acme.example/npu=npu0,acme.example/npu=npu1"}
    assert grant.cdi_devices == ()
    gpu = allocate(r["nvidia.com/gpu"], [GPU0])
    assert dict(gpu.annotations) == {
        "devices.nri-accel.io/resource.nvidia.com_gpu": f"nvidia.com/gpu={GPU0}"}
    mig = allocate(r["nvidia.com/mig-1g.10gb"], [MIG_B])
    assert dict(mig.annotations) == {
        "devices.nri-accel.io/resource.nvidia.com_mig-1g.10gb": f"nvidia.com/mig={MIG_B}"}


def test_advertised_counts_follow_health_and_the_nri_side() -> None:
    (resources, _) = resources_from_inventory(node_inventory(), NODE_CONFIG)
    gpu = _by_name(resources)["nvidia.com/gpu"]
    assert advertised([gpu], nri_down=False) == {("nvidia.com/gpu", "Healthy"): 1,
                                                 ("nvidia.com/gpu", "Unhealthy"): 1}
    assert advertised([gpu], nri_down=True) == {("nvidia.com/gpu", "Healthy"): 0,
                                                ("nvidia.com/gpu", "Unhealthy"): 2}


def test_grant_of_an_unhealthy_device_is_refused_naming_it() -> None:
    # kubelet may allocate a device that turned Unhealthy after it chose: refused here,
    # at admission, where the NRI side would refuse it at every CreateContainer retry
    r = _by_name(resources_from_inventory(node_inventory(), NODE_CONFIG)[0])
    with pytest.raises(AllocationError) as e:
        allocate(r["nvidia.com/gpu"], [GPU0, GPU2])
    assert type(e.value) is AllocationError
    assert str(e.value) == f"nvidia.com/gpu: device ID {GPU2!r} is Unhealthy"


def test_a_grant_the_nri_side_could_not_read_is_refused() -> None:
    # more devices than `run` reads of one grant annotation (syntax.MAX_IDS), or a longer
    # value (MAX_VALUE_BYTES): refused at Allocate, not at every CreateContainer
    many = Inventory(devices=tuple(Device("a.io/n", f"{i:x}") for i in range(MAX_IDS + 1)))
    (npus,) = resources_from_inventory(many, NODE_CONFIG)[0]
    assert allocate(npus, [f"{i:x}" for i in range(MAX_IDS)]).annotations
    with pytest.raises(RequestError) as e:
        allocate(npus, [f"{i:x}" for i in range(MAX_IDS + 1)])
    assert type(e.value) is RequestError
    assert f"more than `nri-accel run` reads of one container's grant ({MAX_IDS} devices" \
        in str(e.value)
    long = Inventory(devices=tuple(Device("acme.example/npu", f"n{i:055d}") for i in range(80)))
    (longs,) = resources_from_inventory(long, NODE_CONFIG)[0]
    with pytest.raises(RequestError, match=f"{MAX_VALUE_BYTES} bytes"):
        allocate(longs, [d.id for d in longs.devices])


def test_grant_of_an_unknown_device_names_it_and_the_resource() -> None:
    r = _by_name(resources_from_inventory(node_inventory(), NODE_CONFIG)[0])
    with pytest.raises(NotFoundError) as e:
        allocate(r["nvidia.com/gpu"], [GPU0, GPU1])  # GPU1 is in MIG mode
    assert str(e.value) == f"nvidia.com/gpu: unknown device ID {GPU1!r}"
    with pytest.raises(NotFoundError, match=r"unknown device ID 'xxxx.*\.\.\.'$"):
        allocate(r["nvidia.com/gpu"], ["x" * 500])


def test_allocate_grant_is_a_trusted_grant_for_the_nri_side() -> None:
    # What kubelet copies from Allocate into the container's annotations is what
    # Policy.request_for takes as a trusted grant, even in an untrusted namespace.
    r = _by_name(resources_from_inventory(node_inventory(), NODE_CONFIG)[0])
    grant = allocate(r["nvidia.com/gpu"], [GPU0])
    info = ContainerInfo(namespace="default", pod_name="p", pod_uid="u",
                         container_name="c", container_id="id", pod_annotations={},
                         container_annotations=dict(grant.annotations), env=())
    req = Policy.from_config(Config()).request_for(info)
    assert [(c.kind, c.ids) for c in req.grants] == [(KIND_GPU, (GPU0,))]
    assert req.grants[0].source.startswith("container annotation devices.nri-accel.io/resource.")
    # The same key written by the pod author (copied into the container by the runtime)
    # is not the device plugin's: refused.
    pod = dict(grant.annotations)
    with pytest.raises(RequestError, match=r"devices\.nri-accel\.io/resource"):
        Policy.from_config(Config()).request_for(
            ContainerInfo(namespace="default", pod_name="p", pod_uid="u", container_name="c",
                          container_id="id", pod_annotations=pod,
                          container_annotations=dict(grant.annotations), env=()))


# ---- preferred allocation -------------------------------------------------------------

# Two NUMA nodes of four GPUs. Links: 0-1 and 2-3 on node 0; 4, 5, 6, 7 all linked.
_LINKS = {0: (1,), 1: (0,), 2: (3,), 3: (2,), 4: (5, 6, 7), 5: (4, 6, 7), 6: (4, 5, 7),
          7: (4, 5, 6)}


def _topology(no_numa: tuple[int, ...] = ()) -> Resource:
    inv = Inventory(devices=tuple(
        Device(KIND_GPU, str(i), uuid=f"GPU-{i}", numa_node=None if i in no_numa else i // 4,
               links=tuple(str(j) for j in _LINKS[i]))
        for i in range(8)))
    (res,), _ = resources_from_inventory(inv, Config())
    return res


def _ids(*indices: int) -> list[str]:
    return [f"GPU-{i}" for i in indices]


@pytest.mark.parametrize(("available", "must", "size", "want"), [
    # One NUMA node, a linked pair; equal nodes: the lower one.
    (range(8), (), 2, (0, 1)),
    # The must-include device's node, and its linked peer.
    (range(8), (5,), 2, (4, 5)),
    (range(8), (2,), 2, (2, 3)),
    # Node 0 offers no linked pair among what is available, node 1 does.
    ((0, 2, 4, 5), (), 2, (4, 5)),
    # Only node 0 has room for three.
    ((0, 1, 2, 4), (), 3, (0, 1, 2)),
    # Both nodes have a linked pair: the smaller node, keeping the other whole.
    ((0, 1, 4, 5, 6, 7), (), 2, (0, 1)),
    # No node fits: a whole node, then the best of the next.
    (range(8), (), 5, (0, 1, 2, 3, 4)),
    ((0, 1, 4, 5, 6, 7), (), 5, (0, 4, 5, 6, 7)),
    # Must-include on node 1 pulls the whole-node choice there.
    (range(8), (6,), 6, (0, 1, 4, 5, 6, 7)),
    # Everything, or more than there is: all available.
    ((3, 1, 2), (), 3, (1, 2, 3)),
    ((1, 2), (), 4, (1, 2)),
    # Must-include alone fills the request.
    (range(8), (7, 3), 2, (3, 7)),
    (range(8), (7, 3), 1, (3, 7)),
])
def test_preferred_allocation(available, must, size, want) -> None:
    got = preferred_allocation(_topology(), _ids(*available), _ids(*must), size)
    assert got == tuple(_ids(*want))


def test_preferred_allocation_ignores_unknown_available_ids() -> None:
    got = preferred_allocation(_topology(), ["GPU-x", *_ids(6, 7)], [], 2)
    assert got == tuple(_ids(6, 7))


def test_preferred_allocation_keeps_unknown_must_include_ids() -> None:
    # The unknown ID counts towards the size; the one device added is GPU 2, whose peer
    # (GPU 3) is not available, so taking it breaks no free link (0-1 stays whole).
    got = preferred_allocation(_topology(), _ids(0, 1, 2), ["GPU-gone"], 2)
    assert got == ("GPU-2", "GPU-gone")


def test_one_device_comes_from_an_unlinked_gpu_not_a_linked_pair() -> None:
    inv = Inventory(devices=(
        Device(KIND_GPU, "0", uuid="GPU-0", numa_node=0, links=("1",)),
        Device(KIND_GPU, "1", uuid="GPU-1", numa_node=0),  # the link is named by 0 only
        Device(KIND_GPU, "2", uuid="GPU-2", numa_node=0),
    ))
    (res,), _ = resources_from_inventory(inv, Config())
    assert preferred_allocation(res, _ids(0, 1, 2), [], 1) == ("GPU-2",)
    index = DeviceIndex(inv)
    assert [d.name for d in choose(index, inv.devices, 1)] == ["2"]


def _agreement_inventory() -> Inventory:
    """Two NUMA nodes of four plus two GPUs of unknown NUMA node; links named by one end
    only, across nodes too (0-4), so both adapters must make them symmetric."""
    links = {0: ("1", "4"), 2: ("3",), 4: ("5", "6", "7"), 5: ("6", "7"), 6: ("7",), 8: ("9",)}
    return Inventory(devices=tuple(
        Device(KIND_GPU, str(i), uuid=f"GPU-{i}", numa_node=i // 4 if i < 8 else None,
               links=links.get(i, ()))
        for i in range(10)))


@pytest.mark.parametrize("count", [1, 2, 3, 5])
def test_engine_and_preferred_allocation_choose_the_same_devices(count) -> None:
    inv = _agreement_inventory()
    (res,), _ = resources_from_inventory(inv, Config())
    index = DeviceIndex(inv)
    n = len(inv.devices)
    checked = 0
    for bits in range(1 << n):
        free = [d for i, d in enumerate(inv.devices) if bits >> i & 1]
        if len(free) < count:
            continue
        engine = [d.uuid for d in choose(index, free, count)]
        plugin = preferred_allocation(res, [d.uuid for d in reversed(free)], [], count)
        assert list(plugin) == engine, [d.name for d in free]
        checked += 1
    assert checked > 100


def test_devices_without_numa_node_form_their_own_group() -> None:
    res = _topology(no_numa=(2, 3))
    assert preferred_allocation(res, _ids(0, 2, 3), [], 2) == tuple(_ids(2, 3))
    assert preferred_allocation(res, _ids(0, 1, 2, 3), [], 2) == tuple(_ids(0, 1))


def test_preferred_allocation_is_deterministic() -> None:
    res = _topology()
    first = preferred_allocation(res, _ids(7, 6, 5, 4, 3, 2, 1, 0), [], 3)
    assert first == preferred_allocation(res, _ids(0, 1, 2, 3, 4, 5, 6, 7), [], 3)
    assert first == tuple(_ids(4, 5, 6))


def test_replicas_are_preferred_spread_over_the_least_shared_devices() -> None:
    inv = Inventory(devices=tuple(Device(KIND_GPU, str(i), uuid=f"GPU-{i}", numa_node=0)
                                  for i in range(3)))
    (res,), _ = resources_from_inventory(inv, _settings(replicas=(("nvidia.com/gpu", 4),)))

    def rid(i: int, n: int) -> str:
        return f"GPU-{i}::{n}"

    every = [d.id for d in res.devices]
    # One from each GPU before a second from any.
    assert preferred_allocation(res, every, [], 3) == (rid(0, 0), rid(1, 0), rid(2, 0))
    assert preferred_allocation(res, every, [], 4) == (rid(0, 0), rid(0, 1), rid(1, 0),
                                                       rid(2, 0))
    # GPU 0 is mostly taken by others (1 replica free), GPU 2 untouched: GPU 2 first.
    free = [rid(0, 3), rid(1, 2), rid(1, 3), *(rid(2, n) for n in range(4))]
    assert preferred_allocation(res, free, [], 1) == (rid(2, 0),)
    # A must-include replica counts for its GPU.
    assert preferred_allocation(res, every, [rid(1, 2)], 2) == (rid(0, 0), rid(1, 2))


@settings(max_examples=300, deadline=None, derandomize=True)
@given(data=st.data(), gpus=st.integers(1, 6), replicas=st.integers(2, 6))
def test_replicas_are_spread_whatever_is_free_and_must_be_included(data, gpus: int,
                                                                   replicas: int) -> None:
    # The greedy spread (fewest replicas of the allocation first, then the least
    # shared device, then inventory order) by what it promises, on random free sets,
    # must-include sets and sizes: the size asked (or every ID there is), the
    # must-include ones, nothing not offered, in inventory order; and no device short
    # of free replicas left with two fewer than a device that got one by choice.
    inv = Inventory(devices=tuple(Device(KIND_GPU, str(i), uuid=f"GPU-{i}", numa_node=0)
                                  for i in range(gpus)))
    (res,), _ = resources_from_inventory(inv, _settings(replicas=(("nvidia.com/gpu", replicas),)))
    ids = [d.id for d in res.devices]
    free = data.draw(st.lists(st.sampled_from(ids), unique=True), "free")
    must = data.draw(st.lists(st.sampled_from(ids), unique=True, max_size=3), "must")
    size = data.draw(st.integers(0, len(ids) + 2), "size")
    got = preferred_allocation(res, free, must, size)
    offered = set(free) | set(must)
    assert len(got) == len(set(got)) == max(len(must), min(size, len(offered)))
    assert set(must) <= set(got) <= offered
    assert list(got) == sorted(got, key=ids.index)

    def gpu(replica_id: str) -> str:
        return replica_id.rpartition("::")[0]

    held = {g: sum(gpu(i) == g for i in got) for g in map(gpu, ids)}
    chosen = {gpu(i) for i in set(got) - set(must)}
    short = {gpu(i) for i in set(free) - set(got)}  # still has a free replica
    for a in short:
        for b in chosen:
            assert held[a] >= held[b] - 1, (a, b, held)
