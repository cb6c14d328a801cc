"""`nri-accel explain`: a dry run of CreateContainer from a Kubernetes Pod manifest.

Owns: main_explain(args), the Pod-manifest reader (read_manifests, pod_containers), the
simulated kubelet device manager (KubeletDevices) and the readable rendering of a Plan.
Imports the standard library, msgspec, PyYAML, nri_accel.app, nri_accel.config,
nri_accel.container, nri_accel.deviceplugin.resources (pure, no grpc), nri_accel.engine,
nri_accel.errors, nri_accel.inventory, and lazily nri_accel.nri.adjust (for --json, the
one builder of a ContainerAdjustment).

    nri-accel explain (--inventory FILE | --root DIR) --pod POD.yaml [--container NAME]
                      [--config FILE] [--json]

What is read from the manifest (YAML or JSON; several documents, a `kind: List`, and the
pod template of a Deployment, StatefulSet, DaemonSet, ReplicaSet, ReplicationController,
Job or CronJob work too):
metadata.name, metadata.namespace ("default" when absent), metadata.uid, metadata.annotations
(the pod annotations), and for each of spec.initContainers and spec.containers (in that
order, the order kubelet creates them) its name, its env entries with a `value` (entries
with `valueFrom` cannot be resolved offline and are listed as notes) and its resources.
A container's extended resources (limits, else requests) that nri-accel's device plugin
advertises on this node (`nvidia.com/gpu`, `nvidia.com/mig-<profile>`,
`aws.amazon.com/neuron`, CDI kinds; see deviceplugin.resources) are allocated as kubelet
would (KubeletDevices): specific devices, chosen by the plugin's preferred allocation
among those no earlier container holds, and the plugin's Allocate annotations
(`devices.nri-accel.io/resource.<resource, / as _>`: the granted devices' qualified
names) become the container's annotations. Other extended resources are noted (another
device plugin serves them); more than the node has free is an error naming the
resource, as the scheduler would leave the pod Pending. The image's own env is not in
a manifest and so is not seen (a CUDA image's NVIDIA_VISIBLE_DEVICES=all only ever
narrows anyway).

Every container of every pod is explained, in order, against one KubeletDevices and one
Engine (so later containers see what earlier ones hold, but for an init container that
is not a sidecar, which exits, its grant released, before the next one is created);
--container shows only the containers of that name (all are still allocated, in order).
Output: per container the annotations kubelet passed, the devices, env, device nodes,
mounts, hooks, annotations and notes; with --json the protobuf JSON mapping of the
ContainerAdjustment (one container: the adjustment itself; several: an object keyed by
"namespace/pod/container"; a refused container is left out, and said on stderr). Exit 0
when every container was planned, 1 when any request was refused (the reason on stderr,
naming the annotation or variable) or a pod asks for more of a resource than is free, 2
for an unreadable manifest, inventory or configuration.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import IO, Any

import yaml
from msgspec import Struct

from nri_accel.app import DRY_RUN, App
from nri_accel.config import Config
from nri_accel.container import ContainerInfo
from nri_accel.deviceplugin.resources import (
    Grant,
    Resource,
    allocate,
    preferred_allocation,
    resources_from_inventory,
)
from nri_accel.engine import Engine, Plan
from nri_accel.errors import AllocationError, ConfigError, RequestError, cut
from nri_accel.inventory import Inventory

WORKLOAD_KINDS = frozenset({"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job",
                            "ReplicationController"})
MAX_MANIFEST_BYTES = 4 * 1024 * 1024
MAX_LIST_DEPTH = 8  # a List in a List ...: deeper is a mistake, or an alias to itself


class PodContainer(Struct, frozen=True):
    """One container of a manifest as CreateContainer would see it, and what the
    manifest could not say (valueFrom env entries)."""

    info: ContainerInfo
    notes: tuple[str, ...] = ()
    exits: bool = False  # an init container (not a sidecar): it exits, and the runtime's
    # StopContainer releases its grant, before kubelet creates the next container

    @property
    def label(self) -> str:
        return self.info.label


def main_explain(args: argparse.Namespace) -> int:
    """The `explain` verb (flags: --inventory FILE | --root DIR, --pod FILE,
    --container NAME, --config FILE, --json)."""
    app = App.from_args(args, mode=DRY_RUN)
    config = app.config
    manifests = read_manifests(args.pod)
    inventory = app.load_inventory()
    kubelet = KubeletDevices(inventory, config)
    containers = [c for m in manifests for c in pod_containers(m, args.pod, kubelet)]
    if args.container:
        containers = [c for c in containers if c.info.container_name == args.container]
        if not containers:
            raise ConfigError(f"no container named {args.container!r}", source=args.pod)
    return explain(containers, Engine(inventory, config), as_json=args.json)


def explain(containers: Iterable[PodContainer], engine: Engine, *, as_json: bool = False,
            out: IO[str] | None = None, err: IO[str] | None = None) -> int:
    """Plan each container and print the result; 1 if any was refused, else 0."""
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    planned: list[tuple[PodContainer, Plan]] = []
    refused = False
    for c in containers:
        try:
            plan = engine.plan(c.info)
            engine.commit(plan)  # later containers see what this one holds
        except RequestError as e:
            refused = True
            print(f"nri-accel: refused {c.label}: {e}", file=err)
            continue
        if c.exits:
            engine.release(c.info.container_id)
        planned.append((c, plan))
    if as_json:
        out.write(_json(planned))
    else:
        out.write("\n".join(render(c, plan) for c, plan in planned))
    return 1 if refused else 0


def _json(planned: list[tuple[PodContainer, Plan]]) -> str:
    from nri_accel.nri.adjust import build_adjustment, to_dict, to_json

    adjustments = [(c, build_adjustment(p.edits, p.annotations, p.cdi_devices))
                   for c, p in planned]
    if len(adjustments) == 1:
        return to_json(adjustments[0][1])
    if not adjustments:
        return ""
    doc = {c.label: to_dict(adj) for c, adj in adjustments}
    return json.dumps(doc, indent=2, sort_keys=True) + "\n"


def render(container: PodContainer, plan: Plan) -> str:
    """A Plan as text: what the container gets, one fact per line."""
    info = container.info
    lines = [f"pod {info.namespace}/{info.pod_name}, container {info.container_name}"]
    _section(lines, "kubelet annotations (device plugin Allocate)",
             (f"{k}={v}" for k, v in sorted(info.container_annotations.items())))
    if plan.devices:
        lines.append("  devices:")
        for d in plan.devices:
            extra = f" ({d.uuid})" if d.uuid else ""
            lines.append(f"    {d.qualified_name}{extra}")
    else:
        lines.append("  devices: none")
    edits = plan.edits
    lines.extend(f"  {name}: {value}" for name, value in plan.facts)
    _section(lines, "env", edits.env)
    _section(lines, "device nodes", (f"{n.path} {n.type} {n.major}:{n.minor}"
                                     for n in edits.device_nodes))
    _section(lines, "mounts", (f"{m.container_path} <- {m.host_path} ({','.join(m.options)})"
                               for m in edits.mounts))
    _section(lines, "hooks", (f"{h.hook_name}: {' '.join(h.args) or h.path} "
                              f"[path {h.path}, env {' '.join(h.env)}, timeout {h.timeout}s]"
                              for h in edits.hooks))
    _section(lines, "annotations", (f"{k}={v}" for k, v in sorted(plan.annotations.items())))
    _section(lines, "cdi devices", plan.cdi_devices)
    _section(lines, "notes", (*container.notes, *plan.notes))
    return "\n".join(lines) + "\n"


def _section(lines: list[str], title: str, items: Iterable[str]) -> None:
    items = list(items)
    if items:
        lines.append(f"  {title}:")
        lines.extend(f"    {i}" for i in items)


# ---- Pod manifests -----------------------------------------------------------------------


def read_manifests(path: str, err: IO[str] | None = None) -> list[dict[str, Any]]:
    """The pod-shaped documents of a YAML/JSON file (Pods, Lists, workload templates);
    an object of another kind (a ConfigMap kept beside the Pod) is skipped, said on
    `err` (default stderr).

    Raises ConfigError naming the file (and the document and key) for a file that
    cannot be read, is not UTF-8, not YAML, nested too deeply to parse, holds no Pod, or
    holds something that is not a Kubernetes object."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as e:
        raise ConfigError(e.strerror or str(e), source=path) from e
    if len(data) > MAX_MANIFEST_BYTES:
        raise ConfigError(f"larger than {MAX_MANIFEST_BYTES} bytes", source=path)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigError(f"not UTF-8 text (byte 0x{data[e.start]:02x} at offset "
                          f"{e.start}): a manifest is UTF-8", source=path) from e
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as e:
        raise ConfigError(f"not valid YAML: {e}", source=path) from e
    except RecursionError as e:  # PyYAML composes nested collections recursively
        raise ConfigError("not readable YAML: sequences or mappings nested too deeply",
                          source=path) from e
    pods: list[dict[str, Any]] = []
    skipped: list[str] = []
    for i, doc in enumerate(docs):
        pods.extend(_pods_of(doc, f"{path}: document {i + 1}", skipped))
    if not pods:
        raise ConfigError("no Pod in this file" + (f" ({'; '.join(skipped)})" if skipped
                                                   else ""), source=path)
    for what in skipped:
        print(f"nri-accel: skipped {what}", file=err if err is not None else sys.stderr)
    return pods


def _pods_of(doc: Any, where: str, skipped: list[str],
             depth: int = 0) -> list[dict[str, Any]]:
    if not isinstance(doc, dict):
        raise ConfigError("expected a Kubernetes object (a mapping)", source=where)
    kind = doc.get("kind", "Pod")
    if not isinstance(kind, str):
        raise ConfigError(f"expected a string, got {type(kind).__name__}",
                          source=f"{where}.kind")
    if kind == "List":
        if depth >= MAX_LIST_DEPTH:
            raise ConfigError(f"Lists nested more than {MAX_LIST_DEPTH} deep", source=where)
        items = doc.get("items") or []
        if not isinstance(items, list):
            raise ConfigError("items must be a list", source=where)
        return [p for i, item in enumerate(items)
                for p in _pods_of(item, f"{where}.items[{i}]", skipped, depth + 1)]
    if kind == "Pod":
        return [doc]
    if kind in WORKLOAD_KINDS or kind == "CronJob":
        spec = _mapping(doc.get("spec"), f"{where}.spec")
        if kind == "CronJob":
            job = _mapping(spec.get("jobTemplate"), f"{where}.spec.jobTemplate")
            spec = _mapping(job.get("spec"), f"{where}.spec.jobTemplate.spec")
        template = _mapping(spec.get("template"), f"{where}: pod template")
        meta = dict(_mapping(template.get("metadata"), f"{where}: template metadata"))
        outer = _mapping(doc.get("metadata"), f"{where}.metadata")
        meta.setdefault("name", outer.get("name", "pod"))
        meta.setdefault("namespace", outer.get("namespace", "default"))
        return [{"kind": "Pod", "metadata": meta, "spec": template.get("spec")}]
    skipped.append(f"{where}: kind {cut(kind, 64)!r} is not a Pod (nor a List or workload "
                   "of Pods)")
    return []


class DeviceRequest(Struct, frozen=True):
    """One container's asks for nri-accel resources, as kubelet's device manager sees
    them: resource name -> count (limits, else requests; kubelet reads the limits, which
    the API server requires for extended resources and copies into the requests)."""

    where: str  # the container in the manifest, for errors
    resources: Mapping[str, int]
    init: bool = False  # an init container
    sidecar: bool = False  # an init container with restartPolicy: Always


class KubeletDevices:
    """kubelet's device manager in front of nri-accel's device plugin, for one node.

    The resources are those the plugin advertises (deviceplugin.resources_from_inventory),
    only healthy devices are allocatable, and each device goes to one running container.
    admit() allocates a pod's containers in creation order as kubelet's devicemanager
    does: an init container's devices are handed on to the containers after it (first to
    the next that asks for that resource; a sidecar init container keeps its own), the
    rest come from the devices no admitted container holds, chosen by the plugin's
    GetPreferredAllocation (preferred_allocation, with the handed-on devices as
    must-include) and granted by its Allocate (allocate). Where kubelet takes handed-on
    devices in map order, this takes them in inventory order, to be deterministic.
    """

    def __init__(self, inventory: Inventory, config: Config) -> None:
        resources, _ = resources_from_inventory(inventory, config)
        self._resources = {r.name: r for r in resources}
        self._in_use: dict[str, frozenset[str]] = {}  # resource -> IDs held by admitted pods

    @property
    def resource_names(self) -> tuple[str, ...]:
        return tuple(self._resources)

    def serves(self, resource: str) -> bool:
        return resource in self._resources

    def admit(self, containers: Sequence[DeviceRequest]) -> tuple[Grant, ...]:
        """The Allocate answer for each container of one pod, in order; all or nothing.

        Raises AllocationError ("Insufficient <resource>", where the scheduler would leave
        the pod Pending) when a container asks for more devices than are free; nothing
        is allocated then."""
        in_use = {name: set(ids) for name, ids in self._in_use.items()}
        handed_on: dict[str, set[str]] = {}  # kubelet's devicesToReuse for this pod
        grants = []
        for c in containers:
            annotations: dict[str, str] = {}
            cdi: list[str] = []
            for name, count in sorted(c.resources.items()):
                resource = self._resources[name]
                pool = handed_on.setdefault(name, set())
                ids = _pick(resource, count, in_use.setdefault(name, set()), pool, c.where)
                grant = allocate(resource, ids)
                annotations.update(grant.annotations)
                cdi.extend(grant.cdi_devices)
                if c.init and not c.sidecar:
                    pool.update(ids)
                else:
                    pool.difference_update(ids)
            grants.append(Grant(MappingProxyType(annotations), tuple(cdi)))
        self._in_use = {name: frozenset(ids) for name, ids in in_use.items()}
        return tuple(grants)


def _pick(resource: Resource, count: int, in_use: set[str], handed_on: set[str],
          where: str) -> tuple[str, ...]:
    """kubelet's devicesToAllocate for one container and resource; marks them in use."""
    reused = [d.id for d in resource.devices if d.id in handed_on][:count]
    if len(reused) < count:
        free = [d.id for d in resource.devices if d.healthy and d.id not in in_use]
        if len(reused) + len(free) < count:
            raise AllocationError(
                f"Insufficient {resource.name}: asks for {count}, "
                f"{len(reused) + len(free)} of the node's {len(resource.devices)} are free "
                "(the others are allocated to earlier containers or unhealthy); the "
                "scheduler would leave the pod Pending", source=where)
        ids = preferred_allocation(resource, free + reused, reused, count)
    else:
        ids = tuple(reused)
    in_use.update(ids)
    return ids


def pod_containers(pod: Mapping[str, Any], origin: str,
                   kubelet: KubeletDevices) -> list[PodContainer]:
    """Each container of a Pod manifest as CreateContainer would present it, once
    `kubelet` has admitted the pod: the Allocate annotations of the nri-accel resources
    a container asks for become its container annotations."""
    meta = _mapping(pod.get("metadata"), f"{origin}: metadata")
    name = _text(meta.get("name", "pod"), f"{origin}: metadata.name")
    where = f"{origin}: pod {name}"
    namespace = _text(meta.get("namespace") or "default", f"{where}: metadata.namespace")
    uid = _text(meta.get("uid", ""), f"{where}: metadata.uid")
    annotations = MappingProxyType(
        _string_map(meta.get("annotations"), f"{where}: metadata.annotations"))
    spec = _mapping(pod.get("spec"), f"{where}: spec")
    parsed: list[tuple[str, tuple[str, ...], list[str], DeviceRequest]] = []
    for field in ("initContainers", "containers"):
        items = spec.get(field) or []
        if not isinstance(items, list):
            raise ConfigError("must be a list", source=f"{where}: spec.{field}")
        for i, c in enumerate(items):
            parsed.append(_container(c, f"{where}: spec.{field}[{i}]",
                                     field == "initContainers", kubelet))
    if not parsed:
        raise ConfigError("the pod has no containers", source=f"{where}: spec.containers")
    grants = kubelet.admit([request for *_, request in parsed])
    out = []
    for (cname, env, notes, request), grant in zip(parsed, grants, strict=True):
        notes.extend(f"kubelet passes CDI device {n} to the runtime" for n in grant.cdi_devices)
        info = ContainerInfo(
            namespace=namespace,
            pod_name=name,
            pod_uid=uid,
            container_name=cname,
            container_id=f"{namespace}/{name}/{cname}",
            pod_annotations=annotations,
            container_annotations=grant.annotations,
            env=env,
        )
        out.append(PodContainer(info, tuple(notes),
                                exits=request.init and not request.sidecar))
    return out


def _container(c: Any, where: str, init: bool, kubelet: KubeletDevices
               ) -> tuple[str, tuple[str, ...], list[str], DeviceRequest]:
    """A container's name, env, notes and device-plugin request."""
    c = _mapping(c, where)
    name = _text(c.get("name"), f"{where}.name")
    if not name:
        raise ConfigError("a container needs a name", source=f"{where}.name")
    env: list[str] = []
    notes: list[str] = []
    entries = c.get("env") or []
    if not isinstance(entries, list):
        raise ConfigError("must be a list", source=f"{where}.env")
    for j, e in enumerate(entries):
        e = _mapping(e, f"{where}.env[{j}]")
        key = _text(e.get("name"), f"{where}.env[{j}].name")
        if "valueFrom" in e:
            notes.append(f"env {key}: valueFrom cannot be resolved offline; not set")
            continue
        value = e.get("value", "")
        env.append(f"{key}={_text(value, f'{where}.env[{j}].value')}")
    resources = _device_resources(c.get("resources"), f"{where}.resources", kubelet, notes)
    request = DeviceRequest(where=f"{where}.resources", resources=MappingProxyType(resources),
                            init=init, sidecar=init and c.get("restartPolicy") == "Always")
    return name, tuple(env), notes, request


def _device_resources(resources: Any, where: str, kubelet: KubeletDevices,
                      notes: list[str]) -> dict[str, int]:
    """The nri-accel resources a container asks for (name -> count > 0), limits over
    requests; other extended resources are noted (another device plugin serves them, if
    any); cpu, memory and hugepages are not devices."""
    resources = _mapping(resources, where)
    wanted = {**_mapping(resources.get("requests"), f"{where}.requests"),
              **_mapping(resources.get("limits"), f"{where}.limits")}
    out = {}
    for name, n in sorted(wanted.items(), key=lambda kv: str(kv[0])):
        if not isinstance(name, str) or "/" not in name:
            continue
        if not kubelet.serves(name):
            served = ", ".join(kubelet.resource_names) or "none"
            notes.append(f"resource {name}: not advertised by nri-accel's device plugin on "
                         f"this node (it advertises: {served}); left to another device plugin")
            continue
        if isinstance(n, bool) or not isinstance(n, int | str) or not (
                str(n).isascii() and str(n).isdigit()):
            raise ConfigError(f"{name}: a device count must be a whole number, not {n!r}",
                              source=where)
        if int(n) > 0:
            out[name] = int(n)
    return out


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise ConfigError(f"expected a mapping, got {type(value).__name__}", source=where)
    return value


def _text(value: Any, where: str) -> str:
    if isinstance(value, bool) or value is None:
        raise ConfigError("expected a string", source=where)
    if isinstance(value, int | float):
        return str(value)
    if not isinstance(value, str):
        raise ConfigError(f"expected a string, got {type(value).__name__}", source=where)
    return value


def _string_map(value: Any, where: str) -> dict[str, str]:
    value = _mapping(value, where)
    out = {}
    for k, v in value.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise ConfigError(f"annotation {k!r}: keys and values must be strings "
                              "(quote numbers and booleans)", source=where)
        out[k] = v
    return out
