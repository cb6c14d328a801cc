"""NRI protobuf pods and containers -> the plain data the pipeline works on.

Owns: PodSandbox + Container -> nri_accel.container.ContainerInfo (container_info), and
the lean ContainerInfo of each live container of a Synchronize (live_containers), so
that nothing outside nri_accel.nri reads a protobuf field. Imports nri_accel.container
and this package's nri_pb2; pure functions, no trust decision (the policy decides which
annotations are a container's own).

Names: containerd names a container from its CRI metadata; CRI-O names it from the
`io.kubernetes.container.name` label, so a container created without kubelet's labels
has no name in NRI (captured from CRI-O 1.36.3). Its CRI metadata name is then read
from CRI-O's own `io.kubernetes.cri-o.Metadata` annotation (JSON, `{"name": ...}`),
which CRI-O writes for every container.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from types import MappingProxyType

from nri_accel.container import ContainerInfo
from nri_accel.nri import nri_pb2 as pb

CRIO_METADATA = "io.kubernetes.cri-o.Metadata"
_MAX_METADATA_CHARS = 4096


def container_info(pod: pb.PodSandbox, container: pb.Container) -> ContainerInfo:
    """What the request pipeline needs to know about a container being created."""
    return ContainerInfo(
        namespace=pod.namespace,
        pod_name=pod.name,
        pod_uid=pod.uid,
        container_name=container_name(container),
        container_id=container.id,
        pod_annotations=MappingProxyType(dict(pod.annotations)),
        container_annotations=MappingProxyType(dict(container.annotations)),
        env=tuple(container.env),
        device_paths=frozenset(d.path for d in container.linux.devices),
        mount_destinations=frozenset(m.destination for m in container.mounts),
        pod_id=pod.id,
    )


def container_name(container: pb.Container) -> str:
    """The container's NRI name, else its CRI metadata name as CRI-O records it."""
    if container.name:
        return container.name
    raw = container.annotations.get(CRIO_METADATA, "")
    if not raw or len(raw) > _MAX_METADATA_CHARS:
        return ""
    try:
        name = json.loads(raw).get("name", "")
    except (ValueError, AttributeError, RecursionError):  # RecursionError: "[[[[..."
        return ""
    return name if isinstance(name, str) else ""


def live_containers(containers: Iterable[pb.Container], pods: Iterable[pb.PodSandbox],
                    keys: Iterable[str]) -> Iterator[ContainerInfo]:
    """Every synchronised container that has not stopped, as a ContainerInfo carrying of
    the container's and of its pod's annotations only `keys` (a Synchronize can list
    tens of thousands of containers: nothing else is kept)."""
    keys = tuple(keys)
    by_id = {p.id: p for p in pods}
    empty = pb.PodSandbox()
    for c in containers:
        if c.state == pb.CONTAINER_STOPPED:
            continue
        pod = by_id.get(c.pod_sandbox_id, empty)
        yield ContainerInfo(
            namespace=pod.namespace,
            pod_name=pod.name,
            pod_uid=pod.uid,
            container_name=container_name(c),
            container_id=c.id,
            pod_annotations={k: pod.annotations[k] for k in keys if k in pod.annotations},
            container_annotations={k: c.annotations[k] for k in keys if k in c.annotations},
            env=(),
            pod_id=c.pod_sandbox_id,
        )
