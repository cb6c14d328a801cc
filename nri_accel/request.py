"""What one container asks for: annotations and env parsed into a Request, trust applied.

Owns: ContainerInfo, DeviceClaim, Request, parse_request() and the syntax of every
annotation and environment variable nri-accel reads (the user-facing reference is
README.md, "Requesting devices"). Imports nri_accel.errors, nri_accel.inventory (kind
names, the CDI syntax of kinds and ids, and vendor_of(), the one definition of which
kinds narrow each other),
nri_accel.policy (every trust decision) and nri_accel.requirements;
PyYAML only for the NRI device-injector's YAML list annotation. Pure: no I/O, no
logging, same input -> same Request.

Sources, in rank order (policy.py explains the trust of each):

1. container annotations (Origin.CONTAINER): ``devices.nri-accel.io`` (written by
   nri-accel's device plugin) and CDI requests ``cdi.k8s.io/*``, ``nvidia.cdi.k8s.io/*``;
2. pod annotations (Origin.POD): ``devices.nri-accel.io/container.<name>`` >
   ``devices.nri-accel.io/pod`` > ``devices.nri-accel.io`` (the first present is used, as
   in containerd/nri plugins/device-injector), the device-injector's CDI key
   ``cdi-devices.noderesource.dev`` (same precedence, YAML list of CDI names) and
   ``cdi.k8s.io/*`` / ``nvidia.cdi.k8s.io/*`` set on the pod;
3. env (Origin.ENV): NVIDIA_VISIBLE_DEVICES (NV_GPU when unset), AWS_NEURON_VISIBLE_DEVICES,
   NVIDIA_MIG_CONFIG_DEVICES, NVIDIA_MIG_MONITOR_DEVICES.

Capabilities (``capabilities.nri-accel.io`` with the same precedence, else
NVIDIA_DRIVER_CAPABILITIES) and requirements (NVIDIA_REQUIRE_*, CUDA_VERSION) only select
driver files and add checks, so any source may set them.

Every value is text from whoever wrote the pod or image: it is size-limited (each value,
and the env variables read taken together), control characters are refused, ids are
names (never paths) and every error names its source, a hostile key or variable name
shown escaped and cut. Variables nri-accel does not read (LD_PRELOAD, LD_LIBRARY_PATH,
...) are never looked at, nor kept in a memo.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache

import yaml

from nri_accel.errors import PolicyError, RequestError
from nri_accel.inventory import (
    DEVICE_NAME_RE,
    KIND_GPU,
    KIND_NEURON,
    KIND_RE,
    NVIDIA_VENDOR,
    vendor_of,
)
from nri_accel.policy import Origin, Policy, Verdict
from nri_accel.requirements import (
    REQUIRE_PREFIX,
    Requirements,
    legacy_cuda_image,
    requirements_from_env,
)

DEVICES_KEY = "devices.nri-accel.io"
CAPABILITIES_KEY = "capabilities.nri-accel.io"
# Container annotations nri-accel's device plugin returns from Allocate, one key per
# resource (kubelet keeps only the first value of a key repeated across resources).
GRANT_KEY_PREFIX = DEVICES_KEY + "/resource."
INJECTOR_CDI_KEYS = ("cdi-devices.noderesource.dev", "cdi-devices.nri.io")  # new, deprecated
CDI_PREFIXES = ("cdi.k8s.io/", "nvidia.cdi.k8s.io/")
_PLUGIN_KEY_PREFIXES = (DEVICES_KEY + "/", CAPABILITIES_KEY + "/")

ENV_VISIBLE = "NVIDIA_VISIBLE_DEVICES"
ENV_NV_GPU = "NV_GPU"
ENV_CAPABILITIES = "NVIDIA_DRIVER_CAPABILITIES"
ENV_MIG_CONFIG = "NVIDIA_MIG_CONFIG_DEVICES"
ENV_MIG_MONITOR = "NVIDIA_MIG_MONITOR_DEVICES"
ENV_NEURON = "AWS_NEURON_VISIBLE_DEVICES"
_READ_ENV = frozenset({ENV_VISIBLE, ENV_NV_GPU, ENV_CAPABILITIES, ENV_MIG_CONFIG,
                       ENV_MIG_MONITOR, ENV_NEURON, "CUDA_VERSION", "NVIDIA_DISABLE_REQUIRE"})
# Entries of the env that nri-accel reads: those of _READ_ENV and NVIDIA_REQUIRE_*.
_READ_ENV_PREFIXES = (*(f"{n}=" for n in sorted(_READ_ENV)), REQUIRE_PREFIX)

# libnvidia-container / nvidia-container-toolkit driver capabilities.
ALL_CAPABILITIES = frozenset(
    {"compute", "compat32", "graphics", "utility", "video", "display", "ngx"})
DEFAULT_CAPABILITIES = frozenset({"utility", "compute"})

MAX_VALUE_BYTES = 4096
MAX_IDS = 256
# All the env entries nri-accel reads together (an image may define any number of
# NVIDIA_REQUIRE_* variables): bounds the parse time and what the memo keeps per env.
MAX_ENV_READ_CHARS = 4 * MAX_VALUE_BYTES
MAX_NAME_CHARS = 253  # longest annotation key or variable name shown as it is in a source

# Device ids are names, never paths: index, GPU-/MIG- UUID, PCI bus id, "0:1", CDI name;
# all in CDI's device-name syntax (inventory.DEVICE_NAME_RE), at most _MAX_ID_CHARS long.
_MAX_ID_CHARS = 128
# The one id with '/': R450-era MIG UUIDs, MIG-GPU-<gpu uuid>/<gi>/<ci>.
_LEGACY_MIG_RE = re.compile(r"MIG-GPU-[0-9A-Fa-f-]{36}/[0-9]{1,3}/[0-9]{1,3}")
_RANGE_RE = re.compile(r"([0-9]+)-([0-9]+)")
_MAX_RANGE_DIGITS = 6
_COUNT_RE = re.compile(r"[0-9]{1,6}")
_CONTROL_RE = re.compile(r"[\x00-\x1f\x7f-\x9f]")
_CONTROL_EXCEPT_NL_RE = re.compile(r"[\x00-\x09\x0b-\x1f\x7f-\x9f]")
_ENTRY_SPLIT_RE = re.compile(r"[;\n]")


@dataclass(frozen=True, slots=True)
class ContainerInfo:
    """Plain data about one container; nri/convert.py builds it from NRI protobuf,
    explain from a Pod manifest."""

    namespace: str
    pod_name: str
    pod_uid: str
    container_name: str
    container_id: str
    pod_annotations: Mapping[str, str]
    container_annotations: Mapping[str, str]
    env: tuple[str, ...]  # "KEY=VALUE" as in the container spec (image env + pod env)
    device_paths: frozenset[str] = frozenset()  # device nodes already in the spec
    mount_destinations: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class DeviceClaim:
    """Devices of one kind that one source names.

    Exactly one form: `ids` (as written, ranges expanded, duplicates dropped, order
    kept), `count` (N devices the allocator picks) or `all`. A limit with `count` means
    "at most N of the devices granted for that vendor" (inventory.vendor_of: the part of the
    kind before "/", so nvidia.com covers GPUs and MIG devices).
    """

    kind: str  # "nvidia.com/gpu", "nvidia.com/mig", "aws.amazon.com/neuron", "vendor/class"
    ids: tuple[str, ...] = ()
    count: int | None = None
    all: bool = False
    source: str = ""  # 'annotation devices.nri-accel.io/pod', 'env NVIDIA_VISIBLE_DEVICES'
    cdi: bool = False  # a CDI request (cdi.k8s.io, ...): its names are in Request.cdi_names

    @property
    def vendor(self) -> str:
        return vendor_of(self.kind)


@dataclass(frozen=True, slots=True)
class Request:
    """What one container gets asked for, after the trust policy.

    Limits narrow the grants of the same vendor: the devices granted for a vendor are
    intersected with the devices that vendor's limits name (a count limit keeps at most
    N). `nvidia_none` drops every nvidia.com device but keeps the driver. Granted CDI
    requests are claims with `cdi` set and, as written, in `cdi_names` (handed to the
    runtime instead when it resolves CDI itself). `notes` say which requests were
    ignored and why, for the canonical log line.
    """

    grants: tuple[DeviceClaim, ...] = ()
    limits: tuple[DeviceClaim, ...] = ()
    nvidia_none: bool = False  # NVIDIA_VISIBLE_DEVICES=none: driver files, no GPU
    capabilities: frozenset[str] = DEFAULT_CAPABILITIES
    capabilities_source: str = ""  # "" = the default (utility,compute)
    requirements: Requirements | None = None
    mig_config: bool = False  # NVIDIA_MIG_CONFIG_DEVICES=all, from a granting source
    mig_monitor: bool = False
    cdi_names: tuple[str, ...] = ()  # granted CDI requests as written ("vendor/class=name")
    notes: tuple[str, ...] = ()


# ---- parse_request ---------------------------------------------------------------------

@dataclass(frozen=True, slots=True)
class _Source:
    """One request source before the policy: its claims and what else it asks."""

    origin: Origin
    name: str  # "annotation devices.nri-accel.io/pod", "env NVIDIA_VISIBLE_DEVICES"
    claims: tuple[DeviceClaim, ...]
    text: str = ""  # the value, for notes
    nvidia_none: bool = False


@dataclass(frozen=True, slots=True)
class _EnvPart:
    """Everything the env alone decides (memoised per env: containers of one image and
    pod spec share it)."""

    sources: tuple[_Source, ...]
    requirements: Requirements | None
    capabilities: tuple[str, str] | None  # (source, value) of NVIDIA_DRIVER_CAPABILITIES
    legacy: bool  # CUDA_VERSION without NVIDIA_REQUIRE_CUDA
    mig_config: bool  # NVIDIA_MIG_CONFIG_DEVICES=all
    mig_monitor: bool


def parse_request(info: ContainerInfo, policy: Policy) -> Request:
    """Parse `info`'s annotations and env and apply `policy`.

    Raises RequestError (malformed value) or PolicyError (refused request), both with
    `source` naming the annotation key or env variable.
    """
    env = _env_part(info.env)
    trusted, demoted = _container_sources(info)
    ranked = (trusted, _pod_sources(info) + demoted, env.sources)

    grants: list[DeviceClaim] = []
    limits: list[DeviceClaim] = []
    notes: list[str] = []
    nvidia_none = False
    granted_vendors: set[str] = set()  # by the ranks above the current one
    for sources in ranked:
        rank_vendors: set[str] = set()
        for src in sources:
            by_vendor: dict[str, list[DeviceClaim]] = {}
            for c in src.claims:
                by_vendor.setdefault(c.vendor, []).append(c)
            if src.nvidia_none:
                by_vendor.setdefault(NVIDIA_VENDOR, [])
            for vendor in sorted(by_vendor):
                verdict = policy.decide(src.origin, info.namespace,
                                        vendor_granted=vendor in granted_vendors)
                mine = by_vendor[vendor]
                none_here = src.nvidia_none and vendor == NVIDIA_VENDOR
                if verdict is Verdict.GRANT:
                    grants.extend(mine)
                    rank_vendors.add(vendor)
                    nvidia_none = nvidia_none or none_here
                elif verdict is Verdict.LIMIT:
                    # "all" narrows nothing; "none" narrows the vendor's grants to nothing.
                    limits.extend(c for c in mine if not c.all)
                    nvidia_none = nvidia_none or none_here
                elif verdict is Verdict.REFUSE:
                    raise PolicyError(policy.reason(src.origin, info.namespace),
                                      source=src.name)
                else:
                    shown = src.text if len(src.text) <= 64 else src.text[:61] + "..."
                    notes.append(f"{src.name}={shown} not granted: "
                                 f"{policy.reason(src.origin, info.namespace)}")
        granted_vendors |= rank_vendors

    for var, asked in ((ENV_MIG_CONFIG, env.mig_config), (ENV_MIG_MONITOR, env.mig_monitor)):
        # Toolkit: refused in an unprivileged container; here, where env may not grant.
        if asked and not policy.may_grant(Origin.ENV, info.namespace):
            raise PolicyError(policy.reason(Origin.ENV, info.namespace), source=f"env {var}")
    capabilities, capabilities_source = _capabilities(info, env)
    return Request(
        grants=tuple(sorted(grants, key=_claim_order)),
        limits=tuple(sorted(limits, key=_claim_order)),
        nvidia_none=nvidia_none,
        capabilities=capabilities,
        capabilities_source=capabilities_source,
        requirements=env.requirements,
        mig_config=env.mig_config,
        mig_monitor=env.mig_monitor,
        cdi_names=tuple(sorted({f"{c.kind}={i}" for c in grants if c.cdi
                                for i in (c.ids or ("all",))})),
        notes=tuple(dict.fromkeys(notes)),
    )


def _claim_order(c: DeviceClaim) -> tuple[str, str, tuple[str, ...]]:
    return (c.kind, c.source, c.ids)


# ---- sources ---------------------------------------------------------------------------

def _container_sources(info: ContainerInfo) -> tuple[tuple[_Source, ...], tuple[_Source, ...]]:
    """Container annotations: kubelet's (trusted), and those whose key the pod also
    carries with another value (ranked and trusted as pod annotations)."""
    trusted: list[_Source] = []
    demoted: list[_Source] = []
    for key in sorted(info.container_annotations):
        is_devices = key == DEVICES_KEY or key.startswith(GRANT_KEY_PREFIX)
        if not is_devices and not key.startswith(CDI_PREFIXES):
            continue
        value = info.container_annotations[key]
        if Policy.container_annotation_trusted(key, info.pod_annotations):
            origin, name, out = Origin.CONTAINER, _named("container annotation", key), trusted
        elif value == info.pod_annotations[key]:
            continue  # the runtime's copy of a pod annotation, parsed with the pod's
        else:
            origin = Origin.POD
            name = _named("container annotation", key) + " (also set on the pod)"
            out = demoted
        claims = _parse_devices(value, name) if is_devices else _parse_cdi_value(value, name)
        out.append(_Source(origin, name, claims, value))
    return tuple(trusted), tuple(demoted)


def _pod_sources(info: ContainerInfo) -> tuple[_Source, ...]:
    pods = info.pod_annotations
    cdi_keys = []
    for key in sorted(pods):
        if key.startswith(_PLUGIN_KEY_PREFIXES):
            _check_plugin_key(key)
        elif key.startswith(CDI_PREFIXES):
            cdi_keys.append(key)
    out: list[_Source] = []
    key = _first_present(pods, (DEVICES_KEY,), info.container_name)
    if key is not None:
        name = _named("annotation", key)
        out.append(_Source(Origin.POD, name, _parse_devices(pods[key], name), pods[key]))
    key = _first_present(pods, INJECTOR_CDI_KEYS, info.container_name)
    if key is not None:
        name = _named("annotation", key)
        out.append(_Source(Origin.POD, name, _parse_injector_cdi(pods[key], name), pods[key]))
    for key in cdi_keys:
        name = _named("annotation", key)
        out.append(_Source(Origin.POD, name, _parse_cdi_value(pods[key], name), pods[key]))
    return tuple(out)


def _env_part(env: tuple[str, ...]) -> _EnvPart:
    """The env's requests. The memo keeps a small env as it is (the common case, and the
    fastest); of a larger one only the entries nri-accel reads, so whatever else the
    image or pod defines (LD_LIBRARY_PATH, ...) is never kept."""
    if sum(map(len, env)) <= MAX_ENV_READ_CHARS:
        return _read_env_part(env)
    read = tuple(kv for kv in env if kv.startswith(_READ_ENV_PREFIXES))
    if sum(map(len, read)) > MAX_ENV_READ_CHARS:
        name = max(read, key=len).partition("=")[0]
        raise RequestError(f"the variables nri-accel reads ({', '.join(sorted(_READ_ENV))}, "
                           f"{REQUIRE_PREFIX}*) hold more than {MAX_ENV_READ_CHARS} "
                           "characters in all", source=_named("env", name))
    return _read_env_part(read)


@lru_cache(maxsize=1024)
def _read_env_part(env: tuple[str, ...]) -> _EnvPart:
    """_env_part(), memoised. OCI env semantics: the last definition of a name wins;
    entries without '=' are not variables. The variables nri-accel reads are checked for
    size and control characters (their names too); other variables (LD_PRELOAD, ...)
    are never looked at."""
    values: dict[str, str] = {}
    for kv in env:
        k, eq, v = kv.partition("=")
        if eq:
            values[k] = v
    for k, v in values.items():
        if k not in _READ_ENV and not k.startswith(REQUIRE_PREFIX):
            continue
        if len(k) > MAX_NAME_CHARS or _CONTROL_RE.search(k):
            raise RequestError("variable name with control characters or longer than "
                               f"{MAX_NAME_CHARS} characters", source=_named("env", k))
        _check_text(v, f"env {k}")
    sources = []
    visible = _visible_devices(values)
    if visible is not None:
        sources.append(visible)
    neuron = values.get(ENV_NEURON, "")
    if neuron.strip():
        name = f"env {ENV_NEURON}"
        sources.append(_Source(Origin.ENV, name, _parse_neuron(neuron, name), neuron))
    caps = values.get(ENV_CAPABILITIES)
    return _EnvPart(
        sources=tuple(sources),
        requirements=requirements_from_env(values),
        capabilities=None if caps is None else (f"env {ENV_CAPABILITIES}", caps),
        legacy=legacy_cuda_image(values),
        mig_config=_mig_caps(values, ENV_MIG_CONFIG),
        mig_monitor=_mig_caps(values, ENV_MIG_MONITOR),
    )


def _first_present(annotations: Mapping[str, str], prefixes: Iterable[str],
                   container: str) -> str | None:
    """The NRI precedence: <p>/container.<name> > <p>/pod > <p>, for each prefix in turn
    per level (new key before its deprecated alias)."""
    prefixes = tuple(prefixes)
    for suffix in (f"/container.{container}", "/pod", ""):
        for p in prefixes:
            if p + suffix in annotations:
                return p + suffix
    return None


def _check_plugin_key(key: str) -> None:
    """Refuse misspelt keys in our own prefixes rather than ignore them."""
    prefix, _, rest = key.partition("/")
    if rest != "pod" and not (rest.startswith("container.") and len(rest) > 10):
        raise RequestError(f"unknown key (use {prefix}/container.<name>, {prefix}/pod "
                           f"or {prefix})", source=_named("annotation", key))


# ---- value syntax ----------------------------------------------------------------------

def _named(what: str, name: str) -> str:
    """The source naming annotation key or variable `name` ("annotation cdi.k8s.io/x").
    Sources are logged and sent back to the runtime: a name with control characters or
    longer than MAX_NAME_CHARS is shown escaped and cut."""
    if len(name) <= MAX_NAME_CHARS and not _CONTROL_RE.search(name):
        return f"{what} {name}"
    return f"{what} {name[:64]!r}..."


def _check_text(value: str, source: str, *, newlines: bool = False) -> None:
    """Refuse values over MAX_VALUE_BYTES and control characters (newline only where
    the grammar uses it as a separator)."""
    if len(value) > MAX_VALUE_BYTES or len(value.encode("utf-8", "replace")) > MAX_VALUE_BYTES:
        raise RequestError(f"value is longer than {MAX_VALUE_BYTES} bytes", source=source)
    if (_CONTROL_EXCEPT_NL_RE if newlines else _CONTROL_RE).search(value):
        raise RequestError("control characters are not allowed", source=source)


class _Claims:
    """Accumulates one source's claims per kind and refuses conflicting forms."""

    def __init__(self, source: str, *, cdi: bool = False) -> None:
        self.source = source
        self.cdi = cdi
        self.ids: dict[str, dict[str, None]] = {}
        self.counts: dict[str, int] = {}
        self.alls: set[str] = set()
        self.n_ids = 0

    def add_id(self, kind: str, ident: str) -> None:
        if ident == "all":
            if self.ids.get(kind) or kind in self.counts:
                self._conflict(kind)
            self.alls.add(kind)
            return
        if kind in self.alls or kind in self.counts:
            self._conflict(kind)
        ids = self.ids.setdefault(kind, {})
        if ident not in ids:
            self.n_ids += 1
            if self.n_ids > MAX_IDS:
                raise RequestError(f"more than {MAX_IDS} device ids", source=self.source)
            ids[ident] = None

    def add_count(self, kind: str, count: int) -> None:
        if self.ids.get(kind) or kind in self.alls or self.counts.get(kind, count) != count:
            self._conflict(kind)
        self.counts[kind] = count

    def _conflict(self, kind: str) -> None:
        raise RequestError(f"{kind} is requested in conflicting forms (ids, 'all' and a "
                           "count exclude each other)", source=self.source)

    def claims(self) -> tuple[DeviceClaim, ...]:
        out = [DeviceClaim(k, ids=tuple(v), source=self.source, cdi=self.cdi)
               for k, v in self.ids.items()]
        out += [DeviceClaim(k, count=n, source=self.source) for k, n in self.counts.items()]
        out += [DeviceClaim(k, all=True, source=self.source, cdi=self.cdi) for k in self.alls]
        return tuple(sorted(out, key=_claim_order))


def _check_kind(kind: str, source: str) -> str:
    if not KIND_RE.fullmatch(kind):
        raise RequestError(f"invalid device kind {kind!r}: expected vendor/class such as "
                           "nvidia.com/gpu", source=source)
    return kind


def _check_id(ident: str, source: str) -> str:
    if not ident:
        raise RequestError("empty device id", source=source)
    if not ((len(ident) <= _MAX_ID_CHARS and DEVICE_NAME_RE.fullmatch(ident))
            or _LEGACY_MIG_RE.fullmatch(ident)):
        raise RequestError(f"invalid device id {ident!r}: ids are names such as 0, "
                           "GPU-<uuid>, 0:1 or 0000:3b:00.0, never paths", source=source)
    return ident


def _add_ids(acc: _Claims, kind: str, token: str, *, ranges: bool) -> None:
    m = _RANGE_RE.fullmatch(token) if ranges else None
    if m is None:
        acc.add_id(kind, _check_id(token, acc.source))
        return
    if max(len(m.group(1)), len(m.group(2))) > _MAX_RANGE_DIGITS:
        raise RequestError(f"range {token[:32]!r} is too large", source=acc.source)
    first, last = int(m.group(1)), int(m.group(2))
    if first > last:
        raise RequestError(f"reversed range {token!r}", source=acc.source)
    if last - first >= MAX_IDS:
        raise RequestError(f"range {token!r} names more than {MAX_IDS} devices",
                           source=acc.source)
    for n in range(first, last + 1):
        acc.add_id(kind, str(n))


# The value parsers are pure and memoised: a pod's annotations repeat for each of its
# containers and across the replicas of a workload. Errors are not memoised.
@lru_cache(maxsize=4096)
def _parse_devices(value: str, source: str) -> tuple[DeviceClaim, ...]:
    """The devices.nri-accel.io grammar (README.md, "Requesting devices"): entries
    separated by ';' or newlines; an entry is ``KIND=ID[,ID...]`` (a token with '='
    starts a new kind) or ``KIND: N``. An empty value asks for nothing."""
    _check_text(value, source, newlines=True)
    acc = _Claims(source)
    for raw in _ENTRY_SPLIT_RE.split(value):
        entry = raw.strip()
        if not entry:
            continue
        if "=" in entry:
            kind = ""
            for raw_token in entry.split(","):
                token = raw_token.strip()
                if "=" in token:
                    k, _, token = token.partition("=")
                    kind = _check_kind(k.strip(), source)
                    token = token.strip()
                elif not kind:
                    raise RequestError(f"id {token!r} has no kind: write KIND=ID such as "
                                       f"nvidia.com/gpu={token}", source=source)
                _add_ids(acc, kind, token, ranges=True)
        elif ":" in entry:
            k, _, n = entry.partition(":")
            kind = _check_kind(k.strip(), source)
            n = n.strip()
            if not _COUNT_RE.fullmatch(n) or not 1 <= int(n) <= MAX_IDS:
                raise RequestError(f"invalid count {n!r} for {kind}: expected a number from "
                                   f"1 to {MAX_IDS}", source=source)
            acc.add_count(kind, int(n))
        else:
            raise RequestError(f"invalid entry {entry!r}: expected KIND=ID[,ID...] or "
                               "KIND: COUNT", source=source)
    return acc.claims()


@lru_cache(maxsize=4096)
def _parse_cdi_value(value: str, source: str) -> tuple[DeviceClaim, ...]:
    """A CDI annotation value (cdi.k8s.io/*): comma-separated fully qualified names, as
    tags.cncf.io/container-device-interface pkg/cdi/producer/annotations Parse() reads
    it: no blanks, every name vendor/class=name, an empty value is an error."""
    _check_text(value, source)
    return _parse_cdi_list(value.split(","), source)


def _parse_cdi_list(names: Iterable[str], source: str) -> tuple[DeviceClaim, ...]:
    acc = _Claims(source, cdi=True)
    for name in names:
        kind, eq, ident = name.partition("=")
        if not eq:
            raise RequestError(f"invalid CDI device name {name!r}: expected vendor/class=name",
                               source=source)
        acc.add_id(_check_kind(kind, source), _check_id(ident, source))
    return acc.claims()


@lru_cache(maxsize=1024)
def _parse_injector_cdi(value: str, source: str) -> tuple[DeviceClaim, ...]:
    """containerd/nri device-injector's CDI annotation: a YAML list of CDI names."""
    _check_text(value, source, newlines=True)
    if not value.strip():
        return ()
    try:
        names = yaml.safe_load(value)
    except yaml.YAMLError as e:
        raise RequestError(f"not a YAML list of CDI device names: {e}", source=source) from e
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise RequestError("expected a YAML list of CDI device names such as "
                           "'- vendor.com/device=dev0'", source=source)
    return _parse_cdi_list(names, source)


def _visible_devices(env: Mapping[str, str]) -> _Source | None:
    """NVIDIA_VISIBLE_DEVICES as nvidia-container-toolkit reads it (internal/config/image):
    comma-separated, blanks trimmed, empty tokens skipped; void (or empty or unset) means
    no GPU and no driver, none means the driver without a GPU, all means every GPU, with
    void > none > all when mixed. Unset in a legacy image (CUDA_VERSION without
    NVIDIA_REQUIRE_CUDA) means all. NV_GPU (nvidia-docker 2 wrapper: ids separated by
    blanks or commas) is read when NVIDIA_VISIBLE_DEVICES is unset."""
    if ENV_VISIBLE in env:
        var, value = ENV_VISIBLE, env[ENV_VISIBLE]
        tokens = value.split(",")
    elif env.get(ENV_NV_GPU, "").strip():
        var, value = ENV_NV_GPU, env[ENV_NV_GPU]
        tokens = value.replace(" ", ",").split(",")
    elif legacy_cuda_image(env):
        return _Source(Origin.ENV, f"env {ENV_VISIBLE}", (DeviceClaim(
            KIND_GPU, all=True, source=f"env {ENV_VISIBLE} (unset in a legacy CUDA image)"),),
            "(unset, legacy CUDA_VERSION image)")
    else:
        return None
    name = f"env {var}"
    tokens = [t.strip() for t in tokens if t.strip()]
    if not tokens or "void" in tokens:
        return None
    if "none" in tokens:
        return _Source(Origin.ENV, name, (), value, nvidia_none=True)
    if "all" in tokens:
        return _Source(Origin.ENV, name, (DeviceClaim(KIND_GPU, all=True, source=name),), value)
    acc = _Claims(name)
    for token in tokens:
        kind, eq, ident = token.partition("=")
        if eq:  # a CDI qualified name, as the toolkit accepts in CDI mode
            acc.add_id(_check_kind(kind, name), _check_id(ident, name))
        else:
            acc.add_id(KIND_GPU, _check_id(token, name))
    return _Source(Origin.ENV, name, acc.claims(), value)


def _parse_neuron(value: str, source: str) -> tuple[DeviceClaim, ...]:
    """AWS_NEURON_VISIBLE_DEVICES (aws-neuron-sdk containers docs): ALL (any case), or a
    comma-separated list of logical device ids and ranges such as 0-3. As with
    NVIDIA_VISIBLE_DEVICES, "all" wins over ids listed beside it."""
    tokens = [t.strip() for t in value.split(",") if t.strip()]
    if any(t.lower() == "all" for t in tokens):
        return (DeviceClaim(KIND_NEURON, all=True, source=source),)
    acc = _Claims(source)
    for token in tokens:
        _add_ids(acc, KIND_NEURON, token, ranges=True)
    return acc.claims()


def _capabilities(info: ContainerInfo, env: _EnvPart) -> tuple[frozenset[str], str]:
    """capabilities.nri-accel.io (NRI precedence) over NVIDIA_DRIVER_CAPABILITIES; unset in
    a legacy image -> all; else utility,compute."""
    key = _first_present(info.pod_annotations, (CAPABILITIES_KEY,), info.container_name)
    if key is not None:
        return _parse_capabilities(info.pod_annotations[key], _named("annotation", key))
    if env.capabilities is not None:
        return _parse_capabilities(env.capabilities[1], env.capabilities[0])
    if env.legacy:
        return ALL_CAPABILITIES, "env CUDA_VERSION (legacy image: all capabilities)"
    return DEFAULT_CAPABILITIES, ""


@lru_cache(maxsize=256)
def _parse_capabilities(value: str, source: str) -> tuple[frozenset[str], str]:
    """Toolkit semantics (cmd/nvidia-container-runtime-hook getDriverCapabilities): comma
    separated, blanks trimmed; empty -> utility,compute; "all" -> every capability;
    unknown names are refused."""
    _check_text(value, source)
    names = {t.strip() for t in value.split(",")} - {""}
    if not names:
        return DEFAULT_CAPABILITIES, source
    unknown = sorted(names - ALL_CAPABILITIES - {"all"})
    if unknown:
        raise RequestError(f"unknown driver capabilities {', '.join(unknown)} (known: all, "
                           f"{', '.join(sorted(ALL_CAPABILITIES))})", source=source)
    return (ALL_CAPABILITIES if "all" in names else frozenset(names)), source


def _mig_caps(env: Mapping[str, str], var: str) -> bool:
    """NVIDIA_MIG_CONFIG_DEVICES / NVIDIA_MIG_MONITOR_DEVICES: "" asks nothing, "all" asks
    for the capability, other values are refused, as in nvidia-container-toolkit
    (migCapsDevices.Validate). parse_request refuses it where env may not grant (the
    toolkit: in an unprivileged container); select.py refuses it beside specific MIG
    devices, which needs the selection."""
    value = env.get(var, "")
    if value not in ("", "all"):
        raise RequestError(f"only 'all' is supported, not {value!r}", source=f"env {var}")
    return value == "all"
