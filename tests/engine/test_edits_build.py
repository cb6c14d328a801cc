"""Edits: nodes, mounts, env, hooks for a Selection, and the safety rules on every path."""

from __future__ import annotations

from types import MappingProxyType

import msgspec
import pytest
from engine_testing import (
    GPU_UUIDS,
    MIG_UUIDS,
    cdi_inventory,
    demo_inventory,
    neuron_inventory,
    request,
)

from nri_accel.config import DevicesConfig
from nri_accel.edits import EDITS_MEMO_SIZE, HOOK_ENV, build, check_edits, compile_catalog
from nri_accel.errors import AllocationError, RequestError
from nri_accel.inventory import ContainerEdits, Device, DeviceNode, Driver, Hook, Inventory, Mount
from nri_accel.policy import Request
from nri_accel.select import DeviceIndex, select
from nri_accel.syntax import DeviceClaim
from nri_accel.vendors.neuron import KIND as KIND_NEURON
from nri_accel.vendors.nvidia import ALL_CAPABILITIES, KIND_GPU, KIND_MIG

SRC = "container annotation devices.nri-accel.io"
LIB64 = "/usr/local/nvidia/lib64"


def edits_for(inventory: Inventory, request: Request, *, devices: DevicesConfig | None = None,
              **kw):
    sel = select(request, DeviceIndex(inventory))
    built = build(sel, request, compile_catalog(inventory, devices or DevicesConfig()), **kw)
    return built.edits, built.notes


def gpu_ids(*idents: str, kind: str = KIND_GPU, **kw) -> Request:
    return request(grants=(DeviceClaim(kind, ids=idents, source=SRC),), **kw)


def env_of(edits: ContainerEdits) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in edits.env)


# ---- NVIDIA -------------------------------------------------------------------------------

def test_one_gpu_gets_its_node_the_control_nodes_and_the_default_capabilities():
    edits, notes = edits_for(demo_inventory(), gpu_ids("0"))
    assert [n.path for n in edits.device_nodes] == [
        "/dev/nvidia0", "/dev/nvidia-uvm", "/dev/nvidia-uvm-tools", "/dev/nvidiactl"]
    dests = {m.container_path for m in edits.mounts}
    assert f"{LIB64}/libcuda.so.1" in dests          # compute
    assert f"{LIB64}/libnvidia-ml.so.1" in dests     # utility
    assert "/usr/bin/nvidia-smi" in dests
    assert "/run/nvidia-persistenced/socket" in dests
    assert f"{LIB64}/libnvidia-encode.so.1" not in dests  # video was not asked for
    assert env_of(edits) == {
        "LD_LIBRARY_PATH": LIB64,
        "NVIDIA_DRIVER_CAPABILITIES": "compute,utility",
        "NVIDIA_VISIBLE_DEVICES": GPU_UUIDS["0"],
    }
    assert edits.hooks == ()
    assert notes == ()


def test_visible_devices_is_rewritten_to_the_injected_uuids_in_order():
    edits, _ = edits_for(demo_inventory(), gpu_ids("4", "0:31:0.0"))
    assert env_of(edits)["NVIDIA_VISIBLE_DEVICES"] == (
        "GPU-8e0a7d52-1c4f-4b9a-a6d3-2f5e9c1b7d21," + GPU_UUIDS["4"])


def test_mig_device_brings_its_caps_nodes_and_its_parent_gpu_node():
    edits, _ = edits_for(demo_inventory(), gpu_ids("7:0", kind=KIND_MIG))
    paths = [n.path for n in edits.device_nodes]
    assert "/dev/nvidia7" in paths
    assert {"/dev/nvidia-caps/nvidia-cap966", "/dev/nvidia-caps/nvidia-cap967"} <= set(paths)
    assert "/dev/nvidia0" not in paths
    assert env_of(edits)["NVIDIA_VISIBLE_DEVICES"] == MIG_UUIDS["7:0"]


def test_capabilities_all_and_missing_ones():
    inv = demo_inventory()
    edits, notes = edits_for(inv, gpu_ids("0", capabilities=ALL_CAPABILITIES))
    assert env_of(edits)["NVIDIA_DRIVER_CAPABILITIES"] == (
        "compat32,compute,display,graphics,ngx,utility,video")
    assert "/dev/nvidia-modeset" in {n.path for n in edits.device_nodes}  # display
    # compat32 libraries live in lib/, and both directories are on the path.
    assert env_of(edits)["LD_LIBRARY_PATH"] == f"{LIB64}:/usr/local/nvidia/lib"
    no_ngx = msgspec.structs.replace(inv.driver("nvidia"), capabilities=MappingProxyType(
        {k: v for k, v in inv.driver("nvidia").capabilities.items() if k != "ngx"}))
    headless = Inventory(devices=inv.devices, drivers=MappingProxyType({"nvidia": no_ngx}))
    edits, notes = edits_for(headless, gpu_ids("0", capabilities=frozenset({"ngx", "utility"})))
    assert env_of(edits)["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    assert notes == ("driver capabilities with no files on this node: ngx",)
    assert f"{LIB64}/libcuda.so.1" not in {m.container_path for m in edits.mounts}


# compat32 adds the 32-bit builds of exactly the libraries the other requested
# capabilities select, and nothing alone: NVIDIA/libnvidia-container src/nvc_mount.c
# (mount_files filters libs and libs32 alike through match_library_flags), src/nvc_info.c
# (match_library_flags: the library lists per OPT_*_LIBS flag) and src/nvc.c
# (container_opts: video = VIDEO_LIBS|COMPUTE_LIBS, display = DISPLAY|GRAPHICS_LIBS).
C32_COMPUTE = {"libcuda.so.1", "libnvidia-gpucomp.so.550.54.15", "libnvidia-nvvm.so.4",
               "libnvidia-opencl.so.1", "libnvidia-ptxjitcompiler.so.1"}
C32_VIDEO = {"libnvcuvid.so.1", "libnvidia-encode.so.1", "libnvidia-opticalflow.so.1"}
C32_GRAPHICS = {"libEGL_nvidia.so.0", "libGLESv1_CM_nvidia.so.1", "libGLESv2_nvidia.so.2",
                "libGLX_nvidia.so.0", "libnvidia-eglcore.so.550.54.15", "libnvidia-fbc.so.1",
                "libnvidia-glcore.so.550.54.15", "libnvidia-glsi.so.550.54.15",
                "libnvidia-glvkspirv.so.550.54.15", "libnvidia-tls.so.550.54.15"}
LIB32 = "/usr/local/nvidia/lib"


@pytest.mark.parametrize(("caps", "libs32", "given"), [
    ({"compat32"}, set(), "compat32"),
    ({"compute"}, set(), "compute"),
    ({"compute", "compat32"}, C32_COMPUTE, "compat32,compute"),
    ({"utility", "compute", "compat32"}, C32_COMPUTE, "compat32,compute,utility"),
    ({"video", "compat32"}, C32_COMPUTE | C32_VIDEO, "compat32,video"),
    ({"graphics", "compat32"}, C32_GRAPHICS, "compat32,graphics"),
    ({"display", "compat32"}, C32_GRAPHICS, "compat32,display"),
    ({"utility", "compat32"}, set(), "compat32,utility"),  # no 32-bit utility library here
    ({"ngx", "compat32"}, set(), "compat32,ngx"),
    (ALL_CAPABILITIES, C32_COMPUTE | C32_VIDEO | C32_GRAPHICS,
     "compat32,compute,display,graphics,ngx,utility,video"),
])
def test_compat32_adds_the_32_bit_libraries_of_the_other_capabilities(caps, libs32, given):
    edits, notes = edits_for(demo_inventory(), gpu_ids("0", capabilities=frozenset(caps)))
    mounted32 = {m.container_path.rpartition("/")[2] for m in edits.mounts
                 if m.container_path.startswith(LIB32 + "/")}
    assert mounted32 == libs32
    env = env_of(edits)
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == given
    libs64 = any(m.container_path.startswith(LIB64 + "/") for m in edits.mounts)
    assert env.get("LD_LIBRARY_PATH", "") == ":".join(
        [LIB64] * libs64 + [LIB32] * bool(libs32))
    assert ("compat32 adds the 32-bit builds of the libraries the other capabilities "
            "requested select: none requested" in notes) is (caps == {"compat32"})


def test_compat32_on_a_node_without_32_bit_libraries():
    inv = demo_inventory()
    drv = inv.driver("nvidia")
    no32 = msgspec.structs.replace(drv, capabilities=MappingProxyType(
        {k: v for k, v in drv.capabilities.items() if not k.startswith("compat32")}))
    inv = Inventory(devices=inv.devices, drivers=MappingProxyType({"nvidia": no32}))
    edits, notes = edits_for(inv, gpu_ids("0", capabilities=frozenset({"compute", "compat32"})))
    assert env_of(edits)["NVIDIA_DRIVER_CAPABILITIES"] == "compute"
    assert notes == ("driver capabilities with no files on this node: compat32",)


def test_no_capability_at_all_gets_only_the_shared_driver_files():
    # NVIDIA_DRIVER_CAPABILITIES="," (or blanks): no library, binary or IPC path; the
    # control node and firmware every NVIDIA container gets; the variable left as it is.
    edits, notes = edits_for(demo_inventory(), gpu_ids("0", capabilities=frozenset()))
    assert [n.path for n in edits.device_nodes] == ["/dev/nvidia0", "/dev/nvidiactl"]
    assert {m.container_path for m in edits.mounts} == {
        "/lib/firmware/nvidia/550.54.15/gsp_ga10x.bin",
        "/lib/firmware/nvidia/550.54.15/gsp_tu10x.bin"}
    assert env_of(edits) == {"NVIDIA_VISIBLE_DEVICES": GPU_UUIDS["0"]}
    assert notes == ("no driver capabilities requested: only the driver's shared files",)


@pytest.mark.parametrize("caps", [{"graphics"}, {"video"}, {"utility"}, {"compute"}])
def test_gsp_firmware_comes_with_every_capability(caps):
    # As libnvidia-container mounts it: the kernel loads it where the GPU is first opened.
    edits, _ = edits_for(demo_inventory(), gpu_ids("0", capabilities=frozenset(caps)))
    assert {"/lib/firmware/nvidia/550.54.15/gsp_ga10x.bin",
            "/lib/firmware/nvidia/550.54.15/gsp_tu10x.bin"} <= {
        m.container_path for m in edits.mounts}


def test_nvidia_none_gets_the_driver_without_a_gpu():
    edits, _ = edits_for(demo_inventory(), request(nvidia_none=True))
    paths = [n.path for n in edits.device_nodes]
    assert "/dev/nvidiactl" in paths
    assert not any(p.startswith("/dev/nvidia") and p[-1].isdigit() for p in paths)
    assert env_of(edits)["NVIDIA_VISIBLE_DEVICES"] == "none"


def test_no_device_no_edits():
    edits, notes = edits_for(demo_inventory(), request())
    assert edits == ContainerEdits()
    assert notes == ()


def test_mig_config_and_monitor_caps():
    inv = demo_inventory()
    req = request(grants=(DeviceClaim(KIND_GPU, all=True, source=SRC),), mig_config=True,
                  mig_monitor=True)
    paths = {n.path for n in edits_for(inv, req)[0].device_nodes}
    assert {"/dev/nvidia-caps/nvidia-cap1", "/dev/nvidia-caps/nvidia-cap2"} <= paths
    assert "/dev/nvidia-caps/nvidia-cap1" not in {
        n.path for n in edits_for(inv, gpu_ids("0"))[0].device_nodes}


# ---- LD_LIBRARY_PATH and hooks -------------------------------------------------------------

@pytest.mark.parametrize(("own", "expected"), [
    (None, LIB64),
    ("/opt/app/lib", f"/opt/app/lib:{LIB64}"),
    (f"/usr/local/nvidia/lib:{LIB64}", None),  # CUDA images: already there, nothing to set
    (f"{LIB64}:/opt/x", None),
])
def test_ld_library_path_appends_the_driver_dir_once(own, expected):
    env = (f"LD_LIBRARY_PATH={own}",) if own is not None else ()
    edits, _ = edits_for(demo_inventory(), gpu_ids("0"), container_env=env)
    assert env_of(edits).get("LD_LIBRARY_PATH") == expected


def test_ld_preload_in_the_image_env_has_no_effect():
    env = ("LD_PRELOAD=/tmp/evil.so", "LD_AUDIT=/tmp/evil.so", "PATH=/evil")
    devices = DevicesConfig(hooks=True, hook_path="/usr/bin/nvidia-cdi-hook")
    edits, _ = edits_for(demo_inventory(), gpu_ids("0"), container_env=env, devices=devices)
    keys = set(env_of(edits))
    assert not keys & {"LD_PRELOAD", "LD_AUDIT", "PATH"}
    assert all(h.env == HOOK_ENV for h in edits.hooks)


def test_no_hook_by_default_and_one_minimal_hook_when_enabled():
    inv = demo_inventory()
    assert edits_for(inv, gpu_ids("0"))[0].hooks == ()
    devices = DevicesConfig(hooks=True, hook_path="/usr/bin/nvidia-cdi-hook")
    (hook,) = edits_for(inv, gpu_ids("0"), devices=devices)[0].hooks
    assert hook.hook_name == "createContainer"
    assert hook.path == "/usr/bin/nvidia-cdi-hook"
    assert hook.args == ("nvidia-cdi-hook", "update-ldcache", "--folder", LIB64)
    assert hook.env == HOOK_ENV and len(hook.env) == 1 and hook.env[0].startswith("PATH=")
    assert hook.timeout and hook.timeout > 0
    # hooks=true without a path, or no library mounted: no hook.
    assert edits_for(inv, gpu_ids("0"), devices=DevicesConfig(hooks=True))[0].hooks == ()


def test_cdi_spec_hooks_only_with_hooks_enabled():
    hook = Hook("createContainer", "/usr/bin/acme-hook", ("acme-hook", "setup"))
    inv = cdi_inventory(hooks=(hook,))
    req = gpu_ids("npu0", kind="acme.example/npu")
    edits, notes = edits_for(inv, req)
    assert edits.hooks == ()
    assert "hook(s) not emitted" in notes[0]
    edits, notes = edits_for(inv, req, devices=DevicesConfig(hooks=True))
    assert edits.hooks == (Hook("createContainer", "/usr/bin/acme-hook", ("acme-hook", "setup"),
                                HOOK_ENV, 10),)


def test_cdi_spec_hooks_run_before_its_devices_hooks():
    # pkg/cdi (cache.go InjectDevices) appends a spec's own edits before those of its
    # devices, and the runtime runs their hooks in that order
    inv = cdi_inventory(hooks=(
        Hook("createContainer", "/usr/bin/acme-hook", ("acme-hook", "spec")),))
    npu0 = inv.devices[0]
    npu0 = msgspec.structs.replace(npu0, edits=msgspec.structs.replace(npu0.edits, hooks=(
        Hook("createContainer", "/usr/bin/acme-hook", ("acme-hook", "npu0")),)))
    inv = Inventory(devices=(npu0, *inv.devices[1:]), drivers=inv.drivers)
    edits, _ = edits_for(inv, gpu_ids("npu0", kind="acme.example/npu"),
                         devices=DevicesConfig(hooks=True))
    assert [h.args for h in edits.hooks] == [("acme-hook", "spec"), ("acme-hook", "npu0")]


# ---- other vendors ------------------------------------------------------------------------

def test_cdi_device_gets_its_nodes_env_and_the_spec_edits():
    edits, _ = edits_for(cdi_inventory(), gpu_ids("npu1", kind="acme.example/npu"))
    assert [n.path for n in edits.device_nodes] == ["/dev/acme1"]
    assert env_of(edits) == {"ACME_RUNTIME": "1", "ACME_VISIBLE": "1"}
    assert [m.container_path for m in edits.mounts] == ["/opt/acme/lib/libacme.so.1"]
    assert "NVIDIA_VISIBLE_DEVICES" not in env_of(edits)


def test_neuron_env_names_devices_and_their_cores():
    edits, _ = edits_for(neuron_inventory(), gpu_ids("1", "2", kind=KIND_NEURON))
    assert [n.path for n in edits.device_nodes] == ["/dev/neuron1", "/dev/neuron2"]
    assert env_of(edits) == {"AWS_NEURON_VISIBLE_DEVICES": "1,2",
                             "NEURON_RT_VISIBLE_CORES": "2-5"}
    edits, _ = edits_for(neuron_inventory(), gpu_ids("0", "3", kind=KIND_NEURON))
    assert env_of(edits)["NEURON_RT_VISIBLE_CORES"] == "0-1,6-7"


def test_neuron_cores_set_by_the_device_plugin_are_kept():
    env = ("NEURON_RT_VISIBLE_CORES=3",)
    edits, _ = edits_for(neuron_inventory(), gpu_ids("1", kind=KIND_NEURON), container_env=env)
    assert env_of(edits) == {"AWS_NEURON_VISIBLE_DEVICES": "1"}


# ---- what the container already has ---------------------------------------------------------

NVIDIA0_AND_CTL = MappingProxyType({"/dev/nvidia0": ("c", 195, 0),
                                     "/dev/nvidiactl": ("c", 195, 255)})


def test_nodes_and_mounts_already_in_the_spec_are_not_emitted_again():
    edits, _ = edits_for(demo_inventory(), gpu_ids("0"), spec_devices=NVIDIA0_AND_CTL,
                         mount_destinations=frozenset({"/usr/bin/nvidia-smi"}))
    paths = [n.path for n in edits.device_nodes]
    assert "/dev/nvidia0" not in paths and "/dev/nvidiactl" not in paths
    assert "/dev/nvidia-uvm" in paths
    assert "/usr/bin/nvidia-smi" not in {m.container_path for m in edits.mounts}


@pytest.mark.parametrize("there", [("c", 195, 5), ("b", 195, 0), ("c", 10, 0)])
def test_another_device_at_a_granted_nodes_path_is_refused(there):
    # a CRI device mapping the host's /dev/nvidia5 (195:5) to /dev/nvidia0 would stand in
    # for GPU 0, whose grant, env and UUID would say otherwise
    with pytest.raises(RequestError) as e:
        edits_for(demo_inventory(), gpu_ids("0"),
                  spec_devices=MappingProxyType({"/dev/nvidia0": there}))
    assert e.value.source == "device /dev/nvidia0"
    assert (f"already has /dev/nvidia0 as {there[0]} {there[1]}:{there[2]}, not the granted "
            "device's c 195:0") in e.value.message


def test_containers_through_one_catalog_each_get_their_own_edits():
    # The edits of a grant are remembered per catalog, and per container env: what one
    # container has or sets never leaks into the next one's.
    inv = demo_inventory()
    catalog, req = compile_catalog(inv, DevicesConfig()), gpu_ids("0")
    sel = select(req, DeviceIndex(inv))

    def edits(**kw) -> ContainerEdits:
        return build(sel, req, catalog, **kw).edits

    plain = edits()
    own = edits(spec_devices=MappingProxyType({"/dev/nvidia0": ("c", 195, 0)}),
                mount_destinations=frozenset({"/usr/bin/nvidia-smi"}))
    assert "/dev/nvidia0" not in {n.path for n in own.device_nodes}
    assert "/usr/bin/nvidia-smi" not in {m.container_path for m in own.mounts}
    assert edits() == plain and "/dev/nvidia0" in {n.path for n in plain.device_nodes}
    more = range(EDITS_MEMO_SIZE + 2)  # than are remembered
    libs = [edits(container_env=(f"LD_LIBRARY_PATH=/opt/lib{i}",)) for i in more]
    assert [env_of(e)["LD_LIBRARY_PATH"] for e in libs] == [f"/opt/lib{i}:{LIB64}" for i in more]
    assert all(e.device_nodes == plain.device_nodes for e in libs)
    assert edits() == plain


def test_edits_remembered_per_env_are_by_its_values_of_the_variables_they_set():
    # One object for a workload's containers, whatever else their env holds; a value of
    # their own, or a variable defined twice, is never answered from what is remembered.
    inv = demo_inventory()
    catalog, req = compile_catalog(inv, DevicesConfig()), gpu_ids("0")
    sel = select(req, DeviceIndex(inv))

    def edits(*env: str) -> ContainerEdits:
        return build(sel, req, catalog, container_env=env).edits

    first = edits("PATH=/bin", "LD_LIBRARY_PATH=/opt/a")
    assert edits("HOME=/root", "LD_LIBRARY_PATH=/opt/a", "TERM=xterm") is first
    assert env_of(edits("LD_LIBRARY_PATH=/opt/b"))["LD_LIBRARY_PATH"] == f"/opt/b:{LIB64}"
    assert env_of(first)["LD_LIBRARY_PATH"] == f"/opt/a:{LIB64}"
    with pytest.raises(RequestError) as e:
        edits("LD_LIBRARY_PATH=/opt/a", "PATH=/bin", "LD_LIBRARY_PATH=/opt/a")
    assert e.value.source == "env LD_LIBRARY_PATH"
    assert "defined more than once" in e.value.message
    # the visibility variable the edits rewrite: an image's own value is replaced
    assert env_of(edits("NVIDIA_VISIBLE_DEVICES=all"))["NVIDIA_VISIBLE_DEVICES"] == \
        env_of(first)["NVIDIA_VISIBLE_DEVICES"]


def test_output_is_deterministic_and_deduplicated():
    inv = demo_inventory()
    req = request(grants=(DeviceClaim(KIND_GPU, ids=("3", "1"), source=SRC),
                          DeviceClaim(KIND_GPU, ids=("1",), source="other")))
    first = edits_for(inv, req)
    assert all(edits_for(inv, req) == first for _ in range(3))
    edits = first[0]
    assert len({n.path for n in edits.device_nodes}) == len(edits.device_nodes)
    assert len({m.container_path for m in edits.mounts}) == len(edits.mounts)
    assert list(edits.env) == sorted(edits.env)


# ---- safety of inventory edits --------------------------------------------------------------

def _bad_gpu_inventory(edits: ContainerEdits) -> Inventory:
    """The demo inventory plus a GPU "8" whose edits are hand-crafted."""
    inv = demo_inventory()
    evil = Device(kind=KIND_GPU, name="8", uuid="GPU-evil", edits=edits, vendor="nvidia",
                  attributes=MappingProxyType({}))
    return Inventory(devices=(*inv.devices, evil), drivers=inv.drivers)


NODE = DeviceNode("/dev/nvidia8", 195, 8)


@pytest.mark.parametrize(("edits", "why"), [
    (ContainerEdits(mounts=(Mount("/etc/passwd", "/proc/sys/kernel/core_pattern"),)),
     "under /proc or /sys"),
    (ContainerEdits(mounts=(Mount("/x", "/sys/fs/cgroup"),)), "under /proc or /sys"),
    (ContainerEdits(mounts=(Mount("/x", "/proc"),)), "under /proc or /sys"),
    (ContainerEdits(mounts=(Mount("/proc/1/root", "/host"),)), "source '/proc/1/root'"),
    (ContainerEdits(mounts=(Mount("/usr/lib/../../etc/shadow", "/x"),)), "contains '..'"),
    (ContainerEdits(mounts=(Mount("/x", "/usr/lib/../../../etc"),)), "contains '..'"),
    (ContainerEdits(mounts=(Mount("relative/lib.so", "/x"),)), "not an absolute path"),
    (ContainerEdits(mounts=(Mount("/x//y", "/x"),)), "not a normalised path"),
    (ContainerEdits(mounts=(Mount("/run/containerd/containerd.sock", "/x.sock"),)),
     "is under /run/containerd: containerd state"),
    (ContainerEdits(mounts=(Mount("/x", "/var/run/docker.sock"),)),
     "is a container runtime socket or its directory"),
    (ContainerEdits(mounts=(Mount("/x", "/x", type="tmpfs"),)),  # default options: bind
     "has type 'tmpfs' and option 'bind'"),
    (ContainerEdits(mounts=(Mount("/dev/sda1", "/x", type="ext4", options=("ro",)),)),
     "only bind mounts and tmpfs"),
    (ContainerEdits(device_nodes=(DeviceNode("/dev/../etc/x", 1, 1),)), "contains '..'"),
    (ContainerEdits(device_nodes=(DeviceNode("/etc/nvidia8", 195, 8),)), "not under /dev"),
    (ContainerEdits(device_nodes=(DeviceNode("/dev/x", 195, 8, host_path="/root/x"),)),
     "not under /dev"),
    (ContainerEdits(device_nodes=(DeviceNode("/dev/x", -1, -1),)), "wildcard"),
    (ContainerEdits(device_nodes=(DeviceNode("/dev/x", 1, 1, permissions="rwmx"),)),
     "cgroup access"),
    (ContainerEdits(device_nodes=(DeviceNode("/dev/x", 1, 1, type="p"),)), "type 'p'"),
    (ContainerEdits(device_nodes=(NODE,), env=("LD_PRELOAD=/x.so",)), "LD_PRELOAD"),
    (ContainerEdits(device_nodes=(NODE,), env=("NOEQUALS",)), "KEY=VALUE"),
    # NRI reads "-PATH" as "remove PATH" (containerd/nri pkg/api IsMarkedForRemoval)
    (ContainerEdits(device_nodes=(NODE,), env=("-PATH=/opt/bin",)), "would remove 'PATH'"),
])
def test_unsafe_inventory_edits_are_refused_for_the_container_that_needs_them(edits, why):
    inv = _bad_gpu_inventory(edits)
    with pytest.raises(AllocationError) as e:
        edits_for(inv, gpu_ids("8"))
    assert e.value.source == "nvidia.com/gpu=8"
    assert why in e.value.message
    # Other containers are unaffected.
    assert env_of(edits_for(inv, gpu_ids("0"))[0])["NVIDIA_VISIBLE_DEVICES"] == GPU_UUIDS["0"]


def test_unsafe_driver_capability_is_refused_with_its_name():
    inv = demo_inventory()
    nvidia = inv.driver("nvidia")
    caps = dict(nvidia.capabilities)
    caps["video"] = ContainerEdits(mounts=(Mount("/x", "/proc/x"),))
    bad = Inventory(devices=inv.devices, drivers=MappingProxyType(
        {"nvidia": msgspec.structs.replace(nvidia, capabilities=MappingProxyType(caps))}))
    assert edits_for(bad, gpu_ids("0"))  # video not asked: fine
    with pytest.raises(AllocationError) as e:
        edits_for(bad, gpu_ids("0", capabilities=frozenset({"video"})))
    assert e.value.source == "driver nvidia capability video"


def test_mount_options_always_include_ro_nosuid_nodev():
    checked = check_edits(ContainerEdits(mounts=(
        Mount("/a", "/a", options=("rw", "suid", "dev", "noexec")),
        Mount("/b", "/b", type="", options=()),
        Mount("/c", "/c", options=("rbind",)),
    )))
    assert [m.options for m in checked.mounts] == [
        ("noexec", "ro", "nosuid", "nodev", "bind"),
        ("ro", "nosuid", "nodev", "bind"),
        ("bind", "ro", "nosuid", "nodev"),  # not recursive: see the next test
    ]
    assert all(m.type == "bind" for m in checked.mounts)


def test_a_recursive_bind_mount_becomes_a_plain_one() -> None:
    # runc remounts only the top mount of a recursive bind read-only (and nosuid, nodev):
    # the mounts under its source would stay writable in the container
    checked = check_edits(ContainerEdits(mounts=(
        Mount("/opt/driver", "/opt/driver", type="none", options=("rbind", "rprivate")),)))
    (mount,) = checked.mounts
    assert "rbind" not in mount.options and "bind" in mount.options
    assert {"ro", "nosuid", "nodev"} <= set(mount.options)


def test_every_demo_mount_is_read_only_nosuid_nodev():
    edits, _ = edits_for(demo_inventory(), gpu_ids("0", capabilities=ALL_CAPABILITIES))
    assert edits.mounts
    for m in edits.mounts:
        assert {"ro", "nosuid", "nodev"} <= set(m.options)
        assert "rw" not in m.options


def test_gpu_on_a_node_without_nvidia_driver_files_gets_its_node_and_a_note():
    inv = demo_inventory()
    bare = Inventory(devices=inv.devices, drivers=MappingProxyType(
        {"neuron": Driver("neuron")}))
    edits, notes = edits_for(bare, gpu_ids("0"))
    assert [n.path for n in edits.device_nodes] == ["/dev/nvidia0"]
    assert "LD_LIBRARY_PATH" not in env_of(edits)
    assert notes == ("no NVIDIA driver files on this node: only device nodes and env",)

