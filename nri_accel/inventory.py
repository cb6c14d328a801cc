"""The node's Inventory and the container-edit types shared by every stage.

Owns: the frozen data model (DeviceNode, Mount, Hook, ContainerEdits, Device,
Driver, Problem, Inventory) and its JSON form, and the syntax of what names a device
(KIND_RE and DEVICE_NAME_RE, CDI's; PCI bus ids; natural order of names). Imports only
the standard library, msgspec and nri_accel.errors. No I/O except `Inventory.load` taking a path.

ContainerEdits has the shape of CDI's `containerEdits` (env, deviceNodes, mounts,
hooks, additionalGids), so a CDI spec loads into it and `cdi generate` writes it out.
Every path in it is a host path found by discovery, never a user-supplied value.

JSON form (schema_version 1) is what `discover --json` prints and `--inventory FILE`
reads: keys are snake_case field names, empty/None fields are omitted, lists keep
their (already deterministic) order. Loading refuses, with an InventoryError whose
source is the file (or the origin given) and whose message starts with the JSON path
(`devices[1].uuid: ...`):
- a file over MAX_INVENTORY_BYTES, bytes that are not UTF-8, text that is not JSON;
- an unknown schema version, an unknown key, a value of the wrong type;
- a device with no kind ("vendor/class", KIND_RE) or no name, a device node whose
  major or minor Linux could not have made, a PCI bus id that is not one, a driver
  with no vendor or the vendor of another;
- two devices sharing an identity, which could not be served safely (the same device
  granted twice, a request meaning another device than it names, a grant or holding
  that cannot tell two devices apart): a UUID (across kinds: it names one piece of
  hardware), an id within a kind (name, UUID, alias or partition id, as
  Inventory.find compares them), a PCI bus id within a kind that one of them answers
  to, or a key (Device.key, what holdings and grants name a device by). Devices may
  share a PCI function none of them answers to, as discovery makes them, when each
  has an id of its own beyond it: the MIG devices of a GPU (a UUID each), the compute
  partitions of an AMD GPU (a partition index each).

identity_collisions(devices) finds every such collision (the later device of each
pair, in the order given, against the first): loading refuses the first, discovery
(nri_accel.discover.assemble) keeps the first device and drops the later one with a
Problem.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cache, lru_cache
from types import MappingProxyType
from typing import Any, NamedTuple

from msgspec import NODEFAULT, Struct, structs

from nri_accel.errors import InventoryError

SCHEMA_VERSION = 1

# The largest inventory file `Inventory.load` reads (`--pod` takes 4 MiB). Chosen from
# what real nodes write: about 1 to 2 KB a device plus the drivers' edits (tens of KB):
# the fake 8-GPU A100 node with 7 MIG devices is 53 KB, the 4-GPU H100 27 KB, the trn1
# (16 Neuron devices, 32 cores) 26 KB; the largest nodes (16 GPUs with 7 MIG devices
# each, a trn2 with 128 NeuronCores) hold a few hundred devices, under 1 MB. 16 MiB is
# about 25,000 devices, which loads in about 1 s and 130 MB of memory; anything larger
# is not a node's inventory.
MAX_INVENTORY_BYTES = 16 * 1024 * 1024

# Device numbers Linux can make (include/linux/kdev_t.h: a 32-bit dev_t, 20 bits of
# minor): a node outside them is not one lstat could have found.
MAX_MAJOR = (1 << 12) - 1
MAX_MINOR = (1 << 20) - 1

# Device kinds known to nri-accel's own discoverers; CDI brings any "vendor/class".
KIND_GPU = "nvidia.com/gpu"
KIND_MIG = "nvidia.com/mig"
KIND_NEURON = "aws.amazon.com/neuron"


def vendor_of(kind: str) -> str:
    """The vendor part of a kind ("nvidia.com" for GPUs and MIG devices): limits and
    NVIDIA_VISIBLE_DEVICES=none act per vendor, as the request policy decides per vendor."""
    return kind.partition("/")[0]


NVIDIA_VENDOR = vendor_of(KIND_GPU)  # "nvidia.com": GPUs and MIG devices

# CDI names (container-device-interface pkg/parser), the one definition for the config,
# CDI specs and requests: a kind is "vendor/class", each part a letter first, letters,
# digits, '_', '-' and '.' inside, a letter or digit last; a device name has a letter or
# digit first and last, and letters, digits, '_', '-', '.' and ':' inside.
_CDI_PART = r"[A-Za-z](?:[A-Za-z0-9_.-]*[A-Za-z0-9])?"
KIND_RE = re.compile(rf"{_CDI_PART}/{_CDI_PART}")
DEVICE_NAME_RE = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9_.:-]*[A-Za-z0-9])?")
REPLICA_SEPARATOR = "::"
"""What a kubelet time-slicing replica's id puts between its device's id and its number
("<device id>::<n>"), and so never in a device's name (is_device_name)."""


def is_device_name(name: str) -> bool:
    """Whether `name` may name a device: CDI's grammar (DEVICE_NAME_RE) without
    REPLICA_SEPARATOR, with which the device "npu::1" would read as a replica of "npu"
    (shared) to `run` while the device plugin hands it out as itself."""
    return DEVICE_NAME_RE.fullmatch(name) is not None and REPLICA_SEPARATOR not in name

# "domain:bus:device.function" in hex, any case and zero padding ("0:3b:0.0", NVML's
# "00000000:3B:00.0", sysfs's "0000:3b:00.0").
_PCI_BUS_ID_RE = re.compile(
    r"([0-9A-Fa-f]{1,16}):([0-9A-Fa-f]{1,8}):([0-9A-Fa-f]{1,8})\.([0-9A-Fa-f]{1,8})")


# What joins a PCI bus id and a partition's index in its partition id ("0000:11:00.0-p3"):
# allowed in a CDI device name, never in a PCI bus id.
PARTITION_SEPARATOR = "-p"
MAX_PARTITION = 255  # amdgpu has at most 8 (MAX_XCP); more is not a partition index

# The "health" attribute of a device the last discovery did not find, kept Unhealthy
# (nri_accel.health.carry_vanished): it is not on the node.
VANISHED = "not found by the last discovery"


def parse_pci_bus_id(text: str) -> tuple[int, int, int, int] | None:
    """A PCI bus id as numbers (domain, bus, device, function); None when `text` is not
    one (a domain over 32 bits, a bus or device over 8 bits, a function over 7)."""
    m = _PCI_BUS_ID_RE.fullmatch(text)
    if m is None:
        return None
    domain, bus, dev, fn = (int(g, 16) for g in m.groups())
    if domain > 0xFFFFFFFF or bus > 0xFF or dev > 0xFF or fn > 7:
        return None
    return domain, bus, dev, fn


def format_pci_bus_id(key: tuple[int, int, int, int]) -> str:
    """The sysfs form of a parsed PCI bus id: "0000:3b:00.0"."""
    return "{:04x}:{:02x}:{:02x}.{:x}".format(*key)


class DeviceNode(Struct, frozen=True):
    """A device node to create in the container (CDI deviceNodes entry)."""

    path: str  # path inside the container
    major: int
    minor: int
    type: str = "c"  # "c" or "b"
    host_path: str = ""  # host path if different from `path`
    file_mode: int | None = None
    uid: int | None = None
    gid: int | None = None
    # cgroup access as CDI writes it: a subset of "rwm" or "none"; through NRI the runtime
    # allows "rw" whatever it says, so nri_accel.edits refuses one without r and w
    permissions: str = "rwm"

    @property
    def source(self) -> str:
        return self.host_path or self.path

    def __hash__(self) -> int:
        # Equal nodes have equal paths; the path's hash is cached by the str, where the
        # generated hash would hash every field each time (edits are memo keys on the
        # hot path, nri_accel.nri.adjust).
        return hash(self.path)


class Mount(Struct, frozen=True):
    """A mount to add to the container (CDI mounts entry): a bind mount of a host path,
    or a tmpfs whose host_path is its source's name ("tmpfs"), never a path."""

    host_path: str
    container_path: str
    type: str = "bind"
    options: tuple[str, ...] = ("ro", "nosuid", "nodev", "bind")

    def __hash__(self) -> int:
        return hash(self.container_path)  # as DeviceNode's: equal mounts, equal paths


class Hook(Struct, frozen=True):
    """An OCI hook (CDI hooks entry). Emitted only where unavoidable."""

    hook_name: str  # createRuntime, createContainer, startContainer, poststart, poststop, prestart
    path: str  # absolute host path of the binary
    args: tuple[str, ...] = ()
    env: tuple[str, ...] = ()
    timeout: int | None = None  # seconds


class ContainerEdits(Struct, frozen=True, cache_hash=True):
    """What to change in a container: the same shape as CDI's containerEdits."""

    env: tuple[str, ...] = ()  # "KEY=VALUE"
    device_nodes: tuple[DeviceNode, ...] = ()
    mounts: tuple[Mount, ...] = ()
    hooks: tuple[Hook, ...] = ()
    additional_gids: tuple[int, ...] = ()
    # cache_hash: edits are memo keys on the hot path (nri_accel.nri.adjust); the hash
    # of their tuples, which calls every node's and mount's __hash__, is computed once.

    def __bool__(self) -> bool:
        return bool(
            self.env or self.device_nodes or self.mounts or self.hooks or self.additional_gids
        )

    def merged(self, *others: ContainerEdits) -> ContainerEdits:
        """These edits followed by `others`: device nodes de-duplicated by container
        path, mounts by container path, env by key (first wins), gids by value."""
        return merge_edits((self, *others))


def merge_edits(all_edits: Iterable[ContainerEdits]) -> ContainerEdits:
    """Merge edits in order; the first occurrence of a node/mount path or env key wins."""
    env: dict[str, str] = {}
    nodes: dict[str, DeviceNode] = {}
    mounts: dict[str, Mount] = {}
    hooks: list[Hook] = []
    gids: dict[int, None] = {}
    for e in all_edits:
        for kv in e.env:
            env.setdefault(kv.partition("=")[0], kv)
        for n in e.device_nodes:
            nodes.setdefault(n.path, n)
        for m in e.mounts:
            mounts.setdefault(m.container_path, m)
        for h in e.hooks:
            if h not in hooks:
                hooks.append(h)
        for g in e.additional_gids:
            gids.setdefault(g, None)
    return ContainerEdits(
        env=tuple(env.values()),
        device_nodes=tuple(nodes.values()),
        mounts=tuple(mounts.values()),
        hooks=tuple(hooks),
        additional_gids=tuple(gids),
    )


class Device(Struct, frozen=True):
    """One grantable device: a GPU, a MIG instance, a Neuron device, a CDI device.

    `name` is the canonical id within `kind` ("0" for GPU 0, "0:1" for MIG GI 1 on
    GPU 0 with its compute instance, "npu0" for a CDI device); `aliases` are the
    other ids users may write (UUID, PCI bus id, index). The qualified name is
    "<kind>=<name>", as in CDI.
    """

    kind: str
    name: str
    uuid: str = ""
    aliases: tuple[str, ...] = ()
    edits: ContainerEdits = ContainerEdits()  # device-specific nodes, env, mounts
    numa_node: int | None = None
    pci_bus_id: str = ""
    parent: str = ""  # MIG: name of the parent GPU
    healthy: bool = True
    # Free-form facts for NVIDIA_REQUIRE_* and display: name, brand, arch,
    # compute_capability, memory_mib, mig_profile, gi_id, ci_id, cores, ...
    attributes: Mapping[str, str] = MappingProxyType({})
    links: tuple[str, ...] = ()  # names of same-kind peers with a direct link (NVLink, Neuron ring)
    vendor: str = ""  # which Driver's capability edits it needs ("nvidia", "neuron", "")
    # A partition of the PCI function `pci_bus_id` (an AMD GPU in DPX/QPX/CPX mode): its
    # index within it, the number the driver gives it (amdgpu's XCP id, KFD's node_id);
    # None: not a partition. With no UUID of its own it is what tells it from its siblings.
    partition: int | None = None

    @property
    def qualified_name(self) -> str:
        return f"{self.kind}={self.name}"

    @property
    def stable_id(self) -> str:
        """The id that keeps naming this device when the node is renumbered (a MIG
        reconfiguration, a GPU off the bus, a driver reload): its UUID, else its
        partition id (a partition of a PCI function), else its PCI bus id, else its name
        (CDI and static devices: the name their spec or config gives)."""
        return self.uuid or self.partition_id or self.pci_bus_id or self.name

    @property
    def partition_id(self) -> str:
        """"<PCI bus id>-p<partition>" ("0000:11:00.0-p3") for a partition of a PCI
        function, which answers to it; "" for any other device."""
        if self.partition is None or not self.pci_bus_id:
            return ""
        return f"{self.pci_bus_id}{PARTITION_SEPARATOR}{self.partition}"

    @property
    def key(self) -> str:
        """"<kind>=<stable id>": what holdings and grant records name a device by."""
        return f"{self.kind}={self.stable_id}"

    @property
    def ids(self) -> tuple[str, ...]:
        """Every id this device answers to: name, uuid, aliases, partition id."""
        return (self.name, *((self.uuid,) if self.uuid else ()), *self.aliases,
                *((self.partition_id,) if self.partition_id else ()))


class Driver(Struct, frozen=True):
    """A vendor driver found on the node and the shared edits each capability brings.

    NVIDIA capabilities: "utility", "compute", "video", "graphics", "display", "ngx",
    "compat32/<one of those>" (its 32-bit libraries), "mig-config", "mig-monitor"; key
    "" holds what every container using the vendor gets (/dev/nvidiactl, firmware).
    """

    vendor: str  # "nvidia", "neuron"
    version: str = ""
    cuda_version: str = ""  # NVIDIA: CUDA driver API version, e.g. "12.4"
    capabilities: Mapping[str, ContainerEdits] = MappingProxyType({})


class Problem(Struct, frozen=True):
    """Something discovery could not do or found wrong, kept for `discover` and logs."""

    source: str  # vendor, path or file: "nvidia", "/dev/char/195:0", "/etc/cdi/x.yaml"
    message: str


@dataclass(frozen=True, slots=True)
class Inventory:
    """What the node has. Built whole by discovery, swapped atomically on refresh.

    Devices are kept sorted by (kind, natural order of name). Lookups by kind and id
    use an index built once at construction: the hot path does no scanning.
    """

    devices: tuple[Device, ...] = ()
    drivers: Mapping[str, Driver] = field(default_factory=lambda: MappingProxyType({}))
    problems: tuple[Problem, ...] = ()
    _index: Mapping[tuple[str, str], Device] = field(
        default_factory=lambda: MappingProxyType({}), compare=False, repr=False
    )
    _by_kind: Mapping[str, tuple[Device, ...]] = field(
        default_factory=lambda: MappingProxyType({}), compare=False, repr=False
    )

    def __post_init__(self) -> None:
        devices = tuple(sorted(self.devices, key=lambda d: (d.kind, natural_key(d.name))))
        object.__setattr__(self, "devices", devices)
        object.__setattr__(self, "drivers", MappingProxyType(dict(sorted(self.drivers.items()))))
        index: dict[tuple[str, str], Device] = {}
        by_kind: dict[str, list[Device]] = {}
        for d in devices:
            by_kind.setdefault(d.kind, []).append(d)
            for i in d.ids:
                index.setdefault((d.kind, i.lower()), d)
        object.__setattr__(self, "_index", MappingProxyType(index))
        object.__setattr__(
            self, "_by_kind", MappingProxyType({k: tuple(v) for k, v in by_kind.items()})
        )

    def kinds(self) -> tuple[str, ...]:
        return tuple(self._by_kind)

    def of_kind(self, kind: str) -> tuple[Device, ...]:
        return self._by_kind.get(kind, ())

    def find(self, kind: str, ident: str) -> Device | None:
        """The device of `kind` answering to `ident` (name, UUID or alias; case-insensitive)."""
        return self._index.get((kind, ident.lower()))

    def driver(self, vendor: str) -> Driver | None:
        return self.drivers.get(vendor)

    def with_health(self, unhealthy: Mapping[str, str]) -> Inventory:
        """This inventory with each device whose key `unhealthy` names marked unhealthy,
        attribute `health` = the reason (a health watch's marks over discovery's view)."""
        if not unhealthy or not any(d.key in unhealthy for d in self.devices):
            return self
        return dataclasses.replace(self, devices=tuple(
            structs.replace(d, healthy=False, attributes=MappingProxyType(
                {**d.attributes, "health": unhealthy[d.key]}))
            if d.key in unhealthy else d for d in self.devices))

    # ---- JSON -------------------------------------------------------------------

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n"

    def to_dict(self) -> dict[str, Any]:
        return {
            "schema_version": SCHEMA_VERSION,
            "drivers": [_encode(d) for d in self.drivers.values()],
            "devices": [_encode(d) for d in self.devices],
            "problems": [_encode(p) for p in self.problems],
        }

    @classmethod
    def from_dict(cls, data: Any, *, origin: str = "inventory") -> Inventory:
        """The inventory a JSON document describes, checked as the module docstring
        says. Raises InventoryError (source `origin`, message led by the JSON path)."""
        try:
            if not isinstance(data, dict):
                raise ValueError(f"top level: expected an object, got {_json_type(data)}")
            for key in data:
                if key not in _TOP_LEVEL:
                    raise ValueError(f"top level: unknown field {key!r}")
            version = data.get("schema_version")
            if version != SCHEMA_VERSION or isinstance(version, bool):
                raise ValueError(f"schema_version: unsupported version {version!r} "
                                 f"(this build reads {SCHEMA_VERSION})")
            drivers = [_decode(Driver, d, f"drivers[{i}]")
                       for i, d in enumerate(_list_at(data, "drivers"))]
            devices = [_decode(Device, d, f"devices[{i}]")
                       for i, d in enumerate(_list_at(data, "devices"))]
            problems = [_decode(Problem, d, f"problems[{i}]")
                        for i, d in enumerate(_list_at(data, "problems"))]
            _check_drivers(drivers)
            for i, d in enumerate(devices):
                if REPLICA_SEPARATOR in d.name:
                    raise ValueError(f"devices[{i}].name: {d.name!r} holds "
                                     f"{REPLICA_SEPARATOR!r}, which kubelet's time-slicing "
                                     "replica ids use")
            collisions = identity_collisions(devices)
            if collisions:
                raise ValueError(collisions[0].describe(devices, path=True))
        except ValueError as e:
            raise InventoryError(str(e), source=origin) from e
        return cls(
            devices=tuple(devices),
            drivers=MappingProxyType({d.vendor: d for d in drivers}),
            problems=tuple(problems),
        )

    @classmethod
    def from_json(cls, text: str, *, origin: str = "inventory") -> Inventory:
        """from_dict of the JSON `text`; InventoryError when it is not JSON."""
        try:
            data = json.loads(text)
        except ValueError as e:  # JSONDecodeError, or an integer of more than 4300 digits
            raise InventoryError(f"not valid JSON: {e}", source=origin) from e
        except RecursionError:
            raise InventoryError("not valid JSON: nested too deeply", source=origin) from None
        return cls.from_dict(data, origin=origin)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Inventory:
        """from_json of the file at `path` (the source of every error), UTF-8 text of at
        most MAX_INVENTORY_BYTES: a larger file is refused by its size, or once that
        much is read from what has none (a pipe), never read whole."""
        origin = os.fspath(path)
        limit = f"larger than {MAX_INVENTORY_BYTES // (1024 * 1024)} MiB: not an inventory"
        try:
            with open(path, "rb") as f:
                if os.fstat(f.fileno()).st_size > MAX_INVENTORY_BYTES:
                    raise InventoryError(limit, source=origin)
                raw = f.read(MAX_INVENTORY_BYTES + 1)
        except OSError as e:
            raise InventoryError(e.strerror or str(e), source=origin) from e
        if len(raw) > MAX_INVENTORY_BYTES:
            raise InventoryError(limit, source=origin)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise InventoryError(f"not UTF-8 text: byte 0x{raw[e.start]:02x} at offset "
                                 f"{e.start}", source=origin) from None
        return cls.from_json(text, origin=origin)


_TOP_LEVEL = ("schema_version", "drivers", "devices", "problems")


def _list_at(data: dict[str, Any], key: str) -> list[Any]:
    """The list at top-level `key` ([] when absent)."""
    value = data.get(key, [])
    if not isinstance(value, list):
        raise ValueError(f"{key}: expected a list, got {_json_type(value)}")
    return value


def _check_drivers(drivers: Sequence[Driver]) -> None:
    """One driver a vendor: a second would silently replace the first's edits."""
    seen: dict[str, int] = {}
    for i, d in enumerate(drivers):
        if d.vendor in seen:
            raise ValueError(f"drivers[{i}].vendor: {d.vendor!r} is already the vendor "
                             f"of drivers[{seen[d.vendor]}]")
        seen[d.vendor] = i


class Collision(NamedTuple):
    """Device `index` shares an identity with the earlier device `other` (indices in
    the sequence given): its field `what` (a JSON path below the device: "uuid",
    "aliases[1]", "pci_bus_id") holds `value`, which is the other's `other_what`."""

    index: int
    what: str
    value: str
    other: int
    other_what: str
    reason: str = ""  # why a shared value is a collision where it is not obvious

    def describe(self, devices: Sequence[Device], *, path: bool = False,
                 origin: str = "") -> str:
        """"devices[1].uuid: 'GPU-1' is also devices[0].uuid (nvidia.com/gpu=0): two
        devices with one identity"; path=False names no position: "UUID 'GPU-1' is also
        the UUID of nvidia.com/gpu=0 (from `origin`): two devices with one identity"."""
        other = devices[self.other].qualified_name
        why = f", {self.reason}" if self.reason else ""
        if path:
            return (f"devices[{self.index}].{self.what}: {self.value!r} is also "
                    f"devices[{self.other}].{self.other_what} ({other}){why}: two devices "
                    "with one identity")
        came = f" (from {origin})" if origin else ""
        return (f"{_field_name(self.what)} {self.value!r} is also the "
                f"{_field_name(self.other_what)} of {other}{came}{why}: two devices with "
                "one identity")


def _field_name(what: str) -> str:
    """A Device field as a message names it: "aliases[1]" -> "alias"."""
    return {"aliases": "alias", "pci_bus_id": "PCI bus id", "uuid": "UUID"}.get(
        what.partition("[")[0], what.partition("[")[0])


def identity_collisions(devices: Sequence[Device]) -> list[Collision]:
    """Every device (in the order given) that shares an identity with an earlier one it
    does not collide with itself: a UUID (any kind), an id within a kind (name, UUID,
    alias, partition id; case-insensitive, as Inventory.find), a PCI bus id within a
    kind (any padding or case) that either answers to (its name, UUID or an alias), or
    a key (kind and UUID, else PCI function and partition index, else PCI function: two
    devices on one PCI function, neither with a UUID or a partition index). One
    Collision per such device, its first; a device that collides counts as absent for
    the later ones (it is the one dropped), so each is judged against the devices
    kept."""
    uuids: dict[str, tuple[int, str]] = {}
    ids: dict[tuple[str, str], tuple[int, str]] = {}
    answered: dict[tuple[str, tuple[int, ...]], tuple[int, str]] = {}  # PCI ids answered to
    located: dict[tuple[str, tuple[int, ...]], tuple[int, str]] = {}  # pci_bus_id fields
    keyed: dict[tuple[str, tuple[int, ...], int | None], tuple[int, str]] = {}
    out: list[Collision] = []
    for i, d in enumerate(devices):
        found = _first_collision(d, uuids, ids, answered, located, keyed)
        if found is not None:
            what, value, (j, other_what), reason = found
            out.append(Collision(i, what, value, j, other_what, reason))
            continue
        # Keep it: what it answers to, is and is located at is taken from now on.
        for what, ident in _named(d):
            ids.setdefault((d.kind, ident.lower()), (i, what))
            bus = parse_pci_bus_id(ident)
            if bus is not None:
                answered.setdefault((d.kind, bus), (i, what))
        if d.uuid:
            uuids.setdefault(d.uuid.lower(), (i, "uuid"))
        bus = parse_pci_bus_id(d.pci_bus_id) if d.pci_bus_id else None
        if bus is not None:
            located.setdefault((d.kind, bus), (i, "pci_bus_id"))
            if not d.uuid:
                keyed.setdefault((d.kind, bus, d.partition),
                                 (i, "partition" if d.partition is not None else "pci_bus_id"))
    return out


def _named(d: Device) -> list[tuple[str, str]]:
    """(field, id) of every id `d` answers to (Device.ids), by the field holding it."""
    return [("name", d.name), *((("uuid", d.uuid),) if d.uuid else ()),
            *((f"aliases[{k}]", a) for k, a in enumerate(d.aliases)),
            *((("partition", d.partition_id),) if d.partition_id else ())]


def _first_collision(
    d: Device,
    uuids: Mapping[str, tuple[int, str]],
    ids: Mapping[tuple[str, str], tuple[int, str]],
    answered: Mapping[tuple[str, tuple[int, ...]], tuple[int, str]],
    located: Mapping[tuple[str, tuple[int, ...]], tuple[int, str]],
    keyed: Mapping[tuple[str, tuple[int, ...], int | None], tuple[int, str]],
) -> tuple[str, str, tuple[int, str], str] | None:
    """(field, value, (index, field) of the earlier device, reason) of `d`'s first
    collision with the devices kept so far, in the order the rules are listed; None."""
    if d.uuid and (other := uuids.get(d.uuid.lower())) is not None:
        return "uuid", d.uuid, other, ""
    named = _named(d)
    for what, ident in named:
        if (other := ids.get((d.kind, ident.lower()))) is not None:
            return what, ident, other, ""
    for what, ident in named:
        bus = parse_pci_bus_id(ident)
        if bus is None:
            continue
        for other in (answered.get((d.kind, bus)), located.get((d.kind, bus))):
            if other is not None:
                return what, ident, other, ""
    if d.pci_bus_id:
        bus = parse_pci_bus_id(d.pci_bus_id)
        if bus is None:  # _check_device refuses it at load; discovery writes none
            return None
        if (other := answered.get((d.kind, bus))) is not None:
            return "pci_bus_id", d.pci_bus_id, other, ""
        if not d.uuid and (other := keyed.get((d.kind, bus, d.partition))) is not None:
            if d.partition is not None:  # its partition id in another PCI padding
                return "partition", d.partition_id, other, "the same partition"
            return ("pci_bus_id", d.pci_bus_id, other,
                    "neither with a UUID or a partition index to tell them apart")
    return None


@lru_cache(maxsize=8192)
def natural_key(name: str) -> tuple[Any, ...]:
    """Sort key that orders "2" before "10" and "0:1" before "0:10". Runs of ASCII digits
    compare as numbers (by length without leading zeros, then digits: no int() of a
    4301-digit run, which Python refuses, nor of a "²", which isdigit() yet int() refuses).
    Remembered: the hot path sorts the same device paths and names for every container
    (a 512-GPU grant sorts 512 of them, a loop over characters each)."""
    out: list[Any] = []
    num = ""
    txt = ""
    for ch in name:
        if "0" <= ch <= "9":
            if txt:
                out.append((1, txt))
                txt = ""
            num += ch
        else:
            if num:
                out.append((0, _number_key(num)))
                num = ""
            txt += ch
    if num:
        out.append((0, _number_key(num)))
    if txt:
        out.append((1, txt))
    return tuple(out)


def _number_key(digits: str) -> tuple[int, str]:
    """A run of ASCII digits as a key that orders like its value."""
    significant = digits.lstrip("0")
    return len(significant), significant


# ---- generic Struct <-> JSON (only the types of this module) ----------------------

_NESTED: dict[str, type] = {}


def _encode(obj: Any) -> Any:
    if isinstance(obj, Struct):
        out: dict[str, Any] = {}
        for name in obj.__struct_fields__:
            v = getattr(obj, name)
            empty = (v is None or v == "" or v == () or (isinstance(v, Mapping) and not v)
                     or (isinstance(v, ContainerEdits) and not v))
            if empty and name in _empty_defaults(type(obj)):
                continue
            out[name] = _encode(v)
        return out
    if isinstance(obj, Mapping):
        return {k: _encode(v) for k, v in obj.items()}
    if isinstance(obj, tuple | list):
        return [_encode(v) for v in obj]
    return obj


def _json_type(value: Any) -> str:
    """What a decoded JSON value is, for messages ("null", "int", "list", "object")."""
    return {type(None): "null", dict: "object"}.get(type(value), type(value).__name__)


def _decode(cls: type, data: Any, where: str) -> Any:
    """An instance of `cls` from the JSON object `data` at JSON path `where`, its
    fields' types and _CHECKS checked (ValueError starting with the path)."""
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected an object, got {_json_type(data)}")
    hints = _FIELD_TYPES[cls]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in hints:
            raise ValueError(f"{where}: unknown field {key!r}")
        kwargs[key] = _decode_value(hints[key], value, f"{where}.{key}")
    try:
        obj = cls(**kwargs)
    except TypeError as e:  # a required field missing
        raise ValueError(f"{where}: {e}") from e
    check = _CHECKS.get(cls)
    if check is not None:
        check(obj, where)
    return obj


def _decode_value(spec: Any, value: Any, where: str) -> Any:
    kind, inner = spec
    if kind == "scalar":
        if value is None and type(None) in inner:
            return None
        if isinstance(value, bool) and bool not in inner:
            raise ValueError(f"{where}: expected {inner[0].__name__}, got bool")
        if not isinstance(value, inner):
            raise ValueError(f"{where}: expected {inner[0].__name__}, got {_json_type(value)}")
        return value
    if kind == "tuple":
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected a list, got {_json_type(value)}")
        return tuple(_decode_value(inner, v, f"{where}[{i}]") for i, v in enumerate(value))
    if kind == "object":
        return _decode(inner, value, where)
    if kind == "map":
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected an object, got {_json_type(value)}")
        return MappingProxyType(
            {str(k): _decode_value(inner, v, f"{where}.{k}") for k, v in value.items()}
        )
    raise AssertionError(kind)


_S = ("scalar", (str,))
_I = ("scalar", (int,))
_OI = ("scalar", (int, type(None)))
_B = ("scalar", (bool,))
_EDITS = ("object", ContainerEdits)
_FIELD_TYPES: dict[type, dict[str, Any]] = {
    DeviceNode: {"path": _S, "major": _I, "minor": _I, "type": _S, "host_path": _S,
                 "file_mode": _OI, "uid": _OI, "gid": _OI, "permissions": _S},
    Mount: {"host_path": _S, "container_path": _S, "type": _S, "options": ("tuple", _S)},
    Hook: {"hook_name": _S, "path": _S, "args": ("tuple", _S), "env": ("tuple", _S),
           "timeout": _OI},
    ContainerEdits: {"env": ("tuple", _S), "device_nodes": ("tuple", ("object", DeviceNode)),
                     "mounts": ("tuple", ("object", Mount)), "hooks": ("tuple", ("object", Hook)),
                     "additional_gids": ("tuple", _I)},
    Device: {"kind": _S, "name": _S, "uuid": _S, "aliases": ("tuple", _S), "edits": _EDITS,
             "numa_node": _OI, "pci_bus_id": _S, "parent": _S, "healthy": _B,
             "attributes": ("map", _S), "links": ("tuple", _S), "vendor": _S,
             "partition": _OI},
    Driver: {"vendor": _S, "version": _S, "cuda_version": _S,
             "capabilities": ("map", _EDITS)},
    Problem: {"source": _S, "message": _S},
}


def _check_node(node: DeviceNode, where: str) -> None:
    for what, number, top in (("major", node.major, MAX_MAJOR), ("minor", node.minor, MAX_MINOR)):
        if not 0 <= number <= top:
            raise ValueError(f"{where}.{what}: {number} is not a device {what} "
                             f"(0 to {top})")


def _check_device(device: Device, where: str) -> None:
    if not KIND_RE.fullmatch(device.kind):
        raise ValueError(f"{where}.kind: {device.kind!r} is not a device kind "
                         "(vendor/class, such as nvidia.com/gpu)")
    if not device.name:
        raise ValueError(f"{where}.name: empty: a device needs a name")
    for k, alias in enumerate(device.aliases):
        if not alias:
            raise ValueError(f"{where}.aliases[{k}]: empty")
    if device.pci_bus_id and parse_pci_bus_id(device.pci_bus_id) is None:
        raise ValueError(f"{where}.pci_bus_id: {device.pci_bus_id!r} is not a PCI bus id "
                         "(domain:bus:device.function, such as 0000:3b:00.0)")
    if device.partition is not None:
        if not 0 <= device.partition <= MAX_PARTITION:
            raise ValueError(f"{where}.partition: {device.partition} is not a partition "
                             f"index (0 to {MAX_PARTITION})")
        if not device.pci_bus_id:
            raise ValueError(f"{where}.partition: a partition needs the pci_bus_id of the "
                             "PCI function it is a partition of")


def _check_driver(driver: Driver, where: str) -> None:
    if not driver.vendor:
        raise ValueError(f"{where}.vendor: empty: a driver needs a vendor")


# What loading checks of a decoded object beyond its fields' types (the module docstring).
_CHECKS: dict[type, Any] = {DeviceNode: _check_node, Device: _check_device,
                            Driver: _check_driver}


@cache
def _empty_defaults(cls: type) -> frozenset[str]:
    """The fields of `cls` whose default is empty (None, "", (), {}, no edits): to_json
    leaves such a field out when empty. An empty value of any other field
    (Mount.options, DeviceNode.permissions, a required field) is written, so that it
    loads back as it was, not as the default. Asked on first use: structs.fields()
    evaluates the annotations, about 1 ms for these classes that `run` never writes."""
    return frozenset(f.name for f in structs.fields(cls)
                     if f.default is not NODEFAULT and not f.default)
