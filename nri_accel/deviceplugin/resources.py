"""Kubelet resources from the Inventory, preferred allocations and the grant annotation.

Owns: which extended resources nri-accel advertises and under which device IDs, the
choice of a preferred allocation, the trusted grant annotation that Allocate writes
(its key and value; nri_accel.request reads it back), the size limits of a request
(request_size_problem) and how device IDs are quoted in messages and logs (shown_id,
shown_ids: truncated, whatever a request names). Pure functions over
frozen records: no grpc, no I/O. Imports the standard library, msgspec, nri_accel.config,
nri_accel.errors, nri_accel.inventory, nri_accel.request (the grant annotation key),
nri_accel.select (the replica ID separator), nri_accel.topology (the choice itself,
shared with the Engine) and nri_accel.vendors (each family's resource names), never
grpc.

Resources (one kubelet device plugin each) are what each family's profile names
(nri_accel.vendors.base, Profile.resources and check_resources) under [device_plugin]:
- NVIDIA, by mig_strategy: `nvidia.com/gpu` for whole GPUs; a GPU in MIG mode only as
  its MIG devices, `nvidia.com/mig-<profile>` (mixed, the default: e.g.
  `nvidia.com/mig-1g.10gb`, `nvidia.com/mig-1g.10gb.me` for the media-extension profile
  `1g.10gb+me`) or `nvidia.com/gpu` (single); none: whole GPUs only;
- every other family its kinds: `aws.amazon.com/neuron` and `aws.amazon.com/neuroncore`,
  CDI and static kinds;
- resource_names renames any kind (`nvidia.com/gpu` -> `nri-accel.io/gpu` beside
  NVIDIA's plugin; the MIG resources take the name of `nvidia.com/mig` + "-<profile>"),
  "" leaves a kind out.
A device's kubelet ID is what stays true of it (Device.stable_id: its UUID, else its
partition id, else its PCI bus id, else its name), never an index a renumbering could
shift. With time-slicing (`replicas` N for a resource) each device is advertised N
times, as "<id>::<n>" for n in 0..N-1 (NVIDIA's annotated IDs); the grant names the
replica, which `run` resolves to the device, used shared (nri_accel.select). Anything
that cannot be advertised (no MIG profile, a name kubelet would refuse, an ID over 63
characters, an ID the resource has already) is left out with a Problem naming it. A
device is Unhealthy when the inventory says so or a health watch does (`unhealthy`,
Device.key -> reason).

The grant: kubelet copies the annotations of each Allocate response into the container's
CRI annotations, where pod authors cannot write. When a container uses two resources,
kubelet keeps only the first value of an annotation key that both responses set, so each
resource writes its own key, `devices.nri-accel.io/resource.<vendor>_<name>` (e.g.
`devices.nri-accel.io/resource.nvidia.com_gpu`), whose value is the comma-separated
qualified names of the granted devices in inventory order
(`nvidia.com/gpu=GPU-<uuid>,nvidia.com/gpu=GPU-<uuid>`), the grammar of the plugin's
annotations.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from heapq import heapify, heappop, heappush
from types import MappingProxyType

from msgspec import Struct

from nri_accel.config import Config, extended_resource_name_error
from nri_accel.errors import AllocationError, NotFoundError, RequestError, cut
from nri_accel.inventory import REPLICA_SEPARATOR, Device, Inventory, Problem
from nri_accel.request import GRANT_KEY_PREFIX
from nri_accel.syntax import MAX_IDS, MAX_VALUE_BYTES
from nri_accel.topology import Topology, choose
from nri_accel.vendors import PROFILES, family_of, parent_of

__all__ = [
    "HEALTHY", "KUBELET_MAX_MESSAGE", "MAX_CONTAINER_REQUESTS", "MAX_DEVICE_ID", "UNHEALTHY",
    "Grant", "PluginDevice", "Resource", "allocate", "check_healthy",
    "extended_resource_name_error", "grant_annotation_key", "listed_bytes",
    "preferred_allocation", "request_size_problem", "resources_from_inventory", "shown_id",
    "shown_ids",
]

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
MAX_DEVICE_ID = 63  # kubelet's limit on a device ID
# Container requests in one Allocate or GetPreferredAllocation: kubelet sends one (it
# allocates container by container); each costs a log line, so more is refused.
MAX_CONTAINER_REQUESTS = 16
KUBELET_MAX_MESSAGE = 4 * 1024 * 1024
"""The longest message kubelet takes from a device plugin, a ListAndWatch answer
included: grpc-go's default, which its client keeps. One longer ends the stream, and
kubelet drops the resource (kubernetes#109304) until the plugin registers again."""
_SHOWN_ID = 80  # characters of a device ID quoted in a message or log line
_SHOWN_IDS = 8  # device IDs quoted from a list


class PluginDevice(Struct, frozen=True):
    """One device as kubelet sees it."""

    id: str  # kubelet device ID: Device.stable_id
    qualified_name: str  # "<kind>=<id>", what the grant annotation lists
    healthy: bool = True
    numa_node: int | None = None
    links: tuple[str, ...] = ()  # IDs of directly linked peers in the same resource
    cdi_name: str = ""  # CDI device name to hand to the runtime ("" when not passed through)


@dataclass(frozen=True, slots=True)
class Resource:
    """One extended resource and its devices, in inventory order."""

    name: str  # "nvidia.com/gpu", "nvidia.com/mig-1g.10gb", "aws.amazon.com/neuron"
    devices: tuple[PluginDevice, ...] = ()
    replicas: int = 1  # time-slicing: each device advertised this many times
    _by_id: Mapping[str, int] = field(
        default_factory=lambda: MappingProxyType({}), compare=False, repr=False
    )
    # NUMA nodes and links by position (built from `devices`), for preferred_allocation.
    topology: Topology = field(
        default_factory=lambda: Topology((), ()), init=False, compare=False, repr=False
    )
    # By position: the position of the first of its replicas (itself, without
    # time-slicing), which names the physical device for preferred_allocation.
    firsts: tuple[int, ...] = field(default=(), init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        index = {d.id: i for i, d in enumerate(self.devices)}
        object.__setattr__(self, "_by_id", MappingProxyType(index))
        object.__setattr__(self, "topology", Topology.build(
            [d.numa_node for d in self.devices],
            [[index[p] for p in d.links if p in index] for d in self.devices]))
        first: dict[str, int] = {}
        object.__setattr__(self, "firsts", tuple(first.setdefault(_base_id(d.id), i)
                                                 for i, d in enumerate(self.devices)))

    def device(self, device_id: str) -> PluginDevice | None:
        i = self._by_id.get(device_id)
        return None if i is None else self.devices[i]

    def position(self, device_id: str) -> int:
        """Inventory order of a device; unknown IDs sort last."""
        return self._by_id.get(device_id, len(self.devices))

    def positions(self, device_ids: Iterable[str]) -> list[int]:
        """The positions of the IDs of `device_ids` this resource knows, each once, in
        the order given (one dict lookup an ID, in C: kubelet lists every available ID,
        8,192 of them for 8 GPUs of 1,024 replicas)."""
        known = map(self._by_id.get, dict.fromkeys(device_ids))
        return [p for p in known if p is not None]

    @property
    def endpoint(self) -> str:
        """File name of this resource's socket in the kubelet device-plugin directory."""
        return "nri-accel-" + self.name.replace("/", "_") + ".sock"

    @property
    def annotation_key(self) -> str:
        return grant_annotation_key(self.name)


class Grant(Struct, frozen=True):
    """What Allocate answers for one container."""

    annotations: Mapping[str, str]
    cdi_devices: tuple[str, ...] = ()


def resources_from_inventory(
    inventory: Inventory, config: Config, unhealthy: Mapping[str, str] | None = None
) -> tuple[tuple[Resource, ...], tuple[Problem, ...]]:
    """The resources to advertise, sorted by name, and the devices left out (why).

    `unhealthy`: Device.key -> reason of devices a health watch found unhealthy, on top
    of those the inventory marks. With `config.devices.cdi_passthrough`, devices from
    CDI specs also carry their CDI name for Allocate's cdi_devices (static devices have
    no spec a runtime could read).
    """
    settings = config.device_plugin
    unhealthy = unhealthy or {}
    static = {(s.kind, s.name) for s in config.static_devices}
    passthrough = config.devices.cdi_passthrough
    refused = {}  # family -> why none of its devices is advertised
    for profile in PROFILES:
        mine = [d for d in inventory.devices if family_of(d.kind) is profile]
        try:
            if mine:
                profile.check_resources(mine, settings)
        except ValueError as e:
            refused[profile.name] = str(e)
    grouped: dict[str, list[Device]] = {}
    problems = [Problem(family, f"no device advertised to kubelet: {why}")
                for family, why in sorted(refused.items())]
    for dev in inventory.devices:
        family = family_of(dev.kind)
        if family.name in refused:
            continue
        try:
            names = family.resources(dev, settings)
        except ValueError as e:
            problems.append(Problem(dev.qualified_name, f"not advertised to kubelet: {e}"))
            continue
        for name in names:
            why = extended_resource_name_error(name)
            longest = dev.stable_id + _replica_suffix(settings.replicas_of(name), -1)
            if not why and len(longest) > MAX_DEVICE_ID:
                why = (f"device ID {longest!r} is longer than {MAX_DEVICE_ID} "
                       "characters")
            if why:
                problems.append(Problem(dev.qualified_name, f"not advertised to kubelet: {why}"))
                continue
            grouped.setdefault(name, []).append(dev)

    resources = []
    for name in sorted(grouped):
        devs = []
        ids: dict[str, str] = {}  # device name -> ID, in inventory order
        owner: dict[str, Device] = {}
        for d in grouped[name]:
            other = owner.get(d.stable_id)
            if other is not None:
                problems.append(Problem(d.qualified_name, (
                    f"not advertised to kubelet: {name} has a device with ID "
                    f"{d.stable_id!r} already ({other.qualified_name})")))
                continue
            owner[d.stable_id] = d
            ids[d.name] = d.stable_id
            devs.append(d)
        pos = {n: k for k, n in enumerate(ids)}
        replicas = settings.replicas_of(name)
        plugin_devices = []
        for d in devs:
            cdi = (passthrough and not family_of(d.kind).native
                   and (d.kind, d.name) not in static)
            peers = sorted({p for p in d.links if p in ids and p != d.name}, key=pos.__getitem__)
            for n in range(replicas):
                suffix = _replica_suffix(replicas, n)
                plugin_devices.append(PluginDevice(
                    id=ids[d.name] + suffix,
                    qualified_name=f"{d.kind}={ids[d.name]}{suffix}",
                    healthy=d.healthy and d.key not in unhealthy,
                    numa_node=_numa_node(d, inventory),
                    links=() if replicas > 1 else tuple(ids[p] for p in peers),
                    cdi_name=d.qualified_name if cdi else "",
                ))
        size = listed_bytes(plugin_devices)
        if size > KUBELET_MAX_MESSAGE:  # kubelet would drop it once the plugin fails closed
            problems.append(Problem(name, (
                f"not advertised to kubelet: its {len(plugin_devices)} device IDs list in "
                f"{size} bytes with every device {UNHEALTHY} (as when `run` is away), over "
                f"the {KUBELET_MAX_MESSAGE} kubelet reads of one message: advertise fewer "
                "replicas")))
            continue
        resources.append(Resource(name, tuple(plugin_devices), replicas))
    return tuple(resources), tuple(problems)


def listed_bytes(devices: Iterable[PluginDevice]) -> int:
    """The size of a ListAndWatch answer listing `devices`, each Unhealthy (the longer
    health: what a plugin failing closed sends), as protobuf encodes it
    (api/deviceplugin.proto: ListAndWatchResponse.devices = 1, Device.ID = 1, health = 2,
    topology = 3, TopologyInfo.nodes = 1, NUMANode.ID = 1, a varint left out when 0)."""
    total = 0
    for d in devices:
        inner = _field(len(d.id.encode())) + _field(len(UNHEALTHY))
        if d.numa_node is not None:
            node = 1 + _varint_bytes(d.numa_node) if d.numa_node else 0
            inner += _field(_field(node))
        total += _field(inner)
    return total


def _field(n: int) -> int:
    """Bytes of a length-delimited field of `n` bytes: its tag, its length, the bytes."""
    return 1 + _varint_bytes(n) + n


def _varint_bytes(n: int) -> int:
    """Bytes of `n` as a protobuf varint: a negative int64 is 10 (two's complement)."""
    return 10 if n < 0 else max(1, (n.bit_length() + 6) // 7)


def _replica_suffix(replicas: int, n: int) -> str:
    """"::<n>" (n = -1: the last), what replica n's ID adds; "" without replicas."""
    return f"{REPLICA_SEPARATOR}{n % replicas}" if replicas > 1 else ""


def _numa_node(dev: Device, inventory: Inventory) -> int | None:
    """The device's NUMA node, else its parent's (a MIG device's GPU)."""
    if dev.numa_node is not None or not dev.parent:
        return dev.numa_node
    parent = parent_of(dev, inventory)
    return parent.numa_node if parent is not None else None


# ---- Allocate -----------------------------------------------------------------------


def grant_annotation_key(resource_name: str) -> str:
    """The annotation key under which `resource_name`'s Allocate grants devices."""
    return GRANT_KEY_PREFIX + resource_name.replace("/", "_")


def shown_id(device_id: str) -> str:
    """`device_id` as a message or log line quotes it: its first 80 characters."""
    return cut(device_id, _SHOWN_ID)


def shown_ids(device_ids: Sequence[str]) -> list[str]:
    """The first few of `device_ids` (each shown_id), then "... (N more)" if there are
    more: a log line stays short whatever a request names."""
    shown = [shown_id(d) for d in device_ids[:_SHOWN_IDS]]
    if len(device_ids) > _SHOWN_IDS:
        shown.append(f"... ({len(device_ids) - _SHOWN_IDS} more)")
    return shown


def request_size_problem(resource: Resource, containers: int, id_counts: Iterable[int]) -> str:
    """Why a request is refused before any work (INVALID_ARGUMENT), "" when it is not:
    `containers` container requests, `id_counts` the number of device IDs each names
    (the longest of its lists; not looked at when there are too many containers). At
    most MAX_CONTAINER_REQUESTS container requests, each naming at most as many IDs as
    the resource advertises (kubelet names only advertised IDs, each once)."""
    if containers > MAX_CONTAINER_REQUESTS:
        return (f"{resource.name}: {containers} container requests in one call, more "
                f"than the limit of {MAX_CONTAINER_REQUESTS} (kubelet sends one)")
    limit = len(resource.devices)  # with time-slicing, each replica is one of them
    for n in id_counts:
        if n > limit:
            return (f"{resource.name}: a container request names {n} device IDs, more than "
                    f"the {limit} this resource advertises")
    return ""


def allocate(resource: Resource, device_ids: Iterable[str]) -> Grant:
    """The grant for one container's devices (inventory order, de-duplicated).

    Raises NotFoundError naming the first ID this resource does not have;
    AllocationError naming the first device the last ListAndWatch sent as Unhealthy
    (kubelet may allocate one that turned so after it chose: the NRI side would refuse
    it at CreateContainer, after the pod was admitted, on every retry); RequestError for
    a grant the NRI side could not read (more devices, or a longer annotation value,
    than it reads of one: syntax.MAX_IDS, MAX_VALUE_BYTES).
    """
    positions = set()
    for did in device_ids:
        if resource.device(did) is None:
            raise NotFoundError(f"unknown device ID {shown_id(did)!r}", source=resource.name)
        check_healthy(resource, did)
        positions.add(resource.position(did))
    devices = [resource.devices[i] for i in sorted(positions)]
    value = ",".join(d.qualified_name for d in devices)
    size = len(value.encode())
    if len(devices) > MAX_IDS or size > MAX_VALUE_BYTES:
        raise RequestError(
            f"{len(devices)} devices, a grant of {size} bytes: more than "
            f"`nri-accel run` reads of one container's grant ({MAX_IDS} devices, "
            f"{MAX_VALUE_BYTES} bytes); request fewer for one container",
            source=resource.name)
    return Grant(
        annotations=MappingProxyType({resource.annotation_key: value}),
        cdi_devices=tuple(d.cdi_name for d in devices if d.cdi_name),
    )


def check_healthy(resource: Resource, device_id: str) -> None:
    """Raise AllocationError where `device_id` is one of the resource's devices and the
    last ListAndWatch sent it Unhealthy (an ID the resource does not have is not
    looked at here)."""
    device = resource.device(device_id)
    if device is not None and not device.healthy:
        raise AllocationError(f"device ID {shown_id(device_id)!r} is {UNHEALTHY}",
                              source=resource.name)


# ---- GetPreferredAllocation --------------------------------------------------------


def preferred_allocation(
    resource: Resource, available: Sequence[str], must_include: Sequence[str], size: int
) -> tuple[str, ...]:
    """`size` device IDs from `available`, including `must_include`, in inventory order.

    The devices are chosen by nri_accel.topology.choose, the policy the Engine uses for a
    count (one NUMA node, then links, then links broken, then best fit), with the known
    must-include devices pre-chosen. IDs the resource does not know are never chosen
    beyond the must-include ones, which are kept (last, in the order given) and count
    towards `size`. A `size` that must-include alone reaches answers must-include; one
    at least the number available answers every available ID. Deterministic.
    """
    must = list(dict.fromkeys(must_include))
    unknown = [i for i in must if resource.device(i) is None]
    free = resource.positions(available)
    known_must = resource.positions(must)
    if resource.replicas > 1:
        chosen = _spread(resource, free, size - len(unknown), known_must)
    else:
        chosen = choose(resource.topology, free, size - len(unknown), known_must)
    return tuple(resource.devices[p].id for p in chosen) + tuple(unknown)


def _spread(resource: Resource, free: Sequence[int], size: int,
            must: Sequence[int]) -> list[int]:
    """Time-slicing replicas: the must-include ones, then one at a time from the device
    with the fewest replicas in this allocation and, among those, the most replicas
    free (the least shared, as NVIDIA's replicated allocation spreads them), earliest
    in inventory order. Positions, sorted."""
    chosen = list(dict.fromkeys(must))
    taken = set(chosen)
    firsts = resource.firsts
    pool: dict[int, list[int]] = {}  # device (its first replica) -> free replicas, in order
    for p in sorted(set(free) - taken):
        pool.setdefault(firsts[p], []).append(p)
    used = dict.fromkeys(pool, 0)
    for p in chosen:
        base = firsts[p]
        used[base] = used.get(base, 0) + 1
    # a heap of (used, -free, first free position, device): a pick costs O(log
    # devices), where a min() over the pool cost a Python call per device (8 GPUs of
    # 1,024 replicas each, 8,191 asked: 20 ms a container)
    heap = [(used[b], -len(ps), ps[0], b) for b, ps in pool.items()]
    heapify(heap)
    queues = {b: deque(ps) for b, ps in pool.items()}
    while len(chosen) < size and heap:
        n, _, first, base = heappop(heap)
        queue = queues[base]
        chosen.append(queue.popleft())
        if queue:
            heappush(heap, (n + 1, -len(queue), first, base))
    return sorted(chosen)


def _base_id(device_id: str) -> str:
    base, sep, n = device_id.rpartition(REPLICA_SEPARATOR)
    return base if sep and n.isdigit() else device_id
