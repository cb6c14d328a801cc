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
their (already deterministic) order. Loading validates types and rejects unknown
schema versions with an InventoryError naming the JSON path.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import cache, lru_cache
from types import MappingProxyType
from typing import Any

from msgspec import NODEFAULT, Struct, structs

from nri_accel.errors import InventoryError

SCHEMA_VERSION = 1

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

# "domain:bus:device.function" in hex, any case and zero padding ("0:3b:0.0", NVML's
# "00000000:3B:00.0", sysfs's "0000:3b:00.0").
_PCI_BUS_ID_RE = re.compile(
    r"([0-9A-Fa-f]{1,16}):([0-9A-Fa-f]{1,8}):([0-9A-Fa-f]{1,8})\.([0-9A-Fa-f]{1,8})")


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

    @property
    def qualified_name(self) -> str:
        return f"{self.kind}={self.name}"

    @property
    def stable_id(self) -> str:
        """The id that keeps naming this device when the node is renumbered (a MIG
        reconfiguration, a GPU off the bus, a driver reload): its UUID, else its PCI bus
        id, else its name (CDI and static devices: the name their spec or config gives)."""
        return self.uuid or self.pci_bus_id or self.name

    @property
    def key(self) -> str:
        """"<kind>=<stable id>": what holdings and grant records name a device by."""
        return f"{self.kind}={self.stable_id}"

    @property
    def ids(self) -> tuple[str, ...]:
        """Every id this device answers to: name, uuid, aliases."""
        return (self.name, *((self.uuid,) if self.uuid else ()), *self.aliases)


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
        if not isinstance(data, dict):
            raise InventoryError("top level must be a JSON object", source=origin)
        version = data.get("schema_version")
        if version != SCHEMA_VERSION:
            raise InventoryError(
                f"unsupported schema_version {version!r} (this build reads {SCHEMA_VERSION})",
                source=origin,
            )
        try:
            drivers = [_decode(Driver, d, f"{origin}.drivers[{i}]")
                       for i, d in enumerate(data.get("drivers", []))]
            devices = [_decode(Device, d, f"{origin}.devices[{i}]")
                       for i, d in enumerate(data.get("devices", []))]
            problems = [_decode(Problem, d, f"{origin}.problems[{i}]")
                        for i, d in enumerate(data.get("problems", []))]
        except (TypeError, ValueError, AttributeError) as e:
            raise InventoryError(str(e), source=origin) from e
        return cls(
            devices=tuple(devices),
            drivers=MappingProxyType({d.vendor: d for d in drivers}),
            problems=tuple(problems),
        )

    @classmethod
    def from_json(cls, text: str, *, origin: str = "inventory") -> Inventory:
        try:
            data = json.loads(text)
        except ValueError as e:  # JSONDecodeError, or an integer of more than 4300 digits
            raise InventoryError(f"not valid JSON: {e}", source=origin) from e
        except RecursionError:
            raise InventoryError("not valid JSON: nested too deeply", source=origin) from None
        return cls.from_dict(data, origin=origin)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Inventory:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise InventoryError(e.strerror or str(e), source=os.fspath(path)) from e
        return cls.from_json(text, origin=os.fspath(path))


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


def _decode(cls: type, data: Any, where: str) -> Any:
    if not isinstance(data, dict):
        raise ValueError(f"{where}: expected an object, got {type(data).__name__}")
    hints = _FIELD_TYPES[cls]
    kwargs: dict[str, Any] = {}
    for key, value in data.items():
        if key not in hints:
            raise ValueError(f"{where}: unknown field {key!r}")
        kwargs[key] = _decode_value(hints[key], value, f"{where}.{key}")
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise ValueError(f"{where}: {e}") from e


def _decode_value(spec: Any, value: Any, where: str) -> Any:
    kind, inner = spec
    if kind == "scalar":
        if value is None and type(None) in inner:
            return None
        if isinstance(value, bool) and bool not in inner:
            raise ValueError(f"{where}: expected {inner[0].__name__}, got bool")
        if not isinstance(value, inner):
            raise ValueError(f"{where}: expected {inner[0].__name__}, got {type(value).__name__}")
        return value
    if kind == "tuple":
        if not isinstance(value, list):
            raise ValueError(f"{where}: expected a list")
        return tuple(_decode_value(inner, v, f"{where}[{i}]") for i, v in enumerate(value))
    if kind == "object":
        return _decode(inner, value, where)
    if kind == "map":
        if not isinstance(value, dict):
            raise ValueError(f"{where}: expected an object")
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
             "attributes": ("map", _S), "links": ("tuple", _S), "vendor": _S},
    Driver: {"vendor": _S, "version": _S, "cuda_version": _S,
             "capabilities": ("map", _EDITS)},
    Problem: {"source": _S, "message": _S},
}


@cache
def _empty_defaults(cls: type) -> frozenset[str]:
    """The fields of `cls` whose default is empty (None, "", (), {}, no edits): to_json
    leaves such a field out when empty. An empty value of any other field
    (Mount.options, DeviceNode.permissions, a required field) is written, so that it
    loads back as it was, not as the default. Asked on first use: structs.fields()
    evaluates the annotations, about 1 ms for these classes that `run` never writes."""
    return frozenset(f.name for f in structs.fields(cls)
                     if f.default is not NODEFAULT and not f.default)
