"""Intel Gaudi (habanalabs driver): discovery, HABANA_VISIBLE_DEVICES, container env.

Owns: PROFILE (a VisibleDevicesProfile), discover(root) -> Found, parse_visible(value),
container_env(granted), probe(root) and the family constants (FAMILY, KIND, ENV_VISIBLE,
ENV_MODULES, ENV_PCI_BUS_IDS, VISIBLE_NONE). Imports the standard library, msgspec,
nri_accel.errors, nri_accel.inventory, nri_accel.log, nri_accel.syntax,
nri_accel.discover.{base,hostroot,kernel,probe} and nri_accel.vendors.base. No ioctl,
no hlml.

Facts it relies on (sources: repository + path):

- Device nodes. With the DRM accel subsystem (Linux >= 6.2, and the out-of-tree
  driver on such kernels), each device is /dev/accel/accel<N>, the accel core's node
  (ACCEL_MAJOR 261, "accel" in /proc/devices; minor == N), plus the driver's own
  control node /dev/accel/accel_controlD<N> (major allocated by the driver with
  alloc_chrdev_region(..., "habanalabs"), minor == N == the accel index): torvalds/linux
  drivers/accel/habanalabs/common/device.c (cdev_sysfs_debugfs_add, device_init_cdev)
  and habanalabs_drv.c (hl_init). Older drivers (class "habanalabs") create /dev/hl<N>
  and /dev/hl_controlD<N> with the "habanalabs" major and consecutive minors 2N and
  2N+1 (hl_device_init: "hl%d", hdev->id / 2; id_control = id + 1). Majors are read
  with lstat and checked against /proc/devices; symlinked nodes are refused.
- Sysfs. The attributes are added to hdev->dev (sysfs.c, hl_sysfs_init): with DRM
  accel that is the PCI function itself, so /sys/class/accel/accel<N>/device/ (a link
  to the PCI device) holds them; the out-of-tree driver without CONFIG_DRM_ACCEL adds
  the same attributes as a group named "device" (HabanaAI/drivers.accel.habanalabs.kernel
  drivers/accel/habanalabs/common/habanalabs_compat_accel.c), so the same path works.
  Old drivers: /sys/class/habanalabs/hl<N>/. Read here (sysfs.c; ABI document
  Documentation/ABI/testing/sysfs-driver-habanalabs): pci_addr ("%04x:%02x:%02x.%x"),
  module_id ("%u", the OAM slot: cpucp_info.card_location, not the index),
  device_type ("GAUDI2", ...), status (the status string with its first letter upper
  cased: "Operational", "In reset", "Disabled", "Needs reset", "In device creation",
  "In reset after device release"; device.c create_hdev), driver_ver (out-of-tree
  driver only). NUMA comes from the PCI function's numa_node.
- Identity. The driver exposes no serial number in sysfs (the device plugin and Intel's
  DRA driver get it from hlml, HabanaAI/habanalabs-k8s-device-plugin
  habana_device_plugin.go, intel/intel-resource-drivers-for-kubernetes
  pkg/gaudi/device/device.go), so `uuid` stays empty and the PCI bus id is the stable
  identity (an alias, with "accel<N>" or "hl<N>"): pci_addr, else the PCI function
  the device's "device" link leads to. A device with neither is left out, with a
  Problem: its index alone would name it, and another device takes that index when
  one does not come up.
- Health. A device whose status is not "Operational" is kept with healthy=False and
  attribute health = the status (the ABI document: every other state is unusable or
  transient).
- Scale-out NICs. The habana runtime also gives each selected device its RDMA verbs
  node: /sys/bus/pci/devices/<bdf>/infiniband_verbs/uverbs<M> -> /dev/infiniband/
  uverbs<M> (HabanaAI/habana-container-runtime discover/discover.go,
  UverbsForAccelerators; mount_uverbs defaults to true). It is added to the device's
  edits when present ("infiniband_verbs" major).
- Env. HabanaAI/habana-container-runtime cmd/habana-container-runtime/specs.go
  (filterDevicesByENV), main.go and cmd/habana-container-runtime-hook/container_config.go:
  "all" selects every device, any other value is split on "," into device indices
  (the CLI rejects non-numbers: cmd/habana-container-cli/main.go); there are no ranges
  and no UUIDs. The runtime matches an id against the last character of each node
  name, so "0" also matches accel10; this module reads the intended grammar (whole
  decimal indices). The legacy hook reads an empty value and "void" as unset and
  "none" as no device; the runtime has no "none" keyword, but "none" matches no device
  there either, so VISIBLE_NONE = "none" grants nothing under both.
  The current runtime (HabanaAI/gaudi-container-runtime cmd/habana-container-runtime/
  specs.go, filterDevicesByENV; main.go, IsHabanaContainer) also selects devices by
  HABANA_VISIBLE_MODULES (module ids), else HABANA_VISIBLE_PCI_BUS_IDS (pci_addr),
  where HABANA_VISIBLE_DEVICES is unset or "all". nri-accel grants nothing for those
  two, but either one set implies HABANA_VISIBLE_DEVICES (PROFILE.selectors): a
  container granted no Gaudi gets HABANA_VISIBLE_DEVICES=none, which the runtime reads
  first, so that it mounts nothing either.
  The device plugin (habana_device_plugin.go, Allocate) sets HABANA_VISIBLE_DEVICES to
  the granted indices joined by "," and HABANA_VISIBLE_MODULES to their module ids in
  the same order (the runtime README: "module IDs in the matching order of
  HABANA_VISIBLE_DEVICES"); container_env() writes both.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING

from msgspec import Struct

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
    parse_pci_bus_id,
)
from nri_accel.log import get_logger
from nri_accel.syntax import decimal_index
from nri_accel.vendors.base import VisibleDevicesProfile

if TYPE_CHECKING:
    from nri_accel.config import Config

log = get_logger(__name__)

FAMILY = "gaudi"
KIND = "habana.ai/gaudi"
ENV_VISIBLE = "HABANA_VISIBLE_DEVICES"
ENV_MODULES = "HABANA_VISIBLE_MODULES"
ENV_PCI_BUS_IDS = "HABANA_VISIBLE_PCI_BUS_IDS"
VISIBLE_NONE = "none"

DRIVER = "habanalabs"  # PCI driver, /proc/devices name of the control major, module name
ACCEL_DRIVER = "accel"  # /proc/devices name of the DRM accel major (ACCEL_MAJOR 261)
VERBS_DRIVER = "infiniband_verbs"
MODULE_DIR = "module/habanalabs"
OPERATIONAL = "operational"

_ACCEL_RE = re.compile(r"^accel([0-9]{1,6})$")  # bounded: int() of 5000 digits raises
_HL_RE = re.compile(r"^hl([0-9]{1,6})$")
_HL_NODE_RE = re.compile(r"^hl(?:_controlD)?[0-9]+$")
_UVERBS_RE = re.compile(r"^uverbs([0-9]{1,6})$")
_MAX_MODULE_ID = (1 << 32) - 1  # a u32 in the driver (the OAM slot, 0-7 on HLS boards)
_NONE_VALUES = ("", "none", "void")
_GRAMMAR = "'all', 'none' or device indices separated by ',' (e.g. '0,3')"


class _Layout(Struct, frozen=True):
    """Where one generation of the driver puts a device's nodes and attributes."""

    name: str  # "accel" or "hl": the alias prefix
    sysfs_class: str  # under HostRoot.sys
    dev_dir: str  # host path of the directory holding the nodes

    def attr_dir(self, root: HostRoot, index: int) -> str:
        base = root.sys_path(f"{self.sysfs_class}/{self.name}{index}")
        return f"{base}/device" if self.name == "accel" else base

    def nodes(self, index: int) -> tuple[tuple[str, str, int], ...]:
        """(host path, /proc/devices driver name, expected minor) of the device's nodes."""
        if self.name == "accel":
            return ((f"{self.dev_dir}/accel{index}", ACCEL_DRIVER, index),
                    (f"{self.dev_dir}/accel_controlD{index}", DRIVER, index))
        return ((f"{self.dev_dir}/hl{index}", DRIVER, 2 * index),
                (f"{self.dev_dir}/hl_controlD{index}", DRIVER, 2 * index + 1))


def discover(root: HostRoot) -> Found:
    """Every Gaudi device of the host: nodes, identity, health; the driver version."""
    problems: list[Problem] = []
    accel = _Layout("accel", "class/accel", root.dev_path("accel"))
    legacy = _Layout("hl", "class/habanalabs", root.dev)
    sys_accel = _habana_accel_indices(root)
    if sys_accel:
        layout, sys_indices = accel, sys_accel
        dev_indices = _indices(root.listdir(accel.dev_dir), _ACCEL_RE)
        # other drivers (NPUs) share /dev/accel: only nodes without any sysfs entry are odd
        dev_indices -= _indices(root.listdir(root.sys_path("class/accel")), _ACCEL_RE)
    else:
        layout = legacy
        sys_indices = _indices(root.listdir(root.sys_path(legacy.sysfs_class)), _HL_RE)
        dev_indices = _indices(root.listdir(root.dev), _HL_RE)
    module_loaded = root.exists(root.sys_path(MODULE_DIR))
    if not sys_indices and not dev_indices and not module_loaded:
        return Found()

    for i in sorted(dev_indices - sys_indices):
        problems.append(Problem(f"{layout.dev_dir}/{layout.name}{i}",
                                "device node without a sysfs entry: not claimed as a Gaudi "
                                "(the driver may have removed the device)"))
    majors = kernel.proc_devices(root)
    if majors is None and sys_indices:
        problems.append(Problem(kernel.PROC_DEVICES, "unreadable: device majors not "
                                "checked against the driver's"))

    devices: list[Device] = []
    driver_versions: list[str] = []
    for i in sorted(sys_indices):
        device = _device(root, layout, i, majors, problems, driver_versions)
        if device is not None:
            devices.append(device)
    _check_module_ids(devices, problems)

    version = kernel.read_stripped(root, root.sys_path(f"{MODULE_DIR}/version"))
    if version is None and driver_versions:
        version = driver_versions[0]  # per-device driver_ver (out-of-tree driver)
    if module_loaded and not sys_indices:
        problems.append(Problem(FAMILY, f"the {DRIVER} driver is loaded but has no device "
                                f"in {root.sys_path('class/accel')} or "
                                f"{root.sys_path(legacy.sysfs_class)}"))
    driver = Driver(vendor=FAMILY, version=version or "")
    log.debug("gaudi_discovered", devices=len(devices), layout=layout.name,
              version=driver.version, problems=len(problems))
    return Found(devices=tuple(devices), drivers=(driver,), problems=tuple(problems))


def _habana_accel_indices(root: HostRoot) -> set[int]:
    """accel<N> entries of the accel class that belong to habanalabs (the class is shared
    with other accelerators): the PCI function's driver link, or the driver's own
    device_type attribute where "device" is an attribute group (compat driver)."""
    out = set()
    for name in root.listdir(root.sys_path("class/accel")):
        m = _ACCEL_RE.match(name)
        if not m:
            continue
        base = root.sys_path(f"class/accel/{name}/device")
        if (kernel.link_name(root, f"{base}/driver") == DRIVER
                or root.exists(f"{base}/device_type")):
            out.add(int(m.group(1)))
    return out


def _indices(names: list[str], pattern: re.Pattern[str]) -> set[int]:
    return {int(m.group(1)) for m in map(pattern.match, names) if m}


def _device(root: HostRoot, layout: _Layout, index: int,
            majors: dict[str, frozenset[int]] | None, problems: list[Problem],
            driver_versions: list[str]) -> Device | None:
    nodes: list[DeviceNode] = []
    for path, driver, minor in layout.nodes(index):
        try:
            nodes.append(kernel.node_checked(root, path, majors=majors, driver=driver,
                                              minor=minor))
        except DiscoveryError as e:
            problems.append(Problem(e.source, e.message))
            return None

    attr_dir = layout.attr_dir(root, index)
    attributes: dict[str, str] = {}
    healthy = True
    status = kernel.read_stripped(root, f"{attr_dir}/status", problems)
    if status is None:
        problems.append(Problem(f"{attr_dir}/status", "missing: device health unknown"))
        healthy = False
        attributes["health"] = "status unknown"
    else:
        attributes["status"] = status
        if status.lower() != OPERATIONAL:
            healthy = False
            attributes["health"] = status
    module_id = kernel.read_stripped(root, f"{attr_dir}/module_id", problems)
    if module_id is not None:
        number = kernel.parse_uint(module_id, maximum=_MAX_MODULE_ID)
        if number is not None:
            attributes["module_id"] = str(number)
        else:
            problems.append(Problem(f"{attr_dir}/module_id",
                                    f"not a number: {module_id[:32]!r}"))
    device_type = kernel.read_stripped(root, f"{attr_dir}/device_type", problems)
    if device_type is not None:
        attributes["device_type"] = device_type
    driver_ver = kernel.read_stripped(root, f"{attr_dir}/driver_ver", problems)
    if driver_ver is not None:
        attributes["driver_version"] = driver_ver
        driver_versions.append(driver_ver)

    bus_id = _bus_id(root, attr_dir, layout, problems)
    if not bus_id:
        return None
    verbs = _verbs_node(root, bus_id, majors, problems)
    if verbs is not None:
        nodes.append(verbs)
    return Device(
        kind=KIND,
        name=str(index),
        aliases=(f"{layout.name}{index}", bus_id),
        edits=ContainerEdits(device_nodes=tuple(nodes)),
        numa_node=kernel.pci_numa_node(root, bus_id),
        pci_bus_id=bus_id,
        healthy=healthy,
        attributes=MappingProxyType(dict(sorted(attributes.items()))),
        vendor=FAMILY,
    )


def _bus_id(root: HostRoot, attr_dir: str, layout: _Layout,
            problems: list[Problem]) -> str:
    """pci_addr, else the PCI function the device's "device" link leads to (the DRM
    accel layout's attributes are that function's own); "" with a Problem when neither
    tells it."""
    text = kernel.read_stripped(root, f"{attr_dir}/pci_addr", problems)
    key = parse_pci_bus_id(text) if text else None
    if key is None:
        name = kernel.resolved_name(root, attr_dir if layout.name == "accel"
                                    else f"{attr_dir}/device")
        key = parse_pci_bus_id(name) if name else None
    if key is None:
        problems.append(Problem(f"{attr_dir}/pci_addr", (
            "missing" if text is None else f"not a PCI address: {text!r}") + (
            ", and no PCI function behind the device: it is left out (only its index "
            "would name it, which another device takes when one does not come up)")))
        return ""
    return format_pci_bus_id(key)


def _verbs_node(root: HostRoot, bus_id: str, majors: dict[str, frozenset[int]] | None,
                problems: list[Problem]) -> DeviceNode | None:
    """The RDMA verbs node of the device's integrated NICs (habanalabs_ib), if any."""
    verbs_dir = root.sys_path(f"bus/pci/devices/{bus_id}/infiniband_verbs")
    names = [n for n in root.listdir(verbs_dir) if _UVERBS_RE.match(n)]
    if not names:
        return None
    if len(names) > 1:
        problems.append(Problem(verbs_dir, f"several verbs devices ({', '.join(names)}): "
                                "none given to the container"))
        return None
    try:
        return kernel.node_checked(root, root.dev_path(f"infiniband/{names[0]}"),
                                    majors=majors, driver=VERBS_DRIVER, minor=None)
    except DiscoveryError as e:
        problems.append(Problem(e.source, e.message))
        return None


def _check_module_ids(devices: list[Device], problems: list[Problem]) -> None:
    seen: dict[str, str] = {}
    for d in devices:
        module = d.attributes.get("module_id")
        if module is None:
            continue
        if module in seen:
            problems.append(Problem(FAMILY, f"devices {seen[module]} and {d.name} report the "
                                    f"same module_id {module}: {ENV_MODULES} is ambiguous"))
        seen.setdefault(module, d.name)


def parse_visible(value: str) -> str | tuple[str, ...] | None:
    """HABANA_VISIBLE_DEVICES as the habana runtime reads it.

    None: no request ("", "none", "void"). "all": every device. Otherwise the device
    indices in the order written, canonical ("03" -> "3") and without repeats.
    ValueError on anything else: an empty element, spaces, a non-number, "all"/"none"
    mixed with indices. The runtime has no ranges and no UUIDs.
    """
    if value in _NONE_VALUES:
        return None
    if value == "all":
        return "all"
    out: dict[str, None] = {}
    for token in value.split(","):
        if token == "":
            raise ValueError(f"empty element in {value!r}; expected {_GRAMMAR}")
        if token != token.strip():
            raise ValueError(f"{token!r} has spaces; expected {_GRAMMAR}")
        if token in ("all", *_NONE_VALUES):
            raise ValueError(f"{token!r} cannot be combined with device indices")
        try:
            out.setdefault(decimal_index(token, "device"), None)
        except ValueError as e:
            raise ValueError(f"{e}; expected {_GRAMMAR}") from None
    return tuple(out)


def container_env(granted: Sequence[Device]) -> dict[str, str]:
    """The env of a container given `granted` (Gaudi devices, in the order given), as the
    device plugin writes it: HABANA_VISIBLE_DEVICES = their indices, HABANA_VISIBLE_MODULES
    = their module ids in the same order (left out when a device has none). Nothing for
    an empty grant."""
    names: dict[str, Device] = {}
    for d in granted:
        if d.kind == KIND:
            names.setdefault(d.name, d)
    if not names:
        return {}
    env = {ENV_VISIBLE: ",".join(names)}
    modules = [d.attributes.get("module_id") for d in names.values()]
    if all(modules):
        env[ENV_MODULES] = ",".join(m for m in modules if m)
    return env


def probe(root: HostRoot) -> list[tuple[str, object]]:
    """Cheap change detection: the driver version, every /dev/accel entry, the /dev/hl*
    nodes and /dev/infiniband/uverbs* (lstat identity), each Gaudi's status text."""
    version = root.sys_path(f"{MODULE_DIR}/version")
    out: list[tuple[str, object]] = [(version, kernel.read(root, version))]
    accel_dir = root.dev_path("accel")
    out += [node_state(root, f"{accel_dir}/{n}")
            for n in root.listdir(accel_dir)]
    out += [node_state(root, root.dev_path(n))
            for n in root.listdir(root.dev) if _HL_NODE_RE.match(n)]
    ib_dir = root.dev_path("infiniband")
    out += [node_state(root, f"{ib_dir}/{n}")
            for n in root.listdir(ib_dir) if _UVERBS_RE.match(n)]
    for i in sorted(_habana_accel_indices(root)):
        path = root.sys_path(f"class/accel/accel{i}/device/status")
        out.append((path, kernel.read(root, path)))
    for name in root.listdir(root.sys_path("class/habanalabs")):
        if _HL_RE.match(name):
            path = root.sys_path(f"class/habanalabs/{name}/status")
            out.append((path, kernel.read(root, path)))
    return out


class GaudiProfile(VisibleDevicesProfile):
    """The family as nri-accel's stages see it (nri_accel.vendors.base)."""

    name = FAMILY
    kinds = (KIND,)
    visible_var = ENV_VISIBLE
    visible_none = VISIBLE_NONE
    selectors = (ENV_MODULES, ENV_PCI_BUS_IDS)
    parse_visible = staticmethod(parse_visible)
    container_env = staticmethod(container_env)

    def discover(self, root: HostRoot, config: Config) -> Found:
        return discover(root)

    def probe(self, root: HostRoot, config: Config) -> list[tuple[str, object]]:
        return probe(root)


PROFILE = GaudiProfile()
