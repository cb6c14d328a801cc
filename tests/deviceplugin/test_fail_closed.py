"""The device plugin fails closed while no `nri-accel run` on the node is registered with
the runtime: over real gRPC, a fake kubelet (fake_kubelet.py) and the NRI side's state
record as a FakeNriSide writes it (conftest.py). Waits are bounded waits for an
expected stream update; nothing measures how fast it comes."""

from __future__ import annotations

import grpc
import pytest
from structlog.testing import capture_logs

from nri_accel import state
from nri_accel.deviceplugin import deviceplugin_pb2 as pb2
from nri_accel.deviceplugin.server import DevicePlugins
from nri_accel.state import NriStatus

from .conftest import (
    GPU0,
    GPU2,
    MIG_A,
    NODE_CONFIG,
    allocate,
    health,
    node_inventory,
    pre_start,
    preferred,
    refused,
)

HEALTHY_AGAIN = [(GPU0, "Healthy"), (GPU2, "Unhealthy")]  # GPU 2 is unhealthy in the inventory


def all_unhealthy(response: pb2.ListAndWatchResponse) -> bool:
    return bool(response.devices) and all(d.health == "Unhealthy" for d in response.devices)


def gpu0_healthy(response: pb2.ListAndWatchResponse) -> bool:
    return response.devices[0].health == "Healthy"


@pytest.mark.parametrize(("state", "reason"), [
    ("remove", "no `nri-accel run` has recorded its state on this node"),
    ("stale", "`nri-accel run` (pid 4242) stopped updating its state"),
    ("unregister", "`nri-accel run` is not registered with the container runtime"),
])
def test_without_a_registered_nri_side_devices_are_unhealthy_and_allocate_refused(
        kubelet, nri_side, plugins, state: str, reason: str) -> None:
    getattr(nri_side, state)()  # absent, stale or not registered before the plugin starts
    plugins()
    gpu = kubelet.wait_registered("nvidia.com/gpu")
    # Registered all the same: kubelet learns the devices, and that none is usable.
    kubelet.wait_list(gpu, all_unhealthy, "every GPU Unhealthy")
    mig = kubelet.wait_registered("nvidia.com/mig-1g.10gb")
    kubelet.wait_list(mig, all_unhealthy, "every MIG device Unhealthy")

    error = refused(lambda: allocate(kubelet, gpu.request.endpoint, [GPU0]))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error.details().startswith(f"nvidia.com/gpu: {reason}")
    assert "fails closed" in error.details()
    error = refused(lambda: pre_start(kubelet, mig.request.endpoint, [MIG_A]))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert reason in error.details()
    error = refused(lambda: preferred(kubelet, gpu.request.endpoint, [GPU0, GPU2], 1))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert reason in error.details()

    nri_side.register()  # `run` registers with the runtime (no list was Healthy before)
    assert health(kubelet.wait_list(gpu, gpu0_healthy, "GPU 0 Healthy again")) == HEALTHY_AGAIN
    kubelet.wait_list(mig, lambda r: not all_unhealthy(r), "MIG devices Healthy again")
    assert all(all_unhealthy(r) for r in gpu.lists[:1])  # the first list was not
    (c,) = allocate(kubelet, gpu.request.endpoint, [GPU0]).container_responses
    assert dict(c.annotations) == {
        "devices.nri-accel.io/resource.nvidia.com_gpu": f"nvidia.com/gpu={GPU0}"}
    assert pre_start(kubelet, mig.request.endpoint, [MIG_A]) == pb2.PreStartContainerResponse()
    assert preferred(kubelet, gpu.request.endpoint, [GPU0, GPU2], 1) == [GPU0]


@pytest.mark.parametrize("state", ["stale", "unregister", "remove"])
def test_the_nri_side_going_away_turns_every_device_unhealthy(
        kubelet, nri_side, plugins, state: str) -> None:
    plugins()
    gpu = kubelet.wait_registered("nvidia.com/gpu")
    assert health(kubelet.wait_list(gpu, gpu0_healthy)) == HEALTHY_AGAIN
    getattr(nri_side, state)()  # `run` hangs or dies, or the runtime restarts
    down = kubelet.wait_list(gpu, all_unhealthy, "every GPU Unhealthy")
    nri_side.register()
    assert health(kubelet.wait_list(gpu, gpu0_healthy, "GPU 0 Healthy again",
                                    after=down)) == HEALTHY_AGAIN


def test_a_container_allocated_before_the_nri_side_went_away_cannot_start(
        kubelet, nri_side, plugins) -> None:
    # The window between Allocate (pod admission) and CreateContainer (after the image
    # pull): kubelet's PreStartContainer, right before CreateContainer, is refused, so
    # kubelet does not create the container and retries it later.
    plugins()
    gpu = kubelet.wait_registered("nvidia.com/gpu")
    kubelet.wait_list(gpu, gpu0_healthy)
    allocate(kubelet, gpu.request.endpoint, [GPU0])
    nri_side.unregister()
    error = refused(lambda: pre_start(kubelet, gpu.request.endpoint, [GPU0]))
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    nri_side.register()  # kubelet's next try starts it
    assert pre_start(kubelet, gpu.request.endpoint, [GPU0]) == pb2.PreStartContainerResponse()


def test_after_a_kubelet_restart_the_new_stream_still_fails_closed(
        kubelet, nri_side, plugins) -> None:
    nri_side.stale()
    plugins()
    kubelet.wait_list(kubelet.wait_registered("nvidia.com/gpu"), all_unhealthy)
    kubelet.restart()
    again = kubelet.wait_registered("nvidia.com/gpu", count=2)
    kubelet.wait_list(again, all_unhealthy, "every GPU Unhealthy on the new stream")
    nri_side.register()
    assert health(kubelet.wait_list(again, gpu0_healthy)) == HEALTHY_AGAIN


def test_one_line_when_an_outage_starts_and_one_when_it_ends(tmp_path, monkeypatch,
                                                             all_logs) -> None:
    # The record of a stopped `run` says "stopped updating its state N s ago", N growing
    # at every poll: a line per changed text was a line a second for as long as it lasted.
    clock = [1000.0]
    monkeypatch.setattr(state, "boottime", lambda: clock[0])
    nri = str(tmp_path / "state")
    NriStatus(True, "containerd v2.1.9", "40-nri-accel", 4242, 900.0).save(nri)
    plugins = DevicePlugins(node_inventory(), str(tmp_path), config=NODE_CONFIG,
                            state_dir=nri)
    with capture_logs() as logs:
        reasons = []
        for _ in range(5):  # five polls a second apart
            reasons.append(plugins.check_nri())
            clock[0] += 1
        NriStatus(True, "containerd v2.1.9", "40-nri-accel", 4243, clock[0]).save(nri)
        assert plugins.check_nri() == ""
        assert plugins.check_nri() == ""
        NriStatus(False, "", "40-nri-accel", 4243, clock[0]).save(nri)
        assert plugins.check_nri() and plugins.check_nri()
    assert len(set(reasons)) == 5  # each poll's reason is today's (Allocate quotes it)
    assert [(e["event"], e.get("reason", "")) for e in logs] == [
        ("nri_plugin_unavailable",
         "`nri-accel run` (pid 4242) stopped updating its state 100 s ago"),
        ("nri_plugin_available", ""),
        ("nri_plugin_unavailable",
         "`nri-accel run` is not registered with the container runtime"),
    ]
