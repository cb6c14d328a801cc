"""The trust policy: which request sources may grant devices, for which namespaces.

Owns: Origin, Verdict, Policy. Imports nri_accel.config only. Pure: no I/O. This is the
one module that decides trust (DESIGN.md, "Trust model"); request.py asks it and acts.

Sources, by rank (a higher rank is consulted first):

1. Origin.CONTAINER: container annotations written by kubelet from a device plugin's
   Allocate (``devices.nri-accel.io``) and CDI requests (``cdi.k8s.io/*``,
   ``nvidia.cdi.k8s.io/*``). They went through scheduling, so they grant. A container
   annotation whose key the pod also carries is NOT trusted (CRI-O copies pod annotations
   into the container's, containerd can pass some through): container_annotation_trusted().
2. Origin.POD: pod annotations (``devices.nri-accel.io/...``, ``cdi-devices.noderesource.dev/...``,
   ``cdi.k8s.io/*`` on the pod). Whoever creates the pod writes them.
3. Origin.ENV: the container's environment (NVIDIA_VISIBLE_DEVICES, NV_GPU,
   AWS_NEURON_VISIBLE_DEVICES, NVIDIA_MIG_*). Whoever builds the image or the pod writes it.

Modes (config ``[policy]``):
- "kubernetes" (default): only Origin.CONTAINER grants; pod annotations and env grant only
  for namespaces in ``trusted_namespaces``.
- "standalone": every origin grants (a node without a device plugin, podman, nerdctl).

decide() turns that into a verdict per device claim. `vendor_granted` says whether a
higher-ranked source already granted devices of the claim's vendor (inventory.vendor_of:
the part of the kind before "/", so nvidia.com covers GPUs and MIG devices). Such a claim
only narrows (LIMIT),
whatever its origin may grant, so a CUDA image's NVIDIA_VISIBLE_DEVICES=all never widens
an allocation. A claim with nothing to narrow that may not grant is REFUSED when it is an
explicit pod annotation and IGNORED (with a note) when it comes from env, because every
CUDA image ships NVIDIA_VISIBLE_DEVICES=all; this mirrors the toolkit's
accept-nvidia-visible-devices-envvar-when-unprivileged=false.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

from nri_accel.config import Config

MODE_KUBERNETES = "kubernetes"
MODE_STANDALONE = "standalone"


class Origin(enum.Enum):
    """Where a request comes from; the value reads well in messages."""

    CONTAINER = "container annotations"
    POD = "pod annotations"
    ENV = "env requests"


class Verdict(enum.Enum):
    GRANT = "grant"  # may give devices
    LIMIT = "limit"  # may only narrow what a higher-ranked source granted
    REFUSE = "refuse"  # fail the container (PolicyError naming the source)
    IGNORE = "ignore"  # drop it and say why in Request.notes


@dataclass(frozen=True, slots=True)
class Policy:
    mode: str = MODE_KUBERNETES
    trusted_namespaces: frozenset[str] = frozenset()

    @classmethod
    def from_config(cls, config: Config) -> Policy:
        return cls(mode=config.policy.mode,
                   trusted_namespaces=frozenset(config.policy.trusted_namespaces))

    def may_grant(self, origin: Origin, namespace: str) -> bool:
        """Whether `origin` may give devices to a container in `namespace`."""
        return (origin is Origin.CONTAINER or self.mode == MODE_STANDALONE
                or namespace in self.trusted_namespaces)

    def decide(self, origin: Origin, namespace: str, *, vendor_granted: bool) -> Verdict:
        if vendor_granted:
            return Verdict.LIMIT
        if self.may_grant(origin, namespace):
            return Verdict.GRANT
        return Verdict.REFUSE if origin is Origin.POD else Verdict.IGNORE

    def reason(self, origin: Origin, namespace: str) -> str:
        """Why `origin` may not grant in `namespace`: the text of refusals and notes."""
        where = f"namespace {namespace!r}" if namespace else "a container with no namespace"
        return (f"{origin.value} may not grant devices in {where}; allocate through the "
                "device plugin or add the namespace to policy.trusted_namespaces")

    @staticmethod
    def container_annotation_trusted(key: str, pod_annotations: Mapping[str, str]) -> bool:
        """A container annotation is kubelet's only if the pod does not carry the key."""
        return key not in pod_annotations
