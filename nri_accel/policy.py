"""The trust policy: which request sources may grant devices, for which namespaces.

Owns: Verdict, Policy, Request and Policy.apply() (one container's parsed sources ->
what is granted, what only narrows, the notes), and own_annotations() (which of a
container's annotations are its own, for rebuilding grants). Imports the standard
library, msgspec, nri_accel.config (types), nri_accel.container, nri_accel.errors,
nri_accel.request and nri_accel.syntax. Pure: no I/O. This is the one module that decides
trust (DESIGN.md, "Trust model"); request.py only parses, the other stages act on the
Request.

Sources, by rank (a higher rank is consulted first):

1. Origin.CONTAINER: container annotations written by kubelet from a device plugin's
   Allocate (``devices.nri-accel.io``, ``devices.nri-accel.io/resource.*``) and CDI
   requests (``cdi.k8s.io/*``, ``nvidia.cdi.k8s.io/*``). They went through scheduling, so
   they grant. A container annotation whose key the pod also carries is NOT trusted
   (CRI-O copies pod annotations into the container's, containerd can pass some
   through): it ranks with the pod annotations.
2. Origin.POD: pod annotations (``devices.nri-accel.io/...``, ``cdi-devices.noderesource.dev/...``,
   ``cdi.k8s.io/*`` on the pod). Whoever creates the pod writes them.
3. Origin.ENV: the container's environment (NVIDIA_VISIBLE_DEVICES, NV_GPU,
   AWS_NEURON_VISIBLE_DEVICES, HABANA_VISIBLE_DEVICES, ...). Whoever builds the image or
   the pod writes it.

Modes (config ``[policy]``):
- "kubernetes" (default): only Origin.CONTAINER grants; pod annotations and env grant only
  for namespaces in ``trusted_namespaces``.
- "standalone": every origin grants (a node without a device plugin, podman, nerdctl).

Per source and vendor (the part of a kind before "/": nvidia.com covers GPUs and MIG
devices) a verdict: a claim of a vendor that a higher-ranked source already granted only
narrows (LIMIT), whatever its origin may grant, so a CUDA image's
NVIDIA_VISIBLE_DEVICES=all never widens an allocation. A claim with nothing to narrow
that may not grant is REFUSED when it is an explicit pod annotation and IGNORED (with a
note) when it comes from env, because every CUDA image ships NVIDIA_VISIBLE_DEVICES=all;
this mirrors the toolkit's accept-nvidia-visible-devices-envvar-when-unprivileged=false.
An env ask only a granting source may make (NVIDIA_MIG_CONFIG_DEVICES, ...) is refused
where env may not grant (the toolkit: in an unprivileged container), and a malformed
variable that qualifies a grant (NVIDIA_DRIVER_CAPABILITIES, NVIDIA_REQUIRE_*, ...) is
refused; both only for a container granted a device of that vendor, as the toolkit
reads them for a GPU container only (else a note says what was not read).
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Mapping
from typing import TYPE_CHECKING

from msgspec import Struct
from msgspec.structs import replace

from nri_accel.container import ContainerInfo
from nri_accel.errors import PolicyError, RequestError, cut
from nri_accel.memo import Memo, text_chars
from nri_accel.request import (
    ID_CHARS,
    Origin,
    Parsed,
    Source,
    check_bounds,
    claimed_ids,
    parse,
    read_by_parse,
)
from nri_accel.syntax import MAX_NAME_CHARS, DeviceClaim, claim_order

if TYPE_CHECKING:
    from nri_accel.config import Config

MODE_KUBERNETES = "kubernetes"
MODE_STANDALONE = "standalone"


class Verdict(enum.Enum):
    GRANT = "grant"  # may give devices
    LIMIT = "limit"  # may only narrow what a higher-ranked source granted
    REFUSE = "refuse"  # fail the container (PolicyError naming the source)
    IGNORE = "ignore"  # drop it and say why in Request.notes


class Request(Struct, frozen=True, cache_hash=True):
    """What one container gets asked for, after the trust policy.

    Limits narrow the grants of the same vendor: the devices granted for a vendor are
    intersected with the devices that vendor's limits name (a count limit keeps at most
    N). `drivers_only` vendors keep their driver files but no device (NVIDIA "none").
    Granted CDI requests are claims with `cdi` set and, as written, in `cdi_names`
    (handed to the runtime instead when it resolves CDI itself). `options` carry each
    family's settings (driver capabilities, requirements, ...), `visible` the families
    whose visibility variable the env sets. `notes` say which requests were ignored and
    why, for the canonical log line. (cache_hash: a memoised request is a key of
    select()'s memo at every create that asks for a device.)
    """

    grants: tuple[DeviceClaim, ...] = ()
    limits: tuple[DeviceClaim, ...] = ()
    drivers_only: frozenset[str] = frozenset()
    options: tuple[tuple[str, Hashable], ...] = ()
    visible: frozenset[str] = frozenset()
    cdi_names: tuple[str, ...] = ()  # granted CDI requests as written ("vendor/class=name")
    notes: tuple[str, ...] = ()
    chars: int = 0  # of the annotations and names it was read from, and its ids (what
    # memos keeping it are charged: nri_accel.memo)
    env: Hashable = None  # Parsed.env: shared by the requests of one env, charged once
    env_chars: int = 0  # of the env entries read

    def option(self, family: str) -> Hashable:
        """The family's settings; None when the container left them at their default."""
        for name, value in self.options:
            if name == family:
                return value
        return None


class Policy(Struct, frozen=True):
    mode: str = MODE_KUBERNETES
    trusted_namespaces: frozenset[str] = frozenset()

    @classmethod
    def from_config(cls, config: Config) -> Policy:
        return cls(mode=config.policy.mode,
                   trusted_namespaces=frozenset(config.policy.trusted_namespaces))

    def may_grant(self, origin: Origin, namespace: str) -> bool:
        """Whether `origin` may give devices to a container in `namespace`."""
        if origin is Origin.CONTAINER or self.mode == MODE_STANDALONE:
            return True
        if len(namespace) <= MAX_NAME_CHARS:
            return namespace in self.trusted_namespaces
        # (a namespace of megabytes is not hashed: strings of other lengths compare at once)
        return any(namespace == t for t in self.trusted_namespaces)

    def decide(self, origin: Origin, namespace: str, *, vendor_granted: bool) -> Verdict:
        if vendor_granted:
            return Verdict.LIMIT
        if self.may_grant(origin, namespace):
            return Verdict.GRANT
        return Verdict.REFUSE if origin is Origin.POD else Verdict.IGNORE

    def reason(self, origin: Origin, namespace: str) -> str:
        """Why `origin` may not grant in `namespace`: the text of refusals and notes."""
        # a namespace is at most 63 characters in Kubernetes; a hostile runtime request
        # may send megabytes
        where = (f"namespace {cut(namespace, MAX_NAME_CHARS)!r}" if namespace
                 else "a container with no namespace")
        return (f"{origin.value} may not grant devices in {where}; allocate through the "
                "device plugin or add the namespace to policy.trusted_namespaces")

    def request_for(self, info: ContainerInfo) -> Request:
        """The Request of one container: its annotations and env parsed
        (nri_accel.request.parse) and this policy applied. Raises RequestError (a
        malformed value) or PolicyError (a refused one), naming the source.

        Remembered by what parse() reads of the container and its namespace (the
        replicas and restarts of a workload ask alike): a third of a CreateContainer's
        time when it grants (bench_hotpath.py), in a memo bounded by the characters of
        its keys (nri_accel.memo: a request read from a sixteenth of them or more is not
        kept). Refusals are not remembered. A request over the bounds of
        nri_accel.request.check_bounds() is refused before any of this."""
        check_bounds(info)
        name, pod_keys, own_keys, env = read_by_parse(info)
        key = (self, info.namespace, name, pod_keys, own_keys, env)
        request = _REQUESTS.get(key)
        if request is None:
            parsed = parse(info)
            request = self.apply(parsed, info.namespace)
            ids = ID_CHARS * claimed_ids((*request.grants, *request.limits))
            request = replace(request, env=parsed.env, env_chars=text_chars(env),
                              chars=text_chars((info.namespace, name, pod_keys, own_keys))
                              + ids)
            _REQUESTS.put(key, request, request.chars + request.env_chars)
        return request

    def apply(self, parsed: Parsed, namespace: str) -> Request:
        """The Request one container's parsed sources amount to in `namespace`. Raises
        PolicyError, naming the source, for a refused one."""
        ranked: tuple[list[Source], list[Source], list[Source]] = ([], [], [])
        demoted = []
        for src in parsed.sources:
            if src.origin is Origin.CONTAINER and src.also_on_pod:
                demoted.append(_demoted(src))
            else:
                ranked[_RANK[src.origin]].append(src)
        ranked[1].extend(demoted)

        grants: list[DeviceClaim] = []
        limits: list[DeviceClaim] = []
        notes: list[str] = []
        drivers_only: set[str] = set()
        granted_vendors: set[str] = set()  # by the ranks above the current one
        for sources in ranked:
            rank_vendors: set[str] = set()
            for src in sources:
                by_vendor: dict[str, list[DeviceClaim]] = {}
                for c in src.claims:
                    by_vendor.setdefault(c.vendor, []).append(c)
                for vendor in src.drivers_only:
                    by_vendor.setdefault(vendor, [])
                for vendor in sorted(by_vendor):
                    verdict = self.decide(src.origin, namespace,
                                          vendor_granted=vendor in granted_vendors)
                    mine = by_vendor[vendor]
                    if verdict is Verdict.GRANT:
                        grants.extend(mine)
                        rank_vendors.add(vendor)
                    elif verdict is Verdict.LIMIT:
                        # "all" narrows nothing; "none" narrows the vendor's grants to nothing.
                        limits.extend(c for c in mine if not c.all)
                    elif verdict is Verdict.REFUSE:
                        raise PolicyError(self.reason(src.origin, namespace), source=src.name)
                    else:
                        shown = src.text if len(src.text) <= 64 else src.text[:61] + "..."
                        notes.append(f"{src.name}={shown} not granted: "
                                     f"{self.reason(src.origin, namespace)}")
                        continue
                    if vendor in src.drivers_only:
                        drivers_only.add(vendor)
            granted_vendors |= rank_vendors

        if parsed.privileged or parsed.problems:  # what qualifies a grant of a vendor's
            # devices counts where the container gets one (the toolkit reads it only for
            # a GPU container)
            granted = drivers_only.union(c.vendor for c in grants)
            for vendor, source in parsed.privileged:
                if vendor in granted and not self.may_grant(Origin.ENV, namespace):
                    raise PolicyError(self.reason(Origin.ENV, namespace), source=source)
            for vendor, source, message in parsed.problems:
                if vendor in granted:
                    raise RequestError(message, source=source)
                notes.append(f"{source} not read ({message}): no {vendor} device is granted")
        return Request(
            grants=tuple(sorted(grants, key=claim_order)),
            limits=tuple(sorted(limits, key=claim_order)),
            drivers_only=frozenset(drivers_only),
            options=parsed.options,
            visible=parsed.visible,
            cdi_names=tuple(sorted({f"{c.kind}={i}" for c in grants if c.cdi
                                    for i in (c.ids or ("all",))})),
            notes=tuple(dict.fromkeys(notes)),
        )


_RANK = {Origin.CONTAINER: 0, Origin.POD: 1, Origin.ENV: 2}
REQUEST_MEMO_SIZE = 512
"""Requests remembered before the memo starts over. Its keys hold the annotations and
env entries parse() reads (under nri-accel's prefixes, a value it does not parse for
this container included): bounded by their characters too, REQUEST_MEMO_CHARS."""
REQUEST_MEMO_CHARS = 1024 * 1024  # a CUDA image's request: some 1,300
_REQUESTS: Memo[tuple[Hashable, ...], Request] = Memo(REQUEST_MEMO_SIZE, REQUEST_MEMO_CHARS)


def _demoted(src: Source) -> Source:
    """A container annotation the pod sets too, with another value: whoever wrote the pod
    may have written it, so it ranks (and is trusted) as a pod annotation."""
    return Source(Origin.POD, src.name, src.claims, src.text)


def own_annotations(container: Mapping[str, str], pod: Mapping[str, str]) -> dict[str, str]:
    """The annotations that are the container's own: those whose key its pod does not
    carry (a key the pod carries may be the runtime's copy of the pod's, written by
    whoever wrote the pod)."""
    return {k: v for k, v in container.items() if k not in pod}
