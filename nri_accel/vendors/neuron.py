"""The AWS Neuron family (Inferentia, Trainium): discovery from /dev and sysfs, the
AWS_NEURON_VISIBLE_DEVICES grammar, and the env a selection brings.

Owns: NeuronProfile (PROFILE), discover_neuron(root) -> Found and probe(root). Imports
the standard library, nri_accel.errors, nri_accel.inventory, nri_accel.log,
nri_accel.syntax, nri_accel.vendors.base and nri_accel.discover.{base, hostroot, probe}.
No ioctl, no Neuron library.

Requests: AWS_NEURON_VISIBLE_DEVICES (aws-neuron-sdk containers docs): ALL (any case), or
a comma-separated list of logical device ids and ranges such as 0-3; as with
NVIDIA_VISIBLE_DEVICES, "all" wins over ids listed beside it.

NeuronCores: each core is a device of its own, kind "aws.amazon.com/neuroncore", named by
its number in the runtime's node-wide numbering (device i's cores follow those of
devices 0..i-1, as NEURON_RT_VISIBLE_CORES counts them), with parent = its device's
name and that device's /dev/neuronN as its node. That number shifts when an earlier
device does not come up: a core is identified (Device.uuid, so its key and kubelet ID)
by its device's index and its own within it, "neuron2-core0" (core_id); a grant
recorded by number (before cores had ids) is read as the core of that number now
(NeuronProfile.current_key). The device plugin advertises them as
aws.amazon.com/neuroncore beside aws.amazon.com/neuron, as the AWS Neuron device plugin
does, and they are granted like any device (`aws.amazon.com/neuroncore=4-5`). A core is
a part of its device (nri_accel.vendors.base): a whole device and one of its cores are
never held by different containers (nri_accel.state.Holdings), while different cores
of one device may go to different containers. Cores are numbered only while every
earlier device's core count is known; from the first device without one, no core is
discovered (its numbering would be a guess). Nor from the first Trainium2 (arch_type
v3, LOGICAL_ARCHES), whose runtime counts logical cores, of a size a container chooses.

Edits: each granted device's /dev/neuronN (a core's: its device's), and
AWS_NEURON_VISIBLE_DEVICES = the device indices, those of granted cores' devices
included (the oci-neuron-hook syntax). NEURON_RT_VISIBLE_CORES: with a core granted, it
is set to exactly the granted cores (and those of granted whole devices), whatever the
container says, since the Neuron runtime's core visibility is the only isolation
between containers sharing a device; with whole devices only, it is their cores, as
ranges "a-b" joined by commas, and left alone when the container already sets it
(narrower, as the AWS Neuron device plugin sets it). When the image asks through
AWS_NEURON_VISIBLE_DEVICES and nothing is granted, the variable is rewritten empty
(VISIBLE_NONE), which names no device index, so the oci-neuron-hook (which reads nothing
else) grants nothing either: a hook that takes an empty value for unset adds nothing, one
that parses it fails the container. (Removing it would be lost: see `visibility` in
nri_accel.vendors.base.)

Identity: a Neuron device is named by its index, which is what stays true of it. On
Trainium and Inferentia2 the driver does not number devices in probe order: it reads
each device's routing id from its firmware (neuron_pci.c, neuron_pci_get_device_id)
and makes it the index of /dev/neuronN, a fixed place in the NeuronLink topology, the
same across reboots and driver reloads; a device that fails to come up leaves a gap,
never a shift. (Inf1's driver counted devices in probe order; an Inf1 node whose
device is lost after a reboot renumbers, as its own tools would.) The class devices
have no PCI parent (/sys/devices/virtual/neuron_device), so there is no other id to
read without the driver's ioctls.

What the aws-neuron-driver exposes (neuron_cdev.c, neuron_module.c) and is read here,
through the HostRoot:

- /dev/neuronN: one character device per Neuron device, named "neuron%d" with
  minor == device index, of the major /proc/devices lists as "neuron" (allocated
  dynamically: read with lstat, checked against /proc/devices; a node of another major
  or minor is not device N).
- /sys/class/neuron_device/neuronN/core_count: the NeuronCores of the device ("%d").
- /sys/class/neuron_device/neuronN/connected_devices: indices of the devices it has a
  direct NeuronLink to, comma separated ("1, 3, 4, 12"); an empty line when none.
- /sys/class/neuron_device/neuronN/info/architecture/{arch_type,device_name,
  instance_type}: kept as attributes where present (newer drivers).
- /sys/module/neuron/version: the driver version (MODULE_VERSION).

Each device becomes Device(kind "aws.amazon.com/neuron", name "N", alias "neuronN",
links = connected devices found on this node, attributes cores/arch/name/instance_type,
vendor "neuron") with its /dev/neuronN node as edits, and each of its cores
Device(kind "aws.amazon.com/neuroncore", name = the core's node-wide number, uuid
"neuronN-coreJ", parent "N", attribute core = its index J within the device, the same
node, and NEURON_RT_VISIBLE_CORES = its number as its own env: what `cdi generate`
writes for it, so that a CDI request for one core shows the runtime that core only; a
grant through nri-accel sets the variable to every granted core instead (the family's
env wins over devices' own). PCI bus id and NUMA node are left empty: the driver's
class devices have no PCI parent and it numbers devices itself, so sysfs gives no
reliable index-to-PCI mapping. The Neuron environment of a container
(AWS_NEURON_VISIBLE_DEVICES, core visibility) is written by the edits stage, not here.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from nri_accel.discover import kernel
from nri_accel.discover.base import Found
from nri_accel.discover.hostroot import HostRoot
from nri_accel.discover.probe import State, entries, file_state
from nri_accel.errors import DiscoveryError
from nri_accel.inventory import (
    VANISHED,
    ContainerEdits,
    Device,
    DeviceNode,
    Driver,
    Inventory,
    Problem,
    natural_key,
)
from nri_accel.log import get_logger
from nri_accel.syntax import ClaimSet, DeviceClaim
from nri_accel.vendors.base import (
    DriverFiles,
    EnvAsk,
    EnvSource,
    FamilyEdits,
    Profile,
    joined_ranges,
)

if TYPE_CHECKING:
    from nri_accel.config import Config

log = get_logger(__name__)

VENDOR = "neuron"
KIND = "aws.amazon.com/neuron"
KIND_CORE = "aws.amazon.com/neuroncore"
ENV_VISIBLE = "AWS_NEURON_VISIBLE_DEVICES"
VISIBLE_NONE = ""  # the value nri-accel writes where nothing is granted (module docstring)
ENV_CORES = "NEURON_RT_VISIBLE_CORES"
MODULE_DIR = "module/neuron"
DRIVER = "neuron"  # the /proc/devices name of its character major
CLASS_DIR = "class/neuron_device"
_NODE_RE = re.compile(r"^neuron([0-9]{1,6})$")
# NeuronCores per device: 2 (Trainium1, Inferentia2), 4 (Inferentia1), 8 (Trainium2).
# 64 leaves room for parts to come; beyond it a core_count is a corrupt or hostile file
# (each core is an inventory device: a million took 24 s and 1.5 GB).
MAX_CORES = 64
MAX_INDEX = 999_999  # a neuron device index (neuronN, connected_devices)
_ARCH_FILES = (("arch", "arch_type"), ("name", "device_name"),
               ("instance_type", "instance_type"))
LOGICAL_ARCHES = frozenset({"v3"})
"""Neuron architectures (arch_type) whose runtime numbers NeuronCores in logical cores:
Trainium2, whose NEURON_LOGICAL_NC_CONFIG (2 by default, a container's own choice) makes
one logical core of two of the 8 the driver counts (core_count), and whose
NEURON_RT_VISIBLE_CORES counts the logical ones. Their cores are not numbered here
(counted_cores), so not offered: a number would name another device's cores."""


class NeuronProfile(Profile):
    name = VENDOR
    kinds = (KIND, KIND_CORE)  # the whole first (nri_accel.vendors.parent_of)
    env_names = frozenset({ENV_VISIBLE})
    env_defaults = frozenset({ENV_CORES})
    visibility = (ENV_VISIBLE, VISIBLE_NONE)

    def discover(self, root: HostRoot, config: Config) -> Found:
        return discover_neuron(root)

    def probe(self, root: HostRoot, config: Config) -> State:
        return probe(root)

    def read_env(self, env: Mapping[str, str]) -> EnvAsk:
        if ENV_VISIBLE not in env:
            return EnvAsk()
        value = env[ENV_VISIBLE]
        if not value.strip():
            return EnvAsk(visible=True)
        name = f"env {ENV_VISIBLE}"
        return EnvAsk(sources=(EnvSource(name, parse_visible(value, name), value),),
                      visible=True)

    def tables(self, inventory: Inventory) -> Mapping[str, tuple[int, int]]:
        """Qualified name -> (first NeuronCore, cores) in the runtime's node-wide
        numbering, as discovery numbers the cores (_cores): over the devices on the
        node (not one kept Unhealthy since it vanished: the runtime counts the cores
        of the devices present), up to the first whose core count is unknown."""
        cores: dict[str, tuple[int, int]] = {}
        first = 0
        for d in inventory.of_kind(KIND):
            if d.attributes.get("health") == VANISHED:
                continue
            n = counted_cores(d)
            if n is None:
                break  # numbering unknown from here on
            cores[d.qualified_name] = (first, n)
            first += n
        return MappingProxyType(cores)

    def current_key(self, key: str, inventory: Inventory) -> str:
        """A core's key from before cores had ids of their own ("...neuroncore=4", its
        node-wide number) is the key of the core that has that number now: the same
        core, unless a Neuron device vanished since it was granted."""
        kind, _, ident = key.partition("=")
        if kind != KIND_CORE or not ident.isdecimal():
            return key
        core = inventory.find(KIND_CORE, ident)
        return key if core is None else core.key

    def edits(self, devices: Sequence[Device], options: Any, drivers_only: bool,
              files: DriverFiles) -> FamilyEdits:
        base = super().edits(devices, options, drivers_only, files)
        numbering = files.table(VENDOR) or {}
        whole = [d for d in devices if d.kind == KIND]
        parts = [d for d in devices if d.kind == KIND_CORE]
        ranges = [numbering.get(d.qualified_name) for d in whole]
        numbers = {n for r in ranges if r is not None for n in range(r[0], r[0] + r[1])}
        numbers.update(int(d.name) for d in parts if d.name.isdigit())
        env = [(ENV_VISIBLE, ",".join(sorted({d.name for d in whole}
                                             | {d.parent for d in parts if d.parent},
                                             key=natural_key)))]
        defaults: tuple[tuple[str, str], ...] = ()
        notes = list(base.notes)
        if parts:  # exactly these cores, whatever the container says
            env.append((ENV_CORES, joined_ranges(numbers)))
            if None in ranges:
                notes.append(f"{ENV_CORES} lists the granted cores only: the cores of "
                             "granted devices without a known core count are not in it")
        elif whole and None not in ranges:
            defaults = ((ENV_CORES, joined_ranges(numbers)),)
        return FamilyEdits(parts=base.parts, notes=tuple(notes), defaults=defaults,
                           env=tuple(env))

    def partition(self, device: Device, inventory: Any) -> str:
        if device.kind == KIND_CORE:
            return f"core {device.attributes.get('core', '?')} of neuron{device.parent}"
        return ""


PROFILE = NeuronProfile()


def parse_visible(value: str, source: str) -> tuple[DeviceClaim, ...]:
    """AWS_NEURON_VISIBLE_DEVICES: ALL (any case), or ids and ranges; all wins. (The
    request parser has checked the value's size and characters.)"""
    tokens = [t.strip() for t in value.split(",") if t.strip()]
    if any(t.lower() == "all" for t in tokens):
        return (DeviceClaim(KIND, all=True, source=source),)
    acc = ClaimSet(source)
    for token in tokens:
        acc.add_ids(KIND, token)
    return acc.claims()


def probe(root: HostRoot) -> State:
    """The driver version and the /dev/neuron* nodes."""
    return [file_state(root, root.sys_path(f"{MODULE_DIR}/version")),
            *entries(root, root.dev, ("neuron",))]


def discover_neuron(root: HostRoot) -> Found:
    """Every /dev/neuronN of the host with its sysfs facts, and the driver version."""
    problems: list[Problem] = []
    dev_indices = _indices(root.listdir(root.dev))
    sys_indices = _indices(root.listdir(root.sys_path(CLASS_DIR)))
    module_loaded = root.exists(root.sys_path(MODULE_DIR))
    if not dev_indices and not sys_indices and not module_loaded:
        return Found()

    for i in sorted(sys_indices - dev_indices):
        problems.append(Problem(root.dev_path(f"neuron{i}"),
                                f"the neuron driver reports neuron{i} in sysfs but the "
                                "device node is missing"))

    found: list[tuple[int, DeviceNode, dict[str, str], tuple[int, ...]]] = []
    majors = kernel.proc_devices(root)
    if majors is None and dev_indices:
        problems.append(Problem(kernel.PROC_DEVICES, "unreadable: device majors not "
                                "checked against the driver's"))
    for i in sorted(dev_indices):
        try:
            # The driver's node N is its major's minor N (neuron_cdev.c: one chrdev
            # region named DRIVER, device_create(MKDEV(major, N), "neuronN")): a stale
            # or foreign node of that name is not device N.
            node = kernel.node_checked(root, root.dev_path(f"neuron{i}"), majors=majors,
                                       driver=DRIVER, minor=i)
        except DiscoveryError as e:
            problems.append(Problem(e.source, e.message))
            continue
        attributes, links, device_problems = _sysfs_facts(root, i)
        problems += device_problems
        found.append((i, node, attributes, links))

    present = {i for i, _, _, _ in found}
    devices = tuple(
        Device(
            kind=KIND,
            name=str(i),
            aliases=(f"neuron{i}",),
            edits=ContainerEdits(device_nodes=(node,)),
            attributes=MappingProxyType(attributes),
            links=tuple(str(j) for j in sorted(set(links) & present) if j != i),
            vendor=VENDOR,
        )
        for i, node, attributes, links in found
    )
    devices += _cores(devices)
    logical = sorted({d.attributes.get("name") or d.attributes["arch"] for d in devices
                      if d.attributes.get("arch") in LOGICAL_ARCHES})
    if logical:
        problems.append(Problem(VENDOR, (
            f"NeuronCores of {', '.join(logical)} are not offered, and a whole device's grant "
            f"sets no {ENV_CORES}: its runtime counts logical cores "
            "(NEURON_LOGICAL_NC_CONFIG), which nri-accel does not number yet; grant whole "
            "devices")))

    version = kernel.read(root, root.sys_path(f"{MODULE_DIR}/version"))
    if version is None:
        problems.append(Problem(VENDOR, f"driver version unknown: "
                                f"{root.sys_path(MODULE_DIR + '/version')} is missing"))
    if module_loaded and not dev_indices:
        problems.append(Problem(VENDOR, f"the neuron driver is loaded but there is no "
                                f"{root.dev_path('neuronN')} device node"))
    driver = Driver(vendor=VENDOR, version=(version or "").strip())
    log.debug("neuron_discovered", devices=len(devices), version=driver.version,
              problems=len(problems))
    return Found(devices=devices, drivers=(driver,), problems=tuple(problems))


def core_id(device: str, core: int) -> str:
    """What names NeuronCore `core` of Neuron device `device` (its index) whatever the
    node-wide numbering: "neuron2-core0" (its Device.uuid, so its key and kubelet ID)."""
    return f"neuron{device}-core{core}"


def counted_cores(device: Device) -> int | None:
    """How many of the runtime's NeuronCores the Neuron device `device` holds, as
    NEURON_RT_VISIBLE_CORES counts them; None where that is not known: no core count, or
    an architecture whose runtime counts logical cores (LOGICAL_ARCHES)."""
    if device.attributes.get("arch") in LOGICAL_ARCHES:
        return None
    return kernel.parse_uint(device.attributes.get("cores", ""), maximum=MAX_CORES)


def _cores(devices: Sequence[Device]) -> tuple[Device, ...]:
    """The NeuronCores of `devices` (in index order), numbered node-wide; none from the
    first device whose cores are not counted (counted_cores)."""
    out = []
    first = 0
    for d in devices:
        count = counted_cores(d)
        if count is None:
            break
        n = str(count)
        out.extend(Device(kind=KIND_CORE, name=str(first + j), uuid=core_id(d.name, j),
                          parent=d.name,
                          edits=ContainerEdits(env=(f"{ENV_CORES}={first + j}",),
                                               device_nodes=d.edits.device_nodes),
                          attributes=MappingProxyType({"core": str(j)}), vendor=VENDOR)
                   for j in range(int(n)))
        first += int(n)
    return tuple(out)


def _indices(names: list[str]) -> set[int]:
    out = set()
    for n in names:
        m = _NODE_RE.match(n)
        if m:
            out.add(int(m.group(1)))
    return out


def _sysfs_facts(root: HostRoot, index: int) -> tuple[dict[str, str], tuple[int, ...],
                                                      list[Problem]]:
    base = root.sys_path(f"{CLASS_DIR}/neuron{index}")
    if not root.exists(base):
        return {}, (), [Problem(base, "missing: NeuronCore count and links unknown")]
    attributes: dict[str, str] = {}
    problems: list[Problem] = []
    cores = kernel.read(root, f"{base}/core_count", problems)
    count = kernel.parse_uint(cores, maximum=MAX_CORES) if cores is not None else None
    if count is None:
        if cores is None:
            problems.append(Problem(f"{base}/core_count", "missing or unreadable"))
        elif kernel.parse_uint(cores) is not None:
            problems.append(Problem(f"{base}/core_count", (
                f"{cores.strip()} NeuronCores: more than the {MAX_CORES} any Neuron "
                "device has; its cores (and those of the devices after it) are left out")))
        else:
            problems.append(Problem(f"{base}/core_count",
                                    f"not a number: {cores.strip()[:32]!r}"))
    else:
        attributes["cores"] = str(count)
    for key, filename in _ARCH_FILES:
        value = kernel.read(root, f"{base}/info/architecture/{filename}", problems)
        if value and value.strip():
            attributes[key] = value.strip()
    links: tuple[int, ...] = ()
    connected = kernel.read(root, f"{base}/connected_devices", problems)
    if connected is not None:
        parts = [p.strip() for p in connected.split(",") if p.strip()]
        indices = [kernel.parse_uint(p, maximum=MAX_INDEX) for p in parts]
        if all(i is not None for i in indices):
            links = tuple(i for i in indices if i is not None)
        else:
            problems.append(Problem(f"{base}/connected_devices",
                                    "not a list of device indices: "
                                    f"{connected.strip()[:64]!r}"))
    return attributes, links, problems
