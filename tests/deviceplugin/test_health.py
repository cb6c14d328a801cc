"""Device health in ListAndWatch: the whole device plugin (deviceplugin.server.serve) on a
fake H100 node (tests/fakes/roots/h100, whose libnvidia-ml is the fake NVML of
tests/fakes/nvml driving the real pynvml), an XID injected through the fake's events
file as the driver would raise it, the fake kubelet watching. Waits are bounded waits
for an expected stream update; nothing measures how fast it comes."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fakes.nvml import build
from fakes.nvml.node import FakeNode
from fakes.roots import materialise
from msgspec.structs import replace

from nri_accel.config import Config, DiscoveryConfig, HealthConfig
from nri_accel.deviceplugin import deviceplugin_pb2 as pb2
from nri_accel.deviceplugin.server import serve
from nri_accel.discover import discover
from nri_accel.discover.hostroot import HostRoot
from nri_accel.health import carry_vanished
from nri_accel.inventory import Inventory

from .conftest import FakeNriSide, health
from .fake_kubelet import WAIT, FakeKubelet

H100 = ["GPU-74106407-f32f-0663-90a7-a1acf7eb04ae", "GPU-08f22e65-3b2d-59a7-2659-c71f416a3808",
        "GPU-126d4085-7b1a-a246-402b-e786f0d2a595", "GPU-d6a0ae3c-5011-a59d-c8a7-2b61c6a912e7"]


@pytest.fixture
def h100(tmp_path: Path) -> HostRoot:
    try:
        build.library()
    except build.BuildError as e:
        pytest.fail(f"cannot build the fake NVML library: {e}")
    return materialise("h100", tmp_path / "h100")


def inject(root: HostRoot, line: str) -> None:
    """What the driver raises, appended to the fake NVML's events file."""
    FakeNode(root).inject(line)


class Serving:
    """`nri-accel device-plugin --root` in-process: serve() on its own loop thread."""

    def __init__(self, root: HostRoot, kubelet_dir: str, config: Config) -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self._thread.start()
        self._stop = asyncio.run_coroutine_threadsafe(self._event(), self.loop).result(WAIT)
        self.inventory = discover(root, config)
        self._on_refresh: Any = None
        self._done = asyncio.run_coroutine_threadsafe(serve(
            self.inventory, kubelet_dir, stop=self._stop, config=config, root=root,
            poll_interval=0.05, refresher=self._refresher), self.loop)

    def _refresher(self, on_change: Any) -> None:
        """serve()'s refresher: none runs; refresh() hands it an inventory instead."""
        self._on_refresh = on_change

    def refresh(self, inventory: Inventory) -> None:
        """What the Refresher hands on after a discovery that found `inventory`."""
        asyncio.run_coroutine_threadsafe(self._on_refresh(inventory), self.loop).result(WAIT)

    @staticmethod
    async def _event() -> asyncio.Event:
        return asyncio.Event()

    def stop(self) -> None:
        self.loop.call_soon_threadsafe(self._stop.set)
        self._done.result(WAIT)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(WAIT)
        self.loop.close()


@pytest.fixture
def serving(h100: HostRoot, kubelet: FakeKubelet, nri_side: FakeNriSide) -> Iterator[Serving]:
    config = Config(discovery=DiscoveryConfig(refresh_interval=0),
                    health=HealthConfig(enabled=True, recheck_interval=0.5),
                    state_dir=nri_side.state_dir)
    s = Serving(h100, kubelet.directory, config)
    yield s
    s.stop()


def _states(response: pb2.ListAndWatchResponse) -> dict[str, str]:
    return dict(health(response))


def test_an_xid_turns_one_gpu_unhealthy_and_a_quiet_recheck_brings_it_back(
        serving: Serving, h100: HostRoot, kubelet: FakeKubelet) -> None:
    gpu = kubelet.wait_registered("nvidia.com/gpu")
    assert _states(kubelet.wait_list(gpu)) == dict.fromkeys(H100, "Healthy")

    # The watch registers with NVML in its own thread; events from before that are never
    # delivered (as with the real driver), so the XID repeats until it is seen.
    def gpu1_unhealthy(r: pb2.ListAndWatchResponse) -> bool:
        return _states(r)[H100[1]] == "Unhealthy"

    unhealthy = None
    for _ in range(int(WAIT / 0.5)):
        inject(h100, f"xid {H100[1]} 79")
        unhealthy = kubelet.wait_list(gpu, gpu1_unhealthy, timeout=0.5, fail=False)
        if unhealthy is not None:
            break
    assert unhealthy is not None, "GPU 1 never turned Unhealthy after XID 79"
    assert _states(unhealthy) == {**dict.fromkeys(H100, "Healthy"), H100[1]: "Unhealthy"}
    # No further event: after recheck_interval quiet, NVML's recheck passes.
    again = kubelet.wait_list(gpu, lambda r: _states(r)[H100[1]] == "Healthy",
                              "GPU 1 Healthy again", after=unhealthy)
    assert _states(again) == dict.fromkeys(H100, "Healthy")


def test_a_mark_survives_a_refresh_that_changes_other_devices(
        h100: HostRoot, kubelet: FakeKubelet, nri_side: FakeNriSide) -> None:
    # the family's watch restarts (another GPU vanished), and GPU 1's mark carries over
    # until its recheck: an hour away here
    config = Config(discovery=DiscoveryConfig(refresh_interval=0),
                    health=HealthConfig(enabled=True, recheck_interval=3600),
                    state_dir=nri_side.state_dir)
    s = Serving(h100, kubelet.directory, config)
    try:
        gpu = kubelet.wait_registered("nvidia.com/gpu")
        unhealthy = None
        for _ in range(int(WAIT / 0.5)):
            inject(h100, f"xid {H100[1]} 48")
            unhealthy = kubelet.wait_list(gpu, lambda r: _states(r)[H100[1]] == "Unhealthy",
                                          timeout=0.5, fail=False)
            if unhealthy is not None:
                break
        assert unhealthy is not None, "GPU 1 never turned Unhealthy after XID 48"
        without_3 = Inventory(devices=tuple(d for d in s.inventory.devices
                                            if d.uuid != H100[3]))
        s.refresh(carry_vanished(s.inventory, without_3))
        after = kubelet.wait_list(gpu, lambda r: _states(r)[H100[3]] == "Unhealthy",
                                  "GPU 3 Unhealthy once vanished", after=unhealthy)
        assert _states(after) == {H100[0]: "Healthy", H100[1]: "Unhealthy",
                                  H100[2]: "Healthy", H100[3]: "Unhealthy"}
    finally:
        s.stop()


def test_health_watch_is_off_when_disabled(h100: HostRoot, kubelet: FakeKubelet,
                                           nri_side: FakeNriSide) -> None:
    config = Config(discovery=DiscoveryConfig(refresh_interval=0),
                    health=replace(HealthConfig(), enabled=False),
                    state_dir=nri_side.state_dir)
    s = Serving(h100, kubelet.directory, config)
    try:
        gpu = kubelet.wait_registered("nvidia.com/gpu")
        assert _states(kubelet.wait_list(gpu)) == dict.fromkeys(H100, "Healthy")
        assert not [t for t in threading.enumerate() if t.name == "nri-accel-health"]
    finally:
        s.stop()
