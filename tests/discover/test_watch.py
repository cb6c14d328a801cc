"""Refresh: the change probe, node checks, the diff, and the poll loop (no real waiting)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType

import pytest
import yaml
from hosttree import HostTree

from nri_accel.config import Config, DiscoveryConfig, StaticDevice
from nri_accel.discover import discover
from nri_accel.discover.hostroot import HostRoot
from nri_accel.discover.watch import Refresher, diff, nodes_match, watch_state
from nri_accel.inventory import ContainerEdits, Device, DeviceNode, Driver, Inventory

CONFIG = Config(discovery=DiscoveryConfig(cdi_spec_dirs=("/etc/cdi", "/var/run/cdi")),
                static_devices=(StaticDevice("acme.example/fpga", "f0", ("/dev/fpga0",)),))
CAPS = "/proc/driver/nvidia/capabilities/gpu0/mig"


def _tree(tmp_path: Path) -> HostTree:
    tree = HostTree(tmp_path / "node")
    tree.file("/proc/driver/nvidia/version", "NVRM version: 550.54.15\n")
    tree.chardev("/dev/nvidia0", 195, 0)
    tree.chardev("/dev/nvidiactl", 195, 255)
    tree.chardev("/dev/nvidia-caps/nvidia-cap1", 508, 1)
    tree.file(f"{CAPS}/gi1/access", "DeviceFileMinor: 12\n")
    tree.file(f"{CAPS}/gi1/ci0/access", "DeviceFileMinor: 13\n")
    tree.chardev("/dev/npu0", 240, 0)
    tree.file("/etc/cdi/acme.yaml", yaml.safe_dump({
        "cdiVersion": "0.6.0", "kind": "acme.example/npu",
        "devices": [{"name": "npu0", "containerEdits": {"deviceNodes": [{"path": "/dev/npu0"}]}}],
    }))
    return tree


CHANGES: list[tuple[str, Callable[[HostTree], None]]] = [
    ("driver upgrade", lambda t: t.file("/proc/driver/nvidia/version",
                                        "NVRM version: 550.90.07\n")),
    ("neuron driver loaded", lambda t: t.file("/sys/module/neuron/version", "2.19.64.0\n")),
    ("gpu hot-plugged", lambda t: t.chardev("/dev/nvidia1", 195, 1)),
    ("gpu node renumbered", lambda t: t.chardev("/dev/nvidia0", 195, 7)),
    ("neuron device appeared", lambda t: t.chardev("/dev/neuron0", 241, 0)),
    ("nvidia-caps node added", lambda t: t.chardev("/dev/nvidia-caps/nvidia-cap2", 508, 2)),
    ("MIG instance created", lambda t: t.file(f"{CAPS}/gi2/access", "DeviceFileMinor: 21\n")),
    ("MIG compute instance created", lambda t: t.file(f"{CAPS}/gi1/ci1/access", "x\n")),
    ("CDI spec edited", lambda t: t.file("/etc/cdi/acme.yaml", "cdiVersion: 0.6.0\n")),
    ("CDI spec added", lambda t: t.file("/var/run/cdi/new.json", "{}")),
    ("CDI spec removed", lambda t: t.remove("/etc/cdi/acme.yaml")),
    ("static node appeared", lambda t: t.chardev("/dev/fpga0", 250, 0)),
]


@pytest.mark.parametrize(("what", "change"), CHANGES, ids=[c[0] for c in CHANGES])
def test_state_moves_with_each_kind_of_change(
        tmp_path: Path, what: str, change: Callable[[HostTree], None]) -> None:
    tree = _tree(tmp_path)
    before = watch_state(tree.root, CONFIG)
    assert watch_state(tree.root, CONFIG) == before  # stable while nothing moves
    change(tree)
    assert watch_state(tree.root, CONFIG) != before, what


def test_unrelated_dev_entries_do_not_count(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    before = watch_state(tree.root, CONFIG)
    tree.chardev("/dev/ttyS9", 4, 73)
    tree.file("/etc/cdi/notes.txt.bak", "")  # still listed: it sits in a spec directory
    tree.remove("/etc/cdi/notes.txt.bak")
    assert watch_state(tree.root, CONFIG) == before


def test_nodes_match_checks_every_granted_node(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    inv = discover(tree.root, CONFIG)
    assert [d.qualified_name for d in inv.devices] == ["acme.example/npu=npu0"]
    assert nodes_match(tree.root, inv)
    tree.chardev("/dev/npu0", 240, 3)
    assert not nodes_match(tree.root, inv)
    tree.remove("/dev/npu0")
    assert not nodes_match(tree.root, inv)


def test_nodes_match_covers_driver_nodes(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    ctl = DeviceNode("/dev/nvidiactl", 195, 255)
    inv = Inventory(
        devices=(Device(kind="nvidia.com/gpu", name="0", vendor="nvidia",
                        edits=ContainerEdits(device_nodes=(DeviceNode("/dev/nvidia0", 195, 0),))),),
        drivers=MappingProxyType({"nvidia": Driver("nvidia", capabilities=MappingProxyType(
            {"": ContainerEdits(device_nodes=(ctl,))}))}))
    assert nodes_match(tree.root, inv)
    tree.remove("/dev/nvidiactl")
    assert not nodes_match(tree.root, inv)


def _device(name: str, env: str = "A=1") -> Device:
    return Device(kind="acme.example/npu", name=name, edits=ContainerEdits(env=(env,)))


def test_diff_names_what_changed() -> None:
    old = Inventory(devices=(_device("0"), _device("1")),
                    drivers=MappingProxyType({"nvidia": Driver("nvidia", "550.54.15"),
                                              "gone": Driver("gone", "1")}))
    new = Inventory(devices=(_device("1", "A=2"), _device("2")),
                    drivers=MappingProxyType({"nvidia": Driver("nvidia", "550.90.07"),
                                              "neuron": Driver("neuron", "2.19")}))
    change = diff(old, new)
    assert change.added == ("acme.example/npu=2",)
    assert change.removed == ("acme.example/npu=0",)
    assert change.changed == ("acme.example/npu=1",)
    assert change.drivers == ("-gone 1", "+neuron 2.19", "nvidia 550.54.15 -> 550.90.07")
    assert not diff(old, old)


class _Discoverer:
    """Stands for discover(): returns prepared inventories and counts its calls."""

    def __init__(self, *results: Inventory | Exception) -> None:
        self.results = list(results)
        self.calls = 0

    def __call__(self, root: HostRoot, config: Config) -> Inventory:
        self.calls += 1
        result = self.results.pop(0)
        if isinstance(result, Exception):
            raise result
        return result


def test_check_does_nothing_while_the_node_is_unchanged(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    inv = discover(tree.root, CONFIG)
    fake = _Discoverer()
    seen: list[Inventory] = []
    r = Refresher(tree.root, CONFIG, inv, seen.append, state=watch_state(tree.root, CONFIG),
                  discover_fn=fake)
    assert asyncio.run(r.check()) is None
    assert (fake.calls, seen) == (0, [])


def test_check_rediscovers_on_change_and_hands_over_a_different_inventory(
        tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    inv = discover(tree.root, CONFIG)
    fake = _Discoverer(inv, Inventory(devices=(_device("9"),)))
    seen: list[Inventory] = []
    r = Refresher(tree.root, CONFIG, inv, seen.append, state=watch_state(tree.root, CONFIG),
                  discover_fn=fake)
    tree.chardev("/dev/nvidia1", 195, 1)
    assert asyncio.run(r.check()) is None  # rediscovered, but nothing differs
    assert (fake.calls, seen) == (1, [])
    assert asyncio.run(r.check()) is None  # the new state was recorded: no second run
    assert fake.calls == 1
    tree.remove("/dev/nvidia1")
    new = asyncio.run(r.check())
    assert new is not None and seen == [new] and r.inventory is new
    assert fake.calls == 2


def test_without_a_recorded_state_the_first_check_rediscovers(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    inv = discover(tree.root, CONFIG)
    fake = _Discoverer(Inventory(devices=(_device("9"),)))
    got: list[Inventory] = []

    async def on_change(new: Inventory) -> None:  # an async callback is awaited
        got.append(new)

    r = Refresher(tree.root, CONFIG, inv, on_change, discover_fn=fake)
    assert asyncio.run(r.check()) is not None
    assert [d.name for d in got[0].devices] == ["9"]


def test_a_vanished_node_triggers_rediscovery_even_if_the_probe_is_still(
        tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    inv = discover(tree.root, CONFIG)
    state = watch_state(tree.root, CONFIG)
    tree.chardev("/dev/npu0", 240, 5)  # not a vendor /dev entry: the probe does not see it
    assert watch_state(tree.root, CONFIG) == state
    fake = _Discoverer(Inventory())
    seen: list[Inventory] = []
    r = Refresher(tree.root, CONFIG, inv, seen.append, state=state, discover_fn=fake)
    asyncio.run(r.check())
    assert fake.calls == 1 and seen == [Inventory()]


def test_run_polls_survives_errors_and_stops_when_cancelled(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    inv = discover(tree.root, CONFIG)
    fake = _Discoverer(RuntimeError("NVML hiccup"), Inventory(devices=(_device("9"),)))
    seen: list[Inventory] = []
    sleeps: list[float] = []

    async def sleep(seconds: float) -> None:
        sleeps.append(seconds)
        if len(sleeps) == 4:
            raise asyncio.CancelledError
        if len(sleeps) == 1:
            tree.chardev("/dev/nvidia1", 195, 1)  # a GPU appears before the first poll

    r = Refresher(tree.root, CONFIG, inv, seen.append, state=watch_state(tree.root, CONFIG),
                  interval=2.5, discover_fn=fake, sleep=sleep)
    with pytest.raises(asyncio.CancelledError):
        asyncio.run(r.run())
    assert sleeps == [2.5, 2.5, 2.5, 2.5]
    # poll 1 failed and did not end the task, poll 2 retried it, poll 3 saw no change
    assert fake.calls == 2
    assert [d.name for d in seen[0].devices] == ["9"]


def test_interval_zero_disables_refresh(tmp_path: Path) -> None:
    tree = _tree(tmp_path)
    fake = _Discoverer()
    config = Config(discovery=DiscoveryConfig(refresh_interval=0))
    r = Refresher(tree.root, config, Inventory(), lambda inv: None, discover_fn=fake)
    asyncio.run(r.run())
    assert fake.calls == 0
