"""[device_plugin] settings end to end: what the device plugin advertises over real gRPC
to the fake kubelet, and what `run` (an Engine, as its CreateContainer handler uses it)
makes of the grant that kubelet copies into the container: renamed resources, each MIG
strategy, time-slicing replicas, NeuronCores."""

from __future__ import annotations

from pathlib import Path

import pytest
from fakes.roots import materialise
from grants import admit, held
from msgspec.structs import replace

from nri_accel.config import Config, DevicePluginConfig
from nri_accel.discover import discover
from nri_accel.engine import Engine
from nri_accel.errors import AllocationError
from nri_accel.inventory import Device, Inventory
from nri_accel.vendors.neuron import core_id

from .conftest import (
    GPU0,
    GPU1,
    GPU2,
    MIG_A,
    MIG_B,
    MIG_C,
    NODE_CONFIG,
    allocate,
    created,
    health,
    ids,
    node_inventory,
    preferred,
)

NVIDIA_RESOURCES_MIXED = ["nvidia.com/gpu", "nvidia.com/mig-1g.10gb", "nvidia.com/mig-2g.20gb"]
OTHERS = ["acme.example/fpga", "acme.example/npu", "aws.amazon.com/neuron"]


def settings(**kw: object) -> Config:
    return replace(NODE_CONFIG, device_plugin=DevicePluginConfig(**kw))  # type: ignore[arg-type]


def served(running) -> list[str]:  # type: ignore[no-untyped-def]
    return [r.name for r in running.plugins.resources]


def engine(inventory: Inventory | None = None) -> Engine:
    """`run` on the same node, in its default (kubernetes) policy."""
    return Engine(inventory if inventory is not None else node_inventory(), Config())


# ---- renamed resources ---------------------------------------------------------------

def test_renamed_resources_serve_beside_nvidias_plugin_and_grant_on_the_nri_side(
        kubelet, plugins) -> None:
    running = plugins(config=settings(resource_names=(
        ("nvidia.com/gpu", "nri-accel.io/gpu"), ("nvidia.com/mig", "nri-accel.io/mig"))))
    gpu = kubelet.wait_registered("nri-accel.io/gpu")
    kubelet.wait_registered("nri-accel.io/mig-2g.20gb")
    mig = kubelet.wait_registered("nri-accel.io/mig-1g.10gb")
    assert served(running) == [*OTHERS, "nri-accel.io/gpu", "nri-accel.io/mig-1g.10gb",
                               "nri-accel.io/mig-2g.20gb"]  # no nvidia.com/* left
    assert ids(kubelet.wait_list(gpu)) == [GPU0, GPU2]

    (c1,) = allocate(kubelet, gpu.request.endpoint, [GPU0]).container_responses
    (c2,) = allocate(kubelet, mig.request.endpoint, [MIG_B]).container_responses
    # The key names the (renamed) resource, the value the devices by kind.
    assert dict(c1.annotations) == {
        "devices.nri-accel.io/resource.nri-accel.io_gpu": f"nvidia.com/gpu={GPU0}"}
    assert dict(c2.annotations) == {
        "devices.nri-accel.io/resource.nri-accel.io_mig-1g.10gb": f"nvidia.com/mig={MIG_B}"}
    run = engine()
    assert admit(run, created(c1, "c1")).qualified_names == ("nvidia.com/gpu=0",)
    assert admit(run, created(c2, "c2")).qualified_names == ("nvidia.com/mig=1:1",)
    assert held(run) == {"c1": ("nvidia.com/gpu=0",), "c2": ("nvidia.com/mig=1:1",)}


def test_a_kind_named_empty_is_not_advertised(kubelet, plugins) -> None:
    running = plugins(config=settings(resource_names=(("aws.amazon.com/neuron", ""),)))
    kubelet.wait_registered("nvidia.com/gpu")
    assert "aws.amazon.com/neuron" not in served(running)


# ---- MIG strategies ------------------------------------------------------------------

def all_in_mig_mode() -> Inventory:
    """GPU 1 alone, in MIG mode with two 1g.10gb MIG devices: what "single" serves."""
    return Inventory(devices=tuple(
        d for d in node_inventory(with_2g=False, with_neuron=False).devices
        if d.kind != "nvidia.com/gpu" or d.name == "1"))


@pytest.mark.parametrize(("strategy", "inventory", "nvidia"), [
    # mixed: whole GPUs not in MIG mode, one resource per MIG profile
    ("mixed", node_inventory(), {"nvidia.com/gpu": [GPU0, GPU2],
                                 "nvidia.com/mig-1g.10gb": [MIG_A, MIG_B],
                                 "nvidia.com/mig-2g.20gb": [MIG_C]}),
    # none: whole GPUs only; GPU 1, in MIG mode, is unusable whole and left out
    ("none", node_inventory(), {"nvidia.com/gpu": [GPU0, GPU2]}),
    # single: every GPU in MIG mode with one profile: the MIG devices as nvidia.com/gpu
    ("single", all_in_mig_mode(), {"nvidia.com/gpu": [MIG_A, MIG_B]}),
    # single on a node it cannot describe (GPUs in and out of MIG mode, two profiles):
    # no NVIDIA resource at all, as k8s-device-plugin refuses to start
    ("single", node_inventory(), {}),
])
def test_each_mig_strategy_advertises_what_nvidias_plugin_does(
        kubelet, plugins, strategy: str, inventory: Inventory,
        nvidia: dict[str, list[str]]) -> None:
    running = plugins(inventory, config=settings(mig_strategy=strategy))
    for name, devices in nvidia.items():
        assert ids(kubelet.wait_list(kubelet.wait_registered(name))) == devices
    kubelet.wait_registered("acme.example/npu")
    assert [n for n in served(running) if n.startswith("nvidia.com/")] == sorted(nvidia)


def test_single_strategy_grants_resolve_to_the_mig_devices(kubelet, plugins) -> None:
    plugins(all_in_mig_mode(), config=settings(mig_strategy="single"))
    gpu = kubelet.wait_registered("nvidia.com/gpu")
    (c,) = allocate(kubelet, gpu.request.endpoint, [MIG_B]).container_responses
    assert dict(c.annotations) == {
        "devices.nri-accel.io/resource.nvidia.com_gpu": f"nvidia.com/mig={MIG_B}"}
    assert admit(engine(all_in_mig_mode()), created(c, "c1")).qualified_names == (
        "nvidia.com/mig=1:1",)


# ---- time-slicing replicas -----------------------------------------------------------

def two_gpus() -> Inventory:
    return Inventory(devices=(
        Device("nvidia.com/gpu", "0", uuid=GPU0, numa_node=0, vendor="nvidia"),
        Device("nvidia.com/gpu", "1", uuid=GPU1, numa_node=0, vendor="nvidia"),
        Device("nvidia.com/gpu", "2", uuid=GPU2, numa_node=1, vendor="nvidia",
               healthy=False),
    ))


def test_time_slicing_replicas_share_a_gpu_between_containers(kubelet, plugins) -> None:
    plugins(two_gpus(), config=settings(replicas=(("nvidia.com/gpu", 3),)))
    gpu = kubelet.wait_registered("nvidia.com/gpu")
    listed = kubelet.wait_list(gpu)
    assert health(listed) == [
        (f"{GPU0}::0", "Healthy"), (f"{GPU0}::1", "Healthy"), (f"{GPU0}::2", "Healthy"),
        (f"{GPU1}::0", "Healthy"), (f"{GPU1}::1", "Healthy"), (f"{GPU1}::2", "Healthy"),
        (f"{GPU2}::0", "Unhealthy"), (f"{GPU2}::1", "Unhealthy"),
        (f"{GPU2}::2", "Unhealthy")]
    # Preferred: spread over the GPUs, the least shared first.
    available = [d.ID for d in listed.devices if d.health == "Healthy"]
    assert preferred(kubelet, gpu.request.endpoint, available, 2) == [
        f"{GPU0}::0", f"{GPU1}::0"]
    assert preferred(kubelet, gpu.request.endpoint, available[1:], 1,
                     must=()) == [f"{GPU1}::0"]  # GPU 1 has more replicas free

    # Two pods get replicas of GPU 0: `run` grants the GPU to both, shared.
    (a,) = allocate(kubelet, gpu.request.endpoint, [f"{GPU0}::0"]).container_responses
    (b,) = allocate(kubelet, gpu.request.endpoint, [f"{GPU0}::1"]).container_responses
    assert dict(a.annotations) == {
        "devices.nri-accel.io/resource.nvidia.com_gpu": f"nvidia.com/gpu={GPU0}::0"}
    run = engine(two_gpus())
    first = admit(run, created(a, "a", pod="p1"))
    second = admit(run, created(b, "b", pod="p2"))
    assert first.qualified_names == second.qualified_names == ("nvidia.com/gpu=0",)
    assert first.grant.shared == second.grant.shared == {f"nvidia.com/gpu={GPU0}"}
    assert held(run) == {}  # shared: held by neither
    assert "NVIDIA_VISIBLE_DEVICES=" + GPU0 in second.edits.env


# ---- NeuronCores -----------------------------------------------------------------------

@pytest.fixture
def trn1(tmp_path: Path) -> Inventory:
    """A trn1.32xlarge (tests/fakes/roots/trn1): 16 Trainium devices of 2 NeuronCores."""
    return discover(materialise("trn1", tmp_path / "trn1"), Config())


def env_of(plan) -> dict[str, str]:  # type: ignore[no-untyped-def]
    return dict(kv.partition("=")[::2] for kv in plan.edits.env)


def test_neuroncores_are_allocated_one_kubelet_device_each(kubelet, plugins, trn1) -> None:
    plugins(trn1, config=Config())
    devices = kubelet.wait_registered("aws.amazon.com/neuron")
    cores = kubelet.wait_registered("aws.amazon.com/neuroncore")
    assert ids(kubelet.wait_list(devices)) == [str(i) for i in range(16)]
    # A core's kubelet ID is its device's index and its own within it (core_id), which
    # no renumbering of the node-wide core numbers shifts.
    assert ids(kubelet.wait_list(cores)) == [core_id(str(i), j) for i in range(16)
                                             for j in range(2)]

    (c1,) = allocate(kubelet, cores.request.endpoint,
                     ["neuron2-core1", "neuron2-core0"]).container_responses
    assert dict(c1.annotations) == {"devices.nri-accel.io/resource.aws.amazon.com_neuroncore":
                                    "aws.amazon.com/neuroncore=neuron2-core0,"
                                    "aws.amazon.com/neuroncore=neuron2-core1"}
    run = engine(trn1)
    plan = admit(run, created(c1, "c1", pod="p1"))
    # Exactly those cores, node-wide numbering, and the node of their device (neuron2).
    assert [n.path for n in plan.edits.device_nodes] == ["/dev/neuron2"]
    assert env_of(plan) == {"AWS_NEURON_VISIBLE_DEVICES": "2", "NEURON_RT_VISIBLE_CORES": "4-5"}

    # Cores of two devices, then the other core of one of them: parts of one device may
    # go to different containers.
    (c2,) = allocate(kubelet, cores.request.endpoint,
                     ["neuron3-core0", "neuron4-core1"]).container_responses
    plan = admit(run, created(c2, "c2", pod="p2"))
    assert [n.path for n in plan.edits.device_nodes] == ["/dev/neuron3", "/dev/neuron4"]
    assert env_of(plan) == {"AWS_NEURON_VISIBLE_DEVICES": "3,4",
                            "NEURON_RT_VISIBLE_CORES": "6,9"}
    (c3,) = allocate(kubelet, cores.request.endpoint, ["neuron3-core1"]).container_responses
    assert env_of(admit(run, created(c3, "c3", pod="p3")))["NEURON_RT_VISIBLE_CORES"] == "7"


def test_a_whole_device_and_its_cores_never_go_to_different_containers(
        kubelet, plugins, trn1) -> None:
    plugins(trn1, config=Config())
    devices = kubelet.wait_registered("aws.amazon.com/neuron")
    cores = kubelet.wait_registered("aws.amazon.com/neuroncore")
    (core,) = allocate(kubelet, cores.request.endpoint, ["neuron2-core0"]).container_responses
    (whole,) = allocate(kubelet, devices.request.endpoint, ["2"]).container_responses
    run = engine(trn1)
    admit(run, created(core, "c1", pod="p1"))
    with pytest.raises(AllocationError) as e:
        admit(run, created(whole, "c2", pod="p2"))
    assert ("aws.amazon.com/neuron=2 (its part aws.amazon.com/neuroncore=neuron2-core0) is "
            "held by default/p1/c-c1") in str(e.value)
    run.release("c1")
    assert admit(run, created(whole, "c2", pod="p2")).qualified_names == (
        "aws.amazon.com/neuron=2",)
    # and the other way round: a core of a device another container holds whole
    with pytest.raises(AllocationError, match=r"aws\.amazon\.com/neuroncore=neuron2-core0 "
                                              r"\(its device aws\.amazon\.com/neuron=2\) is held"):
        admit(run, created(core, "c3", pod="p3"))


def test_a_core_grant_sets_exactly_its_cores_whatever_the_container_says(trn1) -> None:
    grant = {"devices.nri-accel.io/resource.aws.amazon.com_neuroncore":
             "aws.amazon.com/neuroncore=3"}
    plan = admit(engine(trn1), created(grant, "c1", env=("NEURON_RT_VISIBLE_CORES=0-31",)))
    assert env_of(plan) == {"AWS_NEURON_VISIBLE_DEVICES": "1", "NEURON_RT_VISIBLE_CORES": "3"}
    # Whole devices, unchanged: the container's own (narrower) value stays.
    grant = {"devices.nri-accel.io/resource.aws.amazon.com_neuron": "aws.amazon.com/neuron=1"}
    plan = admit(engine(trn1), created(grant, "c1", env=("NEURON_RT_VISIBLE_CORES=3",)))
    assert env_of(plan) == {"AWS_NEURON_VISIBLE_DEVICES": "1"}
