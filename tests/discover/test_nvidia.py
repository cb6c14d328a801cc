"""discover_nvidia against the fake roots, through the real pynvml and the fake
libnvidia-ml (tests/fakes/nvml), for the healthy nodes and every error path."""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from pathlib import Path

import pytest
from fakes.roots import ROOTS_DIR

from nri_accel.config import Config, PolicyConfig
from nri_accel.container import ContainerInfo
from nri_accel.discover import assemble
from nri_accel.discover.base import Found
from nri_accel.discover.hostroot import HostRoot
from nri_accel.engine import Engine
from nri_accel.inventory import Device, Driver, Inventory
from nri_accel.vendors.nvidia import KIND_GPU, KIND_MIG
from nri_accel.vendors.nvidia.discover import discover_nvidia, normalise_pci_bus_id

FakeRoot = Callable[[str], HostRoot]
LIB = "/usr/local/nvidia/lib64"
X86 = "/usr/lib/x86_64-linux-gnu"


def by_name(found: Found, kind: str) -> dict[str, Device]:
    return {d.name: d for d in found.devices if d.kind == kind}


def driver(found: Found) -> Driver:
    (drv,) = found.drivers
    return drv


def mounts(drv: Driver, cap: str) -> dict[str, str]:
    """container path -> host path of one capability's mounts."""
    return {m.container_path: m.host_path for m in drv.capabilities[cap].mounts}


def nodes(edits_owner: Device | Driver, cap: str = "") -> list[tuple[str, int, int]]:
    edits = edits_owner.edits if isinstance(edits_owner, Device) \
        else edits_owner.capabilities[cap]
    return [(n.path, n.major, n.minor) for n in edits.device_nodes]


def messages(found: Found) -> list[str]:
    return [f"{p.source}: {p.message}" for p in found.problems]


def override_nvml(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, root: str,
                  edit: Callable[[str], str]) -> None:
    """Point the fake NVML at an edited copy of `root`'s node description."""
    conf = tmp_path / "nvml-override.conf"
    conf.write_text(edit((ROOTS_DIR / root / "nvml.conf").read_text()))
    monkeypatch.setenv("FAKE_NVML_CONFIG", str(conf))


# ---- a100-mig: 8 GPUs, MIG on two, NVSwitch, merged /usr --------------------------------


@pytest.fixture
def a100(fake_root: FakeRoot) -> Found:
    return discover_nvidia(fake_root("a100-mig"))


def test_a100_gpus(a100: Found) -> None:
    gpus = by_name(a100, KIND_GPU)
    assert list(gpus) == [str(i) for i in range(8)]
    assert a100.problems == ()
    g0 = gpus["0"]
    assert g0.uuid.startswith("GPU-") and g0.vendor == "nvidia"
    assert g0.pci_bus_id == "0000:07:00.0" and g0.aliases == ("0000:07:00.0",)
    assert dict(g0.attributes) == {
        "arch": "ampere", "brand": "nvidia", "compute_capability": "8.0",
        "memory_mib": "81920", "mig_mode": "enabled", "name": "NVIDIA A100-SXM4-80GB",
    }
    assert gpus["2"].attributes["mig_mode"] == "disabled"
    assert [gpus[str(i)].numa_node for i in range(8)] == [0, 0, 0, 0, 1, 1, 1, 1]
    # every GPU reaches every other one through the NVSwitches
    assert gpus["5"].links == ("0", "1", "2", "3", "4", "6", "7")


def test_a100_device_nodes_follow_minor_not_index(a100: Found) -> None:
    gpus = by_name(a100, KIND_GPU)
    assert nodes(gpus["2"]) == [("/dev/nvidia3", 195, 3)]
    assert nodes(gpus["3"]) == [("/dev/nvidia2", 195, 2)]
    node = gpus["0"].edits.device_nodes[0]
    assert node.type == "c" and node.host_path == "" and node.file_mode == 0o666


def test_a100_mig_devices(a100: Found) -> None:
    migs = by_name(a100, KIND_MIG)
    assert list(migs) == ["0:0", "0:1", "0:2", "0:3", "1:0", "1:1", "1:2"]
    gpu0 = by_name(a100, KIND_GPU)["0"]
    m = migs["0:0"]
    assert m.uuid.startswith("MIG-") and m.parent == "0"
    assert m.aliases == (f"MIG-{gpu0.uuid}/2/0",)
    assert m.numa_node == 0 and m.pci_bus_id == "0000:07:00.0"
    assert m.attributes["mig_profile"] == "3g.40gb"
    assert (m.attributes["gi_id"], m.attributes["ci_id"]) == ("2", "0")
    assert m.attributes["memory_mib"] == "40192"
    assert m.attributes["compute_capability"] == "8.0"
    # parent node + the GI and CI access capabilities (3 + 135*minor + 9*gi [+ 1 + ci])
    assert nodes(m) == [("/dev/nvidia0", 195, 0), ("/dev/nvidia-caps/nvidia-cap21", 236, 21),
                        ("/dev/nvidia-caps/nvidia-cap22", 236, 22)]
    # two compute instances of one GPU instance share the GI capability
    assert migs["1:0"].attributes["mig_profile"] == "2c.4g.40gb"
    assert nodes(migs["1:1"])[1:] == [("/dev/nvidia-caps/nvidia-cap147", 236, 147),
                                      ("/dev/nvidia-caps/nvidia-cap149", 236, 149)]
    assert {migs[n].attributes["mig_profile"] for n in ("0:2", "0:3")} == {"1g.10gb"}


def test_a100_driver_files(a100: Found) -> None:
    drv = driver(a100)
    assert (drv.vendor, drv.version, drv.cuda_version) == ("nvidia", "550.54.15", "12.4")
    assert nodes(drv, "") == [("/dev/nvidiactl", 195, 255)]
    compute = mounts(drv, "compute")
    # found through ld.so.cache's /lib/x86_64-linux-gnu (a symlink to usr/lib), mounted at
    # the soname: from the symlink beside a placeholder, from DT_SONAME for the real ELF
    assert compute[f"{LIB}/libcuda.so.1"] == f"{X86}/libcuda.so.550.54.15"
    assert compute[f"{LIB}/libnvidia-gpucomp.so.550.54.15"] == \
        f"{X86}/libnvidia-gpucomp.so.550.54.15"
    assert mounts(drv, "utility")[f"{LIB}/libnvidia-ml.so.1"] == \
        f"{X86}/libnvidia-ml.so.550.54.15"
    assert compute["/usr/bin/nvidia-cuda-mps-server"] == "/usr/bin/nvidia-cuda-mps-server"
    assert compute["/tmp/nvidia-mps"] == "/tmp/nvidia-mps"
    assert nodes(drv, "compute") == [("/dev/nvidia-uvm", 508, 0),
                                     ("/dev/nvidia-uvm-tools", 508, 1)]
    every_host_path = {m.host_path for e in drv.capabilities.values() for m in e.mounts}
    assert not any("535.104.05" in p or "libGL.so.1.7.0" in p for p in every_host_path)


def test_a100_utility_firmware_and_ipc(a100: Found) -> None:
    # GSP firmware comes with every capability (libnvidia-container mounts it whatever
    # the capabilities): the kernel loads it where the GPU is first opened.
    fw = "/lib/firmware/nvidia/550.54.15"
    assert mounts(driver(a100), "") == {
        f"{fw}/gsp_ga10x.bin": "/usr/lib/firmware/nvidia/550.54.15/gsp_ga10x.bin",
        f"{fw}/gsp_tu10x.bin": "/usr/lib/firmware/nvidia/550.54.15/gsp_tu10x.bin",
    }
    utility = mounts(driver(a100), "utility")
    assert not any(k.startswith(fw) for k in utility)
    assert utility["/run/nvidia-persistenced/socket"] == "/run/nvidia-persistenced/socket"
    assert utility["/run/nvidia-fabricmanager/socket"] == "/run/nvidia-fabricmanager/socket"
    assert utility["/usr/bin/nvidia-smi"] == "/usr/bin/nvidia-smi"
    assert f"{LIB}/libcuda.so.1" not in utility


def test_a100_other_capabilities(a100: Found) -> None:
    drv = driver(a100)
    assert nodes(drv, "display") == [("/dev/nvidia-modeset", 195, 254)]
    assert nodes(drv, "graphics") == []
    assert f"{LIB}/libGLX_nvidia.so.0" in mounts(drv, "graphics")
    video = mounts(drv, "video")
    assert f"{LIB}/libnvcuvid.so.1" in video and f"{LIB}/libcuda.so.1" in video
    assert "/usr/bin/nvidia-cuda-mps-control" not in video
    assert mounts(drv, "ngx") == {f"{LIB}/libnvidia-ngx.so.1":
                                  f"{X86}/libnvidia-ngx.so.550.54.15"}
    # 32-bit builds per capability: compat32 adds those of the others requested
    assert "compat32" not in drv.capabilities
    compute32 = mounts(drv, "compat32/compute")
    assert compute32["/usr/local/nvidia/lib/libcuda.so.1"] == \
        "/usr/lib/i386-linux-gnu/libcuda.so.550.54.15"
    video32, graphics32 = mounts(drv, "compat32/video"), mounts(drv, "compat32/graphics")
    assert compute32.items() <= video32.items()  # video selects the compute libraries too
    assert "/usr/local/nvidia/lib/libnvcuvid.so.1" in video32
    assert "/usr/local/nvidia/lib/libGLX_nvidia.so.0" in graphics32
    assert not compute32.keys() & graphics32.keys()
    assert mounts(drv, "compat32/display") == graphics32
    # the fake NVML replaced the 32-bit libnvidia-ml too, and is 64-bit: no 32-bit utility
    assert "compat32/utility" not in drv.capabilities
    assert all(k.startswith("/usr/local/nvidia/lib/") for cap in drv.capabilities
               if cap.startswith("compat32/") for k in mounts(drv, cap))
    assert nodes(drv, "mig-config") == [("/dev/nvidia-caps/nvidia-cap1", 236, 1)]
    assert nodes(drv, "mig-monitor") == [("/dev/nvidia-caps/nvidia-cap2", 236, 2)]


def test_graphics_brings_the_files_that_make_egl_and_vulkan_find_the_driver(a100: Found,
                                                                          ) -> None:
    # Ubuntu's packages put them under /usr/share: glvnd's and EGL's files are mounted
    # where they are, Vulkan's under /etc; the Wayland platform is not installed
    graphics = mounts(driver(a100), "graphics")
    share = "/usr/share"
    assert {k: v for k, v in graphics.items() if not k.startswith(LIB)} == {
        f"{share}/glvnd/egl_vendor.d/10_nvidia.json":
            f"{share}/glvnd/egl_vendor.d/10_nvidia.json",
        f"{share}/egl/egl_external_platform.d/15_nvidia_gbm.json":
            f"{share}/egl/egl_external_platform.d/15_nvidia_gbm.json",
        f"{share}/nvidia/nvoptix.bin": f"{share}/nvidia/nvoptix.bin",
        "/etc/vulkan/icd.d/nvidia_icd.json": f"{share}/vulkan/icd.d/nvidia_icd.json",
        "/etc/vulkan/implicit_layer.d/nvidia_layers.json":
            f"{share}/vulkan/implicit_layer.d/nvidia_layers.json",
        f"{share}/X11/xorg.conf.d/10-nvidia.conf": f"{share}/X11/xorg.conf.d/10-nvidia.conf",
        # X.Org's modules beside the driver's libraries, GLX also by the name X.Org loads
        f"{X86}/nvidia/xorg/nvidia_drv.so": f"{X86}/nvidia/xorg/nvidia_drv.so",
        f"{X86}/nvidia/xorg/libglxserver_nvidia.so.550.54.15":
            f"{X86}/nvidia/xorg/libglxserver_nvidia.so.550.54.15",
        f"{X86}/nvidia/xorg/libglxserver_nvidia.so":
            f"{X86}/nvidia/xorg/libglxserver_nvidia.so.550.54.15",
    }
    # the GBM platform's own library, versioned apart from the driver, by its soname
    assert graphics[f"{LIB}/libnvidia-egl-gbm.so.1"] == f"{X86}/libnvidia-egl-gbm.so.1.1.1"
    assert mounts(driver(a100), "display") == graphics
    assert not any("vulkan" in k or "glvnd" in k for k in mounts(driver(a100), "compute"))


@pytest.mark.parametrize(("lib", "marker"), [
    ("libnvidia-present", "present"),  # the Vulkan layer its layer file names
    ("libnvidia-vksc-core", "vksc"),  # R535 on: the Vulkan SC ICD's library
])
def test_graphics_brings_the_vulkan_libraries_of_recent_drivers(
        fake_root: FakeRoot, lib: str, marker: str) -> None:
    # versioned with the driver, and for graphics only
    root = fake_root("h100")
    dr, v = "/run/nvidia/driver", "570.124.06"
    Path(root.local(f"{dr}{X86}/{lib}.so.{v}")).write_bytes(b"")
    drv = driver(discover_nvidia(root))
    assert mounts(drv, "graphics")[f"{LIB}/{lib}.so.{v}"] == f"{dr}{X86}/{lib}.so.{v}"
    assert not [k for cap in ("compute", "utility", "video")
                for k in mounts(drv, cap) if marker in k]


def test_graphics_brings_gbms_nvidia_backend(fake_root: FakeRoot) -> None:
    # libgbm loads <its dir>/gbm/nvidia-drm_gbm.so, the driver's link to
    # libnvidia-allocator: graphics alone brings both, the backend where it is
    root = fake_root("a100-mig")
    gbm = Path(root.local(f"{X86}/gbm"))
    gbm.mkdir()
    (gbm / "nvidia-drm_gbm.so").symlink_to("../libnvidia-allocator.so.1")
    drv = driver(discover_nvidia(root))
    graphics = mounts(drv, "graphics")
    assert graphics[f"{X86}/gbm/nvidia-drm_gbm.so"] == \
        f"{X86}/libnvidia-allocator.so.550.54.15"
    assert graphics[f"{LIB}/libnvidia-allocator.so.1"] == \
        f"{X86}/libnvidia-allocator.so.550.54.15"
    assert mounts(drv, "display") == graphics
    assert not [k for k in mounts(drv, "compute") if "gbm/" in k]


def test_a_gbm_backend_of_another_driver_is_not_mounted(fake_root: FakeRoot) -> None:
    # a link left by another driver version, or to anything but the allocator
    root = fake_root("a100-mig")
    gbm = Path(root.local(f"{X86}/gbm"))
    gbm.mkdir()
    Path(root.local(f"{X86}/libnvidia-allocator.so.535.104.05")).write_bytes(b"")
    (gbm / "nvidia-drm_gbm.so").symlink_to("../libnvidia-allocator.so.535.104.05")
    assert not [k for k in mounts(driver(discover_nvidia(root)), "graphics") if "gbm/" in k]


def test_vulkan_files_are_found_in_the_driver_root_itself_as_gke_installs_them(
        fake_root: FakeRoot) -> None:
    # GKE's installer: <driver root>/vulkan/icd.d/nvidia_icd.json, no /etc nor
    # /usr/share of its own; mounted under /etc all the same. Only Vulkan's files are
    # looked for there (the toolkit's other graphics files are not).
    root = fake_root("h100")
    dr = "/run/nvidia/driver"
    for name in ("vulkan/icd.d/nvidia_icd.json", "vulkan/implicit_layer.d/nvidia_layers.json",
                 "glvnd/egl_vendor.d/10_nvidia.json"):
        f = Path(root.local(f"{dr}/{name}"))
        f.parent.mkdir(parents=True)
        f.write_text("{}")
    graphics = mounts(driver(discover_nvidia(root)), "graphics")
    assert graphics["/etc/vulkan/icd.d/nvidia_icd.json"] == f"{dr}/vulkan/icd.d/nvidia_icd.json"
    assert graphics["/etc/vulkan/implicit_layer.d/nvidia_layers.json"] == \
        f"{dr}/vulkan/implicit_layer.d/nvidia_layers.json"
    assert not [k for k in graphics if "glvnd" in k]


def test_the_driver_root_is_looked_at_for_vulkan_files_after_etc_and_usr_share(
        fake_root: FakeRoot) -> None:
    root = fake_root("a100-mig")  # its ICD file is in /usr/share
    Path(root.local("/vulkan/icd.d")).mkdir(parents=True)
    Path(root.local("/vulkan/icd.d/nvidia_icd.json")).write_text("{}")
    assert mounts(driver(discover_nvidia(root)), "graphics")[
        "/etc/vulkan/icd.d/nvidia_icd.json"] == "/usr/share/vulkan/icd.d/nvidia_icd.json"


def test_graphics_files_are_looked_for_in_usr_local_share_before_usr_share(
        fake_root: FakeRoot) -> None:
    # the toolkit's config directories: /etc, then XDG_DATA_DIRS' default
    # /usr/local/share:/usr/share
    root = fake_root("a100-mig")
    local = "/usr/local/share"
    for name in ("glvnd/egl_vendor.d/10_nvidia.json", "vulkan/icd.d/nvidia_layers.json"):
        f = Path(root.local(f"{local}/{name}"))
        f.parent.mkdir(parents=True)
        f.write_text("{}")
    graphics = mounts(driver(discover_nvidia(root)), "graphics")
    assert graphics[f"{local}/glvnd/egl_vendor.d/10_nvidia.json"] == \
        f"{local}/glvnd/egl_vendor.d/10_nvidia.json"
    assert "/usr/share/glvnd/egl_vendor.d/10_nvidia.json" not in graphics
    assert graphics["/etc/vulkan/icd.d/nvidia_layers.json"] == \
        f"{local}/vulkan/icd.d/nvidia_layers.json"


def test_a_graphics_file_is_taken_from_etc_first_and_only_as_a_regular_file(
        fake_root: FakeRoot) -> None:
    # the toolkit's order (the driver's /etc, then /usr/share); a directory in its
    # place is not a file, and the next place is looked at
    root = fake_root("a100-mig")
    vendor = Path(root.local("/etc/glvnd/egl_vendor.d/10_nvidia.json"))
    vendor.parent.mkdir(parents=True)
    vendor.write_text('{"file_format_version": "1.0.0"}')
    Path(root.local("/etc/vulkan/icd.d/nvidia_icd.json")).mkdir(parents=True)
    arch_icd = Path(root.local("/etc/vulkan/icd.d/nvidia_icd.x86_64.json"))
    arch_icd.write_text("{}")  # as an RPM driver names it
    graphics = mounts(driver(discover_nvidia(root)), "graphics")
    assert graphics["/etc/glvnd/egl_vendor.d/10_nvidia.json"] == \
        "/etc/glvnd/egl_vendor.d/10_nvidia.json"
    assert "/usr/share/glvnd/egl_vendor.d/10_nvidia.json" not in graphics
    assert graphics["/etc/vulkan/icd.d/nvidia_icd.json"] == \
        "/usr/share/vulkan/icd.d/nvidia_icd.json"
    assert graphics["/etc/vulkan/icd.d/nvidia_icd.x86_64.json"] == \
        "/etc/vulkan/icd.d/nvidia_icd.x86_64.json"


def test_each_gpu_has_its_drm_nodes_by_its_pci_bus_id(a100: Found) -> None:
    # nvidia-drm's nodes as its sysfs drm directory names them; the BMC's card0 is no
    # GPU's and goes to nobody
    drv = driver(a100)
    drm = {cap: nodes(drv, cap) for cap in drv.capabilities if cap.startswith("drm/")}
    buses = ["07", "0f", "47", "4e", "87", "90", "b7", "bd"]
    assert drm == {f"drm/0000:{b}:00.0": [(f"/dev/dri/card{i + 1}", 226, i + 1),
                                           (f"/dev/dri/renderD{128 + i}", 226, 128 + i)]
                   for i, b in enumerate(buses)}
    assert [g.pci_bus_id for g in by_name(a100, KIND_GPU).values()] == [
        f"0000:{b}:00.0" for b in buses]


def test_a_drm_node_that_is_not_the_one_sysfs_names_is_left_out(fake_root: FakeRoot) -> None:
    # a stale node (renderD128 made again as another minor) is not GPU 0's render node
    root = fake_root("a100-mig")
    stale = root.local("/dev/dri/renderD128")
    os.unlink(stale)
    os.mknod(stale, stat.S_IFCHR | 0o666, os.makedev(226, 5))
    found = discover_nvidia(root)
    assert nodes(driver(found), "drm/0000:07:00.0") == [("/dev/dri/card1", 226, 1)]
    assert "/dev/dri/renderD128: is device 226:5, expected 226:128: GPU 0's DRM node " \
        "(graphics, display) is left out" in messages(found)


@pytest.mark.parametrize(("capabilities", "expected"), [
    # GPU 3 (/dev/nvidia2) at 0000:4e:00.0: its nodes by its bus id, not index or minor
    ("graphics", ["/dev/dri/card4", "/dev/dri/renderD131"]),
    ("display,compute", ["/dev/dri/card4", "/dev/dri/renderD131"]),
    ("compute,utility", []),
])
def test_graphics_and_display_give_the_granted_gpus_drm_nodes(
        a100: Found, capabilities: str, expected: list[str]) -> None:
    inventory = assemble([("nvidia", True, a100)])
    engine = Engine(inventory, Config(policy=PolicyConfig(mode="standalone")))
    plan = engine.plan(ContainerInfo(
        namespace="ns", pod_name="p", pod_uid="u", container_name="c", container_id="c1",
        pod_annotations={}, container_annotations={},
        env=("NVIDIA_VISIBLE_DEVICES=3", f"NVIDIA_DRIVER_CAPABILITIES={capabilities}")))
    assert [d.name for d in plan.devices] == ["3"]
    assert [n.path for n in plan.edits.device_nodes if n.path.startswith("/dev/dri/")] \
        == expected


def test_mounts_are_read_only_sorted_and_exist_inside_the_root(fake_root: FakeRoot) -> None:
    root = fake_root("a100-mig")
    drv = driver(discover_nvidia(root))
    for cap, edits in drv.capabilities.items():
        paths = [m.container_path for m in edits.mounts]
        assert paths == sorted(set(paths)), cap
        for m in edits.mounts:
            assert {"ro", "nosuid", "nodev", "bind"} <= set(m.options)
            st = os.lstat(root.local(m.host_path))  # resolved: no symlink left
            assert not stat.S_ISLNK(st.st_mode), m.host_path


def test_inventory_round_trip(a100: Found) -> None:
    inv = Inventory(devices=a100.devices, drivers={d.vendor: d for d in a100.drivers},
                    problems=a100.problems)
    assert Inventory.from_json(inv.to_json()) == inv


def test_repeated_discovery_of_different_roots_is_deterministic(fake_root: FakeRoot) -> None:
    a100_root, h100_root = fake_root("a100-mig"), fake_root("h100")
    first = discover_nvidia(a100_root)
    h100 = discover_nvidia(h100_root)
    assert driver(h100).version == "570.124.06"
    assert discover_nvidia(a100_root) == first


# ---- h100: driver container root, NVLink mesh, MIG disabled ----------------------------


def test_a_driver_root_that_is_a_link_is_followed_inside_the_root(fake_root: FakeRoot,
                                                                  tmp_path: Path) -> None:
    # The driver container's root reached through a link: the host resolves the mount
    # sources, so they are its target's paths; a target outside the root is not read.
    root = fake_root("h100")
    local = Path(root.local("/run/nvidia/driver"))
    Path(root.local("/opt")).mkdir(exist_ok=True)
    local.rename(Path(root.local("/opt")) / "nvidia-driver")
    local.symlink_to("/opt/nvidia-driver")
    drv = driver(discover_nvidia(root))
    assert mounts(drv, "compute")[f"{LIB}/libcuda.so.1"] == \
        f"/opt/nvidia-driver{X86}/libcuda.so.570.124.06"
    local.unlink()
    (Path(root.local("/opt")) / "nvidia-driver").rename(tmp_path / "outside")
    local.symlink_to(tmp_path / "outside")  # absent inside the root: never this process's
    found = discover_nvidia(root)
    assert found.drivers == () and "libnvidia-ml.so.1 not found" in found.problems[-1].message


def test_h100_driver_root(fake_root: FakeRoot) -> None:
    root = fake_root("h100")
    found = discover_nvidia(root)
    assert found.problems == ()
    gpus = by_name(found, KIND_GPU)
    assert [g.attributes["arch"] for g in gpus.values()] == ["hopper"] * 4
    assert gpus["0"].attributes["compute_capability"] == "9.0"
    assert gpus["1"].links == ("0", "2", "3")
    assert by_name(found, KIND_MIG) == {}
    drv = driver(found)
    dr = "/run/nvidia/driver"
    assert (drv.version, drv.cuda_version) == ("570.124.06", "12.8")
    assert mounts(drv, "compute")[f"{LIB}/libcuda.so.1"] == f"{dr}{X86}/libcuda.so.570.124.06"
    assert mounts(drv, "")["/lib/firmware/nvidia/570.124.06/gsp_ga10x.bin"] == \
        f"{dr}/usr/lib/firmware/nvidia/570.124.06/gsp_ga10x.bin"
    assert mounts(drv, "utility")["/run/nvidia-persistenced/socket"] == \
        f"{dr}/run/nvidia-persistenced/socket"
    assert nodes(drv, "display") == []  # headless: no nvidia-modeset
    assert not [c for c in drv.capabilities if c.startswith("compat32")]


def test_a_compute_library_versioned_apart_from_the_driver_is_mounted_by_its_soname(
        fake_root: FakeRoot) -> None:
    # R575 and later: libnvidia-nvvm70.so.4, which CUDA's JIT loads for code built
    # before CUDA 12, carries no driver version in its name; found where the loader
    # would find it, and mounted as its soname with the compute capability only
    root = fake_root("h100")
    dr = "/run/nvidia/driver"
    Path(root.local(f"{dr}{X86}/libnvidia-nvvm70.so.4")).write_bytes(b"")
    drv = driver(discover_nvidia(root))
    assert mounts(drv, "compute")[f"{LIB}/libnvidia-nvvm70.so.4"] == \
        f"{dr}{X86}/libnvidia-nvvm70.so.4"
    assert f"{LIB}/libnvidia-nvvm70.so.4" not in mounts(drv, "utility")
    # a driver without it: nothing in its place
    assert not [k for k in mounts(driver(discover_nvidia(fake_root("a100-mig"))), "compute")
                if "nvvm70" in k]


def test_gsp_firmware_is_found_where_the_kernel_looks_for_it(fake_root: FakeRoot) -> None:
    # the firmware_class.path parameter first (COS sets one), then /lib/firmware/updates
    # and /lib/firmware, each with the running kernel's release and without: every file
    # found, mounted where it was found, where the kernel looks in the container
    root = fake_root("h100")
    dr, v = "/run/nvidia/driver", "570.124.06"
    Path(root.local("/sys/module/firmware_class/parameters")).mkdir(parents=True)
    Path(root.local("/sys/module/firmware_class/parameters/path")).write_text(
        "/var/lib/nvidia/firmware\n")
    Path(root.local("/proc/sys/kernel")).mkdir(parents=True, exist_ok=True)
    Path(root.local("/proc/sys/kernel/osrelease")).write_text("6.8.0-49-generic\n")
    for where in ("/var/lib/nvidia/firmware", "/usr/lib/firmware/updates/6.8.0-49-generic"):
        fw = Path(root.local(f"{dr}{where}/nvidia/{v}"))
        fw.mkdir(parents=True)
        (fw / "gsp_gb10x.bin").write_bytes(b"")
    firmware = {k: h for k, h in mounts(driver(discover_nvidia(root)), "").items()
                if "firmware" in k}
    assert firmware == {
        f"/var/lib/nvidia/firmware/nvidia/{v}/gsp_gb10x.bin":
            f"{dr}/var/lib/nvidia/firmware/nvidia/{v}/gsp_gb10x.bin",
        f"/lib/firmware/updates/6.8.0-49-generic/nvidia/{v}/gsp_gb10x.bin":
            f"{dr}/usr/lib/firmware/updates/6.8.0-49-generic/nvidia/{v}/gsp_gb10x.bin",
        **{f"/lib/firmware/nvidia/{v}/{n}": f"{dr}/usr/lib/firmware/nvidia/{v}/{n}"
           for n in ("gsp_ga10x.bin", "gsp_tu10x.bin")},
    }


# ---- absent or failing NVML ------------------------------------------------------------


def test_nvml_init_failure_reports_nvidia_absent(fake_root: FakeRoot) -> None:
    found = discover_nvidia(fake_root("nvml-init-fails"))
    assert (found.devices, found.drivers) == ((), ())
    (p,) = found.problems
    assert p.source == "nvidia"
    assert "nvmlInit failed: Driver Not Loaded" in p.message
    assert f"{X86}/libnvidia-ml.so.550.127.05" in p.message


def test_no_driver_reports_nvidia_absent(tmp_path: Path) -> None:
    found = discover_nvidia(HostRoot.at(tmp_path))
    assert (found.devices, found.drivers) == ((), ())
    assert [p.source for p in found.problems] == ["nvidia"]
    assert "libnvidia-ml.so.1 not found under driver root /" in found.problems[0].message


def test_unloadable_library_reports_nvidia_absent(tmp_path: Path) -> None:
    lib = tmp_path / "usr/lib64/libnvidia-ml.so.1"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"")  # a placeholder, not a library
    found = discover_nvidia(HostRoot.at(tmp_path))
    assert found.devices == ()
    assert "cannot load" in found.problems[0].message


@pytest.mark.parametrize("relative", [True, False])
def test_library_outside_the_root_is_not_followed(tmp_path: Path, fake_nvml_lib: Path,
                                                  relative: bool) -> None:
    outside = tmp_path / "outside" / "libnvidia-ml.so.1"
    outside.parent.mkdir()
    outside.write_bytes(fake_nvml_lib.read_bytes())
    root = tmp_path / "root"
    (root / "usr/lib64").mkdir(parents=True)
    target = "../../../outside/libnvidia-ml.so.1" if relative else str(outside)
    os.symlink(target, root / "usr/lib64/libnvidia-ml.so.1")
    found = discover_nvidia(HostRoot.at(root))
    assert found.devices == ()
    assert "not found" in found.problems[0].message


def test_failing_gpu_is_left_out_with_a_problem(
        fake_root: FakeRoot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = fake_root("h100")
    override_nvml(monkeypatch, tmp_path, "h100", lambda c: c.replace(
        "minor 3\n", "minor 3\nfail nvmlDeviceGetUUID 15\n"))
    found = discover_nvidia(root)
    assert list(by_name(found, KIND_GPU)) == ["0", "1", "2"]
    assert messages(found) == ["nvidia: GPU 3: left out: GPU is lost"]


def test_pending_mig_mode_change_is_reported(
        fake_root: FakeRoot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = fake_root("h100")

    def pending_on_gpu2(conf: str) -> str:
        head, *gpus = conf.split("\ngpu\n")
        gpus[2] = gpus[2].replace("mig_mode 0 0 7", "mig_mode 0 1 7")
        return "\ngpu\n".join([head, *gpus])

    override_nvml(monkeypatch, tmp_path, "h100", pending_on_gpu2)
    found = discover_nvidia(root)
    (msg,) = messages(found)
    assert msg.startswith("nvidia: GPU 2 (GPU-") and "change to enabled is pending" in msg


# ---- older drivers: functions missing --------------------------------------------------


def test_old_driver_without_numa_function(fake_root: FakeRoot) -> None:
    found = discover_nvidia(fake_root("old-driver"))
    gpus = by_name(found, KIND_GPU)
    assert [g.numa_node for g in gpus.values()] == [0, None]  # sysfs: 0 and -1
    assert messages(found) == [
        "nvidia: the driver lacks nvmlDeviceGetNumaNodeId: NUMA nodes are read from sysfs"]
    assert gpus["0"].links == ("1",) and gpus["1"].links == ("0",)
    assert dict(gpus["0"].attributes) == {
        "arch": "volta", "brand": "tesla", "compute_capability": "7.0",
        "memory_mib": "16384", "name": "Tesla V100-SXM2-16GB"}
    drv = driver(found)
    assert drv.cuda_version == "11.4"
    # no ld.so.cache: the standard directories
    assert mounts(drv, "compute")[f"{LIB}/libcuda.so.1"] == "/usr/lib64/libcuda.so.470.256.02"


def test_pynvml_without_a_wrapper_is_tolerated(
        fake_root: FakeRoot, monkeypatch: pytest.MonkeyPatch) -> None:
    root = fake_root("a100-mig")
    monkeypatch.delattr("pynvml.nvmlDeviceGetNvLinkRemoteDeviceType")
    found = discover_nvidia(root)
    assert messages(found) == ["nvidia: the driver lacks nvmlDeviceGetNvLinkRemoteDeviceType: "
                               "only direct GPU-to-GPU NVLinks are known"]
    assert all(g.links == () for g in by_name(found, KIND_GPU).values())
    assert len(by_name(found, KIND_MIG)) == 7


def test_mig_profile_computed_when_names_are_unavailable(
        fake_root: FakeRoot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = fake_root("a100-mig")
    override_nvml(monkeypatch, tmp_path, "a100-mig", lambda c: c.replace(
        "  gi ", "  fail nvmlDeviceGetName 3\n  gi "))
    found = discover_nvidia(root)
    assert found.problems == ()  # NOT_SUPPORTED: the device's answer, not a defect
    migs = by_name(found, KIND_MIG)
    assert [m.attributes["mig_profile"] for m in migs.values()] == [
        "3g.40gb", "2g.20gb", "1g.10gb", "1g.10gb", "2c.4g.40gb", "2c.4g.40gb", "3g.40gb"]
    assert "name" not in migs["0:0"].attributes


# ---- device nodes ----------------------------------------------------------------------


def test_broken_device_nodes(fake_root: FakeRoot) -> None:
    found = discover_nvidia(fake_root("broken-dev"))
    assert list(by_name(found, KIND_GPU)) == ["0"]
    assert list(by_name(found, KIND_MIG)) == ["0:0"]
    assert "arch" not in by_name(found, KIND_GPU)["0"].attributes
    problems = {p.source: p.message for p in found.problems}
    assert problems["nvidia"] == "GPU 0: nvmlDeviceGetArchitecture failed: Unknown Error"
    assert problems["/dev/nvidia1"].startswith("is a symlink; device nodes must be the node")
    assert problems["/dev/nvidia1"].endswith("GPU 1 (GPU-ed49ff90-4672-c08f-aff6-58a61746305f)"
                                             " is left out")
    assert problems["/dev/nvidia-caps/nvidia-cap49"].startswith("is a symlink; device nodes")
    assert "MIG device 0:1" in problems["/dev/nvidia-caps/nvidia-cap49"]
    assert problems["/dev/char/195:0"].startswith("missing (a link to /dev/nvidia0)")
    assert problems["/dev/char/195:255"].startswith("points to ../nvidia0, not /dev/nvidiactl")
    assert problems["/dev/nvidia-uvm"] == (
        "device node does not exist: /dev/nvidia-uvm (compute) is left out")
    assert len(found.problems) == 6
    assert nodes(driver(found), "compute") == []
    assert nodes(driver(found), "") == [("/dev/nvidiactl", 195, 255)]


@pytest.mark.parametrize(("make", "expected"), [
    (lambda p: None, "device node does not exist: GPU 3"),
    (lambda p: p.write_text(""), "is not a character or block device: GPU 3"),
    (lambda p: os.mknod(p, stat.S_IFCHR | 0o666, os.makedev(195, 9)),
     "is device 195:9, expected 195:3: GPU 3"),
    (lambda p: os.mknod(p, stat.S_IFBLK | 0o666, os.makedev(195, 3)),
     "is a block device, not a character device: GPU 3"),
])
def test_bad_gpu_node_is_refused(fake_root: FakeRoot, make: Callable[[Path], None],
                                 expected: str) -> None:
    root = fake_root("h100")
    node = Path(root.local("/dev/nvidia3"))
    node.unlink()
    make(node)
    found = discover_nvidia(root)
    assert list(by_name(found, KIND_GPU)) == ["0", "1", "2"]
    assert [p.source for p in found.problems] == ["/dev/nvidia3"]
    assert found.problems[0].message.startswith(expected)


def test_optional_node_absent_is_silent_but_a_symlink_is_reported(fake_root: FakeRoot) -> None:
    root = fake_root("h100")
    os.unlink(root.local("/dev/nvidia-uvm-tools"))
    found = discover_nvidia(root)
    assert found.problems == ()
    assert nodes(driver(found), "compute") == [("/dev/nvidia-uvm", 509, 0)]
    os.symlink("nvidia-uvm", root.local("/dev/nvidia-uvm-tools"))
    problems = {p.source: p.message for p in discover_nvidia(root).problems}
    assert problems == {"/dev/nvidia-uvm-tools": (
        "is a symlink; device nodes must be the node itself: /dev/nvidia-uvm-tools "
        "(compute) is left out")}


def test_nodes_carry_host_path_when_dev_is_elsewhere(fake_root: FakeRoot) -> None:
    root = fake_root("h100")
    os.rename(root.local("/dev"), root.local("/hostdev"))
    moved = HostRoot(root=root.root, dev="/hostdev", sys=root.sys, driver_root=root.driver_root)
    gpu = by_name(discover_nvidia(moved), KIND_GPU)["0"]
    (node,) = gpu.edits.device_nodes
    assert (node.path, node.host_path) == ("/dev/nvidia0", "/hostdev/nvidia0")


# ---- helpers ---------------------------------------------------------------------------


@pytest.mark.parametrize(("raw", "norm"), [
    ("00000000:07:00.0", "0000:07:00.0"),
    ("0000:BD:00.0", "0000:bd:00.0"),
    ("0:7:0.1", "0000:07:00.1"),
    ("00010000:c4:1f.7", "10000:c4:1f.7"),
])
def test_normalise_pci_bus_id(raw: str, norm: str) -> None:
    assert normalise_pci_bus_id(raw) == norm


@pytest.mark.parametrize("bad", ["", "07:00.0", "0000:07:00", "0000:07:00.8", "zz:07:00.0"])
def test_normalise_pci_bus_id_rejects(bad: str) -> None:
    with pytest.raises(ValueError, match="not a PCI bus id"):
        normalise_pci_bus_id(bad)


def test_library_and_kernel_driver_version_mismatch(
        fake_root: FakeRoot, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = fake_root("h100")
    override_nvml(monkeypatch, tmp_path, "h100", lambda c: c.replace(
        "driver_version 570.124.06", "driver_version 570.133.20"))
    found = discover_nvidia(root)
    assert len(by_name(found, KIND_GPU)) == 4
    dr = "/run/nvidia/driver"
    assert messages(found) == [
        f"{dr}{X86}/libnvidia-ml.so.570.124.06: is version 570.124.06 but the kernel driver "
        "is 570.133.20: libraries are looked up for the kernel driver's version",
        f"nvidia: libcuda.so.570.133.20 not found under driver root {dr}: the compute "
        "capability cannot run CUDA",
    ]
    assert not any(m.container_path.startswith(LIB)
                   for e in driver(found).capabilities.values() for m in e.mounts)
