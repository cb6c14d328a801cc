"""The Engine: one container's request to its Plan, and who holds which device.

Owns: Plan, Engine (per-inventory tables, the Holdings, planning, committing, releasing
and restoring grants) and the grant annotations. Imports the standard library, msgspec,
nri_accel.config, nri_accel.container, nri_accel.edits, nri_accel.errors,
nri_accel.inventory, nri_accel.log, nri_accel.policy, nri_accel.request,
nri_accel.select, nri_accel.state and nri_accel.vendors (parent_of).

plan() is the hot path: request parse, the trust policy, selection and edits are pure
computation over frozen data and tables built once per inventory (in __init__ and
swap_inventory); no I/O, no NVML, no fork, no logging. It raises RequestError
(PolicyError, NotFoundError, AllocationError, StateError), whose `source` names the
annotation key or env variable, and changes no state: commit() records a Plan once its
answer is known to be deliverable (nri_accel.plugin checks the adjustment's size first),
so an answer that cannot be sent holds nothing.

Allocation state (nri_accel.state.Holdings, keyed by Device.key: kind and UUID, else
partition id, else PCI bus id, else the spec's name): commit() records, release() and
release_pod() drop, restore_grants() rebuilds from what grants_in() reads of the
runtime's list of running containers (handed to it in restore_slices(), the event loop
free in between): the annotations a Plan adds to each (what the holdings already say of
a listed container that carries none is kept: a runtime may not hand the annotations
back):

    nri-accel.io/granted: Device.key of every device granted, sorted, comma separated
    nri-accel.io/shared:  those of them used shared (absent when none)

so a restarted plugin learns from Synchronize what running containers hold, and
load_checkpoint() from the state directory where no Synchronize comes (containerd 1.7
launching a pre-registered plugin). Only nri-accel writes those annotations: the request
parser refuses a container or pod that carries one, and grants_in() reads only a
container's own annotations, not the copies of its pod's. Every change bumps
`holdings.version`, which the checkpoint writer follows. Calls are serialised by a lock
(the refresh thread may swap the inventory while the NRI loop plans).
"""

from __future__ import annotations

import re
import threading
from collections.abc import Iterable, Iterator, Mapping
from functools import partial
from types import MappingProxyType

from msgspec import Struct, structs

from nri_accel.config import Config
from nri_accel.container import ContainerInfo
from nri_accel.edits import ENV_PREFIXES as EDITS_ENV_PREFIXES
from nri_accel.edits import Catalog, compile_catalog
from nri_accel.edits import build as build_edits
from nri_accel.errors import RequestError
from nri_accel.inventory import KIND_RE, ContainerEdits, Device, Inventory
from nri_accel.log import get_logger
from nri_accel.policy import Policy, own_annotations
from nri_accel.request import ANNOTATION_GRANTED, ANNOTATION_SHARED, check_bounds
from nri_accel.request import ENV_PREFIXES as REQUEST_ENV_PREFIXES
from nri_accel.select import DeviceIndex, select
from nri_accel.state import Grant, Holdings
from nri_accel.syntax import MAX_NAME_CHARS
from nri_accel.vendors import family_of, parent_of

log = get_logger(__name__)

_MAX_RESTORED_KEYS = 1024  # more keys than any node has devices: a corrupt annotation
# A grant annotation as grant_annotations() writes it: read by one match, in C.
_WRITTEN_KEYS_RE = re.compile(rf"{KIND_RE.pattern}=[^,\s]+(?:,{KIND_RE.pattern}=[^,\s]+)*")
RESTORE_KEYS = 2048
"""Grant keys (of nri-accel.io/granted and nri-accel.io/shared) in one slice of
restore_slices(): 2 ms of reading at most, UUID keys of 56 characters (a container on a
node of 8 GPUs holds at most 8 keys, or 56 with its MIG devices: 100 such containers
fill a slice of 100 long before)."""
ENV_SCOPE = tuple(sorted({*REQUEST_ENV_PREFIXES, *EDITS_ENV_PREFIXES}))
"""Every env entry plan() looks at starts with one of these: a ContainerInfo whose env
holds only those entries gets the same Plan, but for equal values written again
(nri_accel.nri.convert keeps only them of a large env)."""


class Plan(Struct, frozen=True):
    """What one container gets: the devices, the edits, the grant annotations, and the
    Grant that commit() records."""

    devices: tuple[Device, ...]  # granted, sorted
    edits: ContainerEdits
    annotations: Mapping[str, str]  # added to the container; grants_in() reads them back
    cdi_devices: tuple[str, ...]  # CDI names handed to the runtime (cdi_passthrough)
    grant: Grant
    notes: tuple[str, ...] = ()
    facts: tuple[tuple[str, str], ...] = ()  # per family ("capabilities", ...)
    granted_by: Mapping[str, str] = MappingProxyType({})
    checked_at: int = -1  # Holdings.version when plan() checked the grant

    @property
    def qualified_names(self) -> tuple[str, ...]:
        return tuple(d.qualified_name for d in self.devices)


class _Tables(Struct, frozen=True, eq=False):
    """Everything plan() reads that depends only on the inventory and the config."""

    index: DeviceIndex
    catalog: Catalog
    inventory: Inventory


class Engine:
    """Plans containers against one inventory and tracks what running containers hold."""

    def __init__(self, inventory: Inventory, config: Config) -> None:
        self._config = config
        self._policy = Policy.from_config(config)
        self._shared_kinds = frozenset(config.devices.shared_kinds)
        self._lock = threading.Lock()
        self.holdings = Holdings()
        # holds(container_id, pod, container_name): whether a create of this container
        # (`pod`: its sandbox id, else its pod's uid) would replace a recorded grant,
        # which plan() and commit() then release. Asked of every container created, it
        # is the holdings' own, read without the lock (60 % of a locked call) or a call
        # of the Engine's: two dict lookups, each whole under the GIL, and a grant being
        # recorded or released meanwhile, by another thread, is not this container's,
        # whose create is the one asking.
        self.holds = self.holdings.holds
        self._discovered = inventory  # what discovery found; health marks go on top
        self._unhealthy: dict[str, Mapping[str, str]] = {}  # family -> key -> reason
        self._refused: frozenset[tuple[str, str]] = frozenset()  # inventory edits, logged
        self._tables = self._compile(inventory)
        self.holdings.set_parts(_parts(inventory))

    def _compile(self, inventory: Inventory) -> _Tables:
        catalog = compile_catalog(inventory, self._config.devices)
        refused = frozenset(catalog.refused())
        for who, why in sorted(refused - self._refused):  # said once, not at each health mark
            log.error("inventory_edits_refused", device=who, reason=why,
                      effect="a container granted it fails, naming it")
        self._refused = refused
        return _Tables(DeviceIndex(inventory), catalog, inventory)

    @property
    def inventory(self) -> Inventory:
        return self._tables.inventory

    def swap_inventory(self, inventory: Inventory) -> None:
        """Use `inventory` from now on, with the health marks in force. Holdings are
        kept (they name devices by what stays true of them); a held device the new
        inventory lacks is logged."""
        self._discovered = inventory
        self._use(inventory)
        log.info("engine_inventory_swapped", devices=len(inventory.devices))

    def set_health(self, family: str, unhealthy: Mapping[str, str]) -> None:
        """`family`'s health watch says these devices (Device.key -> reason) are
        unhealthy now (replacing what it said before): they are granted to no new
        container, by a refusal naming them."""
        if dict(self._unhealthy.get(family, {})) == dict(unhealthy):
            return
        self._unhealthy[family] = dict(unhealthy)
        self._use(self._discovered)
        log.info("unhealthy_devices", family=family,
                 unhealthy={k: why for k, why in sorted(unhealthy.items())},
                 effect="granted to no new container")

    def _use(self, discovered: Inventory) -> None:
        marks = {k: why for m in self._unhealthy.values() for k, why in m.items()}
        inventory = discovered.with_health(marks)
        tables = self._compile(inventory)
        parts = _parts(inventory)
        with self._lock:
            self._tables = tables
            self.holdings.set_parts(parts)
            gone = {key: g for g in self.holdings.grants() for key in g.exclusive
                    if key not in tables.index.by_key}
        for key, g in sorted(gone.items()):
            log.warning("held_device_gone", device=key, container=g.name,
                        container_id=g.container_id,
                        meaning="still held by that container until it ends; never "
                                "granted to another")

    def plan(self, info: ContainerInfo) -> Plan:
        """The Plan for one container. Records nothing (commit() does); raises
        RequestError and subclasses. A request over nri_accel.request's bounds (of the
        env, those of ENV_SCOPE: build() reads them too) is refused before any work, and
        one that would be granted for a container whose names or ids a grant could not
        record (_check_recorded)."""
        check_bounds(info, ENV_SCOPE)
        request = self._policy.request_for(info)
        if request.grants:
            _check_recorded(info)
        counted = next((c for c in request.grants if c.count is not None), None)
        with self._lock:
            tables = self._tables
            busy: Mapping[str, str] = {}  # only counts choose among the free devices
            if counted is not None:
                self.holdings.require_known(counted.source)
                busy = self.holdings.busy(_grant(info))
            selection = select(request, tables.index, busy,
                               cdi_passthrough=self._config.devices.cdi_passthrough,
                               shared_kinds=self._shared_kinds)
            exclusive = selection.exclusive
            grant = _grant(info, exclusive, selection.keys - exclusive)
            self.holdings.check(grant, partial(_source_of, selection.devices,
                                               selection.granted_by))
            checked_at = self.holdings.version
        built = build_edits(selection, request, tables.catalog, container_env=info.env,
                            spec_devices=info.spec_devices,
                            mount_destinations=info.mount_destinations)
        return Plan(
            devices=selection.devices,
            edits=built.edits,
            annotations=grant_annotations(grant),
            cdi_devices=selection.cdi_devices,
            grant=grant,
            notes=(*request.notes, *selection.notes, *built.notes),
            facts=built.facts,
            granted_by=selection.granted_by,
            checked_at=checked_at,
        )

    def held_containers(self) -> frozenset[str]:
        """The ids of the containers the holdings record a grant of."""
        with self._lock:
            return self.holdings.container_ids()

    def commit(self, plan: Plan) -> bool:
        """Record `plan`'s grant (replacing its container's earlier one, and that of an
        earlier container of the same pod sandbox and name); whether the holdings
        changed (a grant recorded or one replaced: the checkpoint is written then). An
        empty container id is never recorded (plan() grants it nothing). Raises
        AllocationError if, since plan(), another container took one of its devices
        (checked again only if the holdings changed since: the daemon commits right
        after planning, the device plugin's threads may come between)."""
        if not plan.grant.container_id:
            return False
        with self._lock:
            if self.holdings.version != plan.checked_at:
                self.holdings.check(plan.grant,
                                    partial(_source_of, plan.devices, plan.granted_by))
            replaced = self.holdings.record(plan.grant)
        for g in replaced:
            if g.container_id != plan.grant.container_id:
                log.info("grant_replaced", container_id=g.container_id, container=g.name,
                         by=plan.grant.container_id,
                         reason="a new create of the same pod sandbox and container name")
        return bool(replaced) or plan.grant.holds

    def release(self, container_id: str) -> Grant | None:
        """Forget what `container_id` holds (StopContainer, RemoveContainer)."""
        with self._lock:
            return self.holdings.release(container_id)

    def release_pod(self, pod_uid: str, pod_id: str) -> tuple[Grant, ...]:
        """Forget what every container of a pod holds (Stop/RemovePodSandbox)."""
        with self._lock:
            return self.holdings.release_pod(pod_uid, pod_id)

    def load_checkpoint(self, grants: Iterable[Grant], known: bool) -> None:
        """Start from a checkpoint's grants (known=False: it could not be read)."""
        grants = [self._current(g) for g in grants]
        with self._lock:
            self.holdings.replace_all(grants, known=known)
        log.info("allocations_loaded", containers=len(grants), known=known,
                 held=sum(len(g.exclusive) for g in grants))

    def grants_in(self, containers: Iterable[ContainerInfo],
                  unread: list[str] | None = None) -> list[Grant]:
        """What the running `containers` hold: each one's own grant annotations, else
        what the holdings (the checkpoint) say it was granted. Unreadable annotations
        are logged and skipped: they never stop the plugin; the id of a container whose
        annotations cannot be read and that the holdings do not know is added to
        `unread` (where given): what it holds is not known. Changes nothing."""
        grants = []
        for info in containers:
            grant, readable = _read_grant(info)
            if grant is None:
                with self._lock:
                    grant = self.holdings.get(info.container_id)
                if grant is None and not readable and unread is not None:
                    unread.append(info.container_id)
            if grant is not None:
                grants.append(self._current(grant))
        return grants

    def _current(self, grant: Grant) -> Grant:
        """`grant` with each key the inventory does not know read as its family says it
        names a device now (Profile.current_key: a key from before that family's
        devices had the keys they have now)."""
        tables = self._tables
        known = tables.index.by_key

        def now(keys: frozenset[str]) -> frozenset[str]:
            return frozenset(k if k in known else family_of(k.partition("=")[0]).current_key(
                k, tables.inventory) for k in keys)

        if all(k in known for k in grant.exclusive | grant.shared):
            return grant
        return structs.replace(grant, exclusive=now(grant.exclusive), shared=now(grant.shared))

    def restore_grants(self, grants: list[Grant], *, known: bool = True) -> None:
        """Make `grants` (grants_in() of every running container) the allocation
        state, which is then known, unless `known` is false (a running container's
        grant could not be read)."""
        with self._lock:
            before = self.holdings.container_ids()
            self.holdings.replace_all(grants, known=known)
        dropped = before - {g.container_id for g in grants}
        log.info("allocations_restored", containers=len(grants),
                 held=sum(len(g.exclusive) for g in grants),
                 released_not_running=len(dropped), known=known)


def _grant(info: ContainerInfo, exclusive: frozenset[str] = frozenset(),
           shared: frozenset[str] = frozenset()) -> Grant:
    return Grant(info.container_id, name=info.label, pod_uid=info.pod_uid,
                 pod_id=info.pod_id, container_name=info.container_name,
                 exclusive=exclusive, shared=shared)


def _source_of(devices: Iterable[Device], granted_by: Mapping[str, str], key: str) -> str:
    """What asked for the device of `key` among `devices` (a held one's refusal names
    it)."""
    return next((granted_by.get(d.qualified_name, "") for d in devices if d.key == key), "")


def _parts(inventory: Inventory) -> dict[str, str]:
    """Device.key of each part (a MIG device, a NeuronCore) -> that of its whole."""
    out = {}
    for d in inventory.devices:
        whole = parent_of(d, inventory)
        if whole is not None:
            out[d.key] = whole.key
    return out


def grant_annotations(grant: Grant) -> Mapping[str, str]:
    """The annotations recording a grant (empty when nothing was granted)."""
    keys = sorted(grant.exclusive | grant.shared)
    if not keys:
        return MappingProxyType({})
    out = {ANNOTATION_GRANTED: ",".join(keys)}
    if grant.shared:
        out[ANNOTATION_SHARED] = ",".join(sorted(grant.shared))
    return MappingProxyType(out)


def _read_grant(info: ContainerInfo) -> tuple[Grant | None, bool]:
    """(the grant the container's annotations record, or None; whether they could be
    read: False for annotations that are not what grant_annotations() writes)."""
    own = own_annotations(info.container_annotations, info.pod_annotations)
    granted = own.get(ANNOTATION_GRANTED)
    if not granted:
        return None, True
    keys = _keys(granted)
    shared = _keys(own.get(ANNOTATION_SHARED, ""))
    if keys is None or shared is None:
        log.warning("grant_annotation_unreadable", container_id=info.container_id,
                    annotation=ANNOTATION_GRANTED, value=repr(granted[:200]))
        return None, False
    return Grant(info.container_id, name=info.label, pod_uid=info.pod_uid,
                 pod_id=info.pod_id, container_name=info.container_name,
                 exclusive=keys - shared, shared=shared & keys), True


def _check_recorded(info: ContainerInfo) -> None:
    """Refuse a grant to a container without an id (the holdings record a grant by it:
    answered, its devices would be held by nobody; real runtimes always send one), or
    with a namespace, pod or container name or id over MAX_NAME_CHARS (Kubernetes
    allows 253 at most; a CRI client may send megabytes): a grant records them, in its
    annotations and the checkpoint, which a few such grants would fill past what it
    reads back (state.MAX_CHECKPOINT_BYTES)."""
    if not info.container_id:
        raise RequestError("empty: a grant is recorded by the container's id, and a "
                           "container without one is granted nothing", source="container id")
    for what, name in (("namespace", info.namespace), ("pod name", info.pod_name),
                       ("pod uid", info.pod_uid), ("pod id", info.pod_id),
                       ("container name", info.container_name),
                       ("container id", info.container_id)):
        if len(name) > MAX_NAME_CHARS:
            raise RequestError(f"{len(name)} characters, more than the {MAX_NAME_CHARS} a "
                               "grant records", source=what)


def restore_slices(containers: Iterable[ContainerInfo], most: int,
                   keys: int = RESTORE_KEYS) -> Iterator[list[ContainerInfo]]:
    """`containers` in slices for grants_in(), between which the caller gives the event
    loop a turn: at most `most` containers, whose grant annotations hold at most `keys`
    keys in all (counted by their separators, in C; a slice holds one container at
    least)."""
    part: list[ContainerInfo] = []
    held = 0
    for info in containers:
        own = info.container_annotations
        weight = sum(min(own[k].count(",") + 1, _MAX_RESTORED_KEYS)
                     for k in (ANNOTATION_GRANTED, ANNOTATION_SHARED) if k in own)
        if part and (len(part) >= most or held + weight > keys):
            yield part
            part, held = [], 0
        part.append(info)
        held += weight
    if part:
        yield part


def _keys(value: str) -> frozenset[str] | None:
    """Comma-separated device keys (kind=id), or None if it is not that. The number of
    items (_MAX_RESTORED_KEYS at most, empty ones included) is checked first, by
    counting separators in C; then the form: by one match where it is the one
    grant_annotations() writes, else key by key (blanks, empty items)."""
    if not value:
        return frozenset()
    if value.count(",") >= _MAX_RESTORED_KEYS:
        return None
    if _WRITTEN_KEYS_RE.fullmatch(value):
        return frozenset(value.split(","))
    parts = [p.strip() for p in value.split(",") if p.strip()]
    for p in parts:
        kind, sep, ident = p.partition("=")
        if not sep or not KIND_RE.fullmatch(kind) or not ident:
            return None
    return frozenset(parts)
