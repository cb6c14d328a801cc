"""Selection: which inventory devices a container's Request gets.

Owns: resolving device ids against the Inventory (DeviceIndex), serving counts (the
choice itself is nri_accel.topology's), limits, the family rules' call points, the
Selection record, and the memo of selections each DeviceIndex keeps (select()).
Imports the standard library, msgspec, nri_accel.errors, nri_accel.inventory,
nri_accel.memo, nri_accel.policy (the Request), nri_accel.syntax, nri_accel.topology and
nri_accel.vendors. Pure functions over frozen data (what they remember aside): no I/O,
no NVML, no logging. Who holds what lives in nri_accel.state and comes in as `busy`;
the exclusivity rule itself is decided there.

Semantics (the NVIDIA ones follow libnvidia-container's select_devices; each family adds
its own rules through its profile, see nri_accel.vendors.base):

- An id names a device by its name, UUID, alias or PCI bus id (in any zero padding,
  "0:3b:0.0" = "0000:3b:00.0"), case-insensitively, among the kinds the claim's kind
  covers (a nvidia.com/gpu id may name a MIG device). A kubelet time-slicing replica id
  "<id>::<n>" names device <id>, shared. An unknown id fails the container with a
  NotFoundError naming the claim's source and what the node has; a device the family
  refuses when named (a GPU in MIG mode) or an unhealthy one is refused, naming it.
- `all` is every healthy device of the kinds the kind covers.
- A count is served from the healthy devices its family lets a count choose that no
  running container holds (`busy`) by nri_accel.topology.choose, the policy the device
  plugin's GetPreferredAllocation shares: one NUMA node, then the most direct links
  (NVLink, NeuronLink) inside the set, then the fewest links broken between free devices,
  then the NUMA node with the fewest free devices (best fit), then index order; spanning
  as few NUMA nodes as possible when no one node has enough.
- Devices granted only through `all`, through a time-slicing replica, or of a kind the
  configuration shares are *shared*; every other grant (an id, a count, a CDI request) is
  exclusive. nri_accel.state refuses an exclusive grant of a device another running
  container holds, naming that container.
- Limits only narrow: per vendor (the part of the kind before "/"), the granted devices
  are intersected with the devices the limits name. A limit naming a device that was not
  granted is refused with a PolicyError naming the limit's source; a count limit keeps
  at most that many of the vendor's granted devices (in index order); `all` limits
  nothing. A drivers-only vendor (NVIDIA_VISIBLE_DEVICES=none) keeps no device.
- CDI requests (claims with `cdi`) resolve like ids ("vendor/class=all": every device of
  the kind); with cdi_passthrough they are handed to the runtime as CDI device names
  (Selection.cdi_devices), which resolves them from its own spec files, and the devices
  they name on this node are still held (Selection.passthrough).
"""

from __future__ import annotations

from collections.abc import Container, Iterable, Mapping
from types import MappingProxyType
from typing import Any

from msgspec import Struct

from nri_accel.errors import AllocationError, NotFoundError, PolicyError, cut
from nri_accel.inventory import (
    REPLICA_SEPARATOR,
    Device,
    Inventory,
    parse_pci_bus_id,
    vendor_of,
)
from nri_accel.memo import Memo
from nri_accel.policy import Request
from nri_accel.syntax import DeviceClaim
from nri_accel.topology import Topology
from nri_accel.topology import choose as choose_positions
from nri_accel.vendors import PROFILES, family_of

_MAX_ECHO = 64  # longest user-supplied id echoed back in an error message
_MAX_LISTED = 16  # most device names listed in an "unknown device" error
_MAX_HOLDERS = 8  # most held devices listed with their holders in a refused count
_CHOICES_SIZE = 4096  # count choices remembered per inventory before starting over
# select()'s memo of selections, per inventory: entries, and characters of the requests
# they were made from, each charged SELECTED_CHARS more a device it selects (its tuples,
# sets and granted_by hold some 200 bytes a device).
SELECTIONS_SIZE = 4096
SELECTIONS_CHARS = 1024 * 1024
SELECTED_CHARS = 64


class Selection(Struct, frozen=True):
    """The devices one container gets.

    devices: granted, in inventory order (kind, then natural order of name).
    shared: keys (Device.key) of those granted shared: only through `all`, a replica,
      or a shared kind; the others are exclusive.
    passthrough: devices of this node named by CDI requests handed to the runtime as CDI
      names (cdi_devices); they get no edits from nri-accel but are held like the others.
    granted_by: qualified name -> the source that granted it, for the audit log line.
    """

    devices: tuple[Device, ...] = ()
    shared: frozenset[str] = frozenset()
    cdi_devices: tuple[str, ...] = ()
    passthrough: tuple[Device, ...] = ()
    notes: tuple[str, ...] = ()
    granted_by: Mapping[str, str] = MappingProxyType({})
    keys: frozenset[str] = frozenset()  # of every device it names: devices and passthrough
    device_keys: tuple[str, ...] = ()  # of devices, in their order

    @property
    def exclusive(self) -> frozenset[str]:
        """Keys this container holds exclusively."""
        return self.keys - self.shared


class DeviceIndex:
    """Per-inventory lookup tables, built once (on every inventory swap), read by every
    select().

    Devices are numbered by their position in the inventory (its sort order); links and
    sets of devices are bit masks over those positions, so the allocator does integer
    arithmetic rather than string work (`topology`: NUMA nodes and links by position).
    """

    __slots__ = ("_all", "_choices", "_countable", "_describe", "_members", "_memos", "_pci",
                 "_pos", "by_key", "devices", "families", "inventory", "keys", "names",
                 "selections", "topology")

    def __init__(self, inventory: Inventory) -> None:
        self.inventory = inventory
        devices = inventory.devices
        self.devices = devices
        self.keys = tuple(d.key for d in devices)  # each position's Device.key
        self.names = tuple(d.qualified_name for d in devices)  # and qualified name
        self.families = tuple(family_of(d.kind).name for d in devices)  # and family
        self.by_key = MappingProxyType(dict(zip(self.keys, devices, strict=True)))
        # Keyed by identity: these Device objects are the inventory's own, kept alive by it.
        self._pos = MappingProxyType({id(d): i for i, d in enumerate(devices)})
        members: dict[str, tuple[str, ...]] = {}
        for p in PROFILES:
            members.update(p.members)
        self._members = MappingProxyType(members)
        # A PCI address names the device of its kind that answers to it (an alias), or
        # whose own PCI function it is; not a part (a MIG device, a compute partition),
        # which carries its GPU's address, nor any device where several share it.
        pci: dict[tuple[str, tuple[int, int, int, int]], set[int]] = {}
        for i, d in enumerate(devices):
            whole = not d.parent and d.partition is None
            for ident in ((d.pci_bus_id,) if whole else ()) + d.aliases:
                key = parse_pci_bus_id(ident) if ident else None
                if key is not None:
                    pci.setdefault((d.kind, key), set()).add(i)
        self._pci = MappingProxyType({k: devices[next(iter(found))]
                                      for k, found in pci.items() if len(found) == 1})
        all_: dict[str, tuple[int, ...]] = {}
        countable: dict[str, tuple[int, ...]] = {}
        for kind in inventory.kinds():
            family = family_of(kind)
            of_kind = inventory.of_kind(kind)
            countable[kind] = tuple(self._pos[id(d)] for d in of_kind
                                    if d.healthy and family.countable(d))
        for kind in {*inventory.kinds(), *members}:
            all_[kind] = tuple(self._pos[id(d)] for k in self.members(kind)
                               for d in inventory.of_kind(k) if d.healthy)
        self._all = MappingProxyType(all_)
        self._countable = MappingProxyType(countable)
        # Links restricted to same-kind devices that exist (Topology makes them symmetric).
        by_name = {(d.kind, d.name): d for d in devices}
        peers = []
        for d in devices:
            linked = (by_name.get((d.kind, name)) for name in d.links)
            peers.append([self._pos[id(o)] for o in linked if o is not None])
        self.topology = Topology.build([d.numa_node for d in devices], peers)
        self._describe = MappingProxyType({k: self._describe_kind(k)
                                           for k in {*inventory.kinds(), *members}})
        self._memos: dict[str, Memo[Any, Any]] = {}
        self._choices: dict[tuple[tuple[int, ...], int], tuple[int, ...]] = {}
        self.selections: Memo[tuple[Any, ...], Selection] = Memo(SELECTIONS_SIZE,
                                                                  SELECTIONS_CHARS)

    def members(self, kind: str) -> tuple[str, ...]:
        """The kinds `kind`'s ids and `all` cover (nvidia.com/gpu: GPUs and MIG devices)."""
        return self._members.get(kind, (kind,))

    def position(self, device: Device) -> int:
        """The device's number in this index (its place in inventory order)."""
        return self._pos[id(device)]

    def countable(self, kind: str) -> tuple[int, ...]:
        """Positions of the devices of `kind` a count may choose."""
        return self._countable.get(kind, ())

    def all_of(self, kind: str) -> tuple[int, ...]:
        """Positions of every healthy device `all` means for `kind`."""
        return self._all.get(kind, ())

    def choose(self, free: tuple[int, ...], count: int) -> tuple[int, ...]:
        """nri_accel.topology.choose() over this index's topology, remembered per (free
        positions, count): the choice is pure, and a node goes through few free sets (the
        same few containers come and go), so most counts skip the search."""
        key = (free, count)
        found = self._choices.get(key)
        if found is None:
            found = choose_positions(self.topology, free, count)
            if len(self._choices) >= _CHOICES_SIZE:
                self._choices.clear()
            self._choices[key] = found
        return found

    def memo(self, family: str, entries: int, chars: int) -> Memo[Any, Any]:
        """A Memo a family may keep per-inventory results in (it lives as long as this
        index), of the bounds the family gives."""
        found = self._memos.get(family)
        if found is None:
            found = self._memos[family] = Memo(entries, chars)
        return found

    def resolve(self, kind: str, ident: str) -> tuple[Device | None, bool]:
        """The device of (a kind covered by) `kind` answering to `ident`, and whether
        `ident` is a time-slicing replica of it."""
        base, sep, replica = ident.rpartition(REPLICA_SEPARATOR)
        if sep and replica.isdigit() and base:
            return self.resolve(kind, base)[0], True
        inv = self.inventory
        kinds = self.members(kind)
        for k in kinds:
            found = inv.find(k, ident)
            if found is not None:
                return found, False
        key = parse_pci_bus_id(ident)
        if key is not None:
            for k in kinds:
                found = self._pci.get((k, key))
                if found is not None:
                    return found, False
        return None, False

    def unknown(self, kind: str, ident: str, source: str) -> NotFoundError:
        shown = cut(ident, _MAX_ECHO)
        described = (family_of(kind).unknown_hint(ident, self.inventory)
                     or self._describe.get(kind) or f"this node has no {kind} devices")
        return NotFoundError(f"unknown device {kind}={shown!r}: {described}", source=source)

    def _describe_kind(self, kind: str) -> str:
        parts = []
        for k in self.members(kind):
            names = [d.name for d in self.inventory.of_kind(k)]
            if names:
                more = (f" and {len(names) - _MAX_LISTED} more"
                        if len(names) > _MAX_LISTED else "")
                parts.append(f"{k} {', '.join(names[:_MAX_LISTED])}{more}")
        return "this node has " + "; ".join(parts) if parts else ""


# ---- select -------------------------------------------------------------------------


def select(request: Request, index: DeviceIndex, busy: Mapping[str, str] | None = None, *,
           cdi_passthrough: bool = False, shared_kinds: Container[str] = frozenset()
           ) -> Selection:
    """Resolve a Request against the inventory. `busy`: keys (Device.key) held
    exclusively by other running containers, each with its holders' names (counts avoid
    them; a refused count names them). With `cdi_passthrough`, CDI requests are handed
    on as names. Raises RequestError and subclasses.

    Everything but a count's choice is a function of the request and the inventory, so
    selections are remembered in the index (a node's requests recur: each GPU named by
    the device plugin in turn, a workload's count asking again): a request without a
    count by itself, which skips the whole selection, a quarter of a grant's plan
    (bench_hotpath.py); one with a count by the devices its counts chose among the free
    ones, chosen anew each time, which skips the family rules and building the record.
    Refusals are not remembered."""
    if not request.grants and not request.drivers_only:
        return _NOTHING  # limits narrow grants, and no family has anything to check
    key: tuple[Any, ...] = (request, cdi_passthrough, shared_kinds)
    counted = any(c.count is not None for c in request.grants)
    if not counted:
        found = index.selections.get(key)
        if found is not None:
            return found
    claimed = _Claimed(request, index, cdi_passthrough)
    if counted:
        key = (*key, claimed.count(index, busy or {}))
        found = index.selections.get(key)
        if found is not None:
            return found
    found = claimed.selection(request, index, cdi_passthrough, shared_kinds)
    index.selections.put(key, found, request.chars + SELECTED_CHARS * len(found.keys),
                         request.env, request.env_chars)
    return found


class _Claimed:
    """What a request's claims name, as select() builds its Selection: the devices its
    ids, `all` and CDI requests name (made with the instance), then those its counts
    choose (count())."""

    __slots__ = ("by", "counts", "granted", "notes", "passthrough", "shared", "specific")

    def __init__(self, request: Request, index: DeviceIndex, cdi_passthrough: bool) -> None:
        self.granted: dict[int, Device] = {}  # position -> device
        self.specific: set[int] = set()  # named or counted: not only reached through `all`
        self.shared: set[int] = set()  # named as a replica
        self.by: dict[int, str] = {}  # position -> the source that granted it
        self.notes: list[str] = []
        self.counts: list[DeviceClaim] = []
        self.passthrough: dict[int, Device] = {}
        granted, specific, by = self.granted, self.specific, self.by
        for claim in request.grants:
            if claim.cdi and cdi_passthrough:
                for d, _ in _resolve_known(index, claim, self.notes):
                    self.passthrough.setdefault(index.position(d), d)
                continue
            if claim.all:
                everything = index.all_of(claim.kind)
                if not everything:
                    self.notes.append(f"{claim.source}: no healthy {claim.kind} devices on "
                                      "this node")
                for pos in everything:
                    granted.setdefault(pos, index.devices[pos])
                    by.setdefault(pos, claim.source)
            elif claim.ids:
                options = request.option(family_of(claim.kind).name)
                for ident in claim.ids:
                    d, replica = index.resolve(claim.kind, ident)
                    if d is None:
                        raise index.unknown(claim.kind, ident, claim.source)
                    why = family_of(d.kind).refuse_named(d, options, index)
                    if why:
                        raise AllocationError(why, source=claim.source)
                    if not d.healthy:
                        raise AllocationError(f"{d.qualified_name} is unhealthy "
                                              f"({_health(d)}): it is granted to no new "
                                              "container", source=claim.source)
                    pos = index.position(d)
                    granted.setdefault(pos, d)
                    specific.add(pos)
                    by[pos] = claim.source
                    if replica:
                        self.shared.add(pos)
            elif claim.count is not None:
                self.counts.append(claim)

    def count(self, index: DeviceIndex, busy: Mapping[str, str]) -> tuple[tuple[int, ...], ...]:
        """Serve the counts, among the devices no other container holds (`busy`) and
        not named already; the positions each chose, in the request's order."""
        picks = []
        for claim in self.counts:
            source = f"{claim.source} (count)"
            chosen = _allocate(index, claim, busy, self.granted)
            for pos in chosen:
                self.granted[pos] = index.devices[pos]
                self.specific.add(pos)
                self.by[pos] = source
            picks.append(chosen)
        return tuple(picks)

    def selection(self, request: Request, index: DeviceIndex, cdi_passthrough: bool,
                  shared_kinds: Container[str]) -> Selection:
        """The Selection: the limits and drivers-only vendors applied, the family rules
        checked."""
        granted, specific = self.granted, self.specific
        narrowed = {c.vendor for c in request.limits}
        if request.limits:
            granted = _apply_limits(index, request.limits, granted)
        if request.drivers_only:
            granted = {p: d for p, d in granted.items()
                       if vendor_of(d.kind) not in request.drivers_only}

        order = sorted(granted)
        devices = tuple([granted[p] for p in order])
        _check_families(request, index, granted, order, {
            p for p in order
            if p in specific or (narrowed and vendor_of(granted[p].kind) in narrowed)})
        keys = index.keys
        shared_keys = frozenset([
            keys[p] for p in order
            if p not in specific or p in self.shared or granted[p].kind in shared_kinds])
        held_passthrough: tuple[Device, ...] = ()
        device_keys = tuple([keys[p] for p in order])
        held = frozenset(device_keys)
        passthrough = self.passthrough
        if passthrough:
            held_passthrough = tuple([passthrough[p] for p in sorted(passthrough)])
            held |= frozenset([keys[p] for p in passthrough])
            shared_keys |= frozenset([d.key for d in held_passthrough
                                      if d.kind in shared_kinds])
        by = self.by
        return Selection(
            keys=held,
            device_keys=device_keys,
            devices=devices,
            shared=shared_keys,
            cdi_devices=request.cdi_names if cdi_passthrough else (),
            passthrough=held_passthrough,
            notes=tuple(self.notes),
            granted_by=MappingProxyType({index.names[p]: by[p] for p in order}),
        )


_NOTHING = Selection()


def _health(device: Device) -> str:
    return device.attributes.get("health", "") or "reported unhealthy"


def _resolve_known(index: DeviceIndex, claim: DeviceClaim,
                   notes: list[str]) -> Iterable[tuple[Device, bool]]:
    """The devices of this node a passed-through CDI claim names; a name this node's
    inventory does not have is the runtime's to resolve, and is not tracked (noted)."""
    if claim.all:
        return [(index.devices[p], False) for p in index.all_of(claim.kind)]
    out = []
    for ident in claim.ids:
        d, replica = index.resolve(claim.kind, ident)
        if d is None:
            notes.append(f"{claim.source}: {claim.kind}={ident} is not in nri-accel's "
                         "inventory: the runtime resolves it, nri-accel does not track it")
        else:
            out.append((d, replica))
    return out


def _check_families(request: Request, index: DeviceIndex, granted: Mapping[int, Device],
                    order: list[int], specific: set[int]) -> None:
    """Each family's rules over its part of the selection (the devices `granted`, at
    the positions `order`; those at `specific` named or counted): for every family with
    a device granted, or asked for its driver alone."""
    by_family: dict[str, tuple[list[Device], list[Device]]] = {}
    families = index.families
    for p in order:
        d = granted[p]
        found = by_family.get(families[p])
        if found is None:  # not setdefault: that would build two lists per device
            found = by_family[families[p]] = ([], [])
        found[0].append(d)
        if p in specific:
            found[1].append(d)
    for profile in PROFILES:
        found = by_family.get(profile.name)
        if found is None:
            if not (request.drivers_only and profile.kinds
                    and vendor_of(profile.kinds[0]) in request.drivers_only):
                continue
            found = ([], [])
        profile.check(*found, request.option(profile.name), index)


# ---- the allocator -------------------------------------------------------------------


def _allocate(index: DeviceIndex, claim: DeviceClaim, busy: Mapping[str, str],
              granted: Mapping[int, Device]) -> tuple[int, ...]:
    """Positions of the `claim.count` devices a count gets, or AllocationError."""
    count = claim.count or 0
    if count <= 0:
        return ()
    kind = claim.kind
    keys = index.keys
    taken = busy.keys()  # a dict's keys: tested in C (busy's own `in` may be Python's)
    free = tuple([p for p in index.countable(kind) if p not in granted and keys[p] not in taken])
    if len(free) < count:
        total = len(index.inventory.of_kind(kind))
        if not total:
            raise AllocationError(f"asks for {count} {kind} but this node has none",
                                  source=claim.source)
        free_names = ", ".join(index.devices[p].name for p in free) or "none"
        held = [f"{index.devices[p].name} by {busy[keys[p]]}" for p in index.countable(kind)
                if keys[p] in busy]
        sick = [f"{d.name} ({_health(d)})" for d in index.inventory.of_kind(kind)
                if not d.healthy]
        raise AllocationError(
            f"asks for {count} {kind} but only {len(free)} of {total} are free "
            f"(free: {free_names}; held: {_capped(held) or 'none'}; "
            f"unhealthy: {_capped(sick) or 'none'}; the others are not countable or "
            "granted to this container already)", source=claim.source)
    return index.choose(free, count)


def _capped(items: list[str]) -> str:
    return "; ".join(items[:_MAX_HOLDERS]) + (
        f"; and {len(items) - _MAX_HOLDERS} more" if len(items) > _MAX_HOLDERS else "")


def choose(index: DeviceIndex, free: Iterable[Device], count: int) -> tuple[Device, ...]:
    """The best `count` devices among `free` (nri_accel.topology.choose's order)."""
    positions = tuple(sorted(index.position(d) for d in free))
    return tuple([index.devices[p] for p in index.choose(positions, count)])


# ---- limits ------------------------------------------------------------------------------


def _apply_limits(index: DeviceIndex, limits: Iterable[DeviceClaim],
                  granted: dict[int, Device]) -> dict[int, Device]:
    allowed: dict[str, set[int] | None] = {}  # vendor -> allowed positions (None: unlimited)
    for claim in limits:
        vendor = claim.vendor
        if claim.all:
            allowed[vendor] = None
            continue
        if vendor in allowed and allowed[vendor] is None:
            continue
        mine = sorted(p for p, d in granted.items() if vendor_of(d.kind) == vendor)
        keep = allowed.setdefault(vendor, set())
        assert keep is not None
        if claim.ids:
            for ident in claim.ids:
                d, _ = index.resolve(claim.kind, ident)
                if d is None:
                    raise index.unknown(claim.kind, ident, claim.source)
                pos = index.position(d)
                if pos not in granted:
                    raise PolicyError(
                        f"{d.qualified_name} was not allocated to this container, and this "
                        f"source may only narrow the allocation "
                        f"({_granted_list(index.devices[p].qualified_name for p in mine)})",
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
