"""Selection: which inventory devices a container's Request gets.

Owns: resolving device ids against the Inventory (DeviceIndex), serving counts (the
choice itself is nri_accel.topology's), limits, NVIDIA_REQUIRE_* checks per granted GPU,
and the Selection record. Imports the standard library, nri_accel.errors,
nri_accel.inventory, nri_accel.request, nri_accel.topology and (for types)
nri_accel.requirements.
Pure functions over frozen data: no I/O, no NVML, no logging. The allocation *state*
(which running container holds what) lives in nri_accel.engine and comes in as `busy`.

Semantics (the NVIDIA ones follow libnvidia-container's select_devices):

- An id names a device by its name, UUID or alias, case-insensitively. A claim of kind
  nvidia.com/gpu resolves across GPUs and MIG devices, as NVIDIA_VISIBLE_DEVICES does:
  a GPU index ("3"), a "GPU-" UUID, a PCI bus id in any zero padding ("0:3b:0.0",
  "00000000:3B:00.0"), a "MIG-" UUID or "gpu:mig" ("7:1"). An unknown id fails the
  container with an AllocationError naming the claim's source and what the node has.
- A GPU in MIG mode requested whole is refused (its MIG devices are what a workload can
  use), except for a container asking for MIG config or monitor capabilities; those
  capabilities are refused beside specific MIG devices (they act on whole GPUs).
- `all` is every healthy device of the kind. For nvidia.com/gpu that is every healthy GPU,
  MIG-enabled ones included, plus every healthy MIG device: the toolkit's `all`.
- A count is served from free healthy devices (GPUs in MIG mode are never chosen by
  count) by nri_accel.topology.choose, the policy the device plugin's
  GetPreferredAllocation shares: one NUMA node, then the most direct links (NVLink,
  NeuronLink) inside the set, then the fewest links broken between free devices, then
  the NUMA node with the fewest free devices (best fit), then index order; spanning as
  few NUMA nodes as possible when no one node has enough.
- Exclusivity: a device granted by count or by explicit id is *held*; the allocator never
  picks a held device for a count, so a device chosen by count is never handed to two
  running containers by count. Explicit ids and `all` do not check holdings: they come
  from the device plugin's allocation, an operator or a trusted namespace and may share
  (a monitoring agent asking for `all` must not block every count request). Devices
  granted only through `all` are *shared* and hold nothing.
- Limits only narrow: per vendor (the part of the kind before "/": nvidia.com covers GPUs
  and MIG devices), the granted devices are intersected with the devices the limits name.
  A limit naming a device that was not granted is refused with a PolicyError naming the
  limit's source; a count limit keeps at most that many of the vendor's granted devices
  (in index order); `all` limits nothing. NVIDIA_VISIBLE_DEVICES=none leaves no
  nvidia.com device (the driver files still come, see nri_accel.edits).
- CDI requests (claims with `cdi`) resolve like ids ("vendor/class=all": every device of
  the kind); with cdi_passthrough they are not resolved but handed to the runtime as CDI
  device names (Selection.cdi_devices), which resolves them from its own spec files.
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import TYPE_CHECKING

from nri_accel.errors import AllocationError, PolicyError, RequestError
from nri_accel.inventory import (
    KIND_GPU,
    KIND_MIG,
    NVIDIA_VENDOR,
    Device,
    Inventory,
    parse_pci_bus_id,
    vendor_of,
)
from nri_accel.request import ENV_MIG_CONFIG, ENV_MIG_MONITOR, DeviceClaim, Request
from nri_accel.topology import Topology
from nri_accel.topology import choose as choose_positions

if TYPE_CHECKING:
    from nri_accel.requirements import Requirements

_MAX_ECHO = 64  # longest user-supplied id echoed back in an error message
_MAX_LISTED = 16  # most device names listed in an "unknown device" error
_MEMO_SIZE = 4096  # requirement checks remembered per inventory before starting over


def mig_enabled(device: Device) -> bool:
    """A GPU in MIG mode: only its MIG devices are usable by a workload."""
    return device.kind == KIND_GPU and device.attributes.get("mig_mode") == "enabled"


@dataclass(frozen=True, slots=True)
class Selection:
    """The devices one container gets.

    devices: granted, in inventory order (kind, then natural order of name).
    shared: qualified names granted only through `all` (they hold nothing).
    cdi_devices: CDI names handed to the runtime as they are (cdi_passthrough).
    """

    devices: tuple[Device, ...] = ()
    shared: frozenset[str] = frozenset()
    cdi_devices: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()

    @property
    def held(self) -> frozenset[str]:
        """Qualified names this container holds: granted by count or explicit id."""
        return frozenset(d.qualified_name for d in self.devices) - self.shared


class DeviceIndex:
    """Per-inventory lookup tables, built once (swap_inventory), read by every select().

    Devices are numbered by their position in the inventory (its sort order); links and
    sets of devices are bit masks over those positions, so the allocator does integer
    arithmetic rather than string work (`topology`: NUMA nodes and links by position).
    """

    __slots__ = ("_all", "_by_name", "_checked", "_countable", "_describe", "_pci", "_pos",
                 "devices", "inventory", "qualified_names", "topology")

    def __init__(self, inventory: Inventory) -> None:
        self.inventory = inventory
        devices = inventory.devices
        self.devices = devices
        self.qualified_names = tuple(d.qualified_name for d in devices)
        # Keyed by identity: these Device objects are the inventory's own, kept alive by it.
        self._pos = MappingProxyType({id(d): i for i, d in enumerate(devices)})
        self._by_name = MappingProxyType({(d.kind, d.name): d for d in devices})
        pci: dict[tuple[int, int, int, int], Device] = {}
        for d in inventory.of_kind(KIND_GPU):
            for ident in (d.pci_bus_id, *d.aliases):
                key = parse_pci_bus_id(ident)
                if key is not None:
                    pci.setdefault(key, d)
        self._pci = MappingProxyType(pci)
        all_: dict[str, tuple[Device, ...]] = {}
        for kind in inventory.kinds():
            all_[kind] = tuple(d for d in inventory.of_kind(kind) if d.healthy)
        if KIND_GPU in all_ or KIND_MIG in all_:
            all_[KIND_GPU] = all_.get(KIND_GPU, ()) + all_.get(KIND_MIG, ())
        self._all = MappingProxyType(all_)
        self._countable = MappingProxyType({
            kind: tuple(self._pos[id(d)] for d in inventory.of_kind(kind)
                        if d.healthy and not mig_enabled(d))
            for kind in inventory.kinds()})
        # Links restricted to same-kind devices that exist (Topology makes them symmetric).
        peers = []
        for d in devices:
            linked = (self._by_name.get((d.kind, name)) for name in d.links)
            peers.append([self._pos[id(o)] for o in linked if o is not None])
        self.topology = Topology.build([d.numa_node for d in devices], peers)
        self._describe = MappingProxyType({k: _describe_kind(k, inventory)
                                           for k in (*inventory.kinds(), KIND_GPU)})
        self._checked: dict[tuple[tuple[tuple[str, str], ...], int],
                            tuple[str, str] | None] = {}

    def position(self, device: Device) -> int:
        """The device's number in this index (its place in inventory order)."""
        return self._pos[id(device)]

    def countable(self, kind: str) -> tuple[int, ...]:
        """Positions of the devices of `kind` a count may choose: healthy, not in MIG mode."""
        return self._countable.get(kind, ())

    def parent(self, device: Device) -> Device | None:
        """The GPU a MIG device lives on."""
        if not device.parent:
            return None
        return self._by_name.get((KIND_GPU, device.parent))

    def all_of(self, kind: str) -> tuple[Device, ...]:
        """Every healthy device `all` means for `kind` (GPUs: MIG devices too)."""
        return self._all.get(kind, ())

    def resolve(self, kind: str, ident: str) -> Device | None:
        """The device of `kind` answering to `ident`; nvidia.com/gpu ids may name MIG devices."""
        inv = self.inventory
        found = inv.find(kind, ident)
        if found is not None or kind != KIND_GPU:
            return found
        key = parse_pci_bus_id(ident)
        if key is not None and key in self._pci:
            return self._pci[key]
        return inv.find(KIND_MIG, ident)

    def unknown(self, kind: str, ident: str, source: str) -> AllocationError:
        shown = ident if len(ident) <= _MAX_ECHO else ident[:_MAX_ECHO] + "..."
        return AllocationError(f"unknown device {kind}={shown!r}: {self._describe_for(kind)}",
                               source=source)

    def facts(self, device: Device | None) -> dict[str, str]:
        """What NVIDIA_REQUIRE_* compares for `device` (None: the driver alone)."""
        driver = self.inventory.driver("nvidia")
        facts = {"cuda": driver.cuda_version if driver else "",
                 "driver": driver.version if driver else ""}
        if device is not None:
            parent = self.parent(device)
            for key, attr in (("arch", "compute_capability"), ("brand", "brand")):
                facts[key] = (device.attributes.get(attr)
                              or (parent.attributes.get(attr, "") if parent else ""))
        return facts

    def unsatisfied(self, reqs: Requirements, device: Device | None) -> tuple[str, str] | None:
        """reqs.unsatisfied() for `device`'s facts, remembered per (requirements, device):
        images repeat the same requirements and the facts do not change."""
        # Keyed by the variables' text (str hashes are cached; the dataclass's are not).
        key = (tuple((r.source, r.text) for r in reqs.items),
               -1 if device is None else self.position(device))
        try:
            return self._checked[key]
        except KeyError:
            pass
        result = reqs.unsatisfied(self.facts(device))
        if len(self._checked) >= _MEMO_SIZE:
            self._checked.clear()
        self._checked[key] = result
        return result

    def _describe_for(self, kind: str) -> str:
        return self._describe.get(kind) or f"this node has no {kind} devices"


def _describe_kind(kind: str, inventory: Inventory) -> str:
    kinds = (KIND_GPU, KIND_MIG) if kind == KIND_GPU else (kind,)
    parts = []
    for k in kinds:
        names = [d.name for d in inventory.of_kind(k)]
        if names:
            more = f" and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else ""
            parts.append(f"{k} {', '.join(names[:_MAX_LISTED])}{more}")
    if not parts:
        return ""
    return "this node has " + "; ".join(parts)


# ---- select -------------------------------------------------------------------------


def select(request: Request, index: DeviceIndex, busy: Container[str] = frozenset(), *,
           cdi_passthrough: bool = False) -> Selection:
    """Resolve a Request against the inventory. `busy`: qualified names held by other
    running containers (only counts avoid them). With `cdi_passthrough`, CDI requests are
    not resolved here but handed on as names. Raises RequestError and subclasses."""
    granted: dict[int, Device] = {}  # position -> device
    held: set[int] = set()
    notes: list[str] = []
    counts: list[DeviceClaim] = []
    allow_mig_whole = request.mig_config or request.mig_monitor

    for claim in request.grants:
        if claim.cdi and cdi_passthrough:
            continue
        if claim.all:
            devs = index.all_of(claim.kind)
            if not devs:
                notes.append(f"{claim.source}: no healthy {claim.kind} devices on this node")
            for d in devs:
                granted.setdefault(index.position(d), d)
        elif claim.ids:
            for d in _resolve_ids(index, claim.kind, claim.ids, claim.source):
                if mig_enabled(d) and not allow_mig_whole:
                    raise _whole_mig_gpu(index, d, claim.source)
                if not d.healthy:
                    notes.append(f"{claim.source}: {d.qualified_name} is reported unhealthy")
                pos = index.position(d)
                granted.setdefault(pos, d)
                held.add(pos)
        elif claim.count is not None:
            counts.append(claim)

    for claim in counts:
        for d in _allocate(index, claim, busy, granted):
            pos = index.position(d)
            granted[pos] = d
            held.add(pos)

    if request.limits:
        granted = _apply_limits(index, request.limits, granted)
    if request.nvidia_none:  # the driver without a GPU, whatever else granted GPUs
        granted = {p: d for p, d in granted.items() if vendor_of(d.kind) != NVIDIA_VENDOR}

    if allow_mig_whole:
        _refuse_mig_caps_beside_mig_devices(request, granted, held)
    order = sorted(granted)
    devices = tuple(granted[p] for p in order)
    if request.requirements is not None:
        _check_requirements(index, request, devices)
    return Selection(
        devices=devices,
        shared=frozenset(index.qualified_names[p] for p in order if p not in held),
        cdi_devices=request.cdi_names if cdi_passthrough else (),
        notes=tuple(notes),
    )


def _resolve_ids(index: DeviceIndex, kind: str, ids: Iterable[str],
                 source: str) -> list[Device]:
    out = []
    for ident in ids:
        d = index.resolve(kind, ident)
        if d is None:
            raise index.unknown(kind, ident, source)
        out.append(d)
    return out


def _whole_mig_gpu(index: DeviceIndex, gpu: Device, source: str) -> RequestError:
    migs = [d.qualified_name for d in index.inventory.of_kind(KIND_MIG) if d.parent == gpu.name]
    hint = f" ({', '.join(migs)})" if migs else " (it has none configured)"
    return AllocationError(f"{gpu.qualified_name} is in MIG mode: request its MIG devices"
                           f"{hint} instead of the whole GPU", source=source)


def _refuse_mig_caps_beside_mig_devices(request: Request, granted: Mapping[int, Device],
                                        held: Container[int]) -> None:
    """NVIDIA_MIG_CONFIG_DEVICES / NVIDIA_MIG_MONITOR_DEVICES act on whole GPUs: refused
    when the container gets specific MIG devices (named, counted, or what a narrowing
    request left of `all`), as nvidia-container-toolkit's migCapsDevices.Validate does."""
    narrowed = any(vendor_of(c.kind) == NVIDIA_VENDOR for c in request.limits)
    specific = sorted(d.qualified_name for p, d in granted.items()
                      if d.kind == KIND_MIG and (p in held or narrowed))
    if specific:
        var = ENV_MIG_CONFIG if request.mig_config else ENV_MIG_MONITOR
        shown = ", ".join(specific[:_MAX_LISTED])
        raise RequestError(f"cannot be combined with specific MIG devices ({shown}): the MIG "
                           "configuration and monitoring capabilities act on whole GPUs; "
                           "request whole GPUs or all", source=f"env {var}")


# ---- the allocator -------------------------------------------------------------------


def _allocate(index: DeviceIndex, claim: DeviceClaim, busy: Container[str],
              granted: Mapping[int, Device]) -> tuple[Device, ...]:
    count = claim.count or 0
    if count <= 0:
        return ()
    kind = claim.kind
    names = index.qualified_names
    free = [p for p in index.countable(kind) if p not in granted and names[p] not in busy]
    if len(free) < count:
        total = len(index.inventory.of_kind(kind))
        if not total:
            raise AllocationError(f"asks for {count} {kind} but this node has none",
                                  source=claim.source)
        free_names = ", ".join(index.devices[p].name for p in free) or "none"
        raise AllocationError(
            f"asks for {count} {kind} but only {len(free)} of {total} are free "
            f"(free: {free_names}; the others are held by running containers, "
            "unhealthy or in MIG mode)", source=claim.source)
    return tuple(index.devices[p] for p in choose_positions(index.topology, free, count))


def choose(index: DeviceIndex, free: Iterable[Device], count: int) -> tuple[Device, ...]:
    """The best `count` devices among `free` (nri_accel.topology.choose's order)."""
    positions = [index.position(d) for d in free]
    return tuple(index.devices[p] for p in choose_positions(index.topology, positions, count))


# ---- limits and requirements -----------------------------------------------------------


def _apply_limits(index: DeviceIndex, limits: Iterable[DeviceClaim],
                  granted: dict[int, Device]) -> dict[int, Device]:
    allowed: dict[str, set[int] | None] = {}  # vendor -> allowed positions (None: unlimited)
    for claim in limits:
        vendor = vendor_of(claim.kind)
        if claim.all:
            allowed[vendor] = None
            continue
        if vendor in allowed and allowed[vendor] is None:
            continue
        mine = sorted(p for p, d in granted.items() if vendor_of(d.kind) == vendor)
        keep = allowed.setdefault(vendor, set())
        assert keep is not None
        if claim.ids:
            for d in _resolve_ids(index, claim.kind, claim.ids, claim.source):
                pos = index.position(d)
                if pos not in granted:
                    raise PolicyError(
                        f"{d.qualified_name} was not allocated to this container, and this "
                        f"source may only narrow the allocation "
                        f"({_granted_list(index.qualified_names[p] for p in mine)})",
                        source=claim.source)
                keep.add(pos)
        elif claim.count is not None:  # at most N of the vendor's granted devices
            keep.update(mine[:claim.count])
    out = {}
    for p, d in granted.items():
        keep = allowed.get(vendor_of(d.kind))
        if keep is None or p in keep:
            out[p] = d
    return out


def _granted_list(names: Iterable[str]) -> str:
    listed = list(names)
    return "allocated: " + ", ".join(listed) if listed else "nothing was allocated"


def _check_requirements(index: DeviceIndex, request: Request,
                        devices: tuple[Device, ...]) -> None:
    """NVIDIA_REQUIRE_*: every granted GPU or MIG device must satisfy them (a MIG device
    has its parent GPU's arch and brand); with NVIDIA_VISIBLE_DEVICES=none only the
    driver facts are checked. RequestError names the variable that fails."""
    reqs = request.requirements
    assert reqs is not None
    gpus = [d for d in devices if d.kind in (KIND_GPU, KIND_MIG)]
    if not gpus:
        if request.nvidia_none:
            failed = index.unsatisfied(reqs, None)
            if failed is not None:
                raise RequestError(f"the driver: {failed[1]}", source=failed[0])
        return
    for d in gpus:
        failed = index.unsatisfied(reqs, d)
        if failed is not None:
            raise RequestError(f"{d.qualified_name}: {failed[1]}", source=failed[0])
