"""Fixtures for the device plugin tests.

`node_inventory()`: a small mixed node (built in Python, no discovery): GPU 0 on NUMA 0,
GPU 1 on NUMA 1 in MIG mode with two 1g.10gb and one 2g.20gb MIG devices, GPU 2 on NUMA 1
unhealthy, two linked Neuron devices, two CDI NPUs (acme.example/npu) and one static
FPGA (acme.example/fpga, declared in `NODE_CONFIG`).
`kubelet`: a FakeKubelet (see fake_kubelet.py) started in a short temporary directory
(unix socket paths are limited to 107 bytes).
`nri_side`: a FakeNriSide, standing for `nri-accel run` registered with the runtime: it
keeps the state record the device plugin reads fresh, as `run` does, until a test
makes it unregister, go silent or vanish.
`plugins`: starts DevicePlugins on a background asyncio loop, as `nri-accel
device-plugin` runs it, with a 50 ms poll and `nri_side`'s state directory (and the
default 10 s watch grace and 1 s register settle unless a test sets them); stopped at teardown.
`quiet_servers` (every test): the plugins' log lines are kept in memory, not printed.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import threading
from collections.abc import Callable, Coroutine, Iterator, Mapping
from types import MappingProxyType
from typing import Any

import grpc
import pytest
from structlog.testing import capture_logs

from nri_accel.config import Config, StaticDevice
from nri_accel.container import ContainerInfo
from nri_accel.deviceplugin import deviceplugin_pb2 as pb2
from nri_accel.deviceplugin.server import REGISTER_SETTLE, WATCH_GRACE, DevicePlugins
from nri_accel.inventory import Device, Inventory
from nri_accel.state import NRI_STATUS_FILE, NriStatus, boottime
from nri_accel.vendors.neuron import KIND as KIND_NEURON
from nri_accel.vendors.nvidia import KIND_GPU, KIND_MIG

from .fake_kubelet import WAIT, FakeKubelet

GPU0 = "GPU-6f5c8a36-2b0e-4f59-9d3e-0c1b7a5e9f10"
GPU1 = "GPU-1d2e3f40-5a6b-4c7d-8e9f-a0b1c2d3e4f5"
GPU2 = "GPU-9a8b7c6d-5e4f-4a3b-9c2d-1e0f2a3b4c5d"
MIG_A = "MIG-0a1b2c3d-4e5f-5a6b-8c7d-9e0f1a2b3c4d"
MIG_B = "MIG-1b2c3d4e-5f6a-5b7c-9d8e-0f1a2b3c4d5e"
MIG_C = "MIG-2c3d4e5f-6a7b-5c8d-ae9f-1a2b3c4d5e6f"

NODE_CONFIG = Config(static_devices=(StaticDevice("acme.example/fpga", "fpga0"),))


def ids(response: pb2.ListAndWatchResponse) -> list[str]:
    return [d.ID for d in response.devices]


def health(response: pb2.ListAndWatchResponse) -> list[tuple[str, str]]:
    return [(d.ID, d.health) for d in response.devices]


def allocate(kubelet: FakeKubelet, endpoint: str, *containers: list[str]
             ) -> pb2.AllocateResponse:
    """kubelet's Allocate for one pod: a device list per container."""
    channel, stub = kubelet.client(endpoint)
    with channel:
        request = pb2.AllocateRequest(container_requests=[
            pb2.ContainerAllocateRequest(devices_ids=ids) for ids in containers])
        return stub.Allocate(request, timeout=WAIT)


def pre_start(kubelet: FakeKubelet, endpoint: str, devices: list[str]
              ) -> pb2.PreStartContainerResponse:
    """kubelet's PreStartContainer, right before it asks the runtime to create a container."""
    channel, stub = kubelet.client(endpoint)
    with channel:
        return stub.PreStartContainer(pb2.PreStartContainerRequest(devices_ids=devices),
                                      timeout=WAIT)


def preferred(kubelet: FakeKubelet, endpoint: str, available: list[str], size: int,
              must: tuple[str, ...] = ()) -> list[str]:
    channel, stub = kubelet.client(endpoint)
    with channel:
        response = stub.GetPreferredAllocation(pb2.PreferredAllocationRequest(
            container_requests=[pb2.ContainerPreferredAllocationRequest(
                available_deviceIDs=available, must_include_deviceIDs=must,
                allocation_size=size)]), timeout=WAIT)
    return list(response.container_responses[0].deviceIDs)


def refused(call: Callable[[], Any]) -> grpc.RpcError:
    """The error status a call to the plugin answered with (failing if it succeeded)."""
    try:
        call()
    except grpc.RpcError as e:
        return e
    raise AssertionError("the plugin answered instead of refusing")


def created(answer: pb2.ContainerAllocateResponse | Mapping[str, str], cid: str, *,
            pod: str = "pod", namespace: str = "default",
            env: tuple[str, ...] = ()) -> ContainerInfo:
    """The container CreateContainer presents to `run` once kubelet has copied the
    annotations of its Allocate answer (or these annotations) into the container's CRI
    annotations."""
    annotations = answer if isinstance(answer, Mapping) else answer.annotations
    return ContainerInfo(namespace=namespace, pod_name=pod, pod_uid=f"uid-{pod}",
                         container_name=f"c-{cid}", container_id=cid,
                         pod_annotations=MappingProxyType({}),
                         container_annotations=MappingProxyType(dict(annotations)), env=env)


def _attrs(**kw: str) -> MappingProxyType[str, str]:
    return MappingProxyType(dict(kw))


def node_inventory(*, gpu0_healthy: bool = True, with_2g: bool = True,
                   with_neuron: bool = True) -> Inventory:
    devices = [
        Device(KIND_GPU, "0", uuid=GPU0, numa_node=0, vendor="nvidia",
               healthy=gpu0_healthy),
        Device(KIND_GPU, "1", uuid=GPU1, numa_node=1, vendor="nvidia",
               attributes=_attrs(mig_mode="enabled")),
        Device(KIND_GPU, "2", uuid=GPU2, numa_node=1, vendor="nvidia", healthy=False),
        Device(KIND_MIG, "1:0", uuid=MIG_A, parent="1", vendor="nvidia",
               attributes=_attrs(mig_profile="1g.10gb")),
        Device(KIND_MIG, "1:1", uuid=MIG_B, parent="1", vendor="nvidia",
               attributes=_attrs(mig_profile="1g.10gb")),
        Device("acme.example/npu", "npu0"),
        Device("acme.example/npu", "npu1"),
        Device("acme.example/fpga", "fpga0", attributes=_attrs(origin="config")),
    ]
    if with_2g:
        devices.append(Device(KIND_MIG, "1:2", uuid=MIG_C, parent="1", vendor="nvidia",
                              attributes=_attrs(mig_profile="2g.20gb")))
    if with_neuron:
        devices += [
            Device(KIND_NEURON, "0", aliases=("neuron0",), links=("1",), vendor="neuron"),
            Device(KIND_NEURON, "1", aliases=("neuron1",), links=("0",), vendor="neuron"),
        ]
    return Inventory(devices=tuple(devices))


@pytest.fixture(autouse=True)
def quiet_servers() -> Iterator[None]:
    """The device plugins' own threads log (registered, health changes) when they get
    there, which may be while pytest is between a test's phases with its output capture
    suspended: the lines would land in the progress output. No test here reads them;
    they are kept in memory instead (a test may still capture_logs() itself)."""
    with capture_logs():
        yield


@pytest.fixture
def short_dir() -> Iterator[str]:
    d = tempfile.mkdtemp(prefix="dp-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
def kubelet(short_dir: str) -> Iterator[FakeKubelet]:
    k = FakeKubelet(short_dir)
    k.start()
    yield k
    k.stop()


class FakeNriSide:
    """Stands for `nri-accel run` (nri_accel.plugin._publish_status): writes its
    NriStatus record in `state_dir`, registered, refreshed every 0.2 s from a thread
    while `alive`, as `run` does every 2 s. The states a test can put it in: register()
    (the default), unregister() (connected to nothing: the runtime restarted), stale()
    (the process hung or was killed: the last record stays, older than NriStatus.STALE)
    and remove() (never ran on this boot)."""

    def __init__(self, state_dir: str) -> None:
        self.state_dir = state_dir
        self.path = os.path.join(state_dir, NRI_STATUS_FILE)
        self._registered = True
        self._alive = threading.Event()
        self._lock = threading.Lock()  # a beat never lands after a test's own write
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, daemon=True)

    def start(self) -> None:
        self._alive.set()
        self._write()
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(WAIT)

    def register(self) -> None:
        with self._lock:
            self._registered = True
            self._alive.set()
            self._write()

    def unregister(self) -> None:
        with self._lock:
            self._registered = False
            self._write()

    def stale(self) -> None:
        with self._lock:
            self._alive.clear()
            NriStatus(True, "containerd v2.1.0", "40-nri-accel", 4242,
                      boottime() - 3 * NriStatus.STALE).save(self.state_dir)

    def remove(self) -> None:
        with self._lock:
            self._alive.clear()
            os.unlink(self.path)

    def _write(self) -> None:
        NriStatus(self._registered, "containerd v2.1.0", "40-nri-accel", 4242,
                  boottime()).save(self.state_dir)

    def _beat(self) -> None:
        while not self._stop.wait(0.2):
            with self._lock:
                if self._alive.is_set():
                    self._write()


@pytest.fixture
def nri_side() -> Iterator[FakeNriSide]:
    state_dir = tempfile.mkdtemp(prefix="dp-state-", dir="/tmp")
    side = FakeNriSide(state_dir)
    side.start()
    yield side
    side.stop()
    shutil.rmtree(state_dir, ignore_errors=True)


class RunningPlugins:
    """DevicePlugins.run() on its own event loop thread; call() runs a coroutine there."""

    def __init__(self, plugins: DevicePlugins) -> None:
        self.plugins = plugins
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._stop = self.call(self._make_event())
        self._run = asyncio.run_coroutine_threadsafe(plugins.run(self._stop), self.loop)

    @staticmethod
    async def _make_event() -> asyncio.Event:
        return asyncio.Event()

    def call(self, coro: Coroutine[Any, Any, Any]) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(WAIT)

    def update(self, inventory: Inventory) -> None:
        self.call(self.plugins.update(inventory))

    def stop(self) -> None:
        """Set the stop event, wait for run() to finish, close the loop (idempotent)."""
        if self.loop.is_closed():
            return
        if not self._run.done():
            self.loop.call_soon_threadsafe(self._stop.set)
            self._run.result(WAIT)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(WAIT)
        self.loop.close()


@pytest.fixture
def plugins(short_dir: str, nri_side: FakeNriSide) -> Iterator[Callable[..., RunningPlugins]]:
    started: list[RunningPlugins] = []

    def start(inventory: Inventory | None = None, config: Config = NODE_CONFIG,
              directory: str = short_dir, watch_grace: float = WATCH_GRACE,
              settle: float = REGISTER_SETTLE) -> RunningPlugins:
        p = DevicePlugins(inventory if inventory is not None else node_inventory(), directory,
                          config=config, state_dir=nri_side.state_dir, poll_interval=0.05,
                          grace=0.5, watch_grace=watch_grace, settle=settle)
        running = RunningPlugins(p)
        started.append(running)
        return running

    yield start
    for running in started:
        running.stop()
