"""What the daemon emits: every path comes from the inventory, never from the request;
mounts are read-only nosuid nodev binds from no host state (/proc, /sys, kubelet, the
runtimes' directories) or nosuid nodev tmpfs, never onto /proc, /sys or runtime sockets;
device nodes carry real numbers, live under /dev, and no cgroup rule is written, so a node
asking for less than the runtime's "rw" is refused; no hook unless enabled."""

from __future__ import annotations

from types import MappingProxyType

import pytest
from msgspec.structs import replace
from security_testing import DEVICE_PLUGIN_KEY, TRUSTED_NS, container, demo_inventory, engine

from nri_accel.edits import (
    FORBIDDEN_SOURCES,
    MAX_CONTAINER_EDITS,
    MAX_EDITS,
    RUNTIME_SOCKETS,
    UnsafeEdit,
    check_edits,
    check_mount_source,
)
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
    # a tmpfs with the default options (bind among them): runc would bind its source
    Mount("/usr/lib/x", "/usr/lib/x", type="tmpfs"),
    # host state (issue #9): kubelet, sysfs as a source, the runtimes' state directories
    Mount("/var/lib/kubelet/device-plugins", "/var/lib/kubelet/device-plugins"),
    Mount("/var/lib/kubelet/pod-resources/kubelet.sock", "/pod-resources.sock"),
    Mount("/var/lib/kubelet/pods", "/pods"),
    Mount("/var/lib", "/host-var-lib"),  # holds /var/lib/kubelet
    Mount("/etc", "/host-etc"),  # holds /etc/kubernetes
    Mount("/sys/class/drm", "/drm"),
    Mount("/sys", "/host-sys"),
    Mount("/var/lib/containerd/io.containerd.content.v1.content", "/content"),
    Mount("/var/lib/containers/storage", "/storage"),
    Mount("/run/containers/0/auth.json", "/auth.json"),
    Mount("/var/lib/docker", "/docker"),
    Mount("/var/lib/crio", "/crio"),
    Mount("/run/runc", "/runc"),
    Mount("/var/lib/rancher/k3s/server/token", "/token"),
    Mount("/run/nri-accel/grants.json", "/grants.json"),
    # other filesystem types
    Mount("proc", "/host-proc", type="proc", options=("nosuid",)),
    Mount("sysfs", "/sysfs", type="sysfs", options=("ro",)),
    Mount("/dev/sda1", "/disk", type="ext4", options=("ro",)),
    Mount("overlay", "/o", type="overlay", options=("lowerdir=/var/lib/kubelet",)),
    Mount("ramfs", "/r", type="ramfs", options=("nosuid",)),
    Mount("cgroup2", "/c", type="cgroup2", options=("nosuid",)),
    # tmpfs: a host path as its source, forbidden destinations, options it may not carry
    Mount("/var/lib/kubelet", "/scratch", type="tmpfs", options=("size=1m",)),
    Mount("tmpfs", "/proc/driver/nvidia", type="tmpfs", options=("size=1m",)),
    Mount("tmpfs", "/sys/fs/cgroup", type="tmpfs", options=("size=1m",)),
    Mount("tmpfs", "/run/containerd", type="tmpfs", options=("size=1m",)),
    Mount("tmpfs", "/", type="tmpfs", options=("size=1m",)),
    Mount("tmpfs", "/x", type="tmpfs", options=("rbind",)),
    Mount("tmpfs", "/x", type="tmpfs", options=("remount",)),
    Mount("tmpfs", "/x", type="tmpfs", options=("size=1m,exec",)),
    Mount("tmpfs", "/x", type="tmpfs", options=("context=system_u:object_r:x",)),
    Mount("tmpfs", "/x", type="tmpfs", options=("lowerdir=/etc",)),
]


@pytest.mark.parametrize("mount", UNSAFE_MOUNTS,
                         ids=lambda m: f"{m.type}:{m.host_path}->{m.container_path}")
def test_unsafe_inventory_mounts_are_refused(mount: Mount) -> None:
    with pytest.raises(UnsafeEdit):
        check_edits(ContainerEdits(mounts=(mount,)))
    eng = engine("standalone", _inventory_with(ContainerEdits(
        device_nodes=(DeviceNode("/dev/nvidia0", 195, 0),), mounts=(mount,))))
    with pytest.raises(AllocationError, match="refused the inventory's edits"):
        eng.plan(container(pod={"devices.nri-accel.io": "nvidia.com/gpu=0"}))


def test_refused_inventory_edits_are_logged_when_the_engine_takes_the_inventory(
        all_logs: None) -> None:
    from structlog.testing import capture_logs

    with capture_logs() as logs:
        eng = engine("standalone", _inventory_with(ContainerEdits(
            device_nodes=(DeviceNode("/etc/passwd", 195, 0),))))
        for marks in ({"nvidia.com/gpu=0": "xid 79"}, {}):  # a health watch's reports
            eng.set_health("nvidia", marks)
    (refused,) = [e for e in logs if e["event"] == "inventory_edits_refused"]  # said once
    assert (refused["device"], refused["log_level"]) == ("nvidia.com/gpu=0", "error")
    assert "'/etc/passwd' is not under /dev" in refused["reason"]


def test_mount_options_are_forced_read_only() -> None:
    out = check_edits(ContainerEdits(mounts=(
        Mount("/usr/lib/x", "/usr/lib/x", options=("rw", "suid", "dev", "rbind")),)))
    assert out.mounts[0].options == ("bind", "ro", "nosuid", "nodev")


@pytest.mark.parametrize("root", sorted(FORBIDDEN_SOURCES))
def test_every_forbidden_source_its_children_and_its_ancestors_are_refused(root: str) -> None:
    parent = root.rsplit("/", 1)[0] or "/"
    for source in (root, root + "/x", parent):
        with pytest.raises(UnsafeEdit, match="mount source"):
            check_edits(ContainerEdits(mounts=(Mount(source, "/x"),)))


def test_the_source_denylist_covers_every_runtime_socket() -> None:
    assert set(RUNTIME_SOCKETS) <= set(FORBIDDEN_SOURCES)


def test_bind_mounts_lose_shared_propagation() -> None:
    out = check_edits(ContainerEdits(mounts=(
        Mount("/usr/lib/x", "/usr/lib/x", options=("rbind", "rshared")),
        Mount("/usr/lib/y", "/usr/lib/y", type="none", options=("shared", "rslave")),)))
    assert [m.options for m in out.mounts] == [("bind", "ro", "nosuid", "nodev"),
                                               ("rslave", "ro", "nosuid", "nodev", "bind")]
    assert {m.type for m in out.mounts} == {"bind"}


def test_a_tmpfs_reaches_nri_as_a_nosuid_nodev_tmpfs() -> None:
    tmpfs = Mount("tmpfs", "/var/cache/acme", type="tmpfs",
                  options=("size=64m", "mode=1777", "rw", "dev", "suid", "rshared", "noexec"))
    inv = _inventory_with(ContainerEdits(device_nodes=(DeviceNode("/dev/nvidia0", 195, 0),),
                                         mounts=(tmpfs,)))
    plan = engine("standalone", inv).plan(container(pod={"devices.nri-accel.io":
                                                         "nvidia.com/gpu=0"}))
    adj = build_adjustment(plan.edits, plan.annotations)
    (m,) = adj.mounts
    assert (m.type, m.source, m.destination) == ("tmpfs", "tmpfs", "/var/cache/acme")
    # size, mode and rw kept (the tmpfs is the container's own memory); dev, suid and
    # shared propagation dropped; nosuid, nodev always there
    assert list(m.options) == ["size=64m", "mode=1777", "rw", "noexec", "nosuid", "nodev"]


@pytest.mark.parametrize("permissions", ["r", "w", "m", "rm", "wm", "none", ""])
@pytest.mark.parametrize("node_type", ["c", "b"])
def test_device_nodes_asking_for_less_than_rw_are_refused(node_type: str,
                                                         permissions: str) -> None:
    # The runtime gives a device in an NRI adjustment "rw" (+ "m" for block devices)
    # whatever a node asks: a narrower CDI permission would be silently widened.
    node = DeviceNode("/dev/nvidia0", 195, 0, type=node_type, permissions=permissions)
    with pytest.raises(UnsafeEdit, match="cgroup access"):
        check_edits(ContainerEdits(device_nodes=(node,)))


@pytest.mark.parametrize("permissions", ["rw", "rwm"])
@pytest.mark.parametrize("node_type", ["c", "b"])
def test_device_nodes_allowing_rw_pass(node_type: str, permissions: str) -> None:
    node = DeviceNode("/dev/nvidia0", 195, 0, type=node_type, permissions=permissions)
    assert check_edits(ContainerEdits(device_nodes=(node,))).device_nodes == (node,)


def test_a_hand_written_node_under_sys_is_refused_for_the_container() -> None:
    node = DeviceNode("/sys/devices/virtual/acme/npu0", 240, 0)
    inv = Inventory(devices=(Device(kind="acme.example/npu", name="npu0",
                                    edits=ContainerEdits(device_nodes=(node,))),))
    with pytest.raises(AllocationError, match="'/sys/devices/virtual/acme/npu0' is not under"):
        engine("standalone", inv).plan(container(pod={"devices.nri-accel.io":
                                                      "acme.example/npu=npu0"}))


def test_a_device_adding_more_than_max_edits_is_refused_for_the_container() -> None:
    # A hand-written inventory (CDI specs are held to it as they load: tests/discover).
    def npu(name: str, mounts: int) -> Device:
        return Device(kind="acme.example/npu", name=name, edits=ContainerEdits(
            device_nodes=(DeviceNode(f"/dev/{name}", 240, 0),),
            mounts=tuple(Mount(f"/opt/acme/{i}", f"/opt/acme/{i}") for i in range(mounts))))

    eng = engine("standalone", Inventory(devices=(npu("npu0", MAX_EDITS),
                                                  npu("npu1", MAX_EDITS - 1))))
    with pytest.raises(AllocationError, match=f"{MAX_EDITS + 1} device nodes, mounts, env "
                                              f"entries and hooks, over the {MAX_EDITS}"):
        eng.plan(container(pod={"devices.nri-accel.io": "acme.example/npu=npu0"}))
    plan = eng.plan(container(pod={"devices.nri-accel.io": "acme.example/npu=npu1"}))
    assert len(plan.edits.mounts) == MAX_EDITS - 1


def test_a_container_whose_devices_add_more_than_max_container_edits_is_refused() -> None:
    # Each device within MAX_EDITS, five together past MAX_CONTAINER_EDITS: refused
    # before the answer is built; four (2,004 edits) get theirs.
    def npu(i: int) -> Device:
        return Device(kind="acme.example/npu", name=f"npu{i}", edits=ContainerEdits(
            device_nodes=(DeviceNode(f"/dev/npu{i}", 240, i),),
            mounts=tuple(Mount(f"/opt/acme/{i}/{j}", f"/opt/acme/{i}/{j}")
                         for j in range(500))))

    eng = engine("standalone", Inventory(devices=tuple(npu(i) for i in range(5))))
    with pytest.raises(AllocationError, match=(
            "acme.example/npu=npu0, acme.example/npu=npu1, acme.example/npu=npu2, "
            f"acme.example/npu=npu3 and 1 more add 2505 device nodes, mounts, env entries "
            f"and hooks, over the {MAX_CONTAINER_EDITS} nri-accel gives one container")):
        eng.plan(container(pod={"devices.nri-accel.io": "acme.example/npu=all"}))
    plan = eng.plan(container(pod={"devices.nri-accel.io": "acme.example/npu=npu0,"
                                   "acme.example/npu=npu1,acme.example/npu=npu2,"
                                   "acme.example/npu=npu3"}))
    assert len(plan.edits.mounts) == 2000


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
    info = replace(base, spec_devices=MappingProxyType({"/dev/nvidia0": ("c", 195, 0),
                                                         "/dev/nvidiactl": ("c", 195, 255)}))
    plan = engine().plan(info)
    assert plan.qualified_names == ("nvidia.com/gpu=0",)
    assert not {"/dev/nvidia0", "/dev/nvidiactl"} & {n.path for n in plan.edits.device_nodes}


def test_request_ids_are_never_paths() -> None:
    for value in ("nvidia.com/gpu=../../dev/sda", "nvidia.com/gpu=/dev/sda",
                  "vendor.com/../x=0", "nvidia.com/gpu=0/../../x"):
        with pytest.raises(RequestError):
            engine("standalone").plan(container(pod={"devices.nri-accel.io": value}))


def _refused_by_the_rule(path: str) -> bool:
    """The rule check_mount_source() states, root by root: under one or holding one."""
    def under(p: str, root: str) -> bool:
        return p == root or p.startswith(root.rstrip("/") + "/")
    return any(under(path, r) or under(r, path) for r in FORBIDDEN_SOURCES)


@pytest.mark.parametrize("path", sorted({
    "/", "/usr", "/usr/lib/x86_64-linux-gnu/libcuda.so.1", "/var", "/var/lib", "/var/run",
    "/run", "/etc", "/etc/kube", "/etc/kubernetes2", "/procfs", "/proc2/x", "/syslog",
    "/var/lib/kubelet-plugins", "/run/nri-accel2", "/run/docker.sockets", "/rancher",
    *FORBIDDEN_SOURCES, *(r + "/x" for r in FORBIDDEN_SOURCES),
    *(r.rsplit("/", 1)[0] or "/" for r in FORBIDDEN_SOURCES)}))
def test_the_mount_source_check_refuses_exactly_what_the_rule_says(path: str) -> None:
    try:
        check_mount_source(path)
        refused = False
    except UnsafeEdit:
        refused = True
    assert refused == _refused_by_the_rule(path)
