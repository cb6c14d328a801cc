"""NVIDIA discovery: GPUs, MIG devices and the driver's files, from NVML and the host.

Owns: discover_nvidia(root), nvml_library(root), probe(root), parse_mig_minors() and
the NVIDIA facts they encode (which libraries and binaries each driver capability
brings, brand/architecture names, MIG profiles, device node and capability-file
layout, where the IPC sockets live). Imports
msgspec, nri_accel.discover.{nvml, ldcache, hostroot, base, kernel, probe}, nri_accel.errors,
nri_accel.inventory, nri_accel.log and the kinds of nri_accel.vendors.nvidia; never
pynvml itself (the nvml adapter does). Runs at startup and on refresh, never on a
CreateContainer.

What it finds:
- libnvidia-ml.so.1 located in the driver root like the node's loader would
  (ldcache.Locator); that file is what NVML is loaded from.
- A Device of kind nvidia.com/gpu per GPU (name = NVML index; uuid "GPU-..."; alias the
  PCI bus id "0000:07:00.0"; edits: /dev/nvidia<minor>; attributes name, brand,
  arch, compute_capability, memory_mib, mig_mode for MIG-capable GPUs), links = the
  GPUs it reaches over NVLink (directly, or through NVSwitches: every GPU on the
  switch fabric is a peer of every other).
- A Device of kind nvidia.com/mig per MIG device (name "<gpu index>:<mig index>",
  the NVIDIA_VISIBLE_DEVICES syntax; uuid "MIG-..."; alias "MIG-GPU-<uuid>/<gi>/<ci>";
  edits: the parent's /dev/nvidia<minor> plus the nvidia-caps nodes of its GPU and
  compute instances' "access" capabilities; parent = the GPU's name). A capability's
  minor comes from the driver's table /proc/driver/nvidia-caps/mig-minors
  ("gpu0/gi2/access 21", "gpu0/gi2/ci0/access 22", "config 1", "monitor 2"; the
  toolkit's internal/nvcaps reads it too), else from its file under
  /proc/driver/nvidia/capabilities ("DeviceFileMinor: 21", what libnvidia-container
  reads); the two disagreeing is refused (the wrong minor would grant another instance).
  The major is nvidia-caps' in /proc/devices.
- Driver("nvidia") with its files by capability, as libnvidia-container grants them
  (src/nvc_info.c lists, src/nvc_mount.c rules):
    ""          /dev/nvidiactl, GSP firmware
    utility     NVML & co. libraries, nvidia-smi/-debugdump/-persistenced/nv-fabricmanager,
                the persistenced and fabric manager sockets (nvidia-persistenced/socket,
                nvidia-fabricmanager/socket, in /var/run and in /run)
    compute     CUDA libraries, the MPS binaries, /dev/nvidia-uvm, /dev/nvidia-uvm-tools,
                the MPS pipe directory
    video       video libraries plus what compute brings except its binaries
    graphics    OpenGL/EGL/Vulkan libraries (and the EGL external platforms' own), and
                the configuration files that make them found: glvnd's EGL vendor
                file, the EGL external platforms, OptiX's nvoptix.bin, Vulkan's ICD
                and layer files (in the driver root itself too, as GKE has them),
                GBM's NVIDIA backend and its libnvidia-allocator, X.Org's NVIDIA
                modules and configuration (the toolkit's graphics modifier;
                CONFIG_DIRS, VULKAN_CONFIG_DIRS, GBM_BACKEND and XORG_TREES below)
    display     what graphics brings and /dev/nvidia-modeset
    ngx         libnvidia-ngx
    compat32/<capability>  (x86_64 nodes) the 32-bit builds of the libraries
                <capability> selects (compat32/video: video and compute libraries,
                compat32/display: the graphics ones); compat32 adds those of the other
                capabilities requested, and nothing alone
    drm/<PCI bus id>  one GPU's DRM nodes, /dev/dri/card<N> and renderD<N> (_drm_nodes),
                which the NVIDIA profile adds to graphics and display for that GPU
    mig-config  /dev/nvidia-caps/nvidia-cap<N> of capabilities/mig/config
    mig-monitor /dev/nvidia-caps/nvidia-cap<N> of capabilities/mig/monitor
  Libraries are only the exact `<name>.so.<driver version>` files; each is mounted
  read-only at /usr/local/nvidia/lib64/<soname> (lib/ for compat32), binaries at
  /usr/bin/<name>, firmware and IPC paths where the driver root has them. IPC paths:
  libnvidia-container and the toolkit look only at /var/run, which on most hosts is a
  link to /run; where /var/run is a real directory a daemon's socket may be in either,
  so both are looked at, and each socket found is mounted at its own path (its
  directories resolved in the root: /var/run -> /run gives one mount, at /run/...).
  The MPS pipe directory is CUDA's default /tmp/nvidia-mps only. An IPC path's last
  component must be the socket or directory itself, never a symlink (the MPS pipe
  directory lives in world-writable /tmp), and no one but root, or whom root gave a
  directory on its way, may be able to replace it: no directory on its way writable by
  others unless sticky, and then the entry in it root's. The runtime resolves a mount
  source again when it mounts it; a path a user could swap for a link after discovery
  would bind any host directory into GPU containers. Anything else is a Problem, and
  not mounted.

Device nodes are taken with lstat: major/minor from the node itself, a symlink or a
non-device refused with a Problem (and left out), never followed. A node whose
/dev/char/<major>:<minor> link is missing is reported (runc's systemd cgroup driver
needs it). NVML absent or failing: Found with one Problem, other vendors unaffected.

nvidia-caps nodes are the exception, and /dev/nvidia-uvm of a loaded nvidia-uvm (its
major in /proc/devices): the driver creates them only on demand (nvidia-modprobe -f
<capability file>, which CUDA runs when it first opens a MIG device; nvidia-modprobe
-u, which libnvidia-container runs on every container start), so on a freshly booted
node they are often missing. A missing one is granted
anyway, as a DeviceNode built from its type, major and minor (the runtime creates the
node inside the container; it needs no host node), with a Problem saying so: a
container in a user namespace (runc bind-mounts device nodes there) and runc's systemd
cgroup driver (it allows a device through its /dev/char link) need the host node. With
discovery.create_device_nodes (off by default: it modifies the host) discovery creates
them through the HostRoot as nvidia-modprobe does (/dev/nvidia-caps 0755, the node with
the DeviceFileMode of its capability file, 0666 as nvidia-ctk where that gives none),
and the missing /dev/char/<major>:<minor> links of every node it grants, relative as
udev and nvidia-modprobe write them (nvidia-ctk system create-dev-char-symlinks makes
the same links). It never replaces an entry that exists, and never runs on a
CreateContainer.
"""

from __future__ import annotations

import math
import os
import posixpath
import re
import stat
import time
from collections.abc import Callable, Iterable
from types import MappingProxyType

from msgspec import Struct

from nri_accel.discover import nvml
from nri_accel.discover.base import Found, lstat_device
from nri_accel.discover.hostroot import HostRoot
from nri_accel.discover.kernel import (
    MAX_UINT,
    char_major,
    parse_uint,
    pci_numa_node,
    read_stripped,
)
from nri_accel.discover.ldcache import ARCHES, COMPAT32, Arch, Locator
from nri_accel.discover.probe import State, entries, file_state
from nri_accel.errors import DiscoveryError
from nri_accel.inventory import (
    MAX_MINOR,
    ContainerEdits,
    Device,
    DeviceNode,
    Driver,
    Mount,
    Problem,
    format_pci_bus_id,
    merge_edits,
    parse_pci_bus_id,
)
from nri_accel.log import get_logger
from nri_accel.vendors.nvidia import (
    COMPAT32_PREFIX,
    DRM_PREFIX,
    IMEX_CHANNEL,
    IMEX_CHANNEL_PREFIX,
    KIND_GPU,
    KIND_MIG,
    VENDOR,
)

log = get_logger(__name__)

NVML_SONAME = "libnvidia-ml.so.1"
NVIDIA_MAJOR = 195
NVIDIACTL_MINOR = 255
MODESET_MINOR = 254
LIB_DIR = "/usr/local/nvidia/lib64"
LIB32_DIR = "/usr/local/nvidia/lib"
BIN_DIR = "/usr/bin"
PROC_CAPS = "/proc/driver/nvidia/capabilities"
MIG_MINORS = "/proc/driver/nvidia-caps/mig-minors"
CAPS_DIR = "nvidia-caps"  # under /dev
IMEX_DIR = "nvidia-caps-imex-channels"  # under /dev: channel<N>, minor N
IMEX_DRIVER = "nvidia-caps-imex-channels"  # its /proc/devices name
_IMEX_CHANNEL_RE = re.compile(rf"channel({IMEX_CHANNEL})")
IPC_OPTIONS = ("ro", "nosuid", "nodev", "noexec", "bind")
# The kernel's firmware search (drivers/base/firmware_loader/main.c, fw_path), after
# the firmware_class.path parameter; {release}: the running kernel's
FIRMWARE_DIRS = ("/lib/firmware/updates/{release}", "/lib/firmware/updates",
                 "/lib/firmware/{release}", "/lib/firmware")
FIRMWARE_CLASS_PATH = "module/firmware_class/parameters/path"  # under /sys
OS_RELEASE = "/proc/sys/kernel/osrelease"
MIB = 1 << 20
GIB = 1 << 30

# libnvidia-container src/nvc_info.c
UTILITY_LIBS = ("libnvidia-ml.so", "libnvidia-cfg.so", "libnvidia-nscq.so")
COMPUTE_LIBS = (
    "libcuda.so", "libcudadebugger.so", "libnvidia-opencl.so", "libnvidia-gpucomp.so",
    "libnvidia-ptxjitcompiler.so", "libnvidia-fatbinaryloader.so", "libnvidia-allocator.so",
    "libnvidia-compiler.so", "libnvidia-pkcs11.so", "libnvidia-pkcs11-openssl3.so",
    "libnvidia-nvvm.so", "libnvidia-tileiras.so",
)
# Compute libraries versioned apart from the driver, found by their soname: R575's
# libnvidia-nvvm70.so.4, the link-time optimiser CUDA's JIT loads for code built before
# CUDA 12 ("PTX JIT compiler library not found" without it; nvidia-container-toolkit
# mounts it by name as well).
COMPUTE_SONAMES = ("libnvidia-nvvm70.so.4",)
VIDEO_LIBS = ("libvdpau_nvidia.so", "libnvidia-encode.so", "libnvidia-opticalflow.so",
              "libnvcuvid.so")
GRAPHICS_LIBS = (
    "libnvidia-eglcore.so", "libnvidia-glcore.so", "libnvidia-tls.so", "libnvidia-glsi.so",
    "libnvidia-fbc.so", "libnvidia-ifr.so", "libnvidia-rtcore.so", "libnvoptix.so",
    # GLVND vendor libraries
    "libGLX_nvidia.so", "libEGL_nvidia.so", "libGLESv2_nvidia.so", "libGLESv1_CM_nvidia.so",
    "libnvidia-glvkspirv.so", "libnvidia-cbl.so",
    # the Vulkan layer that implicit_layer.d/nvidia_layers.json (mounted below) names
    # (R550 on; libnvidia-container's list predates it, nvidia-ctk's CDI mounts it)
    "libnvidia-present.so",
    # Vulkan SC's driver (R535 on), which the driver's vulkansc/icd.d/nvidia_icd_vksc.json
    # names; libnvidia-container's list predates it too, and nvidia-ctk's CDI mounts it
    # with every <name>.so.<driver version> (nvidia-container-toolkit
    # pkg/nvcdi/driver-nvml.go, getVersionLibs)
    "libnvidia-vksc-core.so",
    # pre-GLVND drivers ship these with the driver's version; GLVND's own never match it
    "libGL.so", "libEGL.so", "libGLESv1_CM.so", "libGLESv2.so",
)
NGX_LIBS = ("libnvidia-ngx.so",)
# The graphics stack's configuration files, as nvidia-container-toolkit's graphics
# modifier mounts them for graphics and display (internal/discover/graphics.go): each
# looked up in the driver root's /etc, then /usr/share (the first found). Without
# glvnd's vendor file a GLVND libEGL finds no NVIDIA EGL (headless EGL: its device
# platform), without the ICD file the Vulkan loader finds no NVIDIA Vulkan, unless the
# image ships them. GRAPHICS_CONFIGS are mounted where they were found; the Vulkan
# ICD and layer files under /etc, where the Vulkan loader looks first (an RPM driver
# names its ICD file after the architecture).
# The directories are the toolkit's driver.Configs() (internal/lookup/root/root.go,
# configSearchOptions): /etc, then XDG_DATA_DIRS' default, /usr/local/share and
# /usr/share (this daemon's own XDG_DATA_DIRS says nothing about the host's driver).
CONFIG_DIRS = ("/etc", "/usr/local/share", "/usr/share")
# The Vulkan files are looked for in the driver root itself too, after CONFIG_DIRS
# (graphics.go newVulkanConfigsDiscover: lookup.First(driver.Configs(), driver.Files())):
# GKE's driver installer puts them at <driver root>/vulkan/icd.d/nvidia_icd.json
# (driver root /home/kubernetes/bin/nvidia), with no /etc or /usr/share of its own.
VULKAN_CONFIG_DIRS = (*CONFIG_DIRS, "")
GRAPHICS_CONFIGS = (
    "glvnd/egl_vendor.d/10_nvidia.json",
    "egl/egl_external_platform.d/15_nvidia_gbm.json",
    "egl/egl_external_platform.d/10_nvidia_wayland.json",
    "nvidia/nvoptix.bin",  # OptiX's built-in denoiser weights
    "X11/xorg.conf.d/10-nvidia.conf",
    "X11/xorg.conf.d/nvidia-drm-outputclass.conf",
)
VULKAN_CONFIGS = ("vulkan/icd.d/nvidia_icd.json", "vulkan/icd.d/nvidia_layers.json",
                  "vulkan/implicit_layer.d/nvidia_layers.json")
VULKAN_ARCH_ICD = {"x86_64": "vulkan/icd.d/nvidia_icd.x86_64.json",
                   "aarch64": "vulkan/icd.d/nvidia_icd.aarch64.json"}
VULKAN_DIR = "/etc"
# X.Org's NVIDIA modules, for an X server in the container (the toolkit's
# buildXOrgSearchPaths): the first of each found in the driver's library directory
# (libcuda's) under nvidia/xorg and xorg/<module dir>, then under the distributions' X.Org
# trees, mounted where found; libglxserver_nvidia.so.<version> at
# libglxserver_nvidia.so too, the name X.Org loads it by (the toolkit makes that link
# with a hook: a bind mount needs none).
XORG_MODULE_DIRS = ("modules/drivers", "modules/extensions", "modules/updates/drivers",
                    "modules/updates/extensions")
XORG_TREES = ("/usr/lib/xorg", "/usr/lib64/xorg", "/usr/X11R6/lib", "/usr/X11R6/lib64")
XORG_DRIVER = "nvidia_drv.so"
XORG_GLX = "libglxserver_nvidia.so"
# The EGL external platforms' own libraries (their files above load them), versioned
# apart from the driver (egl-gbm, egl-wayland 1.x): the files their sonames name.
EGL_PLATFORM_SONAMES = ("libnvidia-egl-gbm.so.1", "libnvidia-egl-wayland.so.1")
# GBM's NVIDIA backend, which libgbm loads from the gbm/ directory beside it (egl-gbm
# through it): the driver's link <library directory>/gbm/nvidia-drm_gbm.so ->
# ../libnvidia-allocator.so.1. The toolkit's graphics modifier takes
# libnvidia-allocator for graphics and links the backend beside it with a hook
# (internal/discover/graphics.go, graphicsDriverLibraries); here the link found beside
# libcuda, resolved to libnvidia-allocator.so.<driver version> (and only to it), is
# mounted where it is, as X.Org's modules are.
GBM_BACKEND = "gbm/nvidia-drm_gbm.so"
ALLOCATOR = "libnvidia-allocator.so"
# The libraries each capability selects (nvc_info.c match_library_flags through the
# nvc.c container options: video is OPT_VIDEO_LIBS|OPT_COMPUTE_LIBS, display
# OPT_DISPLAY|OPT_GRAPHICS_LIBS), whose 32-bit builds compat32 adds.
COMPAT32_LIBS = {
    "utility": UTILITY_LIBS, "compute": COMPUTE_LIBS, "video": (*VIDEO_LIBS, *COMPUTE_LIBS),
    "graphics": GRAPHICS_LIBS, "display": GRAPHICS_LIBS, "ngx": NGX_LIBS,
}
UTILITY_BINS = ("nvidia-smi", "nvidia-debugdump", "nvidia-persistenced", "nv-fabricmanager")
COMPUTE_BINS = ("nvidia-cuda-mps-control", "nvidia-cuda-mps-server")
# IPC paths, as libnvidia-container (src/nvc_internal.h, _PATH_VARRUN) and the toolkit
# (internal/discover/ipc.go) name them, looked up in /var/run and in /run: a host whose
# /var/run is a real directory (many container root filesystems, hosts that never merged
# it into /run) may have a daemon's socket in either.
RUN_DIRS = ("/var/run", "/run")
PERSISTENCED_SOCKET = "nvidia-persistenced/socket"
FABRICMANAGER_SOCKET = "nvidia-fabricmanager/socket"
MPS_PIPE_DIR = "/tmp/nvidia-mps"  # CUDA's default CUDA_MPS_PIPE_DIRECTORY, not a run dir

# Lower-case names as CUDA images write them in NVIDIA_REQUIRE_CUDA ("brand=tesla").
BRANDS = {
    0: "unknown", 1: "quadro", 2: "tesla", 3: "nvs", 4: "grid", 5: "geforce", 6: "titan",
    7: "vapps", 8: "vpc", 9: "vcs", 10: "vws", 11: "cloudgaming", 12: "quadrortx",
    13: "nvidiartx", 14: "nvidia", 15: "geforcertx", 16: "titanrtx",
}
ARCHITECTURES = {
    2: "kepler", 3: "maxwell", 4: "pascal", 5: "volta", 6: "turing", 7: "ampere", 8: "ada",
    9: "hopper", 10: "blackwell",
}
# What discovery does instead when the driver lacks an NVML function.
_FALLBACKS = {
    "nvmlDeviceGetNumaNodeId": "NUMA nodes are read from sysfs",
    "nvmlDeviceGetAttributes": "MIG profiles are read from the MIG device names",
    "nvmlDeviceGetNvLinkRemoteDeviceType": "only direct GPU-to-GPU NVLinks are known",
}
_NVLINK_GPU = 0
_NVLINK_SWITCH = 2
_PROFILE_RE = re.compile(r"^(\d+c\.)?\d+g\.\d+gb(\+[a-z0-9]+)*$")
_VERSION_RE = re.compile(r"^\d+\.\d+(\.\d+)?$")
_MIG_CAP_RE = re.compile(r"config|monitor|gpu[0-9]+/gi[0-9]+(/ci[0-9]+)?/access")
_MINOR_RE = re.compile(r"[0-9]{1,7}")
_CAP_FIELD_MAX = {"DeviceFileMinor": MAX_MINOR, "DeviceFileMode": 0o7777}


def normalise_pci_bus_id(value: str) -> str:
    """A PCI bus id in sysfs form, "0000:07:00.0", from NVML's "00000000:07:00.0" or
    any case/width variant. Raises ValueError for anything else."""
    key = parse_pci_bus_id(value.strip())
    if key is None:
        raise ValueError(f"not a PCI bus id: {value!r}")
    return format_pci_bus_id(key)


def probe(root: HostRoot) -> State:
    """What moves when the NVIDIA side of the node changes: the driver version (upgrade,
    reload), the /dev/nvidia* and /dev/nvidia-caps nodes (hot-plug, nodes created or
    removed), the IMEX channel nodes (the IMEX daemon or nvidia-modprobe -i makes them
    after boot) and the MIG capability tree (a MIG reconfiguration creates and removes
    its gi<N>/ci<M> directories)."""
    out = [file_state(root, "/proc/driver/nvidia/version"),
           file_state(root, root.sys_path("module/nvidia/version")),
           *entries(root, root.dev, ("nvidia",)),
           *entries(root, root.dev_path("nvidia-caps")),
           *entries(root, root.dev_path(IMEX_DIR))]
    for gpu in root.listdir(PROC_CAPS):
        mig = f"{PROC_CAPS}/{gpu}/mig"
        for gi in root.listdir(mig):
            if gi.startswith("gi"):
                out.append((f"{mig}/{gi}", tuple(c for c in root.listdir(f"{mig}/{gi}")
                                                 if c.startswith("ci"))))
    return out


def nvml_library(root: HostRoot) -> str | None:
    """The libnvidia-ml file discovery loads NVML from, as this process opens it (what
    nri_accel.vendors.nvidia.health.HealthMonitor needs too); None where there is none."""
    locator = Locator(root)
    lib = locator.find_soname(NVML_SONAME)
    return locator.local_path(lib) if lib is not None else None


def discover_nvidia(root: HostRoot, *, create_device_nodes: bool = False) -> Found:
    """NVIDIA GPUs, MIG devices and driver files under `root`. Never raises for a
    missing or broken driver: the reason is a Problem. `create_device_nodes`: create the
    nvidia-caps nodes and /dev/char links the host lacks (config
    discovery.create_device_nodes)."""
    started = time.perf_counter()
    locator = Locator(root)
    problems = list(locator.problems)
    lib = locator.find_soname(NVML_SONAME)
    if lib is None:
        problems.append(Problem(VENDOR, (
            f"{NVML_SONAME} not found under driver root {root.driver_root} (ld.so.cache, "
            "standard library directories): NVIDIA GPUs are not discovered")))
        return Found(problems=tuple(problems))
    try:
        snap = nvml.query(locator.local_path(lib))
    except nvml.NvmlUnavailable as e:
        problems.append(Problem(VENDOR, f"{e} (library {locator.host_path(lib)}): "
                                        "NVIDIA GPUs are not discovered"))
        return Found(problems=tuple(problems))

    scan = _Scan(root, problems, create=create_device_nodes)
    problems.extend(Problem(VENDOR, f"the driver lacks {fn}: "
                                    f"{_FALLBACKS.get(fn, 'that field is left empty')}")
                    for fn in snap.missing)
    problems.extend(Problem(VENDOR, msg) for msg in snap.errors)
    lib_version = lib.rpartition("/")[2].removeprefix("libnvidia-ml.so.")
    if _VERSION_RE.match(lib_version) and lib_version != snap.driver_version:
        problems.append(Problem(locator.host_path(lib), (
            f"is version {lib_version} but the kernel driver is {snap.driver_version}: "
            "libraries are looked up for the kernel driver's version")))

    devices = _devices(snap, scan)
    driver = Driver(
        vendor=VENDOR,
        version=snap.driver_version,
        cuda_version=_cuda_version(snap.cuda_version),
        capabilities=MappingProxyType({**_capabilities(locator, snap.driver_version, scan),
                                       **_drm_nodes(devices, scan)}),
    )
    log.debug("nvidia_discovered", gpus=len(snap.gpus), devices=len(devices),
              driver=snap.driver_version, problems=len(problems),
              ms=round((time.perf_counter() - started) * 1000, 2))
    return Found(devices=tuple(devices), drivers=(driver,), problems=tuple(problems))


# ---- host device nodes ---------------------------------------------------------------


class _Scan(Struct):
    """Reads device nodes and /proc for one discovery, collecting Problems. With
    `create`, creates the nvidia-caps nodes and /dev/char links the host lacks."""

    root: HostRoot
    problems: list[Problem]
    create: bool = False
    _caps_major: int | None = None
    _caps_major_read: bool = False
    _mig_minors: dict[str, int] | None = None

    def node(self, name: str, *, expect: tuple[int | None, int | None] = (None, None),
             what: str, required: bool = True) -> DeviceNode | None:
        """The character device /dev/<name>, from lstat of the host node (lstat_device).
        `expect`: (major, minor) it must have (None: any). Problems name the node and
        `what` is left out. A missing node that is not `required` is silently absent."""
        host = self.root.dev_path(name)
        try:
            typ, st = lstat_device(self.root, host)
        except DiscoveryError as e:
            if required or not isinstance(e.__cause__, FileNotFoundError):
                self.problems.append(Problem(host, f"{e.message}: {what} is left out"))
            return None
        if typ != "c":
            self.problems.append(Problem(host, f"is a block device, not a character "
                                               f"device: {what} is left out"))
            return None
        major, minor = os.major(st.st_rdev), os.minor(st.st_rdev)
        want_major, want_minor = expect
        if (want_major is not None and major != want_major) or \
                (want_minor is not None and minor != want_minor):
            want = f"{'*' if want_major is None else want_major}:" \
                   f"{'*' if want_minor is None else want_minor}"
            self.problems.append(Problem(host, (
                f"is device {major}:{minor}, expected {want}: {what} is left out")))
            return None
        self._check_char_link(host, major, minor)
        path = "/dev/" + name
        return DeviceNode(path=path, major=major, minor=minor, type="c",
                          host_path="" if host == path else host,
                          file_mode=stat.S_IMODE(st.st_mode))

    def _check_char_link(self, host: str, major: int, minor: int) -> None:
        link = self.root.dev_path(f"char/{major}:{minor}")
        hint = ("runc's systemd cgroup driver needs it to allow the device "
                "(nvidia-ctk system create-dev-char-symlinks --create-all")
        try:
            st = self.root.lstat(link)
        except OSError:
            if not (self.create and self._create_char_link(link, host)):
                self.problems.append(Problem(link, (
                    f"missing (a link to {host}): {hint}, or [discovery] "
                    "create_device_nodes = true)")))
            return
        hint += ")"
        if stat.S_ISLNK(st.st_mode):
            target = os.readlink(self.root.local(link))
            resolved = os.path.normpath(os.path.join(os.path.dirname(link), target))
            if resolved != host:
                self.problems.append(Problem(link, f"points to {target}, not {host}: {hint}"))
        elif not (stat.S_ISCHR(st.st_mode) and st.st_rdev == os.makedev(major, minor)):
            self.problems.append(Problem(link, f"is neither a link to {host} nor that device"))

    def _create_char_link(self, link: str, host: str) -> bool:
        """/dev/char/<major>:<minor> -> ../<node>, relative as udev and nvidia-modprobe
        write it (so it holds under any root). Never replaces what is there."""
        target = posixpath.relpath(host, posixpath.dirname(link))
        try:
            self.root.makedirs(posixpath.dirname(link), 0o755)
            self.root.symlink(link, target)
        except OSError as e:
            self.problems.append(Problem(link, f"cannot create it (a link to {host}): "
                                               f"{e.strerror or e}"))
            return True  # reported
        log.info("dev_char_link_created", link=link, target=target)
        return True

    def cap_node(self, proc_path: str, key: str, *, what: str) -> DeviceNode | None:
        """The /dev/nvidia-caps node of an nvidia capability: `proc_path` its file under
        /proc/driver/nvidia/capabilities, `key` its line in mig-minors ("config",
        "gpu0/gi2/access", "gpu0/gi2/ci0/access"). The minor comes from mig-minors, else
        from the capability file's DeviceFileMinor (refused when they disagree: the
        wrong minor would grant another instance), the major from /proc/devices. A node
        the host lacks is still granted, created first when `create`."""
        fields = self._cap_fields(proc_path, what)
        if fields is None:
            return None
        from_file = fields.get("DeviceFileMinor")
        from_table = self.mig_minors().get(key)
        if from_file is not None and from_table is not None and from_file != from_table:
            self.problems.append(Problem(proc_path, (
                f"says minor {from_file} but {MIG_MINORS} says {from_table} for {key}: "
                f"{what} is left out")))
            return None
        minor = from_table if from_table is not None else from_file
        if minor is None:
            self.problems.append(Problem(proc_path, (
                f"missing or unreadable, and {MIG_MINORS} has no {key}: {what} is left out")))
            return None
        major = self.caps_major()
        if major is None:
            self.problems.append(Problem("/proc/devices", (
                f"no nvidia-caps character device major: {what} is left out")))
            return None
        mode = fields.get("DeviceFileMode")
        return self._made_node(f"{CAPS_DIR}/nvidia-cap{minor}", major, minor,
                               0o666 if mode is None else stat.S_IMODE(mode), what=what,
                               fix=f"nvidia-modprobe -f {proc_path}")

    def driver_node(self, name: str, driver: str, minor: int, *,
                    what: str) -> DeviceNode | None:
        """/dev/<name>, minor `minor` of the major /proc/devices gives `driver`
        (nvidia-uvm's 0, which nvidia-modprobe -u makes and libnvidia-container makes on
        every container start, as nri-accel does not): the host's node (node()), else,
        while the driver is loaded, the node _made_node() grants."""
        major = char_major(self.root, driver)
        if major is None:  # not loaded: the host's node or nothing
            return self.node(name, expect=(None, minor), what=what)
        return self._made_node(name, major, minor, 0o666, what=what,
                               fix=f"nvidia-modprobe -u -c={minor}")

    def _made_node(self, name: str, major: int, minor: int, perm: int, *, what: str,
                   fix: str) -> DeviceNode | None:
        """/dev/<name>, char `major`:`minor`: the host's node, created first with `perm`
        when the host lacks it and `create`, else granted anyway as that device, which
        the runtime creates in the container, with a Problem saying what `fix` makes."""
        host = self.root.dev_path(name)
        if self.root.exists(host) or (
                self.create and self._create_node(host, major, minor, perm, what)):
            return self.node(name, expect=(major, minor), what=what)  # never replaced
        if not self.create:  # (a failed creation is reported already)
            self.problems.append(Problem(host, (
                f"missing: {what} is granted anyway as char {major}:{minor}, which the "
                "runtime creates in the container; user-namespace containers need the "
                "host node and runc's systemd cgroup driver "
                f"/dev/char/{major}:{minor} ({fix}, or "
                "[discovery] create_device_nodes = true)")))
        path = "/dev/" + name
        return DeviceNode(path=path, major=major, minor=minor, type="c",
                          host_path="" if host == path else host, file_mode=perm)

    def _create_node(self, host: str, major: int, minor: int, perm: int, what: str) -> bool:
        """mknod a driver's node as nvidia-modprobe does: its directory 0755, the node with
        `perm` (a capability file's DeviceFileMode, else 0666 as nvidia-ctk)."""
        try:
            self.root.makedirs(posixpath.dirname(host), 0o755)
            self.root.mknod_char(host, major, minor, perm)
        except FileExistsError:
            return True  # created meanwhile (nvidia-modprobe): lstat it as found
        except OSError as e:
            self.problems.append(Problem(host, (
                f"missing, and cannot create it ({e.strerror or e}): {what} is granted "
                f"anyway as char {major}:{minor}, which the runtime creates in the "
                "container")))
            return False
        log.info("device_node_created", path=host, major=major, minor=minor,
                 mode=f"{perm:04o}")
        return True

    def _cap_fields(self, proc_path: str, what: str) -> dict[str, int] | None:
        """The "Name: number" lines of a capability file (DeviceFileMinor,
        DeviceFileMode, ...); empty when it cannot be read. None (a Problem added) when
        DeviceFileMinor or DeviceFileMode is not a number in its range (a minor of at
        most 20 bits, as parse_mig_minors; permission bits up to 0o7777): the node it
        would name or create cannot be trusted."""
        try:
            text = self.root.read_text(proc_path)
        except OSError:
            return {}
        out: dict[str, int] = {}
        for line in text.splitlines():
            key, _, value = line.partition(":")
            key = key.strip()
            limit = _CAP_FIELD_MAX.get(key)
            number = parse_uint(value, maximum=limit if limit is not None else MAX_UINT)
            if number is None and limit is not None:
                self.problems.append(Problem(proc_path, (
                    f"{key} {value.strip()[:32]!r} is not a number from 0 to {limit}: "
                    f"{what} is left out")))
                return None
            if number is not None:
                out.setdefault(key, number)
        return out

    def mig_minors(self) -> dict[str, int]:
        if self._mig_minors is None:
            try:
                text = self.root.read_text(MIG_MINORS)
            except OSError:
                text = ""
            self._mig_minors = parse_mig_minors(text)
        return self._mig_minors

    def caps_major(self) -> int | None:
        if not self._caps_major_read:
            self._caps_major_read = True
            self._caps_major = char_major(self.root, "nvidia-caps")
        return self._caps_major


def parse_mig_minors(text: str) -> dict[str, int]:
    """/proc/driver/nvidia-caps/mig-minors: "<capability> <minor>" lines, the capability
    one of config, monitor, gpu<N>/gi<G>/access, gpu<N>/gi<G>/ci<C>/access (N the GPU's
    minor). Malformed lines are skipped, as the toolkit does (internal/nvcaps)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) != 2 or not _MIG_CAP_RE.fullmatch(fields[0]) \
                or not _MINOR_RE.fullmatch(fields[1]) or int(fields[1]) > MAX_MINOR:
            continue
        out.setdefault(fields[0], int(fields[1]))
    return out


# ---- devices -------------------------------------------------------------------------


def _devices(snap: nvml.NvmlSnapshot, scan: _Scan) -> list[Device]:
    gpu_by_bus: dict[str, str] = {}
    bus_of: dict[int, str] = {}
    for g in snap.gpus:
        try:
            bus_of[g.index] = normalise_pci_bus_id(g.pci_bus_id)
            gpu_by_bus[bus_of[g.index]] = str(g.index)
        except ValueError:
            scan.problems.append(Problem(VENDOR, f"GPU {g.index}: bad PCI bus id "
                                                 f"{g.pci_bus_id!r}"))
    peers = _nvlink_peers(snap.gpus, gpu_by_bus)
    devices: list[Device] = []
    for g in snap.gpus:
        name = str(g.index)
        what = f"GPU {g.index} ({g.uuid})"
        bus = bus_of.get(g.index, "")
        node = scan.node(f"nvidia{g.minor}", expect=(NVIDIA_MAJOR, g.minor),
                         what=what + (" and its MIG devices" if g.migs else ""))
        if node is None:
            continue
        numa = g.numa_node if g.numa_node is not None else pci_numa_node(scan.root, bus)
        attrs = {"name": g.name}
        if g.brand is not None:
            attrs["brand"] = BRANDS.get(g.brand, "unknown")
        if g.arch is not None:
            attrs["arch"] = ARCHITECTURES.get(g.arch, "unknown")
        if g.compute_capability is not None:
            attrs["compute_capability"] = "{}.{}".format(*g.compute_capability)
        if g.memory_total is not None:
            attrs["memory_mib"] = str(g.memory_total // MIB)
        if g.mig_current is not None:
            attrs["mig_mode"] = "enabled" if g.mig_current else "disabled"
            if g.mig_pending != g.mig_current:
                scan.problems.append(Problem(VENDOR, (
                    f"{what}: MIG mode change to "
                    f"{'enabled' if g.mig_pending else 'disabled'} is pending a GPU reset")))
        devices.append(Device(
            kind=KIND_GPU, name=name, uuid=g.uuid, aliases=(bus,) if bus else (),
            edits=ContainerEdits(device_nodes=(node,)), numa_node=numa, pci_bus_id=bus,
            attributes=_frozen(attrs), links=peers.get(name, ()), vendor=VENDOR,
        ))
        devices.extend(_mig_devices(g, node, bus, numa, attrs, scan))
    return devices


def _nvlink_peers(gpus: Iterable[nvml.GpuInfo], gpu_by_bus: dict[str, str]
                  ) -> dict[str, tuple[str, ...]]:
    """GPU name -> names of the GPUs it reaches over NVLink. A link to another GPU is
    direct; GPUs with links to NVSwitches all reach one another."""
    direct: dict[str, set[str]] = {}
    fabric: set[str] = set()
    for g in gpus:
        me = str(g.index)
        for link in g.links:
            try:
                remote = gpu_by_bus.get(normalise_pci_bus_id(link.remote_bus_id))
            except ValueError:
                continue
            if remote is not None and link.remote_type in (None, _NVLINK_GPU):
                direct.setdefault(me, set()).add(remote)
            elif link.remote_type == _NVLINK_SWITCH:
                fabric.add(me)
    out = {}
    for name in {*direct, *fabric}:
        reach = direct.get(name, set()) | (fabric if name in fabric else set())
        reach.discard(name)
        out[name] = tuple(sorted(reach, key=int))
    return out


def _mig_devices(g: nvml.GpuInfo, parent_node: DeviceNode, bus: str, numa: int | None,
                 parent_attrs: dict[str, str], scan: _Scan) -> list[Device]:
    out = []
    for m in g.migs:
        name = f"{g.index}:{m.index}"
        what = f"MIG device {name} ({m.uuid})"
        gpu_dir = f"{PROC_CAPS}/gpu{g.minor}/mig/gi{m.gi}"
        key = f"gpu{g.minor}/gi{m.gi}"
        gi_node = scan.cap_node(f"{gpu_dir}/access", f"{key}/access", what=what)
        ci_node = scan.cap_node(f"{gpu_dir}/ci{m.ci}/access", f"{key}/ci{m.ci}/access",
                                what=what)
        if gi_node is None or ci_node is None:
            continue
        attrs = {k: parent_attrs[k] for k in ("brand", "arch", "compute_capability")
                 if k in parent_attrs}
        attrs.update(gi_id=str(m.gi), ci_id=str(m.ci))
        if m.name:
            attrs["name"] = m.name
        profile = mig_profile(m, g.memory_total)
        if profile:
            attrs["mig_profile"] = profile
        if m.memory_total is not None:
            attrs["memory_mib"] = str(m.memory_total // MIB)
        legacy = f"MIG-{g.uuid}/{m.gi}/{m.ci}"
        out.append(Device(
            kind=KIND_MIG, name=name, uuid=m.uuid,
            aliases=(legacy,) if legacy != m.uuid else (),
            edits=ContainerEdits(device_nodes=(parent_node, gi_node, ci_node)),
            numa_node=numa, pci_bus_id=bus, parent=str(g.index),
            attributes=_frozen(attrs), vendor=VENDOR,
        ))
    return out


def mig_profile(m: nvml.MigInfo, gpu_memory: int | None) -> str:
    """The MIG profile ("1g.10gb", "1c.2g.20gb", "1g.10gb+me"): NVML's own, the last word
    of the MIG device's name; else computed from its slices and memory as NVIDIA's
    go-nvlib does (memory rounded up to eighths of the GPU, in whole GB)."""
    last = m.name.rsplit(" ", 1)[-1]
    if _PROFILE_RE.match(last):
        return last
    if None in (m.gi_slices, m.ci_slices, m.memory_size_mb) or not gpu_memory:
        return ""
    fraction = math.ceil(m.memory_size_mb * MIB / gpu_memory * 8) / 8  # type: ignore[operator]
    gb = round(fraction * ((gpu_memory + GIB - 1) // GIB))
    prefix = f"{m.ci_slices}c." if m.ci_slices != m.gi_slices else ""
    return f"{prefix}{m.gi_slices}g.{gb}gb"


# ---- driver files --------------------------------------------------------------------


def _capabilities(locator: Locator, version: str, scan: _Scan) -> dict[str, ContainerEdits]:
    def libs(names: Iterable[str], arch: Arch, lib_dir: str) -> list[Mount]:
        out = []
        for n in names:
            path = locator.find_versioned(n, version, arch)
            if path is not None:
                out.append(Mount(locator.host_path(path),
                                 f"{lib_dir}/{locator.soname_of(path)}"))
        return out

    def by_soname(sonames: Iterable[str]) -> list[Mount]:
        return [Mount(locator.host_path(path), f"{LIB_DIR}/{soname}")
                for soname in sonames if (path := locator.find_soname(soname)) is not None]

    def bins(names: Iterable[str]) -> list[Mount]:
        return [Mount(locator.host_path(p), f"{BIN_DIR}/{n}")
                for n in names if (p := locator.find_binary(n)) is not None]

    def ipc(paths: Iterable[str], is_kind: Callable[[int], bool], kind: str) -> list[Mount]:
        # Each of `paths` that exists, mounted where it is (its directories resolved in
        # the root, so /var/run -> /run gives one mount at /run/...). The last component
        # is taken as it is, never followed: a link planted there (/tmp is
        # world-writable) would otherwise bind any host directory.
        out: list[Mount] = []
        seen: set[str] = set()
        for path in paths:
            parent = locator.resolve(posixpath.dirname(path))
            if parent is None:
                continue
            leaf = posixpath.join(parent, posixpath.basename(path))
            if leaf in seen:
                continue
            seen.add(leaf)
            try:
                st = os.lstat(locator.local_path(leaf))
            except OSError:
                continue
            if not is_kind(st.st_mode):
                scan.problems.append(Problem(locator.host_path(leaf), (
                    f"is not a {kind} (a symlink is not followed): it is not mounted")))
                continue
            who = _replaceable_by(locator, leaf, st)
            if who:
                scan.problems.append(Problem(locator.host_path(leaf), (
                    f"{who} could replace it with a link to any host directory before the "
                    "runtime mounts it: it is not mounted")))
                continue
            out.append(Mount(locator.host_path(leaf), leaf, options=IPC_OPTIONS))
        return out

    def configs(names: Iterable[str], dirs: Iterable[str] = CONFIG_DIRS,
                mounted_under: str | None = None) -> list[Mount]:
        # each name's first file in `dirs`, mounted under the directory it was found in
        # unless `mounted_under` says another
        out = []
        for name in names:
            found = _first_file(locator, dirs, name)
            if found is not None:
                where, path = found
                out.append(Mount(locator.host_path(path), f"{mounted_under or where}/{name}"))
        return out

    def run_paths(name: str) -> tuple[str, ...]:
        return tuple(f"{d}/{name}" for d in RUN_DIRS)

    def nodes(*maybe: DeviceNode | None) -> tuple[DeviceNode, ...]:
        return tuple(n for n in maybe if n is not None)

    firmware = _firmware(locator, version)
    compute_libs = [*libs(COMPUTE_LIBS, locator.arch, LIB_DIR), *by_soname(COMPUTE_SONAMES)]
    cuda = locator.find_versioned("libcuda.so", version, locator.arch)  # one of compute_libs
    if cuda is None:
        scan.problems.append(Problem(VENDOR, (
            f"libcuda.so.{version} not found under driver root {locator.root.driver_root}: "
            "the compute capability cannot run CUDA")))
    vulkan = (*VULKAN_CONFIGS, *filter(None, [VULKAN_ARCH_ICD.get(locator.arch.name)]))
    graphics = (*libs(GRAPHICS_LIBS, locator.arch, LIB_DIR), *by_soname(EGL_PLATFORM_SONAMES),
                *libs((ALLOCATOR,), locator.arch, LIB_DIR), *_gbm_backend(locator, version, cuda),
                *configs(GRAPHICS_CONFIGS), *configs(vulkan, VULKAN_CONFIG_DIRS, VULKAN_DIR),
                *_xorg_modules(locator, version, cuda))
    uvm = nodes(
        scan.driver_node("nvidia-uvm", "nvidia-uvm", 0, what="/dev/nvidia-uvm (compute)"),
        scan.node("nvidia-uvm-tools", what="/dev/nvidia-uvm-tools (compute)", required=False),
    )
    compute_core = ContainerEdits(device_nodes=uvm, mounts=(
        *compute_libs, *ipc((MPS_PIPE_DIR,), stat.S_ISDIR, "directory")))
    ctl = scan.node("nvidiactl", expect=(NVIDIA_MAJOR, NVIDIACTL_MINOR), what="every NVIDIA "
                    "capability (/dev/nvidiactl)")
    modeset = scan.node("nvidia-modeset", expect=(NVIDIA_MAJOR, MODESET_MINOR),
                        what="/dev/nvidia-modeset (display)", required=False)
    caps = {
        # GSP firmware with every capability, as libnvidia-container mounts it: the kernel
        # loads it from the mount namespace of whoever first opens the GPU.
        "": ContainerEdits(device_nodes=nodes(ctl), mounts=tuple(firmware)),
        "utility": ContainerEdits(mounts=(
            *libs(UTILITY_LIBS, locator.arch, LIB_DIR), *bins(UTILITY_BINS),
            *ipc(run_paths(PERSISTENCED_SOCKET), stat.S_ISSOCK, "socket"),
            *ipc(run_paths(FABRICMANAGER_SOCKET), stat.S_ISSOCK, "socket"))),
        "compute": compute_core.merged(ContainerEdits(mounts=tuple(bins(COMPUTE_BINS)))),
        "video": ContainerEdits(mounts=tuple(libs(VIDEO_LIBS, locator.arch,
                                                  LIB_DIR))).merged(compute_core),
        "graphics": ContainerEdits(mounts=graphics),
        "display": ContainerEdits(device_nodes=nodes(modeset), mounts=graphics),
        "ngx": ContainerEdits(mounts=tuple(libs(NGX_LIBS, locator.arch, LIB_DIR))),
    }
    compat = COMPAT32.get(locator.arch.name)
    if compat is not None:
        # compat32 is no set of files of its own: it adds the 32-bit builds of what the
        # other requested capabilities select (libnvidia-container mounts libs32 through
        # the same match_library_flags() filter as the 64-bit ones, nvc_mount.c).
        for cap, names in COMPAT32_LIBS.items():
            caps[f"{COMPAT32_PREFIX}{cap}"] = ContainerEdits(
                mounts=tuple(libs(names, ARCHES[compat], LIB32_DIR)))
    for cap, key in (("mig-config", "config"), ("mig-monitor", "monitor")):
        path = f"{PROC_CAPS}/mig/{key}"
        if scan.root.exists(path):
            caps[cap] = ContainerEdits(device_nodes=nodes(scan.cap_node(path, key, what=cap)))
    caps.update(_imex_channels(scan))
    return {k: _sorted(v) for k, v in caps.items() if v}


def _imex_channels(scan: _Scan) -> dict[str, ContainerEdits]:
    """IMEX_CHANNEL_PREFIX + N -> the node of IMEX channel N, of each
    /dev/nvidia-caps-imex-channels/channel<N> the host has, of the major /proc/devices
    gives nvidia-caps-imex-channels, minor N (the driver's, nvidia-modprobe -i N, or the
    IMEX daemon makes them; none is made here). A channel joins the GPUs of other nodes
    of an NVLink domain, so a container gets one only where it asks (NVIDIA_IMEX_CHANNELS)."""
    major = char_major(scan.root, IMEX_DRIVER)
    if major is None:
        return {}
    out = {}
    for entry in scan.root.listdir(scan.root.dev_path(IMEX_DIR)):
        m = _IMEX_CHANNEL_RE.fullmatch(entry)
        if m is None or (n := int(m[1])) > MAX_MINOR:
            continue
        node = scan.node(f"{IMEX_DIR}/{entry}", expect=(major, n), what=f"IMEX channel {n}")
        if node is not None:
            out[f"{IMEX_CHANNEL_PREFIX}{n}"] = ContainerEdits(device_nodes=(node,))
    return out


def _xorg_modules(locator: Locator, version: str, cuda: str | None) -> list[Mount]:
    """X.Org's NVIDIA driver and GLX modules (XORG_MODULE_DIRS above), each mounted at its
    own path, the GLX module at its unversioned name too; `cuda`: libcuda's path, whose
    directory is the driver's library directory (None: not found)."""
    lib_dir = [posixpath.dirname(cuda)] if cuda is not None else []
    dirs = (*(f"{d}/nvidia/xorg" for d in lib_dir),
            *(f"{d}/xorg/{m}" for d in lib_dir for m in XORG_MODULE_DIRS),
            *(f"{t}/{m}" for t in XORG_TREES for m in XORG_MODULE_DIRS))
    out = []
    for name, also in ((XORG_DRIVER, ()), (f"{XORG_GLX}.{version}", (XORG_GLX,))):
        found = _first_file(locator, dirs, name)
        if found is not None:
            where, path = found
            out += [Mount(locator.host_path(path), f"{where}/{n}") for n in (name, *also)]
    return out


def _gbm_backend(locator: Locator, version: str, cuda: str | None) -> list[Mount]:
    """GBM_BACKEND beside `cuda` (libcuda's path; None: not found), mounted at its own
    path, where it resolves to this driver's libnvidia-allocator; [] elsewhere."""
    if cuda is None:
        return []
    link = f"{posixpath.dirname(cuda)}/{GBM_BACKEND}"
    path = locator.regular_file(link)
    if path is None or posixpath.basename(path) != f"{ALLOCATOR}.{version}":
        return []
    return [Mount(locator.host_path(path), link)]


def _first_file(locator: Locator, dirs: Iterable[str], name: str) -> tuple[str, str] | None:
    """(the directory, the file resolved inside the root) of the first of `dirs` that
    holds `name` as a regular file (a link inside the root followed, as the firmware's);
    None when none does."""
    for where in dirs:
        path = locator.regular_file(f"{where}/{name}")
        if path is not None:
            return where, path
    return None


def _drm_nodes(devices: Iterable[Device], scan: _Scan) -> dict[str, ContainerEdits]:
    """Each GPU's DRM nodes, as the capability DRM_PREFIX + its PCI bus id: the entries
    card<N> and renderD<N> of its /sys/bus/pci/devices/<bus id>/drm (nvidia-drm loaded;
    the toolkit's drm.GetDeviceNodesByBusID reads the same), each the node /dev/dri/<entry>
    of DRM's major with minor N (drm_drv.c registers major 226; drm_sysfs.c names the
    nodes after their minors: card0-63, renderD128-191), taken as every node is (a
    stale or foreign one is a Problem, and left out)."""
    out = {}
    for d in devices:
        if d.kind != KIND_GPU or not d.pci_bus_id:
            continue
        entries = scan.root.listdir(scan.root.sys_path(f"bus/pci/devices/{d.pci_bus_id}/drm"))
        nodes = []
        for entry in entries:
            named = _DRM_NODE_RE.fullmatch(entry)
            if named is None:  # controlD<N> (old kernels), files
                continue
            node = scan.node(f"dri/{entry}", expect=(DRM_MAJOR, int(named[2])),
                             what=f"GPU {d.name}'s DRM node (graphics, display)")
            if node is not None:
                nodes.append(node)
        if nodes:
            out[DRM_PREFIX + d.pci_bus_id] = _sorted(ContainerEdits(device_nodes=tuple(nodes)))
    return out


DRM_MAJOR = 226  # DRM's character major (the kernel's DRM_MAJOR)
_DRM_NODE_RE = re.compile(r"(card|renderD)([0-9]{1,6})")


def _firmware(locator: Locator, version: str) -> list[Mount]:
    """GSP firmware files nvidia/<version>/gsp*.bin of each directory the kernel's
    firmware loader searches, in the driver root, each mounted where it was found (the
    kernel looks there, in the mount namespace of whoever opens the GPU first): the
    firmware_class.path module parameter where it is set (COS sets one), then
    FIRMWARE_DIRS, as nvidia-container-toolkit searches them."""
    root = locator.root
    custom = read_stripped(root, root.sys_path(FIRMWARE_CLASS_PATH)) or ""
    release = read_stripped(root, OS_RELEASE) or ""
    dirs = [custom] if custom.startswith("/") else []
    dirs += [d.format(release=release) for d in FIRMWARE_DIRS if release or "{" not in d]
    out: dict[str, Mount] = {}
    for base in dirs:
        fw_dir = posixpath.normpath(f"{base}/nvidia/{version}")
        resolved_dir = locator.resolve(fw_dir)
        if resolved_dir is None:
            continue
        for n in locator.listdir(resolved_dir):
            if n.startswith("gsp") and n.endswith(".bin"):
                path = locator.regular_file(f"{resolved_dir}/{n}")
                if path is not None:
                    out.setdefault(f"{fw_dir}/{n}", Mount(locator.host_path(path),
                                                          f"{fw_dir}/{n}"))
    return list(out.values())


def _sorted(edits: ContainerEdits) -> ContainerEdits:
    merged = merge_edits((edits,))
    return ContainerEdits(
        device_nodes=tuple(sorted(merged.device_nodes, key=lambda n: n.path)),
        mounts=tuple(sorted(merged.mounts, key=lambda m: m.container_path)),
    )


def _cuda_version(v: int | None) -> str:
    return f"{v // 1000}.{v % 1000 // 10}" if v else ""


def _frozen(attrs: dict[str, str]) -> MappingProxyType[str, str]:
    return MappingProxyType(dict(sorted(attrs.items())))


def _replaceable_by(locator: Locator, leaf: str, st: os.stat_result) -> str:
    """Who could put something else at `leaf` (a resolved path: no link in it) between
    discovery and the runtime's mount of it, which resolves it again on the host,
    without being root or whom root gave a directory on its way (nvidia-persistenced
    --user owns its run directory): anyone who may write to a directory on its way,
    unless it is sticky (/tmp), and then the owner of the entry in it, unless root. ""
    when no one can. An IPC path emitted as a mount source must stay what discovery saw
    (CVE-2024-0132 was a mount source swapped for a link between check and use)."""
    parts = leaf.strip("/").split("/")
    sticky = False  # the directory above is sticky and others may write to it
    for n in range(len(parts) + 1):
        path = "/" + "/".join(parts[:n])
        try:
            d = st if n == len(parts) else os.lstat(locator.local_path(path))
        except OSError:
            return f"whoever made {locator.host_path(path)} unreadable"
        if sticky and d.st_uid != 0:
            return f"uid {d.st_uid}, the owner of {locator.host_path(path)},"
        shared = bool(d.st_mode & 0o022)
        if shared and n < len(parts) and not d.st_mode & stat.S_ISVTX:
            return f"anyone who may write to {locator.host_path(path)}"
        sticky = shared
    return ""
