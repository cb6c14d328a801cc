"""Helpers for the security tests: the demo node, Engines under each policy, containers.

`demo_inventory()` is the built-in demo node (nri_accel/demo/inventory.json: 8 x A100 on
2 NUMA nodes, GPU 7 in MIG mode with three MIG devices, the driver's files by capability).
`container()` builds the ContainerInfo that nri/convert.py builds from an NRI
CreateContainer request (pod and container annotations, the OCI process env).
`DEVICE_PLUGIN_KEY` is the container annotation kubelet copies from nri-accel's device
plugin Allocate response: the one source a pod author cannot write.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType

from demo_node import demo_inventory  # tests/demo_node.py

from nri_accel.config import Config, DevicesConfig, PolicyConfig
from nri_accel.container import ContainerInfo
from nri_accel.engine import Engine
from nri_accel.inventory import Inventory
from nri_accel.request import GRANT_KEY_PREFIX

DEVICE_PLUGIN_KEY = GRANT_KEY_PREFIX + "nvidia.com_gpu"
TRUSTED_NS = "gpu-operator"

def config(mode: str = "kubernetes", *, hooks: bool = False, hook_path: str = "") -> Config:
    return Config(policy=PolicyConfig(mode=mode, trusted_namespaces=frozenset({TRUSTED_NS})),
                  devices=DevicesConfig(hooks=hooks, hook_path=hook_path))


def engine(mode: str = "kubernetes", inventory: Inventory | None = None, **kw: object) -> Engine:
    return Engine(inventory or demo_inventory(), config(mode, **kw))  # type: ignore[arg-type]


def container(*, pod: Mapping[str, str] | None = None, ctr: Mapping[str, str] | None = None,
              env: Iterable[str] = (), namespace: str = "default", name: str = "main",
              cid: str = "c0", pod_name: str = "pod-0") -> ContainerInfo:
    """One container; each container id its own pod (a new create of the same pod and
    container name replaces the earlier grant)."""
    return ContainerInfo(
        namespace=namespace, pod_name=pod_name, pod_uid=f"6b1c1a6e-0000-4000-8000-{cid}",
        container_name=name, container_id=cid,
        pod_annotations=MappingProxyType(dict(pod or {})),
        container_annotations=MappingProxyType(dict(ctr or {})),
        env=tuple(env))
