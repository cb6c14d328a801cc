"""The Engine: one container's request to its Plan, and who holds which device.

Owns: Plan, Engine (per-inventory tables, allocation state, release and restore) and the
grant annotations. Imports the standard library, nri_accel.config, nri_accel.edits,
nri_accel.errors, nri_accel.inventory, nri_accel.log, nri_accel.policy,
nri_accel.request and nri_accel.select.

plan() is the hot path: request parse, selection and edits are pure computation over
frozen data and tables built once per inventory (in __init__ and swap_inventory); no
I/O, no NVML, no fork, no logging. It raises RequestError (PolicyError,
AllocationError), whose `source` names the annotation key or env variable, and changes
no state when it does.

Allocation state: container id -> the qualified names it holds (granted by count or
explicit id; see nri_accel.select) and those it shares (granted through `all`). plan()
records it, release() drops it (StopContainer, RemoveContainer; containerd also sends
these when it undoes a failed creation), restore() rebuilds it from the annotations a
Plan adds to its container:

    nri-accel.io/granted: every device granted, qualified names, sorted, comma separated
    nri-accel.io/shared:  those of them granted only through `all` (absent when none)

so a restarted plugin learns from Synchronize what running containers hold. Only
nri-accel writes them: plan() refuses a container that already carries one, or whose pod
does (a runtime may copy pod annotations into the container's, and a forged record
would make restore() hold devices no one has, or free devices a container still uses),
and nri.convert.live_containers hands restore() only the container's own annotations,
not the copies of its pod's. Calls are serialised by a lock (the refresh thread may swap
the inventory while the NRI loop plans).
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from nri_accel.config import Config
from nri_accel.edits import Catalog, compile_catalog
from nri_accel.edits import build as build_edits
from nri_accel.errors import RequestError
from nri_accel.inventory import ContainerEdits, Device, Inventory
from nri_accel.log import get_logger
from nri_accel.policy import Policy
from nri_accel.request import ContainerInfo, parse_request
from nri_accel.select import DeviceIndex, select

log = get_logger(__name__)

ANNOTATION_GRANTED = "nri-accel.io/granted"
ANNOTATION_SHARED = "nri-accel.io/shared"
_MAX_RESTORED_NAMES = 1024  # more names than any node has devices: a corrupt annotation


@dataclass(frozen=True, slots=True)
class Plan:
    """What one container gets: the devices, the edits, and the grant annotations."""

    devices: tuple[Device, ...]  # granted, sorted
    capabilities: frozenset[str]
    edits: ContainerEdits
    annotations: Mapping[str, str]  # added to the container; restore() reads them back
    cdi_devices: tuple[str, ...]  # CDI names handed to the runtime (cdi_passthrough)
    notes: tuple[str, ...] = ()

    @property
    def qualified_names(self) -> tuple[str, ...]:
        return tuple(d.qualified_name for d in self.devices)


@dataclass(frozen=True, slots=True)
class _Grant:
    held: frozenset[str]
    shared: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class _Tables:
    """Everything plan() reads that depends only on the inventory and the config."""

    index: DeviceIndex
    catalog: Catalog
    inventory: Inventory = field(repr=False)


class Engine:
    """Plans containers against one inventory and tracks what running containers hold."""

    def __init__(self, inventory: Inventory, config: Config) -> None:
        self._config = config
        self._policy = Policy.from_config(config)
        self._lock = threading.Lock()
        self._grants: dict[str, _Grant] = {}
        self._holders: Counter[str] = Counter()
        self._tables = self._compile(inventory)

    def _compile(self, inventory: Inventory) -> _Tables:
        return _Tables(DeviceIndex(inventory), compile_catalog(inventory, self._config.devices),
                       inventory)

    @property
    def inventory(self) -> Inventory:
        return self._tables.inventory

    def swap_inventory(self, inventory: Inventory) -> None:
        """Use `inventory` from now on. Holdings are kept: they are by qualified name."""
        tables = self._compile(inventory)
        with self._lock:
            self._tables = tables
        log.info("engine_inventory_swapped", devices=len(inventory.devices))

    def plan(self, info: ContainerInfo) -> Plan:
        """The Plan for one container, recorded as its allocation (replacing any earlier
        one of the same id; an empty id is planned but not recorded). Raises RequestError
        and records nothing then."""
        _refuse_grant_records(info)
        request = parse_request(info, self._policy)
        with self._lock:
            tables = self._tables
            previous = self._grants.get(info.container_id)
            busy = self._busy_without(previous)
            selection = select(request, tables.index, busy,
                               cdi_passthrough=self._config.devices.cdi_passthrough)
            edits, edit_notes = build_edits(
                selection, request, tables.catalog,
                container_env=info.env,
                device_paths=info.device_paths,
                mount_destinations=info.mount_destinations,
            )
            if info.container_id:
                self._release(info.container_id)
                if selection.devices:
                    self._hold(info.container_id, _Grant(selection.held, selection.shared))
        return Plan(
            devices=selection.devices,
            capabilities=request.capabilities,
            edits=edits,
            annotations=grant_annotations(selection.devices, selection.shared),
            cdi_devices=selection.cdi_devices,
            notes=(*request.notes, *selection.notes, *edit_notes),
        )

    def release(self, container_id: str) -> None:
        """Forget what `container_id` holds (StopContainer, RemoveContainer)."""
        with self._lock:
            self._release(container_id)

    def restore(self, containers: Iterable[tuple[str, Mapping[str, str]]]) -> None:
        """Replace the allocation state with what the running `containers` (id and their
        own annotations, from Synchronize) were granted. Unreadable annotations are
        logged and skipped: they never stop the plugin."""
        grants: dict[str, _Grant] = {}
        for container_id, values in containers:
            grant = _read_grant(container_id, values)
            if grant is not None:
                grants[container_id] = grant
        with self._lock:
            self._grants = {}
            self._holders = Counter()
            for container_id, grant in grants.items():
                self._hold(container_id, grant)
        log.info("allocations_restored", containers=len(grants),
                 held=sum(len(g.held) for g in grants.values()))

    def holdings(self) -> dict[str, tuple[str, ...]]:
        """Container id -> qualified names it holds exclusively (for status and tests)."""
        with self._lock:
            return {cid: tuple(sorted(g.held)) for cid, g in sorted(self._grants.items())
                    if g.held}

    # ---- state (callers hold the lock) ---------------------------------------------

    def _busy_without(self, own: _Grant | None) -> frozenset[str] | Counter[str]:
        if own is None or not own.held:
            return self._holders
        busy = self._holders.copy()
        busy.subtract(own.held)
        return frozenset(name for name, n in busy.items() if n > 0)

    def _hold(self, container_id: str, grant: _Grant) -> None:
        self._grants[container_id] = grant
        self._holders.update(grant.held)

    def _release(self, container_id: str) -> None:
        grant = self._grants.pop(container_id, None)
        if grant is None:
            return
        self._holders.subtract(grant.held)
        for name in grant.held:
            if self._holders[name] <= 0:
                del self._holders[name]


def grant_annotations(devices: Iterable[Device], shared: frozenset[str]) -> Mapping[str, str]:
    """The annotations recording a grant (empty when nothing was granted)."""
    names = sorted({d.qualified_name for d in devices})
    if not names:
        return MappingProxyType({})
    out = {ANNOTATION_GRANTED: ",".join(names)}
    shared_names = sorted(shared & set(names))
    if shared_names:
        out[ANNOTATION_SHARED] = ",".join(shared_names)
    return MappingProxyType(out)


def _refuse_grant_records(info: ContainerInfo) -> None:
    """RequestError when the pod or the container already carries a grant annotation."""
    for key in (ANNOTATION_GRANTED, ANNOTATION_SHARED):
        for where, carried in (("annotation", info.pod_annotations),
                               ("container annotation", info.container_annotations)):
            if key in carried:
                raise RequestError("reserved: nri-accel records there what it granted, "
                                   "remove it", source=f"{where} {key}")


def _read_grant(container_id: str, annotations: Mapping[str, str]) -> _Grant | None:
    granted = annotations.get(ANNOTATION_GRANTED)
    if not granted:
        return None
    names = _names(granted)
    shared = _names(annotations.get(ANNOTATION_SHARED, ""))
    if names is None or shared is None:
        log.warning("grant_annotation_unreadable", container_id=container_id,
                    annotation=ANNOTATION_GRANTED, value=repr(granted[:200]))
        return None
    return _Grant(held=names - shared, shared=shared & names)


def _names(value: str) -> frozenset[str] | None:
    """Comma-separated qualified names, or None if it is not that."""
    parts = [p.strip() for p in value.split(",") if p.strip()]
    if len(parts) > _MAX_RESTORED_NAMES:
        return None
    for p in parts:
        kind, sep, name = p.partition("=")
        if not sep or "/" not in kind or not name:
            return None
    return frozenset(parts)
