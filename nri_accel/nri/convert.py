"""NRI protobuf pods and containers -> the plain data the pipeline works on.

Owns: PodSandbox + Container -> nri_accel.request.ContainerInfo, and the
(container id, annotations) pairs of a Synchronize that Engine.restore takes, so
that nothing outside nri_accel.nri reads a protobuf field. Imports nri_accel.policy
(which container annotations are the container's own), nri_accel.request and this
package's nri_pb2; pure functions.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType

from nri_accel.nri import nri_pb2 as pb
from nri_accel.policy import Policy
from nri_accel.request import ContainerInfo


def container_info(pod: pb.PodSandbox, container: pb.Container) -> ContainerInfo:
    """What the request pipeline needs to know about a container being created."""
    return ContainerInfo(
        namespace=pod.namespace,
        pod_name=pod.name,
        pod_uid=pod.uid,
        container_name=container.name,
        container_id=container.id,
        pod_annotations=MappingProxyType(dict(pod.annotations)),
        container_annotations=MappingProxyType(dict(container.annotations)),
        env=tuple(container.env),
        device_paths=frozenset(d.path for d in container.linux.devices),
        mount_destinations=frozenset(m.destination for m in container.mounts),
    )


def live_containers(
    containers: Iterable[pb.Container], pods: Iterable[pb.PodSandbox] = (),
) -> Iterator[tuple[str, Mapping[str, str]]]:
    """(id, own annotations) of every synchronised container that has not stopped. An
    annotation whose key its pod (among `pods`) also carries is the runtime's copy of the
    pod's, written by whoever wrote the pod, and is left out
    (Policy.container_annotation_trusted)."""
    pod_annotations = {p.id: p.annotations for p in pods}
    for c in containers:
        if c.state == pb.CONTAINER_STOPPED:
            continue
        of_pod = pod_annotations.get(c.pod_sandbox_id, {})
        yield c.id, MappingProxyType({
            k: v for k, v in c.annotations.items()
            if Policy.container_annotation_trusted(k, of_pod)})

