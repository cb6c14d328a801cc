"""Kubelet resources from the Inventory, preferred allocations and the grant annotation.

Owns: which extended resources nri-accel advertises and under which device IDs, the
choice of a preferred allocation, and the trusted grant annotation that Allocate writes
(its key and value; nri_accel.request reads it back). Pure functions over
frozen dataclasses: no grpc, no I/O. Imports the standard library, nri_accel.config,
nri_accel.errors, nri_accel.inventory, nri_accel.request (the grant annotation key),
nri_accel.topology (the choice itself, shared with the Engine) and nri_accel.vendors
(each family's resource names), never grpc.

Resources (one kubelet device plugin each) are what each family's profile names
(nri_accel.vendors.base, Profile.resources):
- NVIDIA: `nvidia.com/gpu` for whole GPUs, except those in MIG mode, which are handed
  out only as their MIG devices, `nvidia.com/mig-<profile>` (e.g. `nvidia.com/mig-1g.10gb`;
  `nvidia.com/mig-1g.10gb.me` for the media-extension profile `1g.10gb+me`);
- every other family its kinds: `aws.amazon.com/neuron`, CDI and static kinds.
A device's kubelet ID is what stays true of it (Device.stable_id: its UUID, else its PCI
bus id, else its name), never an index a renumbering could shift. Anything that cannot
be advertised (no MIG profile, a name kubelet would refuse, an ID over 63 characters) is
left out with a Problem naming it.

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

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType

from nri_accel.config import Config
from nri_accel.errors import AllocationError
from nri_accel.inventory import Device, Inventory, Problem
from nri_accel.request import GRANT_KEY_PREFIX
from nri_accel.topology import Topology, choose
from nri_accel.vendors import family_of

HEALTHY = "Healthy"
UNHEALTHY = "Unhealthy"
MAX_DEVICE_ID = 63  # kubelet's limit on a device ID

_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_QUALIFIED_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


@dataclass(frozen=True, slots=True)
class PluginDevice:
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
    _by_id: Mapping[str, int] = field(
        default_factory=lambda: MappingProxyType({}), compare=False, repr=False
    )
    # NUMA nodes and links by position (built from `devices`), for preferred_allocation.
    topology: Topology = field(
        default_factory=lambda: Topology((), ()), init=False, compare=False, repr=False
    )

    def __post_init__(self) -> None:
        index = {d.id: i for i, d in enumerate(self.devices)}
        object.__setattr__(self, "_by_id", MappingProxyType(index))
        object.__setattr__(self, "topology", Topology.build(
            [d.numa_node for d in self.devices],
            [[index[p] for p in d.links if p in index] for d in self.devices]))

    def device(self, device_id: str) -> PluginDevice | None:
        i = self._by_id.get(device_id)
        return None if i is None else self.devices[i]

    def position(self, device_id: str) -> int:
        """Inventory order of a device; unknown IDs sort last."""
        return self._by_id.get(device_id, len(self.devices))

    @property
    def endpoint(self) -> str:
        """File name of this resource's socket in the kubelet device-plugin directory."""
        return "nri-accel-" + self.name.replace("/", "_") + ".sock"

    @property
    def annotation_key(self) -> str:
        return grant_annotation_key(self.name)


@dataclass(frozen=True, slots=True)
class Grant:
    """What Allocate answers for one container."""

    annotations: Mapping[str, str]
    cdi_devices: tuple[str, ...] = ()


def resources_from_inventory(
    inventory: Inventory, config: Config
) -> tuple[tuple[Resource, ...], tuple[Problem, ...]]:
    """The resources to advertise, sorted by name, and the devices left out (why).

    With `config.devices.cdi_passthrough`, devices from CDI specs also carry their CDI
    name for Allocate's cdi_devices (static devices have no spec a runtime could read).
    """
    static = {(s.kind, s.name) for s in config.static_devices}
    passthrough = config.devices.cdi_passthrough
    grouped: dict[str, list[Device]] = {}
    problems: list[Problem] = []
    for dev in inventory.devices:
        try:
            names = family_of(dev.kind).resources(dev, config.device_plugin)
        except ValueError as e:
            problems.append(Problem(dev.qualified_name, f"not advertised to kubelet: {e}"))
            continue
        for name in names:
            why = extended_resource_name_error(name)
            if why:
                problems.append(Problem(dev.qualified_name, f"not advertised to kubelet: {why}"))
                continue
            if len(dev.stable_id) > MAX_DEVICE_ID:
                problems.append(Problem(dev.qualified_name, f"not advertised to kubelet: "
                                        f"device ID {dev.stable_id!r} is longer than "
                                        f"{MAX_DEVICE_ID} characters"))
                continue
            grouped.setdefault(name, []).append(dev)

    resources = []
    for name in sorted(grouped):
        devs = grouped[name]
        ids = {d.name: d.stable_id for d in devs}  # in inventory order
        pos = {n: k for k, n in enumerate(ids)}
        plugin_devices = []
        for d in devs:
            cdi = (passthrough and not family_of(d.kind).native
                   and (d.kind, d.name) not in static)
            peers = sorted({p for p in d.links if p in ids and p != d.name}, key=pos.__getitem__)
            plugin_devices.append(PluginDevice(
                id=ids[d.name],
                qualified_name=f"{d.kind}={ids[d.name]}",
                healthy=d.healthy,
                numa_node=_numa_node(d, inventory),
                links=tuple(ids[p] for p in peers),
                cdi_name=d.qualified_name if cdi else "",
            ))
        resources.append(Resource(name, tuple(plugin_devices)))
    return tuple(resources), tuple(problems)


def extended_resource_name_error(name: str) -> str:
    """Why kubelet would refuse `name` as an extended resource name ("" if it would not)."""
    prefix, sep, local = name.partition("/")
    if not sep:
        return f"resource name {name!r} has no domain prefix"
    if len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix):
        return f"resource name {name!r}: {prefix!r} is not a DNS subdomain"
    if prefix == "kubernetes.io" or prefix.endswith(".kubernetes.io"):
        return f"resource name {name!r} is in the kubernetes.io domain"
    if len(local) > 63 or not _QUALIFIED_NAME.match(local):
        return (f"resource name {name!r}: {local!r} must be 1-63 letters, digits, '-', '_' "
                "or '.', starting and ending with a letter or digit")
    return ""


def _numa_node(dev: Device, inventory: Inventory) -> int | None:
    """The device's NUMA node, else its parent's (a MIG device's GPU)."""
    if dev.numa_node is not None or not dev.parent:
        return dev.numa_node
    for kind in family_of(dev.kind).kinds:
        parent = inventory.find(kind, dev.parent)
        if parent is not None and parent is not dev:
            return parent.numa_node
    return None


# ---- Allocate -----------------------------------------------------------------------


def grant_annotation_key(resource_name: str) -> str:
    """The annotation key under which `resource_name`'s Allocate grants devices."""
    return GRANT_KEY_PREFIX + resource_name.replace("/", "_")


def allocate(resource: Resource, device_ids: Iterable[str]) -> Grant:
    """The grant for one container's devices (inventory order, de-duplicated).

    Raises AllocationError naming the first ID this resource does not have.
    """
    positions = set()
    for did in device_ids:
        if resource.device(did) is None:
            shown = did if len(did) <= 80 else did[:80] + "..."
            raise AllocationError(f"unknown device ID {shown!r}", source=resource.name)
        positions.add(resource.position(did))
    devices = [resource.devices[i] for i in sorted(positions)]
    value = ",".join(d.qualified_name for d in devices)
    return Grant(
        annotations=MappingProxyType({resource.annotation_key: value}),
        cdi_devices=tuple(d.cdi_name for d in devices if d.cdi_name),
    )


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
    chosen = choose(
        resource.topology,
        [resource.position(i) for i in available if resource.device(i) is not None],
        size - len(unknown),
        [resource.position(i) for i in must if resource.device(i) is not None],
    )
    return tuple(resource.devices[p].id for p in chosen) + tuple(unknown)
