"""NVIDIA IMEX channels (NVIDIA_IMEX_CHANNELS, /dev/nvidia-caps-imex-channels/channel<N>):
the channels a GB200-class node's IMEX daemon joins to other nodes' GPUs over NVLink,
found on the h100 fake root with a channel added, asked for as nvidia-container-toolkit
reads the variable (ImexChannelRequests), and granted only beside a GPU, where env may
grant."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType

import msgspec
import pytest
from engine.engine_testing import admit, container, kubernetes, standalone

from nri_accel.discover.base import Found
from nri_accel.discover.hostroot import HostRoot
from nri_accel.engine import Engine
from nri_accel.errors import PolicyError, RequestError
from nri_accel.inventory import Inventory
from nri_accel.vendors.nvidia import parse_imex_channels
from nri_accel.vendors.nvidia.discover import discover_nvidia, probe

FakeRoot = Callable[[str], HostRoot]
IMEX_MAJOR = 505
CHANNEL0 = "/dev/nvidia-caps-imex-channels/channel0"
GRANTED_BY_DEVICE_PLUGIN = {"devices.nri-accel.io/resource.nvidia.com_gpu": "nvidia.com/gpu=0"}


@pytest.mark.parametrize(("value", "channels"), [
    ("0", ("0",)), ("3, 1,,", ("1", "3")), ("all", ("all",)), ("0,all", ("all",)),
    ("", ()), (" , ", ()), ("void", ()),
])
def test_the_variable_reads_as_the_toolkit_reads_it(value: str, channels: tuple) -> None:
    assert parse_imex_channels(value, "env NVIDIA_IMEX_CHANNELS") == channels


@pytest.mark.parametrize("value", ["01", "-1", "x", "1.0", "१", ",".join(map(str, range(65)))])
def test_a_value_that_names_no_channel_is_refused_by_name(value: str) -> None:
    with pytest.raises(RequestError) as err:
        parse_imex_channels(value, "env NVIDIA_IMEX_CHANNELS")
    assert err.value.source == "env NVIDIA_IMEX_CHANNELS"


def _with_channel0(fake_root: FakeRoot) -> Inventory:
    root = fake_root("h100")
    devices = Path(root.local("/proc/devices"))
    devices.write_text(devices.read_text().replace(
        "Block devices:", f"{IMEX_MAJOR} nvidia-caps-imex-channels\n\nBlock devices:", 1))
    Path(root.local(CHANNEL0)).parent.mkdir()
    os.mknod(root.local(CHANNEL0), stat.S_IFCHR | 0o666, os.makedev(IMEX_MAJOR, 0))
    os.symlink("../nvidia-caps-imex-channels/channel0", root.local(f"/dev/char/{IMEX_MAJOR}:0"))
    found: Found = discover_nvidia(root)
    assert found.problems == ()
    return Inventory(devices=found.devices, drivers={d.vendor: d for d in found.drivers})


def _nodes(plan: object) -> list[str]:
    return [n.path for n in plan.edits.device_nodes]  # type: ignore[attr-defined]


def test_a_channel_the_node_has_is_granted_beside_a_gpu(fake_root: FakeRoot) -> None:
    inv = _with_channel0(fake_root)
    (node,) = inv.driver("nvidia").capabilities["imex-channel/0"].device_nodes
    assert (node.path, node.major, node.minor) == (CHANNEL0, IMEX_MAJOR, 0)
    engine = Engine(inv, standalone())
    for value in ("0", "all"):
        plan = engine.plan(container(cid=value, env=("NVIDIA_VISIBLE_DEVICES=0",
                                                     f"NVIDIA_IMEX_CHANNELS={value}")))
        assert CHANNEL0 in _nodes(plan) and "/dev/nvidia0" in _nodes(plan)
    # asked for nothing, or without a GPU: no channel
    assert CHANNEL0 not in _nodes(engine.plan(container(cid="x", env=(
        "NVIDIA_VISIBLE_DEVICES=0",))))
    assert admit(engine, container(cid="y", env=("NVIDIA_IMEX_CHANNELS=0",))).devices == ()


def test_a_channel_the_node_lacks_is_refused_naming_it(fake_root: FakeRoot) -> None:
    engine = Engine(_with_channel0(fake_root), standalone())
    with pytest.raises(RequestError, match="no IMEX channel 1 on this node") as err:
        admit(engine, container(env=("NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_IMEX_CHANNELS=0,1")))
    assert err.value.source == "env NVIDIA_IMEX_CHANNELS"


def test_kubernetes_grants_a_channel_only_where_env_may_grant(fake_root: FakeRoot) -> None:
    # a channel joins the node's GPUs to other nodes' memory: env asking for one is
    # refused beside a device-plugin GPU in a namespace env may not grant in, as the
    # MIG capabilities are, and granted in a trusted one
    inv = _with_channel0(fake_root)
    env = ("NVIDIA_IMEX_CHANNELS=0",)
    with pytest.raises(PolicyError) as err:
        admit(Engine(inv, kubernetes()), container(annotations=GRANTED_BY_DEVICE_PLUGIN,
                                                   env=env))
    assert err.value.source == "env NVIDIA_IMEX_CHANNELS"
    trusted = admit(Engine(inv, kubernetes("default")),
                    container(annotations=GRANTED_BY_DEVICE_PLUGIN, env=env))
    assert CHANNEL0 in _nodes(trusted)
    # and a container given no GPU is not refused for asking
    assert admit(Engine(inv, kubernetes()), container(env=env)).devices == ()


def test_a_channel_made_after_discovery_moves_the_probe(fake_root: FakeRoot) -> None:
    # the IMEX daemon or nvidia-modprobe -i makes channels after boot: the refresh's
    # cheap check must see one appear, or the channel stays refused until a restart
    root = fake_root("h100")
    Path(root.local(CHANNEL0)).parent.mkdir()
    before = probe(root)
    os.mknod(root.local(CHANNEL0), stat.S_IFCHR | 0o666, os.makedev(IMEX_MAJOR, 0))
    assert probe(root) != before


def test_all_on_a_node_of_more_channels_than_a_container_gets_is_refused_by_name(
        fake_root: FakeRoot) -> None:
    inv = _with_channel0(fake_root)
    driver = inv.driver("nvidia")
    many = {**driver.capabilities, **{f"imex-channel/{n}": driver.capabilities[
        "imex-channel/0"] for n in range(1, 65)}}
    inv = Inventory(devices=inv.devices, drivers={"nvidia": msgspec.structs.replace(
        driver, capabilities=MappingProxyType(many))})
    with pytest.raises(RequestError, match="'all' is this node's 65 IMEX channels") as err:
        Engine(inv, standalone()).plan(container(env=("NVIDIA_VISIBLE_DEVICES=0",
                                                      "NVIDIA_IMEX_CHANNELS=all")))
    assert err.value.source == "env NVIDIA_IMEX_CHANNELS"
