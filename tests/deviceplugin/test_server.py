"""The device plugin over real unix sockets: a fake kubelet (real grpcio Registration
server) and a real grpc client calling the plugin's sockets."""

from __future__ import annotations

import asyncio
import os
import socket
import stat

import grpc
import pytest
from structlog.testing import capture_logs

from nri_accel.config import Config, DevicesConfig
from nri_accel.deviceplugin import deviceplugin_pb2 as pb2
from nri_accel.deviceplugin.resources import PluginDevice, Resource, preferred_allocation
from nri_accel.deviceplugin.server import _Endpoint, _Servicer
from nri_accel.inventory import Inventory
from nri_accel.metrics import DEVICE_PLUGIN_EVENTS, RequestRecorder
from nri_accel.vendors.nvidia import KIND_GPU

from .conftest import GPU0, GPU2, MIG_A, MIG_B, MIG_C, NODE_CONFIG, node_inventory
from .fake_kubelet import WAIT, FakeKubelet

ALL_RESOURCES = [
    "acme.example/fpga", "acme.example/npu", "aws.amazon.com/neuron", "nvidia.com/gpu",
    "nvidia.com/mig-1g.10gb", "nvidia.com/mig-2g.20gb",
]


def _ids(response: pb2.ListAndWatchResponse) -> list[str]:
    return [d.ID for d in response.devices]


def _allocate(kubelet, endpoint: str, *containers: list[str]) -> pb2.AllocateResponse:
    channel, stub = kubelet.client(endpoint)
    with channel:
        request = pb2.AllocateRequest(container_requests=[
            pb2.ContainerAllocateRequest(devices_ids=ids) for ids in containers])
        return stub.Allocate(request, timeout=WAIT)


def test_registers_every_resource_with_its_socket_and_options(kubelet, plugins) -> None:
    plugins()
    for name in ALL_RESOURCES:
        conn = kubelet.wait_registered(name)
        assert conn.request.version == "v1beta1"
        endpoint = conn.request.endpoint
        assert "/" not in endpoint and endpoint.endswith(".sock")
        assert stat.S_ISSOCK(os.lstat(os.path.join(kubelet.directory, endpoint)).st_mode)
        assert conn.request.options.get_preferred_allocation_available
        # kubelet calls PreStartContainer before each container start: the last point
        # where the plugin can refuse while `run` is away
        assert conn.request.options.pre_start_required
        assert conn.options == conn.request.options  # what GetDevicePluginOptions says
    # One socket per resource.
    assert len({kubelet.registrations(n)[0].request.endpoint for n in ALL_RESOURCES}) == 6


def test_list_and_watch_streams_ids_health_and_topology(kubelet, plugins) -> None:
    plugins()
    gpus = kubelet.wait_list(kubelet.wait_registered("nvidia.com/gpu"))
    assert [(d.ID, d.health, [n.ID for n in d.topology.nodes]) for d in gpus.devices] == [
        (GPU0, "Healthy", [0]), (GPU2, "Unhealthy", [1])]
    mig = kubelet.wait_list(kubelet.wait_registered("nvidia.com/mig-1g.10gb"))
    assert [(d.ID, [n.ID for n in d.topology.nodes]) for d in mig.devices] == [
        (MIG_A, [1]), (MIG_B, [1])]
    neuron = kubelet.wait_list(kubelet.wait_registered("aws.amazon.com/neuron"))
    assert [(d.ID, d.HasField("topology")) for d in neuron.devices] == [
        ("0", False), ("1", False)]


def test_inventory_changes_are_streamed(kubelet, plugins) -> None:
    running = plugins()
    gpu = kubelet.wait_registered("nvidia.com/gpu")
    mig2 = kubelet.wait_registered("nvidia.com/mig-2g.20gb")
    neuron = kubelet.wait_registered("aws.amazon.com/neuron")
    kubelet.wait_list(gpu)
    kubelet.wait_list(mig2)
    kubelet.wait_list(neuron)

    # GPU 0 turns unhealthy, the 2g.20gb MIG device and the Neuron devices go away.
    running.update(node_inventory(gpu0_healthy=False, with_2g=False, with_neuron=False))
    changed = kubelet.wait_list(gpu, lambda r: r.devices[0].health == "Unhealthy",
                                "GPU 0 unhealthy")
    assert _ids(changed) == [GPU0, GPU2]
    # A vanished resource is emptied (kubelet drops the capacity) and its stream ends:
    # the stream of its latest registration (a registration retried under load leaves
    # an earlier stream, ended by the restart, with the devices it had).
    for name in ("nvidia.com/mig-2g.20gb", "aws.amazon.com/neuron"):
        latest = kubelet.registrations(name)[-1]
        kubelet.wait_for(lambda latest=latest: latest.ended, f"the {name} stream ends")
        assert _ids(latest.lists[-1]) == [], name
    assert not os.path.exists(os.path.join(kubelet.directory, mig2.request.endpoint))

    # It comes back: served and registered again.
    before = len(kubelet.registrations("nvidia.com/mig-2g.20gb"))
    running.update(node_inventory())
    again = kubelet.wait_registered("nvidia.com/mig-2g.20gb", count=before + 1)
    assert _ids(kubelet.wait_list(again)) == [MIG_C]
    assert _ids(kubelet.wait_list(gpu, lambda r: r.devices[0].health == "Healthy")) == [
        GPU0, GPU2]


def test_an_unchanged_inventory_sends_nothing(kubelet, plugins) -> None:
    running = plugins()
    gpu = kubelet.wait_registered("nvidia.com/gpu")
    kubelet.wait_list(gpu)
    running.update(node_inventory(with_neuron=False))  # GPUs unchanged
    kubelet.wait_for(lambda: kubelet.registrations("aws.amazon.com/neuron")[0].ended,
                     "neuron stream ends")
    running.update(node_inventory(gpu0_healthy=False))  # GPUs changed
    kubelet.wait_list(gpu, lambda r: r.devices[0].health == "Unhealthy")
    assert len(gpu.lists) == 2


def test_allocate_answers_only_the_grant_annotation(kubelet, plugins) -> None:
    plugins()
    conn = kubelet.wait_registered("nvidia.com/gpu")
    response = _allocate(kubelet, conn.request.endpoint, [GPU0, GPU0], [GPU0])
    first, second = response.container_responses
    assert dict(first.annotations) == dict(second.annotations) == {
        "devices.nri-accel.io/resource.nvidia.com_gpu": f"nvidia.com/gpu={GPU0}"}
    for c in response.container_responses:
        assert not c.envs and not c.mounts and not c.devices and not c.cdi_devices

    mig = kubelet.wait_registered("nvidia.com/mig-1g.10gb")
    (only,) = _allocate(kubelet, mig.request.endpoint, [MIG_B]).container_responses
    assert dict(only.annotations) == {
        "devices.nri-accel.io/resource.nvidia.com_mig-1g.10gb": f"nvidia.com/mig={MIG_B}"}


def test_allocate_and_pre_start_of_an_unhealthy_device_fail_naming_it(kubelet, plugins) -> None:
    # GPU2 was sent Unhealthy: kubelet fails the pod's admission, where the NRI side
    # would refuse the device at every CreateContainer retry
    plugins()
    conn = kubelet.wait_registered("nvidia.com/gpu")
    with pytest.raises(grpc.RpcError) as e:
        _allocate(kubelet, conn.request.endpoint, [GPU0, GPU2])
    assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert e.value.details() == f"nvidia.com/gpu: device ID {GPU2!r} is Unhealthy"
    channel, stub = kubelet.client(conn.request.endpoint)
    with channel:
        with pytest.raises(grpc.RpcError) as e:
            stub.PreStartContainer(pb2.PreStartContainerRequest(devices_ids=[GPU0, GPU2]),
                                   timeout=WAIT)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert GPU2 in e.value.details() and "Unhealthy" in e.value.details()
        assert stub.PreStartContainer(pb2.PreStartContainerRequest(devices_ids=[GPU0]),
                                      timeout=WAIT) == pb2.PreStartContainerResponse()


def test_allocate_of_an_unknown_device_fails_naming_it(kubelet, plugins) -> None:
    plugins()
    conn = kubelet.wait_registered("nvidia.com/gpu")
    with pytest.raises(grpc.RpcError) as e:
        _allocate(kubelet, conn.request.endpoint, [GPU0], [MIG_A])
    assert e.value.code() == grpc.StatusCode.NOT_FOUND
    assert e.value.details() == f"nvidia.com/gpu: unknown device ID {MIG_A!r}"


def test_cdi_passthrough_adds_cdi_device_names(kubelet, plugins) -> None:
    config = Config(devices=DevicesConfig(cdi_passthrough=True),
                    static_devices=NODE_CONFIG.static_devices)
    plugins(config=config)
    npu = kubelet.wait_registered("acme.example/npu")
    (c,) = _allocate(kubelet, npu.request.endpoint, ["npu1"]).container_responses
    assert [d.name for d in c.cdi_devices] == ["acme.example/npu=npu1"]
    assert dict(c.annotations) == {
        "devices.nri-accel.io/resource.acme.example_npu": "acme.example/npu=npu1"}
    fpga = kubelet.wait_registered("acme.example/fpga")
    (c,) = _allocate(kubelet, fpga.request.endpoint, ["fpga0"]).container_responses
    assert list(c.cdi_devices) == []


def test_preferred_allocation_and_prestart_over_grpc(kubelet, plugins) -> None:
    plugins()
    conn = kubelet.wait_registered("aws.amazon.com/neuron")
    channel, stub = kubelet.client(conn.request.endpoint)
    with channel:
        response = stub.GetPreferredAllocation(pb2.PreferredAllocationRequest(
            container_requests=[
                pb2.ContainerPreferredAllocationRequest(
                    available_deviceIDs=["1", "0"], allocation_size=1),
                pb2.ContainerPreferredAllocationRequest(
                    available_deviceIDs=["0", "1"], must_include_deviceIDs=["1"],
                    allocation_size=2),
            ]), timeout=WAIT)
        assert [list(c.deviceIDs) for c in response.container_responses] == [["0"], ["0", "1"]]
        assert stub.PreStartContainer(pb2.PreStartContainerRequest(devices_ids=["0"]),
                                      timeout=WAIT) == pb2.PreStartContainerResponse()


def test_kubelet_restart_reregisters_every_resource(kubelet, plugins) -> None:
    plugins()
    before = {n: kubelet.wait_registered(n) for n in ALL_RESOURCES}
    kubelet.restart()  # deletes the plugins' sockets and recreates kubelet.sock
    for name in ALL_RESOURCES:
        after = kubelet.wait_registered(name, count=2)
        assert after.request.endpoint == before[name].request.endpoint
        assert kubelet.wait_list(after).devices  # the new socket serves
    gpu = kubelet.registrations("nvidia.com/gpu")[1]
    (c,) = _allocate(kubelet, gpu.request.endpoint, [GPU0]).container_responses
    assert dict(c.annotations)


def test_kubelet_restart_keeping_plugin_sockets_still_reregisters(kubelet, plugins) -> None:
    plugins()
    kubelet.wait_registered("nvidia.com/gpu")
    kubelet.stop()
    kubelet._remove_sockets = lambda: None  # this kubelet leaves plugin sockets alone
    kubelet.start()
    again = kubelet.wait_registered("nvidia.com/gpu", count=2)
    assert _ids(kubelet.wait_list(again)) == [GPU0, GPU2]


def test_refused_registration_is_retried(kubelet, plugins) -> None:
    kubelet.refuse_next = [grpc.StatusCode.UNAVAILABLE] * 2
    plugins(Inventory(devices=tuple(d for d in node_inventory().devices if d.kind == KIND_GPU)))
    conn = kubelet.wait_registered("nvidia.com/gpu")
    assert kubelet.refuse_next == []
    assert _ids(kubelet.wait_list(conn)) == [GPU0, GPU2]


def test_plugin_started_before_kubelet_registers_when_it_appears(short_dir, plugins) -> None:
    plugins()
    late = FakeKubelet(short_dir)
    late._remove_sockets = lambda: None  # a kubelet that starts after the plugin
    late.start()
    try:
        assert _ids(late.wait_list(late.wait_registered("nvidia.com/gpu"))) == [GPU0, GPU2]
    finally:
        late.stop()


def test_stop_ends_streams_and_removes_sockets(kubelet, plugins) -> None:
    running = plugins()
    conns = [kubelet.wait_registered(n) for n in ALL_RESOURCES]
    running.stop()
    kubelet.wait_for(lambda: all(c.ended for c in conns), "every stream ends")
    assert sorted(os.listdir(kubelet.directory)) == ["kubelet.sock"]


def test_a_stale_socket_is_replaced(kubelet, plugins) -> None:
    stale = os.path.join(kubelet.directory, "nri-accel-nvidia.com_gpu.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(stale)  # bound, never listening: what a killed plugin leaves behind
    s.close()
    plugins()
    conn = kubelet.wait_registered("nvidia.com/gpu")
    assert _ids(kubelet.wait_list(conn)) == [GPU0, GPU2]


def test_a_resource_that_cannot_be_served_does_not_hold_back_the_others(kubelet,
                                                                        plugins) -> None:
    blocked = os.path.join(kubelet.directory, "nri-accel-aws.amazon.com_neuron.sock")
    with open(blocked, "w"):
        pass
    running = plugins()
    for name in ALL_RESOURCES:
        if name != "aws.amazon.com/neuron":
            kubelet.wait_registered(name)
    running.call(running.plugins.tick())
    assert kubelet.registrations("aws.amazon.com/neuron") == []
    assert os.path.isfile(blocked)  # never removed: it is not a socket
    os.unlink(blocked)  # the operator clears the way: served at the next retry
    assert _ids(kubelet.wait_list(kubelet.wait_registered("aws.amazon.com/neuron"))) == [
        "0", "1"]


def test_the_event_loop_runs_between_the_containers_of_a_preference() -> None:
    # 8 GPUs of 1,024 time-slicing replicas: kubelet lists all 8,192 IDs for each
    # container, a few ms of work each; the loop is free between two containers.
    gpus = Resource("nvidia.com/gpu", tuple(
        PluginDevice(f"GPU-{g}::{n}", f"nvidia.com/gpu=GPU-{g}::{n}", numa_node=0)
        for g in range(8) for n in range(1024)), replicas=1024)
    every = [d.id for d in gpus.devices]

    class Endpoint:  # stands for the resource's _Endpoint: its current Resource
        resource = gpus

    class Plugins:  # stands for DevicePlugins: its recorders, and `run` registered
        recorders = RequestRecorder.for_events(DEVICE_PLUGIN_EVENTS)

        def check_nri(self) -> str:
            return ""

    request = pb2.PreferredAllocationRequest(container_requests=[
        pb2.ContainerPreferredAllocationRequest(available_deviceIDs=every,
                                                allocation_size=size) for size in (1, 3, 8)])

    async def main() -> tuple[list[list[str]], int]:
        turns = 0  # of the loop, seen by a task beside the call

        async def ticker() -> None:
            nonlocal turns
            while True:
                turns += 1
                await asyncio.sleep(0)

        tick = asyncio.create_task(ticker())
        await asyncio.sleep(0)  # its first turn
        answer = await _Servicer(Endpoint(), Plugins()).GetPreferredAllocation(request, None)
        tick.cancel()
        return [list(c.deviceIDs) for c in answer.container_responses], turns

    answered, turns = asyncio.run(main())
    assert answered == [list(preferred_allocation(gpus, every, [], size))
                        for size in (1, 3, 8)]
    assert answered[2] == [f"GPU-{g}::0" for g in range(8)]  # one replica of each GPU
    assert turns == 3  # before the first container, and between each two


def test_closing_a_resource_waits_for_each_stream_to_send_its_last_list(tmp_path) -> None:
    # A vanished resource is emptied, then closed, while a stream is still sending its
    # list: the emptying is sent after it (a stream that ended at the close, seen
    # once it had sent its list, left kubelet the devices it last saw), and the close
    # waits until each ListAndWatch stream has sent it (gRPC takes the next item once
    # it has sent the one before), so kubelet drops the capacity at once.
    class Plugins:  # stands for DevicePlugins: the NRI side is registered
        nri_down = False

    async def main() -> tuple[list[int], list[int]]:
        gpus = Resource("nvidia.com/gpu", (PluginDevice("GPU-a", "nvidia.com/gpu=GPU-a"),))
        endpoint = _Endpoint(gpus, str(tmp_path), Plugins())
        sent: list[int] = []

        async def stream() -> None:  # a stream whose writes take a while (a slow kubelet)
            async for resource, _ in endpoint.watch():
                await asyncio.sleep(0.05)
                sent.append(len(resource.devices))

        task = asyncio.create_task(stream())
        await asyncio.sleep(0.01)  # the first list is being sent
        endpoint.set_resource(Resource("nvidia.com/gpu"))
        await endpoint.close(grace=5.0)
        at_close = list(sent)
        await task
        return at_close, sent

    at_close, sent = asyncio.run(main())
    assert at_close == sent == [1, 0]


def _gpu_only() -> Inventory:
    return Inventory(devices=tuple(d for d in node_inventory().devices if d.kind == KIND_GPU))


def test_a_stream_kubelet_lost_is_registered_again(kubelet, plugins, all_logs) -> None:
    # kubelet loses the stream (kubernetes#131013) and never connects again by itself
    with capture_logs() as logs:
        plugins(_gpu_only(), watch_grace=0.2)
        first = kubelet.wait_registered("nvidia.com/gpu")
        kubelet.wait_list(first)
        kubelet.drop(first)
        again = kubelet.wait_registered("nvidia.com/gpu", count=2)
        assert again.request.endpoint == first.request.endpoint
        assert _ids(kubelet.wait_list(again)) == [GPU0, GPU2]
    # the first of them: on a loaded machine the new stream may itself come late
    line, *_ = [e for e in logs if e["event"] == "kubelet_not_watching"]
    assert line["resource"] == "nvidia.com/gpu" and line["seconds"] >= 0.2
    assert "registering again" in line["effect"]


def test_a_register_kubelet_never_follows_with_a_stream_is_made_again(kubelet,
                                                                      plugins) -> None:
    # A kubelet that holds its client for the resource until it has handled the old
    # stream's end answers the first Register after the drop and does nothing: the
    # plugin, still not watched, registers once more after its back-off. (Here kubelet
    # takes longer than the plugin's register settle, 1 s, to handle the end.)
    kubelet.keeps_clients, kubelet.forget_delay = True, 2.0
    running = plugins(_gpu_only(), watch_grace=0.2)
    first = kubelet.wait_registered("nvidia.com/gpu")
    kubelet.wait_list(first)
    kubelet.drop(first)
    kubelet.wait_for(lambda: kubelet.registers >= 2, "a Register kubelet does nothing with")
    assert len(kubelet.registrations("nvidia.com/gpu")) == 1
    again = kubelet.wait_registered("nvidia.com/gpu", count=2)
    assert _ids(kubelet.wait_list(again)) == [GPU0, GPU2]
    assert kubelet.wait_for(lambda: running.plugins.ready() is None, "ready again")


def test_a_socket_served_again_registers_after_kubelet_handled_the_old_stream(
        kubelet, plugins) -> None:
    # kubelet hands the old stream's end on by resource name, a little later
    # (manager.go PluginDisconnected): a Register before that has its new endpoint
    # marked stopped, every Allocate refused while its stream stays open.
    kubelet.disconnects_by_resource, kubelet.forget_delay = True, 0.3
    plugins(_gpu_only())
    first = kubelet.wait_registered("nvidia.com/gpu")
    kubelet.wait_list(first)
    os.unlink(os.path.join(kubelet.directory, first.request.endpoint))  # same kubelet
    again = kubelet.wait_registered("nvidia.com/gpu", count=2)
    assert again.request.endpoint == first.request.endpoint
    kubelet.wait_for(lambda: first.stopped or again.stopped,
                     "kubelet to hand the first stream's end on")
    assert first.stopped and not again.stopped
    assert _ids(kubelet.wait_list(again)) == [GPU0, GPU2]


def test_a_new_kubelet_is_registered_with_at_once(kubelet, plugins) -> None:
    # A kubelet that has just started holds no client to hand on: no settle time.
    plugins(_gpu_only(), settle=60.0)
    kubelet.wait_list(kubelet.wait_registered("nvidia.com/gpu"))
    kubelet.restart()
    again = kubelet.wait_registered("nvidia.com/gpu", count=2)
    assert _ids(kubelet.wait_list(again)) == [GPU0, GPU2]


def test_a_resource_kubelet_watches_is_not_registered_again(kubelet, plugins) -> None:
    running = plugins(_gpu_only(), watch_grace=0.2)
    kubelet.wait_list(kubelet.wait_registered("nvidia.com/gpu"))
    assert kubelet.wait_for(lambda: kubelet.registers > 1, "another Register",
                            timeout=1.0, fail=False) is None
    assert running.plugins.registered() == {"nvidia.com/gpu": True}


def test_a_resource_kubelet_stopped_watching_is_not_ready(kubelet, plugins) -> None:
    kubelet.keeps_clients, kubelet.forget_delay = True, 60.0  # it never forgets it
    running = plugins(_gpu_only(), watch_grace=0.2)
    first = kubelet.wait_registered("nvidia.com/gpu")
    kubelet.wait_list(first)
    kubelet.drop(first)
    why = "not registered with kubelet, or not watched by it: nvidia.com/gpu"
    kubelet.wait_for(lambda: running.plugins.ready() == why,
                     "readiness to name the resource kubelet left")
    assert running.plugins.registered() == {"nvidia.com/gpu": False}


def test_a_kubelet_back_after_a_long_absence_is_registered_with_at_once(
        kubelet, plugins, all_logs) -> None:
    # A stopped kubelet leaves kubelet.sock behind (devicemanager plugin/v1beta1
    # server.go Stop: "we do not remove the registration socket"): the plugin, no longer
    # watched, registers again and again against it, backing off. The kubelet that
    # starts then, a new kubelet.sock, must not wait out that back-off.
    plugins(_gpu_only(), watch_grace=0.2)
    kubelet.wait_list(kubelet.wait_registered("nvidia.com/gpu"))
    with capture_logs() as logs:
        kubelet.stop()
        if not os.path.exists(kubelet.socket):  # as kubelet leaves it: no one listens
            with socket.socket(socket.AF_UNIX) as s:
                s.bind(kubelet.socket)
        kubelet.wait_for(lambda: any(e["event"] == "registration_failed"
                                     and e["retry_in"] >= 3.2 for e in logs),
                         "the back-off to reach 3.2 s")
        kubelet.start()
        again = kubelet.wait_for(lambda: len(kubelet.registrations("nvidia.com/gpu")) >= 2,
                                 "registration with the new kubelet", timeout=1.5, fail=False)
    assert again, "the new kubelet waited for the back-off the old one caused"
    assert _ids(kubelet.wait_list(kubelet.wait_registered("nvidia.com/gpu", count=2))) == [
        GPU0, GPU2]
