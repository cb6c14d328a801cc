"""Device health in the Engine: a health watch's marks (Engine.set_health) over what
discovery found, and what a refresh that no longer finds a device keeps
(nri_accel.health.carry_vanished).

The node is the built-in demo node (tests/demo_node.py); a "refresh" is the same
inventory with devices removed or renumbered, as nri_accel.discover.watch would hand it.
"""

from __future__ import annotations

import dataclasses

import msgspec
import pytest
from engine_testing import (
    GPU_UUIDS,
    admit,
    allocated,
    cdi_inventory,
    demo_inventory,
    held,
    standalone,
)
from structlog.testing import capture_logs

from nri_accel.engine import Engine
from nri_accel.errors import AllocationError, NotFoundError
from nri_accel.health import VANISHED, carry_vanished
from nri_accel.inventory import Inventory
from nri_accel.vendors.nvidia import KIND_GPU, KIND_MIG

GPU0 = f"{KIND_GPU}={GPU_UUIDS['0']}"
GPU3 = f"{KIND_GPU}={GPU_UUIDS['3']}"


def without(inventory: Inventory, *qualified: str) -> Inventory:
    return dataclasses.replace(inventory, devices=tuple(
        d for d in inventory.devices if d.qualified_name not in qualified))


# ---- a health watch's marks ---------------------------------------------------------------

def test_a_marked_gpu_is_refused_by_name_with_the_reason_and_skipped_by_counts(all_logs):
    engine = Engine(demo_inventory(), standalone())
    with capture_logs() as logs:
        engine.set_health("nvidia", {GPU0: "XID 79"})
    (said,) = [e for e in logs if e["event"] == "unhealthy_devices"]
    assert said["unhealthy"] == {GPU0: "XID 79"} and said["family"] == "nvidia"
    with pytest.raises(AllocationError, match=r"nvidia.com/gpu=0 is unhealthy \(XID 79\)"):
        engine.plan(allocated("nvidia.com/gpu=0", cid="a"))
    with pytest.raises(AllocationError, match=r"nvidia.com/gpu=0 is unhealthy"):
        engine.plan(allocated(f"nvidia.com/gpu={GPU_UUIDS['0']}", cid="a"))
    whole = [d for d in demo_inventory().of_kind(KIND_GPU)
             if d.attributes.get("mig_mode") != "enabled"]
    plan = admit(engine, allocated(f"nvidia.com/gpu: {len(whole) - 1}", cid="b"))
    assert GPU0 not in {d.key for d in plan.devices}
    with pytest.raises(AllocationError, match=r"only 0 of 8 are free .*unhealthy: 0 \(XID 79\)"):
        engine.plan(allocated("nvidia.com/gpu: 1", cid="c"))


def test_a_request_granted_before_a_mark_or_a_swap_is_selected_again_after_it():
    # select() remembers a named request's selection per inventory: a health mark or a
    # refresh makes a new index, so nothing chosen before it is served after it
    engine = Engine(demo_inventory(), standalone())
    asks = allocated("nvidia.com/gpu=0", cid="a")
    assert [d.key for d in engine.plan(asks).devices] == [GPU0]
    engine.set_health("nvidia", {GPU0: "XID 79"})
    with pytest.raises(AllocationError, match=r"nvidia.com/gpu=0 is unhealthy \(XID 79\)"):
        engine.plan(asks)
    engine.set_health("nvidia", {})
    assert [d.key for d in engine.plan(asks).devices] == [GPU0]
    engine.swap_inventory(without(demo_inventory(), "nvidia.com/gpu=0"))
    with pytest.raises(NotFoundError, match=r"unknown device nvidia\.com/gpu='0'"):
        engine.plan(asks)


def test_a_watch_that_clears_its_marks_makes_the_gpu_grantable_again():
    engine = Engine(demo_inventory(), standalone())
    engine.set_health("nvidia", {GPU0: "XID 79"})
    engine.set_health("nvidia", {})
    plan = admit(engine, allocated("nvidia.com/gpu=0", cid="a"))
    assert [d.key for d in plan.devices] == [GPU0]
    assert engine.inventory.find(KIND_GPU, "0").healthy


def test_marks_outlive_an_inventory_swap_and_each_family_keeps_its_own():
    engine = Engine(demo_inventory(), standalone())
    engine.set_health("nvidia", {GPU0: "XID 79"})
    engine.set_health("neuron", {})  # another family's report leaves nvidia's marks alone
    engine.swap_inventory(demo_inventory())
    gpu0 = engine.inventory.find(KIND_GPU, "0")
    assert not gpu0.healthy and gpu0.attributes["health"] == "XID 79"


def test_a_gpu_marked_while_held_stays_with_its_holder_and_goes_to_no_one_else():
    engine = Engine(demo_inventory(), standalone())
    admit(engine, allocated("nvidia.com/gpu=0", cid="a"))
    engine.set_health("nvidia", {GPU0: "XID 48 (double-bit ECC error)"})
    assert held(engine) == {"a": ("nvidia.com/gpu=0",)}
    engine.release("a")
    engine.set_health("nvidia", {GPU0: "XID 48 (double-bit ECC error)"})
    with pytest.raises(AllocationError, match="double-bit ECC"):
        engine.plan(allocated("nvidia.com/gpu=0", cid="b"))


def test_a_repeated_identical_report_is_not_logged_again(all_logs):
    engine = Engine(demo_inventory(), standalone())
    engine.set_health("nvidia", {GPU0: "XID 79"})
    with capture_logs() as logs:
        engine.set_health("nvidia", {GPU0: "XID 79"})
    assert not [e for e in logs if e["event"] == "unhealthy_devices"]


# ---- what a refresh no longer finds -------------------------------------------------------

def test_a_gpu_a_refresh_no_longer_finds_is_kept_unhealthy_and_refused_by_uuid(all_logs):
    old = demo_inventory()
    with capture_logs() as logs:
        new = carry_vanished(old, without(old, "nvidia.com/gpu=3"))
    (said,) = [e for e in logs if e["event"] == "device_vanished"]
    assert said["device"] == GPU3 and said["log_level"] == "warning"
    gone = new.find(KIND_GPU, GPU_UUIDS["3"])
    assert gone is not None and not gone.healthy and gone.attributes["health"] == VANISHED
    engine = Engine(new, standalone())
    with pytest.raises(AllocationError, match=f"is unhealthy \\({VANISHED}\\)"):
        engine.plan(allocated(f"nvidia.com/gpu={GPU_UUIDS['3']}", cid="a"))
    # Carried again by the next refresh that still lacks it, without a second warning.
    with capture_logs() as logs:
        again = carry_vanished(new, without(old, "nvidia.com/gpu=3"))
    assert again.find(KIND_GPU, GPU_UUIDS["3"]) == gone
    assert not [e for e in logs if e["event"] == "device_vanished"]
    # Found again: it is the discovered device once more, healthy.
    back = carry_vanished(again, old)
    assert back == old


def test_an_index_a_vanished_gpu_had_belongs_to_the_gpu_that_has_it_now():
    old = demo_inventory()
    g3 = old.find(KIND_GPU, "3")
    g4 = old.find(KIND_GPU, "4")
    # GPU 3 fell off the bus; the driver renumbered GPU 4 as 3.
    rest = without(old, "nvidia.com/gpu=3", "nvidia.com/gpu=4")
    shifted = dataclasses.replace(rest, devices=(
        *rest.devices, msgspec.structs.replace(g4, name="3", aliases=(g4.pci_bus_id,))))
    new = carry_vanished(old, shifted)
    assert new.find(KIND_GPU, "3").uuid == g4.uuid
    vanished = new.find(KIND_GPU, g3.uuid)
    assert vanished.name == g3.uuid and not vanished.healthy
    plan = admit(Engine(new, standalone()), allocated("nvidia.com/gpu=3", cid="a"))
    assert [d.uuid for d in plan.devices] == [g4.uuid]


def test_mig_devices_removed_by_a_reconfiguration_of_a_present_gpu_are_not_carried():
    old = demo_inventory()
    migs = [d.qualified_name for d in old.of_kind(KIND_MIG)]
    assert migs
    new = carry_vanished(old, without(old, *migs))
    assert new.of_kind(KIND_MIG) == ()


def test_mig_devices_of_a_vanished_gpu_are_carried_though_another_gpu_has_its_index_now():
    # GPU 7 (in MIG mode) fell off the bus; the driver renumbered GPU 6 as 7. A MIG
    # device's parent is an index: "7" is another GPU now, not the whole it was part of.
    old = demo_inventory()
    g6, g7 = old.find(KIND_GPU, "6"), old.find(KIND_GPU, "7")
    migs = old.of_kind(KIND_MIG)
    assert migs and {m.parent for m in migs} == {"7"}
    rest = without(old, "nvidia.com/gpu=6", "nvidia.com/gpu=7",
                   *(m.qualified_name for m in migs))
    shifted = dataclasses.replace(rest, devices=(
        *rest.devices, msgspec.structs.replace(g6, name="7", aliases=(g6.pci_bus_id,))))
    new = carry_vanished(old, shifted)
    carried = {d.key: d for d in new.of_kind(KIND_MIG)}
    assert set(carried) == {m.key for m in migs}
    assert not any(d.healthy for d in carried.values())
    assert new.find(KIND_GPU, g7.uuid) is not None


def test_devices_a_cdi_spec_described_are_not_carried_when_the_spec_drops_them():
    old = cdi_inventory()
    new = carry_vanished(old, without(old, "acme.example/npu=npu1"))
    assert [d.name for d in new.devices] == ["npu0"]
