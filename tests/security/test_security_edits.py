"""What the daemon emits: every path comes from the inventory, never from the request;
mounts are read-only nosuid nodev binds away from /proc, /sys and runtime sockets; device
nodes carry real numbers and no cgroup rule is written; no hook unless enabled."""

from __future__ import annotations

from dataclasses import replace

import pytest
from security_testing import DEVICE_PLUGIN_KEY, TRUSTED_NS, container, demo_inventory, engine

from nri_accel.edits import UnsafeEdit, check_edits
from nri_accel.errors import AllocationError, RequestError
from nri_accel.inventory import ContainerEdits, Device, DeviceNode, Hook, Inventory, Mount
from nri_accel.nri.adjust import build_adjustment
from nri_accel.vendors.nvidia import KIND_GPU

HOSTILE_ENV = (
    "LD_PRELOAD=/tmp/evil.so", "LD_AUDIT=/tmp/a.so", "LD_LIBRARY_PATH=/proc/self/root/../..:/x",
    "PATH=/tmp", "NVIDIA_DRIVER_CAPABILITIES=all", "CUDA_MPS_PIPE_DIRECTORY=/run/containerd",
    "NVIDIA_VISIBLE_DEVICES=all",
)
HOSTILE_NAMES = "evil/../../proc/1/root"


def _inventory_paths() -> set[str]:
    inv = demo_inventory()
    edits = [d.edits for d in inv.devices]
    edits += [e for drv in inv.drivers.values() for e in drv.capabilities.values()]
    paths: set[str] = set()
    for e in edits:
        paths |= {n.path for n in e.device_nodes}
        paths |= {p for m in e.mounts for p in (m.host_path, m.container_path)}
    return paths


@pytest.mark.parametrize("mode", ["kubernetes", "standalone"])
def test_every_emitted_path_is_the_inventorys(mode: str) -> None:
    info = container(ctr={DEVICE_PLUGIN_KEY: "nvidia.com/gpu=0,nvidia.com/mig=7:1"},
                     env=HOSTILE_ENV, name=HOSTILE_NAMES, pod_name=HOSTILE_NAMES,
                     namespace=TRUSTED_NS if mode == "standalone" else "default")
    plan = engine(mode).plan(info)
    adj = build_adjustment(plan.edits, plan.annotations, plan.cdi_devices)
    known = _inventory_paths()
    assert adj.linux.devices and adj.mounts
    assert {d.path for d in adj.linux.devices} <= known
    assert {p for m in adj.mounts for p in (m.source, m.destination)} <= known
    assert set(adj.annotations) == {"nri-accel.io/granted"}
    env = {kv.key: kv.value for kv in adj.env}
    assert not {"LD_PRELOAD", "LD_AUDIT", "PATH", "CUDA_MPS_PIPE_DIRECTORY"} & set(env)
    # The container's own LD_LIBRARY_PATH is kept in front (it is its own env), nothing
    # else of it goes anywhere.
    assert env["LD_LIBRARY_PATH"].startswith("/proc/self/root/../..:/x:")
    assert not adj.hooks.ListFields()


def test_mounts_are_read_only_binds_and_no_cgroup_rule_is_written() -> None:
    plan = engine().plan(container(ctr={DEVICE_PLUGIN_KEY: "nvidia.com/gpu=0"},
                                   env=["NVIDIA_DRIVER_CAPABILITIES=all"]))
    adj = build_adjustment(plan.edits, plan.annotations)
    assert len(adj.mounts) > 10
    for m in adj.mounts:
        assert {"ro", "nosuid", "nodev"} <= set(m.options) and m.type == "bind", m
        assert "rw" not in m.options and ".." not in m.destination.split("/")
        assert not m.destination.startswith(("/proc", "/sys")), m
    for d in adj.linux.devices:
        assert d.type == "c" and d.major > 0 and d.minor >= 0 and d.path.startswith("/dev/")
    assert not adj.linux.HasField("resources")  # no LinuxDeviceCgroup, wildcard or not


def _inventory_with(edits: ContainerEdits) -> Inventory:
    return Inventory(devices=(Device(kind=KIND_GPU, name="0", edits=edits),))


UNSAFE_MOUNTS = [
    Mount("/usr/lib/x", "//proc/sys/kernel/core_pattern"),  # normpath keeps "//"
    Mount("/usr/lib/x", "//sys/fs/cgroup"),
    Mount("//run/containerd/containerd.sock", "/run/x.sock"),
    Mount("/run", "/host-run"),  # holds /run/containerd/containerd.sock
    Mount("/var/run", "/host-run"),
    Mount("/", "/host"),
    Mount("/usr/lib/x", "/"),
    Mount("/usr/lib/x", "/proc"),
    Mount("/usr/lib/../../etc/shadow", "/x"),
    Mount("/run/crio/crio.sock", "/x"),
    Mount("/usr/lib/x", "/usr/lib/x", type="tmpfs"),
]


@pytest.mark.parametrize("mount", UNSAFE_MOUNTS, ids=lambda m: f"{m.host_path}->{m.container_path}")
def test_unsafe_inventory_mounts_are_refused(mount: Mount) -> None:
    with pytest.raises(UnsafeEdit):
        check_edits(ContainerEdits(mounts=(mount,)))
    eng = engine("standalone", _inventory_with(ContainerEdits(
        device_nodes=(DeviceNode("/dev/nvidia0", 195, 0),), mounts=(mount,))))
    with pytest.raises(AllocationError, match="refused the inventory's edits"):
        eng.plan(container(pod={"devices.nri-accel.io": "nvidia.com/gpu=0"}))


def test_mount_options_are_forced_read_only() -> None:
    out = check_edits(ContainerEdits(mounts=(
        Mount("/usr/lib/x", "/usr/lib/x", options=("rw", "suid", "dev", "rbind")),)))
    assert out.mounts[0].options == ("rbind", "ro", "nosuid", "nodev")


@pytest.mark.parametrize("node", [
    DeviceNode("/dev/nvidia0", -1, 0), DeviceNode("/dev/nvidia0", 195, -1),
    DeviceNode("/dev/nvidia0", 195, 0, type="a"), DeviceNode("//dev/nvidia0", 195, 0),
    DeviceNode("/dev/../etc/x", 195, 0), DeviceNode("/tmp/nvidia0", 195, 0),
    DeviceNode("/dev/nvidia0", 195, 0, host_path="/proc/kcore"),
    DeviceNode("/dev/nvidia0", 195, 0, permissions="rwmx"),
])
def test_unsafe_device_nodes_are_refused(node: DeviceNode) -> None:
    with pytest.raises(UnsafeEdit):
        check_edits(ContainerEdits(device_nodes=(node,)))


HOOK = Hook("createContainer", "/usr/bin/nvidia-cdi-hook", ("nvidia-cdi-hook", "x"))


def test_inventory_hooks_are_emitted_only_when_hooks_are_enabled() -> None:
    inv = _inventory_with(ContainerEdits(device_nodes=(DeviceNode("/dev/nvidia0", 195, 0),),
                                         hooks=(HOOK,)))
    request = container(pod={"devices.nri-accel.io": "nvidia.com/gpu=0"},
                        env=["LD_PRELOAD=/tmp/evil.so", "PATH=/tmp"])
    off = engine("standalone", inv).plan(request)
    assert off.edits.hooks == () and any("hook(s) not emitted" in n for n in off.notes)
    on = engine("standalone", inv, hooks=True, hook_path="/usr/bin/nvidia-cdi-hook").plan(request)
    (hook,) = on.edits.hooks
    assert hook.path == "/usr/bin/nvidia-cdi-hook" and hook.timeout
    assert [kv.partition("=")[0] for kv in hook.env] == ["PATH"]
    assert "/tmp" not in hook.env[0].split("=", 1)[1].split(":")


@pytest.mark.parametrize("hook", [replace(HOOK, path="nvidia-cdi-hook"),
                                  replace(HOOK, path="/usr/bin/../../tmp/x"),
                                  replace(HOOK, env=("LD_PRELOAD=/x.so",))])
def test_unsafe_hooks_are_refused_when_enabled(hook: Hook) -> None:
    with pytest.raises(UnsafeEdit):
        check_edits(ContainerEdits(hooks=(hook,)), hooks_enabled=True)


def test_the_ldcache_hook_sees_no_container_env() -> None:
    eng = engine("standalone", hooks=True, hook_path="/usr/bin/nvidia-cdi-hook")
    plan = eng.plan(container(pod={"devices.nri-accel.io": "nvidia.com/gpu=0"},
                              env=["LD_PRELOAD=/tmp/evil.so", "LD_LIBRARY_PATH=/tmp/evil"]))
    (hook,) = plan.edits.hooks
    assert hook.timeout and [kv.partition("=")[0] for kv in hook.env] == ["PATH"]
    assert not any("/tmp" in a for a in hook.args)


def test_devices_already_in_the_spec_are_not_emitted_again() -> None:
    base = container(ctr={DEVICE_PLUGIN_KEY: "nvidia.com/gpu=0"})
    info = replace(base, device_paths=frozenset({"/dev/nvidia0", "/dev/nvidiactl"}))
    plan = engine().plan(info)
    assert plan.qualified_names == ("nvidia.com/gpu=0",)
    assert not {"/dev/nvidia0", "/dev/nvidiactl"} & {n.path for n in plan.edits.device_nodes}


def test_request_ids_are_never_paths() -> None:
    for value in ("nvidia.com/gpu=../../dev/sda", "nvidia.com/gpu=/dev/sda",
                  "vendor.com/../x=0", "nvidia.com/gpu=0/../../x"):
        with pytest.raises(RequestError):
            engine("standalone").plan(container(pod={"devices.nri-accel.io": value}))
