"""Health decisions (nri_accel.vendors.nvidia.health: HealthState, watched_devices): which
events make which devices unhealthy, the reasons, and the way back. Pure: time is passed in."""

from __future__ import annotations

import pytest

from nri_accel.discover.nvml import GpuEvent
from nri_accel.inventory import Device
from nri_accel.vendors.nvidia import KIND_GPU, KIND_MIG
from nri_accel.vendors.nvidia.health import HealthState, WatchedDevice, watched_devices

GPU_A = "GPU-a"
GPU_B = "GPU-b"
MIG_GI1_CI0 = WatchedDevice("MIG-1-0", GPU_A, 1, 0)
MIG_GI1_CI1 = WatchedDevice("MIG-1-1", GPU_A, 1, 1)
MIG_GI2_CI0 = WatchedDevice("MIG-2-0", GPU_A, 2, 0)
DEVICES = [WatchedDevice(GPU_A), MIG_GI1_CI0, MIG_GI1_CI1, MIG_GI2_CI0, WatchedDevice(GPU_B)]
EVERY_A = ["GPU-a", "MIG-1-0", "MIG-1-1", "MIG-2-0"]
INTERVAL = 60.0


def state() -> HealthState:
    return HealthState(DEVICES, INTERVAL)


@pytest.mark.parametrize(("event", "hit"), [
    (GpuEvent(GPU_A, "xid", 79), EVERY_A),  # not attributable: the GPU and its MIG devices
    (GpuEvent(GPU_A, "xid", 94, 1, 1), ["MIG-1-1"]),  # that MIG device only
    (GpuEvent(GPU_A, "xid", 94, 1), ["MIG-1-0", "MIG-1-1"]),  # its GPU instance
    (GpuEvent(GPU_A, "xid", 94, 3, 0), []),  # an instance nobody watches
    (GpuEvent(GPU_A, "dbe"), EVERY_A),
    (GpuEvent(GPU_A, "lost"), EVERY_A),
    (GpuEvent(GPU_B, "xid", 79), [GPU_B]),
    (GpuEvent("GPU-elsewhere", "lost"), []),
])
def test_which_devices_an_event_makes_unhealthy(event: GpuEvent, hit: list[str]) -> None:
    s = state()
    assert s.affected(event) == hit
    assert s.apply(event, 0.0) is bool(hit)
    assert list(s.unhealthy()) == hit


@pytest.mark.parametrize(("event", "reason"), [
    (GpuEvent(GPU_B, "xid", 79), "XID 79"),
    (GpuEvent(GPU_B, "dbe"), "double-bit ECC error"),
    (GpuEvent(GPU_B, "lost"), "GPU lost"),
])
def test_reasons(event: GpuEvent, reason: str) -> None:
    s = state()
    s.apply(event, 0.0)
    assert s.unhealthy() == {GPU_B: reason}


def test_the_newest_event_gives_the_reason() -> None:
    s = state()
    s.apply(GpuEvent(GPU_B, "xid", 79), 0.0)
    assert s.apply(GpuEvent(GPU_B, "xid", 79), 1.0) is False  # same map
    assert s.apply(GpuEvent(GPU_B, "dbe"), 2.0) is True
    assert s.unhealthy() == {GPU_B: "double-bit ECC error"}


def test_gpus_to_watch_include_parents_of_mig_devices() -> None:
    assert state().gpus == (GPU_A, GPU_B)
    assert HealthState([MIG_GI2_CI0], INTERVAL).gpus == (GPU_A,)


def test_recheck_comes_after_a_quiet_interval_and_brings_the_device_back() -> None:
    s = state()
    s.apply(GpuEvent(GPU_B, "xid", 79), 100.0)
    assert s.due(100.0 + INTERVAL - 1) == []
    assert s.due(100.0 + INTERVAL) == [WatchedDevice(GPU_B)]
    assert s.rechecked(GPU_B, None, 100.0 + INTERVAL) is True
    assert s.unhealthy() == {}
    assert s.due(1e9) == []


def test_a_new_event_restarts_the_quiet_interval() -> None:
    s = state()
    s.apply(GpuEvent(GPU_B, "xid", 79), 100.0)
    s.apply(GpuEvent(GPU_B, "xid", 48), 150.0)
    assert s.due(100.0 + INTERVAL) == []
    assert s.due(150.0 + INTERVAL) == [WatchedDevice(GPU_B)]


def test_a_failed_recheck_keeps_the_device_unhealthy_and_says_why() -> None:
    s = state()
    s.apply(GpuEvent(GPU_B, "dbe"), 0.0)
    assert s.rechecked(GPU_B, "row remapping pending a GPU reset", INTERVAL) is True
    assert s.unhealthy() == {
        GPU_B: "double-bit ECC error (recheck: row remapping pending a GPU reset)"}
    assert s.due(2 * INTERVAL - 1) == []
    assert s.due(2 * INTERVAL) == [WatchedDevice(GPU_B)]
    assert s.rechecked(GPU_B, "row remapping pending a GPU reset", 2 * INTERVAL) is False
    assert s.rechecked(GPU_B, None, 3 * INTERVAL) is True
    assert s.unhealthy() == {}


def test_mig_devices_come_back_one_by_one() -> None:
    s = state()
    s.apply(GpuEvent(GPU_A, "xid", 79), 0.0)
    assert [d.uuid for d in s.due(INTERVAL)] == EVERY_A
    s.rechecked("MIG-1-0", None, INTERVAL)
    assert list(s.unhealthy()) == ["GPU-a", "MIG-1-1", "MIG-2-0"]


def test_recheck_of_a_healthy_device_changes_nothing() -> None:
    assert state().rechecked(GPU_B, "anything", 0.0) is False


def test_a_failed_watch_marks_every_device() -> None:
    s = state()
    assert s.fail_all("NVML health watch failed: Unknown Error", 0.0) is True
    assert set(s.unhealthy().values()) == {"NVML health watch failed: Unknown Error"}
    assert len(s.unhealthy()) == len(DEVICES)


def test_an_earlier_watchs_marks_start_unhealthy_and_are_rechecked_an_interval_on() -> None:
    s = HealthState(DEVICES, INTERVAL, marked={GPU_B: "XID 48", "GPU-gone": "XID 79"},
                    now=100.0)
    assert s.unhealthy() == {GPU_B: "XID 48"}  # a device not followed any more is dropped
    assert s.due(100.0 + INTERVAL - 1) == []
    assert s.due(100.0 + INTERVAL) == [WatchedDevice(GPU_B)]


def test_what_a_check_finds_is_marked_and_a_mark_already_there_kept() -> None:
    s = state()
    s.apply(GpuEvent(GPU_B, "xid", 79), 0.0)
    assert s.found({GPU_A: "row remapping pending a GPU reset", GPU_B: "GPU lost"}, 5.0)
    assert s.unhealthy() == {GPU_A: "row remapping pending a GPU reset", GPU_B: "XID 79"}
    assert s.found({GPU_A: "again"}, 6.0) is False
    assert [d.uuid for d in s.devices] == sorted(d.uuid for d in DEVICES)


def test_recheck_interval_must_be_positive() -> None:
    with pytest.raises(ValueError, match="recheck_interval"):
        HealthState(DEVICES, 0)


def test_watched_devices_from_the_inventory() -> None:
    devices = [
        Device(KIND_GPU, "0", uuid="GPU-0"),
        Device(KIND_MIG, "0:1", uuid="MIG-x", parent="0",
               attributes={"gi_id": "9", "ci_id": "0"}),
        Device(KIND_GPU, "1", uuid="GPU-1"),
        Device("aws.amazon.com/neuron", "0", uuid="neuron-0"),
    ]
    assert watched_devices(devices) == [
        WatchedDevice("GPU-0"), WatchedDevice("MIG-x", "GPU-0", 9, 0), WatchedDevice("GPU-1")]
