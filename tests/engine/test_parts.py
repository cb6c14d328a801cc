"""A device and its parts (NeuronCores of a Neuron device, MIG devices of a GPU) in the
one exclusivity rule (nri_accel.state.Holdings): a whole and one of its parts are never
held by different containers; parts of one device may be. Through the Engine, as `run`
plans and commits containers."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path
from types import MappingProxyType

import pytest
from engine_testing import admit, container, demo_inventory, held, standalone
from msgspec import structs

from nri_accel.engine import Engine, grant_annotations
from nri_accel.errors import AllocationError
from nri_accel.inventory import ContainerEdits, Device, DeviceNode, Driver, Inventory
from nri_accel.state import Checkpoint, CheckpointWriter, Grant, Holdings
from nri_accel.vendors.neuron import KIND, KIND_CORE, core_id


def neuron_node() -> Inventory:
    """Two Neuron devices of 2 NeuronCores each, as Neuron discovery makes them."""
    devices = []
    for i in range(2):
        node = DeviceNode(f"/dev/neuron{i}", 240, i)
        devices.append(Device(KIND, str(i), aliases=(f"neuron{i}",), vendor="neuron",
                              edits=ContainerEdits(device_nodes=(node,)),
                              attributes=MappingProxyType({"cores": "2"})))
        devices += [Device(KIND_CORE, str(2 * i + j), uuid=core_id(str(i), j), parent=str(i),
                           vendor="neuron",
                           edits=ContainerEdits(env=(f"NEURON_RT_VISIBLE_CORES={2 * i + j}",),
                                                device_nodes=(node,)),
                           attributes=MappingProxyType({"core": str(j)}))
                    for j in range(2)]
    return Inventory(devices=tuple(devices),
                     drivers=MappingProxyType({"neuron": Driver("neuron", "2.19.64.0")}))


def asks(value: str, cid: str) -> object:
    return container(pod_annotations={"devices.nri-accel.io": value}, cid=cid, pod=cid)


def test_cores_of_one_device_go_to_different_containers() -> None:
    engine = Engine(neuron_node(), standalone())
    admit(engine, asks("aws.amazon.com/neuroncore=0", "a"))
    admit(engine, asks("aws.amazon.com/neuroncore=1", "b"))
    assert held(engine) == {"a": ("aws.amazon.com/neuroncore=0",),
                            "b": ("aws.amazon.com/neuroncore=1",)}


def test_a_whole_device_committed_after_a_core_was_taken_since_its_plan_is_refused() -> None:
    engine = Engine(neuron_node(), standalone())
    whole = engine.plan(asks("aws.amazon.com/neuron=0", "b"))
    admit(engine, asks("aws.amazon.com/neuroncore=1", "a"))
    with pytest.raises(AllocationError, match=r"aws\.amazon\.com/neuron=0 \(its part aws\.amazon"
                                              r"\.com/neuroncore=neuron0-core1\) is held by"):
        engine.commit(whole)
    assert held(engine) == {"a": ("aws.amazon.com/neuroncore=1",)}


def test_a_whole_device_is_refused_while_another_container_holds_a_core() -> None:
    engine = Engine(neuron_node(), standalone())
    admit(engine, asks("aws.amazon.com/neuroncore=1", "a"))
    with pytest.raises(AllocationError, match=r"aws\.amazon\.com/neuron=0 \(its part aws\.amazon"
                                              r"\.com/neuroncore=neuron0-core1\) is held by "
                                              r"default/a/"):
        engine.plan(asks("aws.amazon.com/neuron=0", "b"))
    # A count of whole devices passes over it, and says why when nothing else is free.
    assert admit(engine, asks("aws.amazon.com/neuron: 1", "b")).qualified_names == (
        "aws.amazon.com/neuron=1",)
    with pytest.raises(AllocationError, match=r"held: 0 by default/a/main-a \(id a\), which "
                                              r"holds its part aws\.amazon\.com/neuroncore="
                                              r"neuron0-core1"):
        engine.plan(asks("aws.amazon.com/neuron: 1", "c"))


def test_a_core_is_refused_while_another_container_holds_its_device() -> None:
    engine = Engine(neuron_node(), standalone())
    admit(engine, asks("aws.amazon.com/neuron=1", "a"))
    with pytest.raises(AllocationError, match=r"aws\.amazon\.com/neuroncore=neuron1-core0 "
                                              r"\(its device aws\.amazon\.com/neuron=1\) is held"):
        engine.plan(asks("aws.amazon.com/neuroncore=2", "b"))
    plan = admit(engine, asks("aws.amazon.com/neuroncore: 2", "b"))  # neuron0's, free
    assert plan.qualified_names == ("aws.amazon.com/neuroncore=0", "aws.amazon.com/neuroncore=1")
    # The same container may hold a device and its cores (one grant).
    admit(engine, asks("aws.amazon.com/neuron=1;aws.amazon.com/neuroncore=3", "a"))
    # Released: the core is free again.
    engine.release("a")
    assert admit(engine, asks("aws.amazon.com/neuroncore=2", "c")).qualified_names == (
        "aws.amazon.com/neuroncore=2",)


def test_a_whole_gpu_for_mig_configuration_waits_for_its_mig_devices() -> None:
    # A GPU in MIG mode is granted whole only for MIG configuration or monitoring; while
    # another container holds one of its MIG devices, an exclusive grant of it is refused.
    inv = demo_inventory()
    engine = Engine(inv, standalone())
    admit(engine, asks("nvidia.com/mig=7:0", "a"))
    info = container(pod_annotations={"devices.nri-accel.io": "nvidia.com/gpu=7"},
                     env=("NVIDIA_MIG_CONFIG_DEVICES=all",), cid="b", pod="b")
    with pytest.raises(AllocationError, match=r"nvidia\.com/gpu=GPU-.*\(its part "
                                              r"nvidia\.com/mig=MIG-.*\) is held"):
        engine.plan(info)
    engine.release("a")
    assert admit(engine, info).qualified_names == ("nvidia.com/gpu=7",)


def mig_mode_off(inv: Inventory, gpu: str) -> Inventory:
    """`inv` after `nvidia-smi -i <gpu> -mig 0`: that GPU without MIG mode, and without
    its MIG devices, as the next discovery finds it."""
    whole = inv.find("nvidia.com/gpu", gpu)
    assert whole is not None
    off = structs.replace(whole, attributes=MappingProxyType(
        {**whole.attributes, "mig_mode": "disabled"}))
    return dataclasses.replace(inv, devices=tuple(
        off if d is whole else d for d in inv.devices
        if not (d.kind == "nvidia.com/mig" and d.parent == gpu)))


def test_a_held_mig_device_whose_gpu_left_mig_mode_still_ties_its_gpu() -> None:
    # The container still has /dev/nvidia7: until it ends, GPU 7 goes to nobody else,
    # though the new inventory no longer says that MIG device was part of it.
    inv = demo_inventory()
    engine = Engine(inv, standalone())
    admit(engine, asks("nvidia.com/mig=7:0", "a"))
    engine.swap_inventory(mig_mode_off(inv, "7"))
    whole = asks("nvidia.com/gpu=7", "b")
    with pytest.raises(AllocationError, match=r"nvidia\.com/gpu=GPU-.*\(its part "
                                              r"nvidia\.com/mig=MIG-.*\) is held by"):
        engine.plan(whole)
    engine.release("a")
    engine.swap_inventory(mig_mode_off(inv, "7"))  # the next refresh forgets the link
    assert admit(engine, whole).qualified_names == ("nvidia.com/gpu=7",)


def test_the_checkpoint_keeps_a_held_parts_whole_across_a_restart(tmp_path: Path) -> None:
    # Written as `run` writes it after each change: by a CheckpointWriter, from the
    # holdings' snapshot (and not only by to_json, which `run` calls once, at start).
    inv = demo_inventory()
    engine = Engine(inv, standalone())
    admit(engine, asks("nvidia.com/mig=7:0", "a"))
    admit(engine, asks("nvidia.com/gpu=0", "c"))
    checkpoint = Checkpoint(str(tmp_path), boot_id="boot")
    writer = CheckpointWriter(checkpoint, engine.holdings.snapshot,
                              known=lambda: engine.holdings.known)

    async def written() -> bool:
        return await writer.changed()

    assert asyncio.run(written())
    gpu, mig = inv.find("nvidia.com/gpu", "7"), inv.find("nvidia.com/mig", "7:0")
    assert gpu is not None and mig is not None
    grants, known = checkpoint.load()
    assert {g.container_id: g.wholes for g in grants} == {"a": ((mig.key, gpu.key),), "c": ()}
    assert Path(checkpoint.path).read_text() == engine.holdings.to_json("boot")
    grants = [g for g in grants if g.container_id == "a"]

    restarted = Engine(mig_mode_off(inv, "7"), standalone())  # reconfigured meanwhile
    restarted.load_checkpoint(grants, known=known)
    with pytest.raises(AllocationError, match=r"\(its part nvidia\.com/mig=MIG-"):
        restarted.plan(asks("nvidia.com/gpu=7", "b"))
    # A Synchronize restores the grant from the container's annotation, which names the
    # part only: the link the checkpoint gave is kept.
    restarted.restore_grants(restarted.grants_in([container(
        cid="a", pod="a", annotations=grant_annotations(grants[0]))]))
    assert held(restarted) == {"a": (mig.key,)}
    with pytest.raises(AllocationError, match=r"\(its part nvidia\.com/mig=MIG-"):
        restarted.plan(asks("nvidia.com/gpu=7", "b"))


def test_holdings_learn_parts_per_inventory_and_keep_grants_by_key() -> None:
    h = Holdings()
    h.record(Grant("a", name="ns/p/a", exclusive=frozenset({"k/core=0"})))
    whole = Grant("b", name="ns/p/b", exclusive=frozenset({"k/dev=0"}))
    h.check(whole)  # no parts known: unrelated keys
    h.set_parts({"k/core=0": "k/dev=0", "k/core=1": "k/dev=0"})
    with pytest.raises(AllocationError, match=r"k/dev=0 \(its part k/core=0\) is held by "
                                              r"ns/p/a"):
        h.check(whole)
    assert h.busy(whole) == {"k/core=0": "ns/p/a (id a)",
                             "k/dev=0": "ns/p/a (id a), which holds its part k/core=0"}
    h.check(Grant("c", exclusive=frozenset({"k/core=1"})))  # a sibling part: free


def test_busy_names_the_holders_of_a_whole_and_its_parts_and_leaves_out_a_replaced_grant() -> None:
    h = Holdings()
    h.set_parts({"k/core=0": "k/dev=0", "k/core=1": "k/dev=0"})
    h.record(Grant("a", name="ns/p/a", pod_uid="p", container_name="a",
                   exclusive=frozenset({"k/dev=0"})))
    h.record(Grant("b", name="ns/q/b", exclusive=frozenset({"k/dev=1"})))
    busy = h.busy(Grant("c", name="ns/r/c", exclusive=frozenset({"k/core=1"})))
    # keys(): what the allocator tests each device against
    assert set(busy.keys()) == {"k/dev=0", "k/dev=1", "k/core=0", "k/core=1"}
    assert "k/core=1" in busy and len(busy) == 4
    assert dict(busy) == {"k/dev=0": "ns/p/a (id a)", "k/dev=1": "ns/q/b (id b)",
                          "k/core=0": "ns/p/a (id a), which holds its device k/dev=0",
                          "k/core=1": "ns/p/a (id a), which holds its device k/dev=0"}
    # A new create of a's pod and name replaces a's grant: only b's device is busy.
    again = Grant("a2", name="ns/p/a", pod_uid="p", container_name="a")
    assert dict(h.busy(again)) == {"k/dev=1": "ns/q/b (id b)"}
    h.release("a")
    h.release("b")
    assert not h.busy(again)
