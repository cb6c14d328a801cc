"""AMD Instinct (amdgpu + amdkfd): discovery, AMD_VISIBLE_DEVICES, container env.

Owns: PROFILE (a VisibleDevicesProfile), discover(root) -> Found, parse_visible(value),
container_env(granted), probe(root) and the family constants (FAMILY, KIND, ENV_VISIBLE,
VISIBLE_NONE). Imports the standard library, msgspec, nri_accel.errors, nri_accel.inventory,
nri_accel.log, nri_accel.syntax, nri_accel.discover.{base,hostroot,kernel,probe} and
nri_accel.vendors.base. No ioctl, no libdrm.

Facts it relies on (sources: repository + path):

- KFD topology, /sys/class/kfd/kfd/topology/: generation_id (bumped on every change)
  and nodes/<N>/ with gpu_id (0 for CPU nodes), name and properties, one
  "<key> <decimal value>" per line (torvalds/linux drivers/gpu/drm/amd/amdkfd/
  kfd_topology.c, node_show and kfd_build_sysfs_node_entry; real files in
  ROCm/k8s-device-plugin testdata/topo-mi210-xgmi-pcie/nodes/*/properties). Keys read
  here: simd_count (0 on CPU nodes: ROCr skips nodes with no compute cores,
  ROCm/ROCR-Runtime runtime/hsa-runtime/core/runtime/amd_filter_device.cpp,
  BuildDeviceUuidList), drm_render_minor, location_id (pci_dev_id(): bus << 8 | devfn),
  domain, unique_id (64-bit), hive_id (the XGMI hive; GPUs sharing one are linked),
  gfx_target_version, device_id, num_xcc. The topology is read as libhsakmt does:
  generation_id before and after, again if it moved (ROCm/ROCR-Runtime
  libhsakmt/src/topology.c, formerly ROCm/ROCT-Thunk-Interface src/topology.c:
  topology_take_snapshot).
- Device nodes: /dev/kfd (one for all GPUs; its major is the "kfd" entry of
  /proc/devices, register_chrdev in amdkfd's kfd_chardev.c) and per GPU
  /dev/dri/renderD<drm_render_minor> (DRM major 226, "drm"). Both are read with lstat
  and checked against /proc/devices; symlinks are refused. The ROCm device plugin gives
  a container /dev/kfd and the GPU's /dev/dri/card<N> and renderD<N>
  (ROCm/k8s-device-plugin internal/pkg/plugin/plugin.go, Allocate); compute needs only
  the render node (libhsakmt opens renderD<minor>), so the card (modesetting) node is
  not given.
- Index order: the AMD container toolkit numbers GPUs in the order of
  /sys/module/amdgpu/drivers/pci:amdgpu/<bdf> (sorted PCI addresses; partitions of one
  GPU grouped and sorted by render minor): ROCm/container-toolkit
  internal/amdgpu/amdgpu.go (GetAMDGPUsWithFS). Device names here follow that order:
  sorted by (PCI bus id, render minor), counting GPUs whose render node is refused, so
  the others keep their numbers. ROCm's own ordinals (ROCR_VISIBLE_DEVICES,
  rocm-smi) follow KFD node order; the KFD node number is kept as attribute kfd_node.
- Identity: ROCr's agent UUID is "GPU-" + the unique_id as 16 hex digits ("GPU-XX" when
  it is 0): amd_filter_device.cpp and hsa_ext_amd.h (HSA_AMD_AGENT_INFO_UUID); rocminfo
  prints it lower case. The container toolkit writes the same id as "0x" + hex
  (ROCm/container-toolkit internal/gpu-tracker/gpu-tracker.go, parseGPUsList). The
  device plugin's device id is the PCI address. Product name: the PCI function's
  product_name (amdgpu FRU, server boards only; Documentation/gpu/amdgpu/driver-misc.rst).
- Compute partitions (MI300 series in DPX, QPX or CPX mode, the PCI function's
  current_compute_partition): each partition is a KFD node of its own with its own
  render node (partition 0 the PCI function's own DRM device, the others amdgpu_xcp
  platform devices: amdgpu_xcp.c, amdgpu_xcp_dev_alloc), and the GPU's unique_id and
  hive_id (node_show prints adev->unique_id for every node of the GPU). Where the GPU
  has more than one KFD node, its nodes' location_id is pci_dev_id | node_id, the
  partition's index in its GPU (kfd_topology_add_device: `if (gpu->kfd->num_nodes >
  1) location_id |= node_id`, ROCm/amdgpu and torvalds/linux drivers/gpu/drm/amd/
  amdkfd/kfd_topology.c; an amd-gfx patch of February 2024 moved it to bits 31:28 and
  was reverted). So partitions are the GPU nodes sharing a domain, a bus and a nonzero
  unique_id; their GPU's PCI address is the AND of their location_ids (partition 0's,
  which always exists: it is the GPU's own DRM device), and each one's index is what
  its location_id adds to it, or its bits 31:28. From Linux 6.18 ("drm/amdkfd: set
  uuid for each partition in topology") a partition's unique_id is its first XCD's,
  one of its own: partitions are then the nodes whose location_id names a PCI function
  that is not there (function 0 of the slot is their GPU's), or one PCI function for
  several nodes (_apart), and their GPU's unique_id is read from its PCI function's
  amdgpu unique_id file (_with_gpu_ids; the partition's own is kept as the attribute
  partition_unique_id). A partition has no UUID, answers to no id it shares, and is
  named for what stays true of it, its GPU's PCI address and its index
  (Device.partition: "0000:11:00.0-p3", its key and its device-plugin ID) while the
  mode stays; its GPU's unique_id keys its whole. A new mode makes new devices, as a
  MIG reconfiguration does. ROCm's device plugin IDs partitions by the PCI address
  (partition 0) and the amdgpu_xcp_<N> platform device name (the others), whose N is a
  counter over every GPU in probe order (ROCm/k8s-device-plugin internal/pkg/amdgpu/
  amdgpu.go, GetAMDGPUs): not what stays true of one partition, so not used here.
- Driver version: /sys/module/amdgpu/version exists for the DKMS driver only (the
  in-tree module has no MODULE_VERSION); "" otherwise, which is not a problem.
- AMD_VISIBLE_DEVICES (gpu-tracker.go parseGPUsList, internal/oci/oci.go): "all"
  ("All", "ALL"); else ","-separated tokens, each a GPU index, a range "a-b" (a <= b),
  or a unique id ("0x<hex>", or more than 8 hex digits). Upstream ignores invalid
  tokens silently (so "none" selects nothing); here they are errors. There is no
  "none" keyword: VISIBLE_NONE = "none" grants nothing there.
- DOCKER_RESOURCE_*: amd-container-runtime reads every variable of that prefix (Docker
  Swarm's generic resources) exactly as AMD_VISIBLE_DEVICES, the last one in the env
  winning (ROCm/container-toolkit internal/oci/oci.go, getAMDEnv). nri-accel grants
  nothing for them, but one set implies AMD_VISIBLE_DEVICES (selector_prefixes), and
  each one set is written with the value AMD_VISIBLE_DEVICES gets (the granted GPUs'
  indices, or "none"), so that none of them, before or after it, widens the grant.
- ROCm env inside the container: not set. libhsakmt enumerates a GPU only if it can
  open its render node (libhsakmt/src/topology.c,
  topology_sysfs_check_node_supported: ENOENT/EPERM -> node skipped), so the injected
  GPUs are exactly the ones ROCm sees, numbered from 0 in KFD order; host indices in
  ROCR_VISIBLE_DEVICES/HIP_VISIBLE_DEVICES would select the wrong GPUs or none, and
  ordinals 0..n-1 would change nothing. Neither the ROCm device plugin nor the
  container toolkit sets them.
"""

from __future__ import annotations

import operator
import re
from collections import Counter
from collections.abc import Callable, Sequence
from functools import reduce
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from msgspec import Struct
from msgspec.structs import replace

from nri_accel.discover import kernel
from nri_accel.discover.base import Found
from nri_accel.discover.hostroot import HostRoot
from nri_accel.discover.probe import node_state
from nri_accel.errors import DiscoveryError
from nri_accel.inventory import (
    ContainerEdits,
    Device,
    DeviceNode,
    Driver,
    Problem,
    format_pci_bus_id,
)
from nri_accel.log import get_logger
from nri_accel.syntax import MAX_IDS, TOO_MANY_IDS, decimal_index
from nri_accel.vendors.base import VisibleDevicesProfile

if TYPE_CHECKING:
    from nri_accel.config import Config

log = get_logger(__name__)

FAMILY = "amd"
KIND = "amd.com/gpu"
ENV_VISIBLE = "AMD_VISIBLE_DEVICES"
VISIBLE_NONE = "none"
DOCKER_RESOURCE_PREFIX = "DOCKER_RESOURCE_"  # also read as AMD_VISIBLE_DEVICES upstream

KFD_DRIVER = "kfd"  # /proc/devices names
DRM_DRIVER = "drm"
MODULE_DIR = "module/amdgpu"
TOPOLOGY = "class/kfd/kfd/topology"
MAX_RANGE = 1024  # a range selecting more GPUs than any node has is a typo
_SNAPSHOT_TRIES = 3
_HEX = frozenset("0123456789abcdefABCDEF")
_RENDER_RE = re.compile(r"^renderD[0-9]+$")
_GRAMMAR = ("'all', 'none' or ','-separated GPU indices, ranges 'a-b' and unique ids "
            "'0x<hex>' (e.g. '0-3,5')")


class _GpuNode(Struct, frozen=True):
    """One GPU node of the KFD topology."""

    kfd_node: int
    gpu_id: int | None
    props: dict[str, int]
    bus_key: tuple[int, int, int, int]  # its GPU's PCI function
    partition: int | None = None  # its index among the GPU's partitions (_partitioned)

    @property
    def render_minor(self) -> int:
        return self.props["drm_render_minor"]

    @property
    def unique_id(self) -> int:
        return self.props.get("unique_id", 0)


_MAX_NODE = 1 << 16  # KFD topology node numbers (one per CPU socket or GPU)
_MAX_U32 = (1 << 32) - 1  # gpu_id is a u32


def discover(root: HostRoot) -> Found:
    """Every GPU node of the KFD topology, /dev/kfd as the driver's shared node."""
    problems: list[Problem] = []
    topo = root.sys_path(TOPOLOGY)
    module_loaded = root.exists(root.sys_path(MODULE_DIR))
    kfd_path = root.dev_path("kfd")
    if not root.exists(topo) and not module_loaded:
        return Found()  # no amdgpu here (a /dev/kfd alone may be a CDI spec's node)

    gpus = _with_gpu_ids(_partitioned(_snapshot(root, problems), lambda key: root.exists(
        root.sys_path(f"bus/pci/devices/{format_pci_bus_id(key)}"))), root)
    if not root.exists(topo):
        problems.append(Problem(topo, "missing: amdkfd is not initialised, no GPU is usable "
                                "for compute"))
    elif not gpus and module_loaded:
        problems.append(Problem(topo, "no GPU node (only CPU nodes)"))

    majors = kernel.proc_devices(root)
    if majors is None:
        problems.append(Problem(kernel.PROC_DEVICES, "unreadable: device majors not "
                                "checked against the driver's"))
    kfd: DeviceNode | None = None
    kfd_error = ""
    try:
        kfd = kernel.node_checked(root, kfd_path, majors=majors, driver=KFD_DRIVER,
                                   minor=None)
    except DiscoveryError as e:
        problems.append(Problem(e.source, e.message))
        kfd_error = f"{kfd_path} unusable: {e.message}"

    uid_count = Counter(g.unique_id for g in gpus)
    bus_count = Counter(g.bus_key for g in gpus)
    devices: list[Device] = []
    # names count every GPU node, usable or not, so they keep the toolkit's numbering
    for index, gpu in enumerate(sorted(gpus, key=lambda g: (g.bus_key, g.render_minor))):
        device = _device(root, gpu, str(index), majors, problems, kfd_error,
                         unique_uid=uid_count[gpu.unique_id] == 1,
                         unique_bus=bus_count[gpu.bus_key] == 1)
        if device is not None:
            devices.append(device)

    version = kernel.read_stripped(root, root.sys_path(f"{MODULE_DIR}/version"))
    capabilities = {"": ContainerEdits(device_nodes=(kfd,))} if kfd is not None else {}
    driver = Driver(vendor=FAMILY, version=version or "",
                    capabilities=MappingProxyType(capabilities))
    devices = _with_hive_links(devices)
    log.debug("amd_discovered", devices=len(devices), version=driver.version,
              problems=len(problems))
    return Found(devices=tuple(devices), drivers=(driver,), problems=tuple(problems))


def _snapshot(root: HostRoot, problems: list[Problem]) -> list[_GpuNode]:
    """The GPU nodes, read between two equal generation_id values (as libhsakmt does)."""
    gen_path = root.sys_path(f"{TOPOLOGY}/generation_id")
    for _ in range(_SNAPSHOT_TRIES):
        attempt: list[Problem] = []
        before = kernel.read(root, gen_path, attempt)
        gpus = _read_nodes(root, attempt)
        if kernel.read(root, gen_path) == before:
            problems += attempt
            return gpus
    problems.append(Problem(gen_path, f"the topology kept changing over {_SNAPSHOT_TRIES} "
                            "reads; it is read again at the next refresh"))
    problems += attempt
    return gpus


def _read_nodes(root: HostRoot, problems: list[Problem]) -> list[_GpuNode]:
    nodes_dir = root.sys_path(f"{TOPOLOGY}/nodes")
    gpus = []
    numbers = []
    for x in root.listdir(nodes_dir):
        n = kernel.parse_uint(x, maximum=_MAX_NODE)
        if n is not None:
            numbers.append(n)
        elif x.isdigit():  # digits, but not ASCII or far too many
            problems.append(Problem(f"{nodes_dir}/{x}", "not a node number: skipped"))
    for n in sorted(numbers):
        base = f"{nodes_dir}/{n}"
        node_problems: list[Problem] = []
        text = kernel.read(root, f"{base}/properties", node_problems)
        if text is None:
            problems += node_problems or [Problem(f"{base}/properties",
                                                  "unreadable: node skipped")]
            continue
        props = _parse_properties(text, f"{base}/properties", problems)
        if props.get("simd_count", 0) == 0:
            continue  # a CPU node
        gpu_id_text = kernel.read_stripped(root, f"{base}/gpu_id", problems)
        gpu_id = kernel.parse_uint(gpu_id_text, maximum=_MAX_U32) if gpu_id_text else None
        if gpu_id_text and gpu_id is None:
            problems.append(Problem(f"{base}/gpu_id", f"not a number: {gpu_id_text[:32]!r}"))
        if props.get("drm_render_minor", 0) <= 0:
            problems.append(Problem(f"{base}/properties", "GPU node without a render node "
                                    "(drm_render_minor): skipped"))
            continue
        if "location_id" not in props:
            problems.append(Problem(f"{base}/properties", "GPU node without location_id "
                                    "(PCI address): skipped"))
            continue
        loc, domain = props["location_id"], props.get("domain", 0)
        key = (domain, (loc >> 8) & 0xFF, (loc >> 3) & 0x1F, loc & 0x7)
        gpus.append(_GpuNode(kfd_node=n, gpu_id=gpu_id, props=props, bus_key=key))
    return gpus


def _partitioned(gpus: list[_GpuNode],
                 is_function: Callable[[tuple[int, int, int, int]], bool]) -> list[_GpuNode]:
    """`gpus` with the compute partitions of each GPU told apart: the GPU nodes sharing
    a domain, a bus and a nonzero unique_id get their GPU's PCI function and their
    index in it (see the module docstring), and so do those _apart() finds of a kernel
    that gives each partition a unique_id of its own. Should a GPU's location_ids not
    tell its partitions apart (no kernel writes that), they are numbered by render
    minor, the order amdgpu creates them in. `is_function`: whether a PCI function is
    there (sysfs)."""
    groups: dict[tuple[int, ...], list[_GpuNode]] = {}
    for g in gpus:
        key = (g.bus_key[0], g.bus_key[1], g.unique_id) if g.unique_id else g.bus_key
        groups.setdefault(key, []).append(g)
    out = []
    for members in _apart(list(groups.values()), is_function):
        if len(members) == 1:
            out += members
            continue
        locations = [m.props["location_id"] for m in members]
        base = reduce(operator.and_, (loc & 0xFFFF for loc in locations))
        index = [(loc >> 28) & 0xF or (loc & 0xFFFF) ^ base for loc in locations]
        if len(set(index)) < len(index):
            by_minor = sorted(range(len(members)), key=lambda k: members[k].render_minor)
            index = [by_minor.index(k) for k in range(len(members))]
        bus = (members[0].bus_key[0], base >> 8, (base >> 3) & 0x1F, base & 0x7)
        out += [replace(m, bus_key=bus, partition=n)
                for m, n in zip(members, index, strict=True)]
    return out


def _apart(groups: list[list[_GpuNode]],
           is_function: Callable[[tuple[int, int, int, int]], bool]) -> list[list[_GpuNode]]:
    """`groups` with the partitions that a unique_id of their own kept apart put
    together again: from Linux 6.18 (drm/amdkfd, "set uuid for each partition in
    topology") a partition's unique_id is that of its first XCD, not its GPU's, so each
    partition of a GPU is a group of its own above. A lone node is one GPU's partition
    where its location_id names a PCI function that is not there (pci_dev_id |
    node_id: function 0 of its slot is the GPU's), or names the PCI function another
    lone node names (node_id << 28): no two GPUs are one PCI function."""
    homes: dict[tuple[int, int, int, int], list[_GpuNode]] = {}
    out = []
    for members in groups:
        if len(members) > 1:
            out.append(members)
            continue
        (g,) = members
        d, bus, dev, fn = g.bus_key
        home = g.bus_key if fn == 0 or is_function(g.bus_key) else (d, bus, dev, 0)
        homes.setdefault(home, []).append(g)
    return out + list(homes.values())


def _with_gpu_ids(gpus: list[_GpuNode], root: HostRoot) -> list[_GpuNode]:
    """Each partition with its GPU's unique_id for its own, which keys the GPU whole
    (AmdProfile.partition_whole) across a change of mode and leaves the partitions no
    UUID (they answer to their partition id). From Linux 6.18 a partition's own is its
    first XCD's (kept as partition_unique_id); the GPU's is then its PCI function's
    amdgpu unique_id file ("%016llx"), else the one its partitions share."""
    shared: dict[tuple[int, int, int, int], set[int]] = {}
    for g in gpus:
        if g.partition is not None:
            shared.setdefault(g.bus_key, set()).add(g.unique_id)
    gpu_uids = {key: _gpu_unique_id(root, key, ids) for key, ids in shared.items()}
    out = []
    for g in gpus:
        if g.partition is None:
            out.append(g)
            continue
        gpu_uid = gpu_uids[g.bus_key]
        props = {**g.props, "unique_id": gpu_uid}
        if g.unique_id not in (0, gpu_uid):
            props["partition_unique_id"] = g.unique_id
        out.append(replace(g, props=props))
    return out


def _gpu_unique_id(root: HostRoot, bus_key: tuple[int, int, int, int], ids: set[int]) -> int:
    """The unique_id of the GPU at PCI function `bus_key` whose partitions report `ids`:
    its amdgpu unique_id file, else the one id they share, else 0 (not known)."""
    text = kernel.read_stripped(
        root, root.sys_path(f"bus/pci/devices/{format_pci_bus_id(bus_key)}/unique_id"))
    if text and _HEX16_RE.fullmatch(text):
        return int(text, 16)
    return next(iter(ids)) if len(ids) == 1 else 0


_HEX16_RE = re.compile(r"[0-9a-fA-F]{1,16}")


def _parse_properties(text: str, source: str, problems: list[Problem]) -> dict[str, int]:
    """The "name value" lines of a KFD node's properties (values are u64, printed
    "%llu" by kfd_topology.c); a value that is not one is left out with a Problem."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[1].isdigit():
            value = kernel.parse_uint(parts[1])
            if value is None:
                problems.append(Problem(source, f"{parts[0][:64]}: not a number: "
                                        f"{parts[1][:32]!r}; left out"))
                continue
            out[parts[0]] = value
    return out


def _device(root: HostRoot, gpu: _GpuNode, name: str,
            majors: dict[str, frozenset[int]] | None, problems: list[Problem],
            kfd_error: str, *, unique_uid: bool, unique_bus: bool) -> Device | None:
    render = root.dev_path(f"dri/renderD{gpu.render_minor}")
    try:
        node = kernel.node_checked(root, render, majors=majors, driver=DRM_DRIVER,
                                    minor=gpu.render_minor)
    except DiscoveryError as e:
        problems.append(Problem(e.source, e.message))
        return None
    bus_id = format_pci_bus_id(gpu.bus_key)
    uuid = f"GPU-{gpu.unique_id:016x}" if gpu.unique_id and unique_uid else ""
    props = gpu.props
    attributes = {
        "kfd_node": str(gpu.kfd_node),
        "drm_render_minor": str(gpu.render_minor),
        "simd_count": str(props["simd_count"]),
    }
    if gpu.gpu_id is not None:
        attributes["gpu_id"] = str(gpu.gpu_id)
    for key in ("gfx_target_version", "num_xcc"):
        if props.get(key):
            attributes[key] = str(props[key])
    if props.get("device_id"):
        attributes["device_id"] = f"0x{props['device_id']:04x}"  # PCI device id
    for key in ("hive_id", "unique_id", "partition_unique_id"):
        if props.get(key):
            attributes[key] = f"0x{props[key]:016x}"
    product = kernel.read_stripped(root, root.sys_path(f"bus/pci/devices/{bus_id}/"
                                                        "product_name"))
    if product:
        attributes["product_name"] = product
    if kfd_error:
        attributes["health"] = kfd_error
    aliases = [f"renderD{gpu.render_minor}"]
    if unique_bus:
        aliases.append(bus_id)
    if uuid:
        aliases.append(f"0x{gpu.unique_id:016x}")
    return Device(
        kind=KIND,
        name=name,
        uuid=uuid,
        aliases=tuple(aliases),
        edits=ContainerEdits(device_nodes=(node,)),
        numa_node=kernel.pci_numa_node(root, bus_id),
        pci_bus_id=bus_id,
        partition=gpu.partition,
        healthy=not kfd_error,
        attributes=MappingProxyType(dict(sorted(attributes.items()))),
        vendor=FAMILY,
    )


def _with_hive_links(devices: list[Device]) -> list[Device]:
    """links = the other GPUs of the same XGMI hive (nonzero hive_id)."""
    hives: dict[str, list[str]] = {}
    for d in devices:
        hive = d.attributes.get("hive_id")
        if hive:
            hives.setdefault(hive, []).append(d.name)
    out = []
    for d in devices:
        peers = hives.get(d.attributes.get("hive_id", ""), [])
        links = tuple(p for p in peers if p != d.name)
        out.append(replace(d, links=links) if links else d)
    return out


def parse_visible(value: str) -> str | tuple[str, ...] | None:
    """AMD_VISIBLE_DEVICES as the AMD container toolkit reads it.

    None: no request ("", and "none"/"void" in any case). "all" (also "All", "ALL").
    Otherwise the GPUs in the order written, without repeats: indices canonical
    ("03" -> "3"), ranges "a-b" expanded, unique ids as "GPU-<16 hex digits>" (the form
    of Device.uuid). ValueError on anything else, where upstream silently drops it, and
    on a value naming more than MAX_IDS GPUs, repeats and each GPU of a range counted
    (a range before it is expanded), as every id list is bounded (nri_accel.syntax).
    """
    if value == "" or value.lower() in ("none", "void"):
        return None
    if value in ("all", "All", "ALL"):
        return "all"
    if value.lower() == "all":
        raise ValueError(f"{value!r}: the toolkit reads only 'all', 'All' and 'ALL'")
    out: dict[str, None] = {}
    named = 0
    for token in value.split(","):
        items = _token(token)
        named += len(items)
        if named > MAX_IDS:
            raise ValueError(TOO_MANY_IDS)
        out.update(dict.fromkeys(map(str, items)))  # a repeat keeps its first place
    return tuple(out)


def _token(token: str) -> list[str] | range:
    """One token's GPUs: an id, or the indices of a range, not expanded yet."""
    if token == "":
        raise ValueError(f"empty element; expected {_GRAMMAR}")
    if token != token.strip():
        raise ValueError(f"{token!r} has spaces; expected {_GRAMMAR}")
    if token.lower() in ("all", "none", "void"):
        raise ValueError(f"{token!r} cannot be combined with other GPUs")
    if token[:4].upper() == "GPU-":
        raise ValueError(f"{token!r} is ROCm's UUID form; {ENV_VISIBLE} takes the unique id "
                         f"as '0x{token[4:]}'")
    prefixed = token[:2] in ("0x", "0X")
    if prefixed or (len(token) > 8 and set(token) <= _HEX):
        digits = token[2:] if prefixed else token
        if not 1 <= len(digits) <= 16 or not set(digits) <= _HEX:
            raise ValueError(f"{token!r} is not a GPU unique id (up to 16 hex digits)")
        uid = int(digits, 16)
        if uid == 0:
            raise ValueError(f"{token!r}: unique id 0 names no GPU")
        return [f"GPU-{uid:016x}"]
    try:
        if "-" in token:
            first, _, last = token.partition("-")
            a = int(decimal_index(first, "range start"))
            b = int(decimal_index(last, "range end"))
            if a > b:
                raise ValueError(f"range {token!r} runs backwards")
            if b - a >= MAX_RANGE:
                raise ValueError(f"range {token!r} selects more than {MAX_RANGE} GPUs")
            return range(a, b + 1)
        return [decimal_index(token, "GPU")]
    except ValueError as e:
        raise ValueError(f"{e}; expected {_GRAMMAR}") from None


def container_env(granted: Sequence[Device]) -> dict[str, str]:
    """The env of a container given `granted` (AMD GPUs, in the order given):
    AMD_VISIBLE_DEVICES = their indices. No ROCR_VISIBLE_DEVICES/HIP_VISIBLE_DEVICES (see
    the module docstring). Nothing for an empty grant."""
    names = list(dict.fromkeys(d.name for d in granted if d.kind == KIND))
    return {ENV_VISIBLE: ",".join(names)} if names else {}


def probe(root: HostRoot) -> list[tuple[str, object]]:
    """Cheap change detection: driver version, KFD topology generation, /dev/kfd and
    /dev/dri/renderD* (lstat identity)."""
    out: list[tuple[str, object]] = []
    for path in (root.sys_path(f"{MODULE_DIR}/version"),
                 root.sys_path(f"{TOPOLOGY}/generation_id")):
        out.append((path, kernel.read(root, path)))
    kfd = root.dev_path("kfd")
    out.append(node_state(root, kfd))
    dri = root.dev_path("dri")
    out += [node_state(root, f"{dri}/{n}")
            for n in root.listdir(dri) if _RENDER_RE.match(n)]
    return out


class AmdProfile(VisibleDevicesProfile):
    """The family as nri-accel's stages see it (nri_accel.vendors.base)."""

    name = FAMILY
    kinds = (KIND,)
    visible_var = ENV_VISIBLE
    visible_none = VISIBLE_NONE
    selector_prefixes = (DOCKER_RESOURCE_PREFIX,)
    parse_visible = staticmethod(parse_visible)
    container_env = staticmethod(container_env)

    def discover(self, root: HostRoot, config: Config) -> Found:
        return discover(root)

    def probe(self, root: HostRoot, config: Config) -> list[tuple[str, object]]:
        return probe(root)

    def partition_whole(self, device: Device) -> Device:
        """The GPU a compute partition is part of, keyed as discovery keys it whole (in
        SPX mode): by its ROCr UUID, "GPU-" and its GPU's unique_id, which discovery gives
        every partition (_with_gpu_ids)."""
        whole = super().partition_whole(device)
        uid = device.attributes.get("unique_id", "")  # "0x" and 16 hex digits (_device)
        return replace(whole, uuid=f"GPU-{uid[2:]}") if uid else whole

    def current_key(self, key: str, inventory: Any) -> str:
        """A partition's grant recorded before partitions had an index of their own
        named its GPU's PCI address ("amd.com/gpu=0000:11:00.0"): it holds that GPU
        whole, every partition of it (partition_whole)."""
        kind, _, ident = key.partition("=")
        if kind == KIND:
            for d in inventory.of_kind(KIND):
                if d.partition is not None and d.pci_bus_id == ident:
                    return self.partition_whole(d).key
        return key

    def unknown_hint(self, ident: str, inventory: Any) -> str:
        """A GPU's unique id or ROCm UUID where the GPU is split into compute partitions
        (DPX/QPX/CPX): they carry its unique_id but answer to none of its ids (module
        docstring), where amd-container-runtime takes it for all of them."""
        digits = ident[4:] if ident[:4].upper() == "GPU-" else ident[2:] if ident[:2] in (
            "0x", "0X") else ""
        if not 1 <= len(digits) <= 16 or not set(digits) <= _HEX:
            return ""
        uid = f"0x{int(digits, 16):016x}"
        parts = [d for d in inventory.of_kind(KIND)
                 if d.partition is not None and d.attributes.get("unique_id") == uid]
        if not parts:
            return ""
        shown = ", ".join(d.key.partition("=")[2] for d in parts[:2])
        return (f"GPU {uid} is split into {len(parts)} compute partitions, each a device of "
                f"its own: name them ({shown}, ...) or ask for a count")

    def partition(self, device: Device, inventory: Any) -> str:
        if device.partition is None:
            return ""
        return f"partition {device.partition} of {device.pci_bus_id}"


PROFILE = AmdProfile()
