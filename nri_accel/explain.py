"""`nri-accel explain`: a dry run of CreateContainer from a Kubernetes Pod manifest.

Owns: main_explain(args), the Pod-manifest reader (read_manifests, pod_containers) and
the readable rendering of a Plan. Imports the standard library, PyYAML, nri_accel.config,
nri_accel.engine, nri_accel.errors, nri_accel.inventory, nri_accel.log, nri_accel.request,
and lazily nri_accel.discover (for --root) and nri_accel.nri.adjust (for --json, the one
builder of a ContainerAdjustment).

    nri-accel explain (--inventory FILE | --root DIR) --pod POD.yaml [--container NAME]
                      [--config FILE] [--json]

What is read from the manifest (YAML or JSON; several documents, a `kind: List`, and the
pod template of a Deployment, StatefulSet, DaemonSet, ReplicaSet, Job or CronJob work too):
metadata.name, metadata.namespace ("default" when absent), metadata.uid, metadata.annotations
(the pod annotations), and for each of spec.initContainers and spec.containers (in that
order, the order kubelet creates them) its name, its env entries with a `value` (entries
with `valueFrom` cannot be resolved offline and are listed as notes) and its resources.
A container whose resources (limits, else requests) name a device kind of the inventory,
such as `nvidia.com/gpu: 1`, is treated as nri-accel's device plugin would treat it:
kubelet passes the allocation as the container annotation `devices.nri-accel.io`, here
"KIND: N", so nri-accel's allocator picks which devices. The image's own env is not in
a manifest and so is not seen (a CUDA image's NVIDIA_VISIBLE_DEVICES=all only ever
narrows anyway).

Every container of every pod is explained, in order, against one Engine (so containers
of one pod get distinct devices for counts), unless --container names one. Output: per
container the devices, env, device nodes, mounts, hooks, annotations and notes; with
--json the protobuf JSON mapping of the ContainerAdjustment (one container: the
adjustment itself; several: an object keyed by "pod/container"). Exit 0 when every
container was planned, 1 when any request was refused (the reason on stderr, naming the
annotation or variable), 2 for an unreadable manifest or configuration.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import IO, Any

import yaml

from nri_accel.config import Config, load_config
from nri_accel.engine import Engine, Plan
from nri_accel.errors import ConfigError, RequestError
from nri_accel.inventory import Inventory
from nri_accel.log import configure as configure_logging
from nri_accel.request import DEVICES_KEY, ContainerInfo

WORKLOAD_KINDS = frozenset({"Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job",
                            "ReplicationController"})
MAX_MANIFEST_BYTES = 4 * 1024 * 1024


@dataclass(frozen=True, slots=True)
class PodContainer:
    """One container of a manifest as CreateContainer would see it, and what the
    manifest could not say (valueFrom env entries)."""

    info: ContainerInfo
    notes: tuple[str, ...] = ()

    @property
    def label(self) -> str:
        return f"{self.info.pod_name}/{self.info.container_name}"


def main_explain(args: argparse.Namespace) -> int:
    """The `explain` verb (flags: --inventory FILE | --root DIR, --pod FILE,
    --container NAME, --config FILE, --json)."""
    config = load_config(args.config)
    setup_cli_logging(config)
    manifests = read_manifests(args.pod)
    inventory = _inventory(args, config)
    kinds = frozenset(inventory.kinds())
    containers = [c for m in manifests for c in pod_containers(m, args.pod, kinds)]
    if args.container:
        containers = [c for c in containers if c.info.container_name == args.container]
        if not containers:
            raise ConfigError(f"no container named {args.container!r}", source=args.pod)
    return explain(containers, Engine(inventory, config), as_json=args.json)


def setup_cli_logging(config: Config) -> None:
    """Diagnostics to stderr, warnings and up (debug if configured): stdout is the output."""
    level = "debug" if config.log.level == "debug" else "warning"
    configure_logging(level=level, fmt=config.log.format)


def _inventory(args: argparse.Namespace, config: Config) -> Inventory:
    if args.inventory:
        return Inventory.load(args.inventory)
    from nri_accel.discover import load_or_discover

    return load_or_discover(None, args.root, config)


def explain(containers: Iterable[PodContainer], engine: Engine, *, as_json: bool = False,
            out: IO[str] | None = None, err: IO[str] | None = None) -> int:
    """Plan each container and print the result; 1 if any was refused, else 0."""
    out = out if out is not None else sys.stdout
    err = err if err is not None else sys.stderr
    planned: list[tuple[PodContainer, Plan]] = []
    refused = False
    for c in containers:
        try:
            planned.append((c, engine.plan(c.info)))
        except RequestError as e:
            refused = True
            print(f"nri-accel: refused {c.info.namespace}/{c.label}: {e}", file=err)
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
    if plan.devices:
        lines.append("  devices:")
        for d in plan.devices:
            extra = f" ({d.uuid})" if d.uuid else ""
            lines.append(f"    {d.qualified_name}{extra}")
    else:
        lines.append("  devices: none")
    edits = plan.edits
    if any(d.kind.startswith("nvidia.com/") for d in plan.devices) or any(
            kv.startswith("NVIDIA_DRIVER_CAPABILITIES=") for kv in edits.env):
        lines.append(f"  capabilities: {','.join(sorted(plan.capabilities))}")
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


def read_manifests(path: str) -> list[dict[str, Any]]:
    """The pod-shaped documents of a YAML/JSON file (Pods, Lists, workload templates)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read(MAX_MANIFEST_BYTES + 1)
    except OSError as e:
        raise ConfigError(e.strerror or str(e), source=path) from e
    if len(text) > MAX_MANIFEST_BYTES:
        raise ConfigError(f"larger than {MAX_MANIFEST_BYTES} bytes", source=path)
    try:
        docs = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as e:
        raise ConfigError(f"not valid YAML: {e}", source=path) from e
    pods: list[dict[str, Any]] = []
    for i, doc in enumerate(docs):
        pods.extend(_pods_of(doc, f"{path}: document {i + 1}"))
    if not pods:
        raise ConfigError("no Pod in this file", source=path)
    return pods


def _pods_of(doc: Any, where: str) -> list[dict[str, Any]]:
    if not isinstance(doc, dict):
        raise ConfigError("expected a Kubernetes object (a mapping)", source=where)
    kind = doc.get("kind", "Pod")
    if kind == "List":
        items = doc.get("items") or []
        if not isinstance(items, list):
            raise ConfigError("items must be a list", source=where)
        return [p for i, item in enumerate(items) for p in _pods_of(item, f"{where}.items[{i}]")]
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
    raise ConfigError(f"kind {kind!r} is not a Pod (nor a List or workload of Pods)",
                      source=where)


def pod_containers(pod: Mapping[str, Any], origin: str,
                   device_kinds: Container[str] = frozenset()) -> list[PodContainer]:
    """Each container of a Pod manifest as CreateContainer would present it; resources of
    `device_kinds` become the device plugin's allocation annotation."""
    meta = _mapping(pod.get("metadata"), f"{origin}: metadata")
    name = _text(meta.get("name", "pod"), f"{origin}: metadata.name")
    where = f"{origin}: pod {name}"
    namespace = _text(meta.get("namespace") or "default", f"{where}: metadata.namespace")
    uid = _text(meta.get("uid", ""), f"{where}: metadata.uid")
    annotations = _string_map(meta.get("annotations"), f"{where}: metadata.annotations")
    spec = _mapping(pod.get("spec"), f"{where}: spec")
    out: list[PodContainer] = []
    for field in ("initContainers", "containers"):
        items = spec.get(field) or []
        if not isinstance(items, list):
            raise ConfigError("must be a list", source=f"{where}: spec.{field}")
        for i, c in enumerate(items):
            out.append(_container(c, f"{where}: spec.{field}[{i}]", namespace, name, uid,
                                  annotations, device_kinds))
    if not out:
        raise ConfigError("the pod has no containers", source=f"{where}: spec.containers")
    return out


def _container(c: Any, where: str, namespace: str, pod: str, uid: str,
               annotations: Mapping[str, str], device_kinds: Container[str]) -> PodContainer:
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
    allocation = _device_resources(c.get("resources"), f"{where}.resources", device_kinds,
                                   notes)
    container_annotations = {DEVICES_KEY: allocation} if allocation else {}
    info = ContainerInfo(
        namespace=namespace,
        pod_name=pod,
        pod_uid=uid,
        container_name=name,
        container_id=f"{namespace}/{pod}/{name}",
        pod_annotations=MappingProxyType(dict(annotations)),
        container_annotations=MappingProxyType(container_annotations),
        env=tuple(env),
    )
    return PodContainer(info, tuple(notes))


def _device_resources(resources: Any, where: str, device_kinds: Container[str],
                      notes: list[str]) -> str:
    """The device-plugin allocation of a container's extended resources ("KIND: N; ...")
    for every resource that is a device kind of the node; other extended resources are
    noted (another device plugin serves them), cpu, memory and hugepages are not devices."""
    if resources is None:
        return ""
    resources = _mapping(resources, where)
    wanted = resources.get("limits") or resources.get("requests") or {}
    wanted = _mapping(wanted, f"{where}.limits")
    entries = []
    for kind, n in sorted(wanted.items()):
        if not isinstance(kind, str) or "/" not in kind:
            continue
        if kind not in device_kinds:
            notes.append(f"resource {kind}: not a device kind of this node; nri-accel's "
                         "device plugin does not allocate it")
            continue
        count = n if isinstance(n, int) else str(n)
        if isinstance(count, str) and not count.isdigit():
            raise ConfigError(f"{kind}: a device count must be a whole number, not {n!r}",
                              source=where)
        if int(count) > 0:
            entries.append(f"{kind}: {int(count)}")
    return "; ".join(entries)


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
