"""Helpers for the request tests: build a ContainerInfo the way nri/convert.py does.

`info()` stands for one NRI CreateContainer's pod and container as the runtime sends them
(namespace, pod and container annotations, the OCI process env of image + pod spec).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from nri_accel.container import ContainerInfo
from nri_accel.policy import Policy, Request
from nri_accel.vendors.nvidia import DEFAULT_OPTIONS, Options

KUBERNETES = Policy()
STANDALONE = Policy(mode="standalone")
TRUSTING_GPU_OPERATOR = Policy(trusted_namespaces=frozenset({"gpu-operator"}))

# A CUDA 12.4 base image's env (nvidia/cuda:12.4.1-base-ubuntu22.04), trimmed.
CUDA_IMAGE_ENV = (
    "PATH=/usr/local/nvidia/bin:/usr/local/cuda/bin:/usr/local/sbin:/usr/bin:/bin",
    "NVARCH=x86_64",
    "NVIDIA_REQUIRE_CUDA=cuda>=12.4 brand=tesla,driver>=470,driver<471 "
    "brand=unknown,driver>=470,driver<471 brand=nvidia,driver>=470,driver<471 "
    "brand=tesla,driver>=525,driver<526 brand=unknown,driver>=525,driver<526",
    "CUDA_VERSION=12.4.1",
    "LD_LIBRARY_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64",
    "NVIDIA_VISIBLE_DEVICES=all",
    "NVIDIA_DRIVER_CAPABILITIES=compute,utility",
)

UUID0 = "GPU-5fd4c5a4-1f2d-9a3b-8c1e-0123456789ab"
UUID1 = "GPU-0b1c2d3e-4f50-6172-8394-a5b6c7d8e9f0"
MIG0 = "MIG-1d6c2b5e-3a4f-5b6c-7d8e-9fa0b1c2d3e4"


def info(*, pod: Mapping[str, str] | None = None, ctr: Mapping[str, str] | None = None,
         env: Iterable[str] = (), namespace: str = "default",
         container: str = "main") -> ContainerInfo:
    return ContainerInfo(
        namespace=namespace,
        pod_name="pod-0",
        pod_uid="6b1c1a6e-0000-4000-8000-000000000001",
        container_name=container,
        container_id="c0ffee",
        pod_annotations=dict(pod or {}),
        container_annotations=dict(ctr or {}),
        env=tuple(env),
    )


def parse(policy: Policy = STANDALONE, **kwargs: object) -> Request:
    return policy.request_for(info(**kwargs))  # type: ignore[arg-type]


def claims(request: Request, which: str = "grants") -> list[tuple[object, ...]]:
    """Claims as (kind, ids, count, all, source) tuples, easy to compare in tables."""
    return [(c.kind, c.ids, c.count, c.all, c.source) for c in getattr(request, which)]


def nv(request: Request) -> Options:
    """The request's NVIDIA settings (capabilities, requirements, MIG capabilities)."""
    options = request.option("nvidia")
    return options if isinstance(options, Options) else DEFAULT_OPTIONS


def nvidia_none(request: Request) -> bool:
    """NVIDIA_VISIBLE_DEVICES=none applied: the NVIDIA driver, no device."""
    return "nvidia.com" in request.drivers_only
