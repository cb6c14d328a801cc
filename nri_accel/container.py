"""What the runtime says about one container: the plain input of the request pipeline.

Owns: ContainerInfo. Imports only the standard library and msgspec. No logic: nri/convert.py builds
it from NRI's protobuf pod and container, explain from a Pod manifest, tests by hand.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType

from msgspec import Struct


class ContainerInfo(Struct, frozen=True):
    """One container being created, as plain data."""

    namespace: str
    pod_name: str
    pod_uid: str
    container_name: str
    container_id: str
    pod_annotations: Mapping[str, str]
    container_annotations: Mapping[str, str]
    env: tuple[str, ...]  # "KEY=VALUE" as in the container spec (image env + pod env)
    # device nodes already in the spec: path -> (type, major, minor)
    spec_devices: Mapping[str, tuple[str, int, int]] = MappingProxyType({})
    mount_destinations: frozenset[str] = frozenset()
    pod_id: str = ""  # the runtime's sandbox id (what pod sandbox events carry)

    @property
    def label(self) -> str:
        """namespace/pod/container, for messages."""
        return f"{self.namespace}/{self.pod_name}/{self.container_name}"
