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
names (never paths) and every error names its source (nri_accel.syntax). A request of
up to 4 MiB is also bounded as a whole, by counts taken before any per-key work
(check_bounds(), parse()): MAX_ANNOTATION_KEYS keys under ANNOTATION_PREFIXES on the pod
and on the container each, MAX_SOURCES annotation sources per container,
MAX_REQUEST_IDS device ids in all, MAX_ENV_ENTRIES env entries read; over one, the
container is refused, so its work on the event loop stays within about 2 ms. Variables no
family reads (LD_PRELOAD, LD_LIBRARY_PATH, ...) are never looked at, nor kept in a memo.
The annotations nri-accel writes to record a grant are refused on the way in: a forged
record could make a restarted plugin hold devices no one has, or free some still in use.
"""

from __future__ import annotations

import enum
import re
from bisect import bisect_left
from collections.abc import Callable, Hashable, Iterable, Mapping
from itertools import islice

from msgspec import Struct

from nri_accel.container import ContainerInfo
from nri_accel.errors import RequestError
from nri_accel.memo import memoized
from nri_accel.syntax import (
    MAX_IDS,
    MAX_NAME_CHARS,
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
ENV_PREFIXES = _READ_ENTRY_PREFIXES
"""Every env entry parse() reads starts with one of these ("NAME=", or a family's name
prefix such as "NVIDIA_REQUIRE_")."""
ANNOTATION_PREFIXES = tuple(sorted({DEVICES_KEY, *_OPTION_KEYS, *INJECTOR_CDI_KEYS,
                                    *CDI_PREFIXES, *RESERVED_KEYS}))
"""Every annotation key parse() reads or refuses, on the pod or the container, starts
with one of these. A container whose annotations and env (ENV_PREFIXES) have none asks
for nothing: parse() would return an empty Parsed (nri_accel.plugin answers it at once)."""
# Container annotations that ask for devices: these, and DEVICES_KEY itself.
_CONTAINER_SOURCE_PREFIXES = (GRANT_KEY_PREFIX, *CDI_PREFIXES)
# What a refusal for too many keys names: the most specific of these most keys start with.
_KEY_DOMAINS = tuple(sorted({*ANNOTATION_PREFIXES, GRANT_KEY_PREFIX,
                             *(k + "/container." for k in (DEVICES_KEY, *_OPTION_KEYS,
                                                           *INJECTOR_CDI_KEYS))}))
# All the env entries nri-accel reads together (an image may define any number of
# NVIDIA_REQUIRE_* variables): bounds the parse time and what the memo keeps per env.
MAX_ENV_READ_CHARS = 4 * MAX_VALUE_BYTES

# ---- bounds on one request (check_bounds(), parse()) --------------------------------------
# A request may be 4 MiB: 100,000 annotations or env entries. Everything after these
# checks costs time in proportion to what they let through, on the event loop where
# every other container waits (DESIGN.md: a few milliseconds at most, whatever the
# request), so each is checked by counting, before any key is parsed or sorted.
MAX_ANNOTATION_KEYS = 1024
"""Keys under ANNOTATION_PREFIXES that the pod's annotations, and the container's, may
each carry. A pod carries one per container and option (devices.nri-accel.io/container.<name>,
capabilities.nri-accel.io/container.<name>) and one per CDI claim; CRI-O copies them onto
each container. Kubernetes keeps a pod's annotations under 256 KiB in all, and a pod has
tens of containers at most: 1024 keys leave ample room, and the most costly 1024 (per-
container keys, checked each) parse in about a millisecond."""
MAX_SOURCES = 64
"""Annotations that ask one container for devices (its own devices.nri-accel.io,
devices.nri-accel.io/resource.* and CDI keys, the pod's CDI keys and the key of each
precedence list used). A device plugin writes one per resource, DRA and CDI-aware
device plugins one per claim: a container has a few."""
MAX_REQUEST_IDS = 2 * MAX_IDS
"""Device ids that one container's annotations and env name in all (a count or "all"
counts one, repeats and each id of a range count). One source may name MAX_IDS; the
most a real container names is a grant of that many written out id by id, and a
variable naming them again to narrow it. Counted as the sources are parsed, one after
the other: an annotation's tokens before it is parsed (_tokens), its ids after (a range
is one token), so at most this plus one source's MAX_IDS ids are parsed, resolved and
checked (about 2 ms)."""
MAX_ENV_ENTRIES = 256
"""Env entries of the variables nri-accel looks at (ENV_PREFIXES, and those the edits
rewrite: nri_accel.engine.ENV_SCOPE) that one container may carry, each definition of a
name counted. A CUDA image sets about five NVIDIA_* variables and LD_LIBRARY_PATH, a pod
spec may define them again."""

_DEFAULT_SETTINGS = {p.name: p.settings(NO_ASK, None) for p in PROFILES}
_COUNT_RE = re.compile(r"[0-9]{1,6}")
_MAX_YAML_COLLECTIONS = 64  # '[' and '{' in the injector's YAML list (it needs one at most)
_ENTRY_SPLIT_RE = re.compile(r"[;\n]")
_TOKEN_SEPARATORS = (",", ";", "\n")
_TOKEN_ENDS = " ,;\n"


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
    privileged: tuple[tuple[str, str], ...] = ()  # (vendor, source): env asks only a
    # granting origin may make, of a grant of the vendor's devices
    options: tuple[tuple[str, Hashable], ...] = ()  # (family, options) where not default
    visible: frozenset[str] = frozenset()  # families whose visibility variable env sets
    env: Hashable = None  # what the env alone decided: one object for one env (memoised),
    # which the options hold parts of (memos keeping them are charged for it once)
    problems: tuple[tuple[str, str, str], ...] = ()  # (vendor, source, message): env that
    # only qualifies a grant of the vendor's devices is malformed (EnvAsk.problem)


class _EnvPart(Struct, frozen=True):
    """Everything the env alone decides (memoised per env: containers of one image and
    pod spec share it)."""

    sources: tuple[Source, ...]
    asks: tuple[tuple[str, EnvAsk], ...]  # (family, its reading) where not empty
    privileged: tuple[tuple[str, str], ...] = ()  # (vendor, source)
    problems: tuple[tuple[str, str, str], ...] = ()  # (vendor, source, message)


def check_bounds(info: ContainerInfo, env_scope: tuple[str, ...] = ENV_PREFIXES) -> None:
    """Refuse a request too large to be served within the event loop's budget, by
    counting before any per-key work: more than MAX_ANNOTATION_KEYS keys under
    ANNOTATION_PREFIXES on the pod or on the container, or more than MAX_ENV_ENTRIES env
    entries starting with one of `env_scope`. A request within them costs three len()
    calls; one over them, the count of at most MAX_* + 1 entries that match (the
    ContainerInfo the plugin builds holds no others). Raises RequestError naming the
    prefix most of them share, their number and the limit."""
    if (len(info.env) <= MAX_ENV_ENTRIES
            and len(info.pod_annotations) <= MAX_ANNOTATION_KEYS
            and len(info.container_annotations) <= MAX_ANNOTATION_KEYS):
        return  # the hot path: nothing to count
    for where, carried in (("pod", info.pod_annotations),
                           ("container", info.container_annotations)):
        if len(carried) > MAX_ANNOTATION_KEYS:
            read = list(islice((k for k in carried if k.startswith(ANNOTATION_PREFIXES)),
                              MAX_ANNOTATION_KEYS + 1))
            if len(read) > MAX_ANNOTATION_KEYS:
                domain = _most_common(read, _KEY_DOMAINS)
                raise RequestError(
                    f"{len(carried)} annotations, more than {MAX_ANNOTATION_KEYS} of "
                    f"them under nri-accel's and CDI's prefixes, most under {domain}*: at "
                    f"most {MAX_ANNOTATION_KEYS} are read per pod and per container",
                    source=f"{where} annotations {domain}*")
    env = info.env
    if len(env) > MAX_ENV_ENTRIES:
        read = list(islice((kv for kv in env if kv.startswith(env_scope)), MAX_ENV_ENTRIES + 1))
        if len(read) > MAX_ENV_ENTRIES:
            # the size first, if over too
            _check_read_chars(kv for kv in read if kv.startswith(_READ_ENTRY_PREFIXES))
            prefix = _most_common(read, env_scope)
            shown = prefix[:-1] if prefix.endswith("=") else prefix + "*"
            raise RequestError(
                f"{len(env)} env entries, more than {MAX_ENV_ENTRIES} of them defining "
                f"variables nri-accel reads or rewrites, most {shown}: at most "
                f"{MAX_ENV_ENTRIES} are read per container", source=f"env {shown}")


def _most_common(texts: Iterable[str], prefixes: tuple[str, ...]) -> str:
    """The prefix that most of `texts` start with, each text counted for the longest of
    `prefixes` it starts with (ties: the longest prefix). The texts (a limit's worth) are
    sorted once: those starting with a prefix are a range of them, found by bisection."""
    texts = sorted(texts)

    def starting(p: str) -> int:
        return bisect_left(texts, p + "\U0010ffff") - bisect_left(texts, p)

    def own(p: str) -> int:  # less those counted for a longer prefix
        longer = [q for q in prefixes if q != p and q.startswith(p)]
        outer = [q for q in longer if not any(o != q and q.startswith(o) for o in longer)]
        return starting(p) - sum(map(starting, outer))

    counts = {p: own(p) for p in prefixes}
    return min(prefixes, key=lambda p: (-counts[p], -len(p), p))


def read_by_parse(info: ContainerInfo) -> tuple[Hashable, ...]:
    """Everything of `info` that parse() reads, as a hashable key: the container's name,
    the annotations whose key starts with one of ANNOTATION_PREFIXES (pod's, then the
    container's) and the env entries starting with one of ENV_PREFIXES. Two containers
    with equal keys parse alike (or fail alike); the key holds nothing else of them."""
    keys, entries = ANNOTATION_PREFIXES, _READ_ENTRY_PREFIXES
    return (info.container_name,
            tuple(sorted([kv for kv in info.pod_annotations.items() if kv[0].startswith(keys)])),
            tuple(sorted([kv for kv in info.container_annotations.items()
                          if kv[0].startswith(keys)])),
            tuple([kv for kv in info.env if kv.startswith(entries)]))


def parse(info: ContainerInfo) -> Parsed:
    """Parse `info`'s annotations and env. Raises RequestError (source: the annotation
    key or env variable) for a malformed value, or for a request over the bounds
    (check_bounds(), MAX_SOURCES, MAX_REQUEST_IDS)."""
    check_bounds(info)
    for key in RESERVED_KEYS:
        for where, carried in (("annotation", info.pod_annotations),
                               ("container annotation", info.container_annotations)):
            if key in carried:
                raise RequestError("reserved: nri-accel records there what it granted, "
                                   "remove it", source=f"{where} {key}")
    env = _env_part(info.env)
    own_keys = _container_keys(info)
    pod_keys = _pod_keys(info)
    if len(own_keys) + len(pod_keys) > MAX_SOURCES:
        domain = _most_common(islice((*own_keys, *pod_keys), MAX_SOURCES + 1), _KEY_DOMAINS)
        raise RequestError(f"{len(own_keys) + len(pod_keys)} annotations ask this container "
                           f"for devices, most under {domain}*: at most {MAX_SOURCES} are "
                           "read per container", source=f"annotations {domain}*")
    pending = [*_container_sources(info, own_keys), *_pod_sources(info, pod_keys)]
    ids = sum(map(_id_count, env.sources))
    sources = []
    for p in pending:  # parsed one after the other: the count stops the work
        tokens = _tokens(p.value)  # each names an id at least: counted before the parse
        if ids + tokens > MAX_REQUEST_IDS:
            check_text(p.value, p.name, newlines=True)  # a value too long says so first
            raise _too_many_ids(p.name)
        claims = p.parser(p.value, p.name)
        ids += max(tokens, _id_count(claims))  # more where a range names many
        if ids > MAX_REQUEST_IDS:
            raise _too_many_ids(p.name)
        sources.append(Source(p.origin, p.name, claims, p.value, also_on_pod=p.also_on_pod))
    sources += env.sources
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
        sources=tuple(sources),
        privileged=env.privileged,
        options=tuple(options),
        visible=frozenset(name for name, ask in env.asks if ask.visible),
        env=env if env.sources or env.asks else None,  # None: it decided nothing
        problems=env.problems,
    )


def _id_count(source: Source | tuple[DeviceClaim, ...]) -> int:
    """The device ids a source's claims name (a count or "all": one)."""
    claims = source.claims if isinstance(source, Source) else source
    return sum(len(c.ids) or 1 for c in claims)


def _tokens(value: str) -> int:
    """The tokens an annotation value writes: the pieces its separators (',', ';',
    newline) delimit, blanks and separators at either end left out (a YAML list ends
    with a newline). Counted in C (str.count), whatever the value. Each names at least
    one device id in every grammar here (a range or "all" one token), except an empty
    entry within (';;', a YAML comment line), which a real value does not hold."""
    value = value.strip(_TOKEN_ENDS)
    return sum(map(value.count, _TOKEN_SEPARATORS)) + 1 if value else 0


def _too_many_ids(source: str) -> RequestError:
    return RequestError(f"this container's annotations and env name more than "
                        f"{MAX_REQUEST_IDS} device ids in all (a count or 'all' counts "
                        "one, repeats and each id of a range count)", source=source)


# ---- annotation sources ----------------------------------------------------------------

class _Pending(Struct, frozen=True):
    """An annotation source found, not parsed yet (parse() counts them first)."""

    origin: Origin
    key: str
    name: str
    value: str
    parser: Callable[[str, str], tuple[DeviceClaim, ...]]
    also_on_pod: bool = False


def _container_keys(info: ContainerInfo) -> list[str]:
    """The keys of the container's own annotation sources, sorted: not those that are
    the runtime's copies of the pod's (equal key and value), parsed with the pod's."""
    own, pods = info.container_annotations, info.pod_annotations
    keys = [*(k for k in own if k.startswith(_CONTAINER_SOURCE_PREFIXES)),
            *((DEVICES_KEY,) if DEVICES_KEY in own else ())]
    return [k for k in sorted(keys) if pods.get(k) != own[k]]


def _container_sources(info: ContainerInfo, keys: list[str]) -> list[_Pending]:
    own, pods = info.container_annotations, info.pod_annotations
    out = []
    for key in keys:
        is_devices = key.startswith(DEVICES_KEY)
        name = named("container annotation", key)
        if key in pods:
            name += " (also set on the pod)"
        out.append(_Pending(Origin.CONTAINER, key, name, own[key],
                            _parse_devices if is_devices else _parse_cdi_value,
                            also_on_pod=key in pods))
    return out


def _pod_keys(info: ContainerInfo) -> list[str]:
    """The keys of the pod's annotation sources that apply to the container: the first
    present of each precedence list, then the CDI keys, sorted. Refuses a misspelt or
    unusable key in nri-accel's own prefixes (_check_plugin_key)."""
    pods = info.pod_annotations
    cdi_keys = []
    for key in sorted(pods):
        if key.startswith(_PLUGIN_KEY_PREFIXES):
            _check_plugin_key(key, info.container_name)
        elif key.startswith(CDI_PREFIXES):
            cdi_keys.append(key)
    firsts = (first_present(pods, keys, info.container_name)
              for keys in ((DEVICES_KEY,), INJECTOR_CDI_KEYS))
    return [*(k for k in firsts if k is not None), *cdi_keys]


def _pod_sources(info: ContainerInfo, keys: list[str]) -> list[_Pending]:
    pods = info.pod_annotations
    return [_Pending(Origin.POD, key, named("annotation", key), pods[key],
                     _parse_devices if key.startswith(DEVICES_KEY)
                     else _injector_cdi_claims if key.startswith(INJECTOR_CDI_KEYS)
                     else _parse_cdi_value)
            for key in keys]


def first_present(annotations: Mapping[str, str], prefixes: Iterable[str],
                  container: str) -> str | None:
    """The NRI precedence: <p>/container.<name> > <p>/pod > <p>, for each prefix in turn
    per level (new key before its deprecated alias). No per-container key names a
    container whose name is empty or longer than MAX_NAME_CHARS (_check_plugin_key()
    refuses such a key): a name of megabytes is never copied into a key."""
    prefixes = tuple(prefixes)
    suffixes = ((f"/container.{container}", "/pod", "")
                if container and len(container) <= MAX_NAME_CHARS else ("/pod", ""))
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
    if len(rest) - 10 > MAX_NAME_CHARS:
        raise RequestError(f"a container name longer than {MAX_NAME_CHARS} characters "
                           "(Kubernetes allows 63): no per-container key applies to one",
                           source=named("annotation", key))
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
    read = tuple([kv for kv in env if kv.startswith(_READ_ENTRY_PREFIXES)])
    _check_read_chars(read)
    return _read_env_part(read)


def _check_read_chars(read: Iterable[str]) -> None:
    """Refuse env entries nri-accel reads that hold more than MAX_ENV_READ_CHARS in all,
    naming the longest."""
    read = tuple(read)
    if sum(map(len, read)) > MAX_ENV_READ_CHARS:
        name = max(read, key=len).partition("=")[0]
        shown = ", ".join((*sorted(_READ_ENV), *(p + "*" for p in _READ_ENV_PREFIXES)))
        raise RequestError(f"the variables nri-accel reads ({shown}) hold more than "
                           f"{MAX_ENV_READ_CHARS} characters in all",
                           source=named("env", name))


@memoized(1024, 256 * 1024)
def _read_env_part(env: tuple[str, ...]) -> _EnvPart:
    """_env_part(), memoised. OCI env semantics: the last definition of a name wins;
    entries without '=' are not variables. The variables some family reads are checked
    for size and control characters, their names for unprintable characters and length
    (syntax.bad_name), before any family sees them; other variables (LD_PRELOAD, ...)
    are never looked at."""
    values: dict[str, str] = {}
    for kv in env:
        k, eq, v = kv.partition("=")
        if eq and (k in _READ_ENV or k.startswith(_READ_ENV_PREFIXES)):
            values[k] = v
    if not values:
        return _NO_ENV
    for k, v in values.items():
        if bad_name(k):
            raise RequestError("variable name with unprintable characters (control, "
                               "format or bidi) or longer than the limit",
                               source=named("env", k))
        check_text(v, f"env {k}")
    sources: list[Source] = []
    asks = []
    privileged, problems = [], []
    for profile in PROFILES:
        ask = profile.read_env(values)
        if ask == NO_ASK:
            continue
        asks.append((profile.name, ask))
        vendor = profile.kinds[0].partition("/")[0] if profile.kinds else ""
        sources.extend(Source(Origin.ENV, s.name, s.claims, s.text,
                              frozenset({vendor}) if s.drivers_only else frozenset())
                       for s in ask.sources)
        privileged += ((vendor, s) for s in ask.privileged)
        if ask.problem:
            problems.append((vendor, *ask.problem))
    return _EnvPart(tuple(sources), tuple(asks), tuple(privileged), tuple(problems))


_NO_ENV = _EnvPart((), ())


# ---- value syntax ------------------------------------------------------------------------

# The value parsers are pure and memoised: a pod's annotations repeat for each of its
# containers and across the replicas of a workload. Errors are not memoised; the memos
# are bounded by the characters of what they were given (nri_accel.memo).
ID_CHARS = 16
"""Characters a memo is charged for each device id a value parses into (an id string
and its place in a tuple, beyond the text that wrote it)."""


def claimed_ids(claims: Iterable[DeviceClaim]) -> int:
    """The ids `claims` hold: a range of a few characters writes 256."""
    return sum(len(c.ids) for c in claims)


def _ids_chars(found: tuple[DeviceClaim, ...] | str) -> int:
    """What a memo of parsed claims is charged beyond their text: ID_CHARS an id."""
    return 0 if isinstance(found, str) else ID_CHARS * claimed_ids(found)



@memoized(4096, 256 * 1024, _ids_chars)
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


@memoized(4096, 256 * 1024, _ids_chars)
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


def _injector_cdi_claims(value: str, source: str) -> tuple[DeviceClaim, ...]:
    """containerd/nri device-injector's CDI annotation: a YAML list of CDI names.
    Memoised, failures too (_parse_injector_cdi): parsing 4 KiB of YAML costs
    milliseconds even with libyaml. Its size is checked first, so that no memo keeps a
    value refused for it."""
    check_text(value, source, newlines=True)
    found = _parse_injector_cdi(value, source)
    if isinstance(found, str):
        raise RequestError(found, source=source)
    return found


@memoized(1024, 256 * 1024, _ids_chars)
def _parse_injector_cdi(value: str, source: str) -> tuple[DeviceClaim, ...] | str:
    """_injector_cdi_claims(): the claims, or the message of the RequestError to raise
    (a fresh one each time: a raised exception keeps its traceback)."""
    try:
        return _read_injector_cdi(value, source)
    except RequestError as e:
        return e.message


def _read_injector_cdi(value: str, source: str) -> tuple[DeviceClaim, ...]:
    """The claims of a value _injector_cdi_claims() has checked (check_text)."""
    if not value.strip():
        return ()
    if value.count("[") + value.count("{") > _MAX_YAML_COLLECTIONS:
        # PyYAML's scanner takes quadratic time over open flow collections: 4096 '[' cost
        # over a second per container before it ran out of recursion.
        raise RequestError(f"not a YAML list of CDI device names: more than "
                           f"{_MAX_YAML_COLLECTIONS} '[' and '{{'", source=source)
    import yaml  # here: most nodes never see this annotation, and yaml costs start-up time

    # libyaml's loader where PyYAML was built with it (the pure one takes 5 to 20 ms
    # over 4 KiB); the same safe constructor either way.
    loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    try:
        names = yaml.load(value, Loader=loader)
    except (yaml.YAMLError, ValueError) as e:  # ValueError: an impossible date (2001-02-30)
        if "maximum nesting depth" in str(e):  # libyaml's limit: the same as RecursionError
            raise RequestError("not a YAML list of CDI device names: nested too deeply",
                               source=source) from None
        raise RequestError(f"not a YAML list of CDI device names: {e}", source=source) from e
    except RecursionError:
        raise RequestError("not a YAML list of CDI device names: nested too deeply",
                           source=source) from None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise RequestError("expected a YAML list of CDI device names such as "
                           "'- vendor.com/device=dev0'", source=source)
    return _parse_cdi_list(names, source)
