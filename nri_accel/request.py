"""What one container asks for: its annotations and env parsed into sources, no trust.

Owns: Origin, Source, Parsed, parse() and the syntax of every annotation nri-accel reads
(the user-facing reference is README.md, "Requesting devices"). The env grammars are the
vendor profiles' (nri_accel.vendors): parse() hands each family the variables it reads.
Imports the standard library, msgspec, PyYAML (the NRI device-injector's YAML list annotation:
only when a pod carries one, so `run` starts without it), nri_accel.container,
nri_accel.errors, nri_accel.syntax and nri_accel.vendors. Pure: no I/O, no logging, same
input -> same Parsed. Who may grant what is decided by nri_accel.policy from what this
returns.

Sources, in the order returned:

1. container annotations (Origin.CONTAINER): ``devices.nri-accel.io`` and
   ``devices.nri-accel.io/resource.<resource>`` (written by nri-accel's device plugin
   through kubelet) and CDI requests ``cdi.k8s.io/*``, ``nvidia.cdi.k8s.io/*``. A
   container annotation whose key and value the pod carries too is the runtime's copy of
   the pod's (CRI-O copies them all) and is parsed with the pod's; one whose key the pod
   carries with another value is marked `also_on_pod`;
2. pod annotations (Origin.POD): ``devices.nri-accel.io/container.<name>`` >
   ``devices.nri-accel.io/pod`` > ``devices.nri-accel.io`` (the first present is used, as
   in containerd/nri plugins/device-injector), the device-injector's CDI key
   ``cdi-devices.noderesource.dev`` (same precedence, YAML list of CDI names) and
   ``cdi.k8s.io/*`` / ``nvidia.cdi.k8s.io/*`` set on the pod;
3. env (Origin.ENV): each family's variables (NVIDIA_VISIBLE_DEVICES, NV_GPU,
   AWS_NEURON_VISIBLE_DEVICES, ...), read by the family's read_env().

A family's option annotation (NVIDIA's ``capabilities.nri-accel.io``, same precedence)
and the rest of its env reading (driver capabilities, NVIDIA_REQUIRE_*) only select
driver files and add checks: they are handed on as the family's options.

Every value is text from whoever wrote the pod or image: it is size-limited (each value,
and the env variables read taken together), control characters are refused, ids are
names (never paths) and every error names its source (nri_accel.syntax). Variables no
family reads (LD_PRELOAD, LD_LIBRARY_PATH, ...) are never looked at, nor kept in a memo.
The annotations nri-accel writes to record a grant are refused on the way in: a forged
record could make a restarted plugin hold devices no one has, or free some still in use.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Hashable, Iterable, Mapping
from functools import lru_cache
from operator import methodcaller

from msgspec import Struct

from nri_accel.container import ContainerInfo
from nri_accel.errors import RequestError
from nri_accel.syntax import (
    MAX_IDS,
    MAX_VALUE_BYTES,
    ClaimSet,
    DeviceClaim,
    bad_name,
    check_id,
    check_kind,
    check_text,
    named,
)
from nri_accel.vendors import PROFILES, family_of
from nri_accel.vendors.base import NO_ASK, EnvAsk

DEVICES_KEY = "devices.nri-accel.io"
# Container annotations nri-accel's device plugin returns from Allocate, one key per
# resource (kubelet keeps only the first value of a key repeated across resources).
GRANT_KEY_PREFIX = DEVICES_KEY + "/resource."
INJECTOR_CDI_KEYS = ("cdi-devices.noderesource.dev", "cdi-devices.nri.io")  # new, deprecated
CDI_PREFIXES = ("cdi.k8s.io/", "nvidia.cdi.k8s.io/")
# What nri-accel writes on a container it grants devices to (nri_accel.engine).
ANNOTATION_GRANTED = "nri-accel.io/granted"
ANNOTATION_SHARED = "nri-accel.io/shared"
RESERVED_KEYS = (ANNOTATION_GRANTED, ANNOTATION_SHARED)

_OPTION_KEYS = tuple(p.option_key for p in PROFILES if p.option_key)
_PLUGIN_KEY_PREFIXES = tuple(k + "/" for k in (DEVICES_KEY, *_OPTION_KEYS))
_READ_ENV = frozenset(n for p in PROFILES for n in p.env_names)
_READ_ENV_PREFIXES = tuple(x for p in PROFILES for x in p.env_prefixes)
# Entries of the env that some family reads.
_READ_ENTRY_PREFIXES = (*(f"{n}=" for n in sorted(_READ_ENV)), *_READ_ENV_PREFIXES)
_IS_READ_ENTRY = methodcaller("startswith", _READ_ENTRY_PREFIXES)
ENV_PREFIXES = _READ_ENTRY_PREFIXES
"""Every env entry parse() reads starts with one of these ("NAME=", or a family's name
prefix such as "NVIDIA_REQUIRE_")."""
ANNOTATION_PREFIXES = tuple(sorted({DEVICES_KEY, *_OPTION_KEYS, *INJECTOR_CDI_KEYS,
                                    *CDI_PREFIXES, *RESERVED_KEYS}))
"""Every annotation key parse() reads or refuses, on the pod or the container, starts
with one of these. A container whose annotations and env (ENV_PREFIXES) have none asks
for nothing: parse() would return an empty Parsed (nri_accel.plugin answers it at once)."""
_IS_PARSED_KEY = methodcaller("startswith", ANNOTATION_PREFIXES)
# All the env entries nri-accel reads together (an image may define any number of
# NVIDIA_REQUIRE_* variables): bounds the parse time and what the memo keeps per env.
MAX_ENV_READ_CHARS = 4 * MAX_VALUE_BYTES

_DEFAULT_SETTINGS = {p.name: p.settings(NO_ASK, None) for p in PROFILES}
_COUNT_RE = re.compile(r"[0-9]{1,6}")
_MAX_YAML_COLLECTIONS = 64  # '[' and '{' in the injector's YAML list (it needs one at most)
_ENTRY_SPLIT_RE = re.compile(r"[;\n]")


class Origin(enum.Enum):
    """Where a request's text comes from; the value reads well in messages."""

    CONTAINER = "container annotations"
    POD = "pod annotations"
    ENV = "env requests"


class Source(Struct, frozen=True):
    """One request source: its claims and what else it asks."""

    origin: Origin
    name: str  # "annotation devices.nri-accel.io/pod", "env NVIDIA_VISIBLE_DEVICES"
    claims: tuple[DeviceClaim, ...]
    text: str = ""  # the value, for notes
    drivers_only: frozenset[str] = frozenset()  # vendors asked for their driver alone
    also_on_pod: bool = False  # a container annotation the pod sets with another value


class Parsed(Struct, frozen=True):
    """Everything one container asks, before the trust policy."""

    sources: tuple[Source, ...]  # container annotations, pod annotations, env
    privileged: tuple[str, ...] = ()  # env asks only a granting origin may make
    options: tuple[tuple[str, Hashable], ...] = ()  # (family, options) where not default
    visible: frozenset[str] = frozenset()  # families whose visibility variable env sets


class _EnvPart(Struct, frozen=True):
    """Everything the env alone decides (memoised per env: containers of one image and
    pod spec share it)."""

    sources: tuple[Source, ...]
    asks: tuple[tuple[str, EnvAsk], ...]  # (family, its reading) where not empty


def read_by_parse(info: ContainerInfo) -> tuple[Hashable, ...]:
    """Everything of `info` that parse() reads, as a hashable key: the container's name,
    the annotations whose key starts with one of ANNOTATION_PREFIXES (pod's, then the
    container's) and the env entries starting with one of ENV_PREFIXES. Two containers
    with equal keys parse alike (or fail alike); the key holds nothing else of them."""
    starts = _IS_PARSED_KEY
    return (info.container_name,
            tuple(sorted(kv for kv in info.pod_annotations.items() if starts(kv[0]))),
            tuple(sorted(kv for kv in info.container_annotations.items() if starts(kv[0]))),
            tuple(filter(_IS_READ_ENTRY, info.env)))


def parse(info: ContainerInfo) -> Parsed:
    """Parse `info`'s annotations and env. Raises RequestError (source: the annotation
    key or env variable) for a malformed value."""
    for key in RESERVED_KEYS:
        for where, carried in (("annotation", info.pod_annotations),
                               ("container annotation", info.container_annotations)):
            if key in carried:
                raise RequestError("reserved: nri-accel records there what it granted, "
                                   "remove it", source=f"{where} {key}")
    env = _env_part(info.env)
    sources = (*_container_sources(info), *_pod_sources(info), *env.sources)
    asks = dict(env.asks)
    options = []
    for profile in PROFILES:
        ask = asks.get(profile.name, NO_ASK)
        option = None
        if profile.option_key:
            key = first_present(info.pod_annotations, (profile.option_key,),
                                info.container_name)
            if key is not None:
                option = profile.read_option(info.pod_annotations[key], named("annotation", key))
        if ask is NO_ASK and option is None:
            continue
        settings = profile.settings(ask, option)
        if settings != _DEFAULT_SETTINGS[profile.name]:
            options.append((profile.name, settings))
    return Parsed(
        sources=sources,
        privileged=tuple(s for _, ask in env.asks for s in ask.privileged),
        options=tuple(options),
        visible=frozenset(name for name, ask in env.asks if ask.visible),
    )


# ---- annotation sources ----------------------------------------------------------------

def _container_sources(info: ContainerInfo) -> list[Source]:
    out = []
    pods = info.pod_annotations
    for key in sorted(info.container_annotations):
        is_devices = key == DEVICES_KEY or key.startswith(GRANT_KEY_PREFIX)
        if not is_devices and not key.startswith(CDI_PREFIXES):
            continue
        value = info.container_annotations[key]
        if key in pods and pods[key] == value:
            continue  # the runtime's copy of a pod annotation, parsed with the pod's
        name = named("container annotation", key)
        if key in pods:
            name += " (also set on the pod)"
        claims = _parse_devices(value, name) if is_devices else _parse_cdi_value(value, name)
        out.append(Source(Origin.CONTAINER, name, claims, value, also_on_pod=key in pods))
    return out


def _pod_sources(info: ContainerInfo) -> list[Source]:
    pods = info.pod_annotations
    cdi_keys = []
    for key in sorted(pods):
        if key.startswith(_PLUGIN_KEY_PREFIXES):
            _check_plugin_key(key, info.container_name)
        elif key.startswith(CDI_PREFIXES):
            cdi_keys.append(key)
    out: list[Source] = []
    key = first_present(pods, (DEVICES_KEY,), info.container_name)
    if key is not None:
        name = named("annotation", key)
        out.append(Source(Origin.POD, name, _parse_devices(pods[key], name), pods[key]))
    key = first_present(pods, INJECTOR_CDI_KEYS, info.container_name)
    if key is not None:
        name = named("annotation", key)
        out.append(Source(Origin.POD, name, _parse_injector_cdi(pods[key], name), pods[key]))
    for key in cdi_keys:
        name = named("annotation", key)
        out.append(Source(Origin.POD, name, _parse_cdi_value(pods[key], name), pods[key]))
    return out


def first_present(annotations: Mapping[str, str], prefixes: Iterable[str],
                  container: str) -> str | None:
    """The NRI precedence: <p>/container.<name> > <p>/pod > <p>, for each prefix in turn
    per level (new key before its deprecated alias)."""
    prefixes = tuple(prefixes)
    suffixes = (f"/container.{container}", "/pod", "") if container else ("/pod", "")
    for suffix in suffixes:
        for p in prefixes:
            if p + suffix in annotations:
                return p + suffix
    return None


def _check_plugin_key(key: str, container: str) -> None:
    """Refuse misspelt keys in our own prefixes rather than ignore them, and per-container
    keys for a container the runtime gave no name (CRI-O names a container from its
    io.kubernetes.container.name label, and nri.convert falls back to the CRI metadata):
    which container they mean cannot be known."""
    prefix, _, rest = key.partition("/")
    if rest != "pod" and not (rest.startswith("container.") and len(rest) > 10):
        raise RequestError(f"unknown key (use {prefix}/container.<name>, {prefix}/pod "
                           f"or {prefix})", source=named("annotation", key))
    if rest != "pod" and not container:
        raise RequestError("the runtime gave this container no name, so a per-container "
                           f"key cannot apply to it: use {prefix}/pod or name the "
                           "container", source=named("annotation", key))


# ---- env ---------------------------------------------------------------------------------

def _env_part(env: tuple[str, ...]) -> _EnvPart:
    """The env's requests. The memo keeps a small env as it is (the common case, and the
    fastest); of a larger one only the entries some family reads, so whatever else the
    image or pod defines (LD_LIBRARY_PATH, ...) is never kept."""
    if sum(map(len, env)) <= MAX_ENV_READ_CHARS:
        return _read_env_part(env)
    read = tuple(filter(_IS_READ_ENTRY, env))  # filtered in C: a huge env costs little
    if sum(map(len, read)) > MAX_ENV_READ_CHARS:
        name = max(read, key=len).partition("=")[0]
        shown = ", ".join((*sorted(_READ_ENV), *(p + "*" for p in _READ_ENV_PREFIXES)))
        raise RequestError(f"the variables nri-accel reads ({shown}) hold more than "
                           f"{MAX_ENV_READ_CHARS} characters in all",
                           source=named("env", name))
    return _read_env_part(read)


@lru_cache(maxsize=1024)
def _read_env_part(env: tuple[str, ...]) -> _EnvPart:
    """_env_part(), memoised. OCI env semantics: the last definition of a name wins;
    entries without '=' are not variables. The variables some family reads are checked
    for size and control characters (their names too) before any family sees them;
    other variables (LD_PRELOAD, ...) are never looked at."""
    values: dict[str, str] = {}
    for kv in env:
        k, eq, v = kv.partition("=")
        if eq and (k in _READ_ENV or k.startswith(_READ_ENV_PREFIXES)):
            values[k] = v
    if not values:
        return _NO_ENV
    for k, v in values.items():
        if bad_name(k):
            raise RequestError("variable name with control characters or longer than "
                               "the limit", source=named("env", k))
        check_text(v, f"env {k}")
    sources: list[Source] = []
    asks = []
    for profile in PROFILES:
        ask = profile.read_env(values)
        if ask == NO_ASK:
            continue
        asks.append((profile.name, ask))
        vendor = profile.kinds[0].partition("/")[0] if profile.kinds else ""
        sources.extend(Source(Origin.ENV, s.name, s.claims, s.text,
                              frozenset({vendor}) if s.drivers_only else frozenset())
                       for s in ask.sources)
    return _EnvPart(tuple(sources), tuple(asks))


_NO_ENV = _EnvPart((), ())


# ---- value syntax ------------------------------------------------------------------------

# The value parsers are pure and memoised: a pod's annotations repeat for each of its
# containers and across the replicas of a workload. Errors are not memoised.
@lru_cache(maxsize=4096)
def _parse_devices(value: str, source: str) -> tuple[DeviceClaim, ...]:
    """The devices.nri-accel.io grammar (README.md, "Requesting devices"): entries
    separated by ';' or newlines; an entry is ``KIND=ID[,ID...]`` (a token with '='
    starts a new kind) or ``KIND: N``. An empty value asks for nothing."""
    check_text(value, source, newlines=True)
    acc = ClaimSet(source)
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
                    kind = check_kind(k.strip(), source)
                    token = token.strip()
                elif not kind:
                    raise RequestError(f"id {token!r} has no kind: write KIND=ID such as "
                                       f"nvidia.com/gpu={token}", source=source)
                acc.add_ids(kind, token, family_of(kind).id_pattern)
        elif ":" in entry:
            k, _, n = entry.partition(":")
            kind = check_kind(k.strip(), source)
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
    check_text(value, source)
    return _parse_cdi_list(value.split(","), source)


def _parse_cdi_list(names: Iterable[str], source: str) -> tuple[DeviceClaim, ...]:
    acc = ClaimSet(source, cdi=True)
    for name in names:
        kind, eq, ident = name.partition("=")
        if not eq:
            raise RequestError(f"invalid CDI device name {name!r}: expected vendor/class=name",
                               source=source)
        check_kind(kind, source)
        acc.add_id(kind, check_id(ident, source, family_of(kind).id_pattern))
    return acc.claims()


@lru_cache(maxsize=1024)
def _parse_injector_cdi(value: str, source: str) -> tuple[DeviceClaim, ...]:
    """containerd/nri device-injector's CDI annotation: a YAML list of CDI names."""
    check_text(value, source, newlines=True)
    if not value.strip():
        return ()
    if value.count("[") + value.count("{") > _MAX_YAML_COLLECTIONS:
        # PyYAML's scanner takes quadratic time over open flow collections: 4096 '[' cost
        # over a second per container before it ran out of recursion.
        raise RequestError(f"not a YAML list of CDI device names: more than "
                           f"{_MAX_YAML_COLLECTIONS} '[' and '{{'", source=source)
    import yaml  # here: most nodes never see this annotation, and yaml costs start-up time

    try:
        names = yaml.safe_load(value)
    except (yaml.YAMLError, ValueError) as e:  # ValueError: an impossible date (2001-02-30)
        raise RequestError(f"not a YAML list of CDI device names: {e}", source=source) from e
    except RecursionError:
        raise RequestError("not a YAML list of CDI device names: nested too deeply",
                           source=source) from None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise RequestError("expected a YAML list of CDI device names such as "
                           "'- vendor.com/device=dev0'", source=source)
    return _parse_cdi_list(names, source)
