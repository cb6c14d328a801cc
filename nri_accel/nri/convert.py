"""NRI protobuf pods and containers -> the plain data the pipeline works on.

Owns: how the stub decodes the requests that carry containers (REQUEST_DECODERS: as
views, messages declaring what is read of them, api/nri_views.proto; a CreateContainer
first at a glance, glance_decoder, which answers a container that asks for nothing
itself), PodSandbox + Container -> nri_accel.container.ContainerInfo
(container_info), the little of each pod and container of a Synchronize that is kept
while its parts arrive (synced: SyncedPod, SyncedContainer), and the lean ContainerInfo
of each live container of a Synchronize (live_containers), so that nothing outside
nri_accel.nri reads a protobuf field.
Imports msgspec, protobuf's unknown_fields, nri_accel.container and this package's
nri_pb2 and nri_views_pb2; pure functions (glance_decoder's decoder reads the clock,
for the time it reports), no trust decision (the policy decides which annotations are
a container's own).

Large envs: an image or pod may define any number of variables (tens of thousands, a
MiB), and testing them one by one from Python costs some 150-300 ns each, the most of a
request's time. Of a large env (over LARGE_ENV entries) container_env() keeps only the
entries that start with a prefix its caller reads, found by env_entries() in one string
of the whole env joined with NUL: one str.find pass per group of prefixes, in C, then
only the entries found are looked at. (NUL separates: no env entry holds one, the kernel
could not pass it; an env that does is tested entry by entry.) large_container_info()
does the same a part at a time.

Large requests: a CreateContainer over LARGE_REQUEST bytes (a huge env, huge
annotations, tens of thousands of mounts or devices: up to the 4 MiB message limit) is
decoded only as far as its pod's and its container's encodings (is_large(): each an
Encoded), which large_container_info() decodes a run of fields at a time
(nri.fields.runs), as the large views, whose annotations are their map entries, for a
caller that gives the event loop a turn between runs: protobuf builds a repeated
field's elements at 30-40 ns each, and 4 MiB holds 1.3 million one-byte env entries.

Synchronize: a runtime lists every pod and container of the node, split into parts of
up to its 4 MiB message limit (containerd 2.x; a node of 60,000 containers: some 30
full parts). protobuf decodes a map in time that grows faster than linearly with its
entries (one C call, the GIL held: 16,000 keys 2-3 ms, 20,000 6-10 ms, 200,000 300-500
ms), and a pod's or a container's annotations may fill a part. decode_synchronize()
decodes a part of up to SYNC_MAP_BYTES (a small node's whole Synchronize) with its
annotations as maps, as they are read; a larger one as the bare view, which skips
every pod's and container's annotations undecoded (kept among its unknown fields): 1-6
ms for the most 4 MiB can hold. synced() then looks for the keys it reads (the grant
annotations) in each bare pod's and container's bytes, in C, and decodes the
annotations of only the few where one appears: as a map up to SYNC_MAP_BYTES, beyond
that as their entries (the large view's Annotation), a run of fields a step. A key
absent from the bytes is absent from the map, so what synced() keeps is what the map
would give. One difference, on bytes a runtime never writes: damage inside the
annotations of a pod or container that holds none of the keys read goes unseen (the
map view refuses the part).

Names: containerd names a container from its CRI metadata; CRI-O names it from the
`io.kubernetes.container.name` label, so a container created without kubelet's labels
has no name in NRI (captured from CRI-O 1.36.3). Its CRI metadata name is then read
from CRI-O's own `io.kubernetes.cri-o.Metadata` annotation (JSON, `{"name": ...}`),
which CRI-O writes for every container.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Collection, Generator, Iterable, Iterator, Mapping, Sequence
from functools import lru_cache
from operator import attrgetter, itemgetter
from time import perf_counter_ns
from types import MappingProxyType
from typing import Any

from msgspec import Struct

from nri_accel.container import ContainerInfo
from nri_accel.errors import RequestError
from nri_accel.nri import nri_pb2 as pb
from nri_accel.nri import nri_views_pb2 as views
from nri_accel.nri.fields import Encoding, runs, values

CRIO_METADATA = "io.kubernetes.cri-o.Metadata"
_MAX_METADATA_CHARS = 4096
LARGE_ENV = 1024
"""Entries from which an env is large (see the module docstring)."""
LARGE_REQUEST = 64 * 1024
"""Bytes from which a CreateContainer is decoded as the large view (module docstring)."""
SYNC_MAP_BYTES = 128 * 1024
"""Bytes up to which a Synchronize part, and a pod or container of a larger part that
carries a key synced() reads, is decoded with its annotations as maps (the module
docstring): 128 KiB hold at most some 14,000 distinct keys (9 bytes an entry, the
least a distinct key of 3 characters takes), whose map decodes in 2-3 ms, or 65,000
entries of one key (0.3 us each: 2 ms)."""

Pod = pb.PodSandbox | views.PodSandbox
Container = pb.Container | views.Container
"""A pod or container of a CreateContainer: the full message, or a view of it."""


class Encoded(Struct, frozen=True):
    """A pod or the container of a CreateContainer over LARGE_REQUEST bytes, undecoded:
    its encoding (a view of the request's bytes; every occurrence of its field joined,
    which protobuf would merge into one message, where there are several), for
    large_container_info() to read a run of fields at a time."""

    data: Encoding


class LargeRequest(Struct, frozen=True):
    """A request carrying a container (CreateContainer, StopContainer, RemoveContainer:
    pod = 1, container = 2) over LARGE_REQUEST bytes, as decode_create() and
    decode_ended() give it."""

    pod: Encoded
    container: Encoded


def decode_create(payload: bytes) -> views.CreateContainerRequest | LargeRequest:
    """A CreateContainer request's bytes as its view; over LARGE_REQUEST, its pod's and
    container's encodings (decoding them is large_container_info()'s). Raises
    protobuf's DecodeError."""
    if len(payload) > LARGE_REQUEST:
        return decode_large(payload)
    return views.CreateContainerRequest.FromString(payload)


ASKED_NOTHING = b""
"""What glance_decoder()'s decoder returns for a container that asks for nothing: the
CreateContainerResponse the stub sends (an empty one encodes to no bytes)."""


def glance_decoder(key_prefixes: tuple[str, ...], env_prefixes: tuple[str, ...],
                   env_scope: tuple[str, ...], replaces: Callable[[str, str, str], bool],
                   answered: Callable[[str, int], None],
                   ) -> Callable[[bytes], bytes | views.CreateContainerRequest | LargeRequest]:
    """A decoder of CreateContainer requests (as decode_create()) that answers a container
    asking for nothing itself, at a glance: it decodes a request first as the glance
    view (annotations, env, ids and names), and when the container asks for nothing and
    `replaces(container_id, pod, container_name)` (`pod`: its sandbox id, else its pod's
    uid) says its creation replaces no grant, calls `answered(container_id,
    nanoseconds)` (the time since the request's bytes came to it) and returns
    ASKED_NOTHING, the stub's answer (the plugin's create_container is not called);
    else it decodes the request again, as decode_create() does (a typical container
    asking for nothing: 40 % fewer instructions than the full view; one that asks is
    decoded twice, a few us more on a path of a few hundred). A container asks when one
    of its pod's or its own annotation keys starts with one of `key_prefixes`, or an
    entry of its env (container_env() of it, in `env_scope`) with one of
    `env_prefixes`, as PrefixTest tests them.

    Every container created takes this path, most of them to its end, and so it is one
    function: between two requests the runtime runs, and what a request touches
    (functions, objects, protobuf's tables) is fetched into the CPU's caches anew, so
    that the handler taking 4 us in a loop takes 8-9 us of CPU a request in the daemon.
    Answering here, rather than handing a glance on to the plugin's handler, saves the
    stub's and the plugin's calls: 1-1.5 us of CPU, 2-3 % of the empty answer's round
    trip (bench_roundtrip.py, taken in turns with the tree before)."""
    keys, entries = PrefixTest(key_prefixes), PrefixTest(env_prefixes)
    key_heads, key_head, key_firsts, first = keys.heads, keys.head, keys.firsts, keys.first
    env_heads, env_head = entries.heads, entries.head
    glance = views.GlanceCreateContainerRequest.FromString
    clock = perf_counter_ns

    def decode(payload: bytes) -> bytes | views.CreateContainerRequest | LargeRequest:
        started = clock()
        if len(payload) > LARGE_REQUEST:
            return decode_large(payload)
        request = glance(payload)
        pod, container = request.pod, request.container
        pod_keys, own_keys, env = pod.annotations, container.annotations, container.env
        # A step of PrefixTest inline for each, the whole test only where it finds
        # something: of the container's keys, the runtime's and kubelet's own
        # (io.kubernetes.*), the first character; of the pod's and the env, anybody's,
        # the first n characters. (A protobuf list read whole, env[:], costs less than
        # item by item; an empty map's iterator, what a test of a few keys does.)
        if ((((not pod_keys or key_heads.isdisjoint(map(key_head, pod_keys)))
              and key_firsts.isdisjoint(map(first, own_keys))
              and len(env) <= LARGE_ENV and env_heads.isdisjoint(map(env_head, env[:])))
             or not (keys(pod_keys) or keys(own_keys)
                     or entries(container_env(container, env_scope))))
                and not replaces(container_id := container.id, pod.id or pod.uid,
                                 # container_name(), its annotations already read
                                 container.name or name_of("", own_keys))):
            answered(container_id, clock() - started)
            return ASKED_NOTHING
        return views.CreateContainerRequest.FromString(payload)

    return decode


def decode_synchronize(payload: bytes) -> \
        views.SynchronizeRequest | views.BareSynchronizeRequest:
    """A Synchronize part's bytes as its view: up to SYNC_MAP_BYTES, with the pods' and
    containers' annotations as maps; over that, the bare view, their annotations left
    undecoded for synced() to look into (see the module docstring). Raises protobuf's
    DecodeError."""
    if len(payload) <= SYNC_MAP_BYTES:
        return views.SynchronizeRequest.FromString(payload)
    return views.BareSynchronizeRequest.FromString(payload)


def is_bare(item: Any) -> bool:
    """Whether a pod or container of a Synchronize comes in the bare view (its part was
    over SYNC_MAP_BYTES): its annotations are read by synced() only."""
    return type(item) in _BARE


_BARE = (views.BarePodSandbox, views.BareSyncedContainer)



def decode_large(payload: bytes) -> LargeRequest:
    """A request's bytes (one of LargeRequest's) as its pod's (field 1) and its
    container's (field 2) encodings, views of the bytes: a copy of 4 MiB takes some
    2 ms, the first touch of each new page of memory. Raises protobuf's DecodeError."""
    found = values(payload, frozenset((_POD, _CONTAINER)), _MOST_REQUEST_FIELDS)
    return LargeRequest(Encoded(_joined(found[_POD])), Encoded(_joined(found[_CONTAINER])))


_POD, _CONTAINER = 1, 2  # the field numbers of the requests LargeRequest stands for
_MOST_REQUEST_FIELDS = 64
"""Fields a large request may have (its pod and container, and whatever a later NRI
adds beside them: a few); its fields are walked in one step (64: 30 us)."""


def decode_ended(payload: bytes) -> views.StopContainerRequest | LargeRequest:
    """A StopContainer or RemoveContainer request's bytes as their view; over
    LARGE_REQUEST, its pod's and container's encodings, the container's id for
    ended_id() to read: the view skips the rest of a container in one C call, some 4
    ns a field, 7-8 ms for 4 MiB of one-byte env entries. Raises protobuf's
    DecodeError."""
    if len(payload) > LARGE_REQUEST:
        return decode_large(payload)
    return views.StopContainerRequest.FromString(payload)


def ended_id(container: Encoded) -> Generator[None, None, str]:
    """The id of a container given as its encoding (a large StopContainer's or
    RemoveContainer's), a run of fields a step, as large_container_info() reads: the
    last run that holds it gives it. Raises protobuf's DecodeError."""
    found = ""
    for run in runs(container.data):
        part = views.EndedContainer.FromString(run)
        if part.HasField("id"):
            found = part.id
        yield
    return found


REQUEST_DECODERS = {"CreateContainer": decode_create,
                    "Synchronize": decode_synchronize,
                    "StopContainer": decode_ended,
                    "RemoveContainer": decode_ended,
                    "StopPodSandbox": views.StopPodSandboxRequest.FromString,
                    "RemovePodSandbox": views.StopPodSandboxRequest.FromString,
                    "StateChange": views.StateChangeEvent.FromString}
"""How a plugin reading containers through this module has the stub decode the requests
that carry containers (the stub's `request_decoders`): as views of every field
container_info(), container_name(), glance_decoder()'s tests and synced() read, and of
the requests that end a container or a pod, their ids; no other field. (A plugin that
answers a container asking nothing at a glance decodes CreateContainer with
glance_decoder(), which answers it.) The pods
and containers of a Synchronize part over SYNC_MAP_BYTES come bare: read them with
synced(). Of a CreateContainer, StopContainer or RemoveContainer over LARGE_REQUEST
bytes, the pod and container come as their encodings (is_large()): read them with
large_container_info() and ended_id()."""


def _joined(occurrences: list[memoryview]) -> Encoding:
    return occurrences[0] if len(occurrences) == 1 else b"".join(occurrences)


def is_large(container: Container | Encoded) -> bool:
    """Whether the container comes as its encoding (its request was over LARGE_REQUEST
    bytes): read it with large_container_info()."""
    return isinstance(container, Encoded)


def large_container_info(pod: Encoded, container: Encoded, env_scope: tuple[str, ...],
                         pod_keys: tuple[str, ...], own_keys: tuple[str, ...],
                         ) -> Generator[None, None, ContainerInfo]:
    """container_info() of a pod and container given as their encodings, one run of
    fields per step (nri.fields.runs: protobuf decodes each as the large view): the
    caller gives the event loop a turn between steps and gets the ContainerInfo as the
    generator's value. It keeps what its caller reads: the env entries that start with
    one of `env_scope`, the pod's annotations whose key starts with one of `pod_keys`
    and the container's with one of `own_keys` (of a key given twice, the later entry,
    as protobuf decodes a map), every device path and mount destination, and of each
    of the ids and names the last run that holds it (as protobuf keeps a singular
    field's last occurrence). Raises protobuf's DecodeError, or RequestError for more
    than MOST_KEPT of a kind it keeps."""
    pod_fields: dict[str, str] = {}
    pod_annotations: dict[str, str] = {}
    for run in runs(pod.data):
        part = views.LargePodSandbox.FromString(run)
        _present(part, ("id", "name", "uid", "namespace"), pod_fields)
        pod_annotations.update((a.key, a.value) for a in part.annotations
                               if a.key.startswith(pod_keys))
        _check_kept("pod", "annotations", pod_annotations)
        yield
    fields: dict[str, str] = {}
    annotations: dict[str, str] = {}
    env: list[str] = []
    destinations: set[str] = set()
    linux = bytearray()  # every occurrence of the linux part, joined a run at a time
    for run in runs(container.data):
        part = views.LargeContainer.FromString(run)
        _present(part, ("id", "name"), fields)
        annotations.update((a.key, a.value) for a in part.annotations
                           if a.key.startswith(own_keys))
        # a run's thousand tested one by one: searched as one string they take 40 %
        # less, but a long entry costs that search in proportion (one of 4 MiB: 36 ms)
        env += env_entries(part.env, env_scope)
        destinations.update(map(attrgetter("destination"), part.mounts[:]))
        linux += b"".join(part.linux)
        for kind, kept in (("annotations", annotations), ("env entries", env),
                           ("mounts", destinations)):
            _check_kept("container", kind, kept)
        yield
    spec_devices: dict[str, tuple[str, int, int]] = {}
    for run in runs(linux):
        spec_devices.update(map(_numbered, views.LinuxContainer.FromString(run).devices[:]))
        _check_kept("container", "devices", spec_devices)
        yield
    return container_info(views.PodSandbox(**pod_fields), views.Container(**fields), tuple(env),
                          pod_annotations=pod_annotations, annotations=annotations,
                          spec_devices=MappingProxyType(spec_devices),
                          mount_destinations=frozenset(destinations))


MOST_KEPT = 65_536
"""Of a container given as its encoding, the most large_container_info() keeps of each
kind it reads: mounts (a mount namespace holds at most 100,000, fs.mount-max), devices,
env entries and annotations under the prefixes read (the request parser refuses more
than a few hundred of these anyway). Each is a set, list or dict that grows and is
copied whole in one step, some 10 ms a 100,000: a container of more is refused."""


def _check_kept(whose: str, kind: str, kept: Collection[Any]) -> None:
    if len(kept) > MOST_KEPT:
        raise RequestError(f"more than {MOST_KEPT} {kind} in one request, which nri-accel "
                           "does not read", source=f"{whose} {kind}")


def _present(part: Any, names: tuple[str, ...], into: dict[str, str]) -> None:
    """Of the singular fields `names`, those the run `part` holds, into `into`."""
    for name in names:
        if part.HasField(name):
            into[name] = getattr(part, name)


def read_container_info(pod: Pod, container: Container, env_scope: tuple[str, ...],
                        pod_keys: tuple[str, ...], own_keys: tuple[str, ...]) -> ContainerInfo:
    """container_info() of a container (not one given as its encoding) with what its caller
    reads, as large_container_info() keeps it: the env as container_env() gives it,
    the pod's annotations whose key starts with one of `pod_keys` and the container's
    with one of `own_keys`. A value is read only for a key kept: protobuf's map copies
    itself entry by entry through Python's mapping protocol (3 k instructions an entry;
    a container has 7 or more of the runtime's own)."""
    return container_info(pod, container, container_env(container, env_scope),
                          pod_annotations=_starting(pod.annotations, pod_keys),
                          annotations=_starting(container.annotations, own_keys))


def _starting(annotations: Mapping[str, str], prefixes: tuple[str, ...]) -> dict[str, str]:
    return {k: annotations[k] for k in annotations if k.startswith(prefixes)}


def container_info(pod: Pod, container: Container, env: tuple[str, ...] | None = None, *,
                   pod_annotations: Mapping[str, str] | None = None,
                   annotations: Mapping[str, str] | None = None,
                   spec_devices: Mapping[str, tuple[str, int, int]] | None = None,
                   mount_destinations: frozenset[str] | None = None) -> ContainerInfo:
    """What the request pipeline needs to know about a container being created; its
    env as container_env() gives it (by default the whole env), and the rest as given
    (by default read from the messages; of a large view, large_container_info() reads
    them). Annotations given are
    the caller's to give up: the ContainerInfo shows them read-only, uncopied (a large
    request's may be 100,000, which the request parser then refuses)."""
    pod_annotations = dict(pod.annotations) if pod_annotations is None else pod_annotations
    own = dict(container.annotations) if annotations is None else annotations
    # (a repeated field sliced, as in container_env(); read by attrgetter, in C)
    if spec_devices is None:
        spec_devices = MappingProxyType(dict(map(_numbered, container.linux.devices[:])))
    if mount_destinations is None:
        mount_destinations = frozenset(map(attrgetter("destination"), container.mounts[:]))
    return ContainerInfo(
        namespace=pod.namespace,
        pod_name=pod.name,
        pod_uid=pod.uid,
        container_name=name_of(container.name, own),
        container_id=container.id,
        pod_annotations=MappingProxyType(pod_annotations),
        container_annotations=MappingProxyType(own),
        env=tuple(container.env) if env is None else env,
        spec_devices=spec_devices,
        mount_destinations=mount_destinations,
        pod_id=pod.id,
    )


def _numbered(device: Any) -> tuple[str, tuple[str, int, int]]:
    """A LinuxDevice of the container's spec as (its path, (type, major, minor)): what
    the node at that path is, whatever its path says."""
    return device.path, (device.type, device.major, device.minor)


def container_env(container: Container, scope: tuple[str, ...]) -> tuple[str, ...]:
    """The container's env as the pipeline sees it: all of a small env; of a large one
    (over LARGE_ENV entries) only the entries starting with one of `scope`, all that
    its reader looks at (see the module docstring)."""
    env = container.env
    # env[:]: protobuf's repeated field lists itself in one C call, where tuple(env)
    # would take it item by item (half the instructions for a typical env)
    return tuple(env[:]) if len(env) <= LARGE_ENV else env_entries(env, scope)


class PrefixTest:
    """A test of whether any of some strings starts with one of `prefixes`, in C and in
    steps, each cheaper than the next and conclusive when it finds nothing: whether
    the first character of any string is that of a prefix (one set lookup a string:
    a one-character string is one Python keeps, not a new one), then whether its first
    n characters are (n: the shortest prefix's length), then str.startswith, which
    tries the prefixes one after the other. glance_decoder() runs it on every
    CreateContainer, over every annotation key and env entry: for the 8 annotation
    prefixes and a container's 7 keys of the runtime's own
    ("io.kubernetes.cri.container-name"), which end at the first step, that step takes
    40 % of the instructions startswith would take, the second 55 %."""

    __slots__ = ("first", "firsts", "head", "heads", "prefixes")

    def __init__(self, prefixes: tuple[str, ...]) -> None:
        if "" in prefixes:  # it would start every string, and have no first character
            raise ValueError("an empty prefix")
        n = min(map(len, prefixes), default=0)
        self.first = itemgetter(slice(None, 1))
        self.firsts = frozenset(p[:1] for p in prefixes)
        self.head = itemgetter(slice(None, n))
        self.heads = frozenset(p[:n] for p in prefixes)
        self.prefixes = prefixes

    def __call__(self, strings: Collection[str]) -> bool:
        return not (self.firsts.isdisjoint(map(self.first, strings))
                    or self.heads.isdisjoint(map(self.head, strings))
                    or not any(s.startswith(self.prefixes) for s in strings))


def env_entries(env: Sequence[str], prefixes: tuple[str, ...]) -> tuple[str, ...]:
    """The entries of `env` that start with one of `prefixes`, in order. A large env is
    searched as one string (see the module docstring)."""
    # env[:]: a slice, which protobuf lists faster than join would
    text = "\0".join(env[:]) if len(env) > LARGE_ENV else None
    if text is None or text.count("\0") != len(env) - 1:  # small, or an entry holds a NUL
        return tuple([kv for kv in env if kv.startswith(prefixes)])
    found: dict[int, str] = {}  # position in `text` -> entry
    for needle in _needles(prefixes):
        separated = "\0" + needle
        at = 0 if text.startswith(needle) else _after(text.find(separated))
        while at >= 0:
            end = text.find("\0", at)
            entry = text[at:] if end < 0 else text[at:end]
            if entry.startswith(prefixes):
                found[at] = entry
            at = -1 if end < 0 else _after(text.find(separated, end))
    return tuple(found[at] for at in sorted(found))


def _after(separator: int) -> int:
    """Where the entry after a NUL found at `separator` starts; -1 when none was found."""
    return separator + 1 if separator >= 0 else -1


@lru_cache(maxsize=64)
def _needles(prefixes: tuple[str, ...]) -> tuple[str, ...]:
    """What env_entries() searches for: the longest common start of the prefixes that
    share their first three characters ("NVIDIA_" for the five NVIDIA_* prefixes), so
    that one pass finds them all; the entries found are then tested against the
    prefixes themselves."""
    groups: dict[str, list[str]] = {}
    for p in prefixes:
        groups.setdefault(p[:3], []).append(p)
    return tuple(_common_start(group) for group in groups.values())


def _common_start(texts: list[str]) -> str:
    start = texts[0]
    for text in texts[1:]:
        while not text.startswith(start):
            start = start[:-1]
    return start


def container_name(container: pb.Container | views.Container | views.SyncedContainer) -> str:
    """The container's NRI name, else its CRI metadata name as CRI-O records it."""
    return container.name or name_of("", container.annotations)


def name_of(name: str, annotations: Mapping[str, str]) -> str:
    """A container's NRI `name`, else the CRI metadata name CRI-O records in its
    `annotations`."""
    if name:
        return name
    raw = annotations.get(CRIO_METADATA, "")
    if not raw or len(raw) > _MAX_METADATA_CHARS:
        return ""
    try:
        name = json.loads(raw).get("name", "")
    except (ValueError, AttributeError, RecursionError):  # RecursionError: "[[[[..."
        return ""
    return name if isinstance(name, str) else ""


class SyncedPod(Struct, frozen=True):
    """What live_containers() reads of a synchronised pod (pb.PodSandbox's fields of the
    same names, its annotations only those asked for)."""

    id: str
    namespace: str
    name: str
    uid: str
    annotations: Mapping[str, str]


class SyncedContainer(Struct, frozen=True):
    """What live_containers() reads of a synchronised container (pb.Container's fields
    of the same names; `name` as container_name() finds it, its annotations only those
    asked for)."""

    id: str
    pod_sandbox_id: str
    name: str
    state: int
    annotations: Mapping[str, str]


_NO_ANNOTATIONS: Mapping[str, str] = MappingProxyType({})


def synced(pods: Iterable[Any], containers: Iterable[Any],
           keys: Iterable[str], ids: Collection[str] | None = None,
           ) -> Generator[None, None, tuple[list[SyncedPod], list[SyncedContainer]]]:
    """The pods and containers of (a part of) a Synchronize, each as the little
    live_containers() reads of it, with of their annotations only `keys`; of the
    containers, when `ids` is given, only those that carry one of `keys` or whose id
    it lists. A runtime sends tens of thousands of containers over several requests:
    the protobuf messages (some 3 KB each, with their env, mounts and resources) are
    not kept meanwhile, nor a container the caller has no use for. The pods and
    containers may be messages with their annotations (nri_pb2's, or a view's) or bare
    (decode_synchronize(), is_bare()): of those, the annotations are decoded only where
    the bytes hold one of `keys` (and, for a container with no name, CRI-O's metadata
    annotation, read for its name).

    A generator of steps, as large_container_info(): the caller gives the event loop a
    turn between steps and gets the pods and containers as its value. A step ends after
    each run of fields (nri.fields.runs) of a bare pod or container over SYNC_MAP_BYTES
    whose annotations are read (100,000 of them: 30-50 ms); the rest takes one step."""
    keys = tuple(keys)
    intern = sys.intern  # a pod's id and namespace recur in each of its containers
    needles, nameless = _needles_of(keys), _needles_of((*keys, CRIO_METADATA))
    kept_pods = []
    for p in pods:
        annotations = (yield from _kept_bare(p, keys, needles, views.PodSandbox,
                                             views.LargePodSandbox)) \
            if type(p) in _BARE else _wanted(p.annotations, keys)
        kept_pods.append(SyncedPod(intern(p.id), intern(p.namespace), p.name, p.uid,
                                   annotations))
    kept_containers = []
    for c in containers:
        if type(c) not in _BARE:
            name, annotations = container_name(c), _wanted(c.annotations, keys)
        elif c.name:
            name = c.name
            annotations = yield from _kept_bare(c, keys, needles, views.SyncedContainer,
                                                views.LargeSyncedContainer)
        else:  # CRI-O names a container without kubelet's labels in an annotation only
            read = yield from _kept_bare(c, (*keys, CRIO_METADATA), nameless,
                                         views.SyncedContainer, views.LargeSyncedContainer)
            name, annotations = name_of("", read), _wanted(read, keys)
        if annotations or ids is None or c.id in ids:
            kept_containers.append(SyncedContainer(c.id, intern(c.pod_sandbox_id), name,
                                                   c.state, annotations))
    return kept_pods, kept_containers


def _wanted(annotations: Mapping[str, str], keys: tuple[str, ...]) -> Mapping[str, str]:
    return {k: annotations[k] for k in keys if k in annotations} or _NO_ANNOTATIONS


@lru_cache(maxsize=16)
def _needles_of(keys: tuple[str, ...]) -> tuple[bytes, ...]:
    """What synced() looks for in a bare pod's or container's bytes: each of `keys`,
    UTF-8 encoded, or their longest common start where that is 8 bytes or more
    ("nri-accel.io/": one search for every grant annotation)."""
    encoded = tuple(k.encode() for k in keys)
    common = _common_start(list(keys)).encode() if keys else b""
    return (common,) if len(common) >= 8 else encoded


def _kept_bare(item: Any, keys: tuple[str, ...], needles: tuple[bytes, ...],
               entries: Any, large: Any) -> Generator[None, None, Mapping[str, str]]:
    """Of a bare pod's or container's annotations, `keys`: none where no needle appears
    in its bytes (its own fields and the undecoded annotations, serialised again in C);
    else its annotations decoded, as a map (`entries`, the view with them as a map) up
    to SYNC_MAP_BYTES, beyond that as entries (`large`), a run of fields a step, read
    as protobuf reads them into a map: the last entry of a key wins, and an entry
    holding a field other than key and value is set aside (see api/nri_views.proto)."""
    raw = item.SerializeToString()
    if not any(n in raw for n in needles):
        return _NO_ANNOTATIONS
    if len(raw) <= SYNC_MAP_BYTES:
        return _wanted(entries.FromString(raw).annotations, keys)
    wanted, found = frozenset(keys), {}
    for run in runs(raw):
        found.update((a.key, a.value) for a in large.FromString(run).annotations
                     if a.key in wanted and _key_and_value_only(a))
        yield
    return _wanted(found, keys)


def _key_and_value_only(entry: views.Annotation) -> bool:
    """Whether a map entry holds no field but its key and value: its size is theirs
    (UnknownFieldSet would build an object per other field, 2 million in one call)."""
    return entry.ByteSize() == views.Annotation(key=entry.key, value=entry.value).ByteSize()


def live_containers(containers: Iterable[pb.Container | SyncedContainer],
                    pods: Iterable[pb.PodSandbox | SyncedPod],
                    keys: Iterable[str]) -> Iterator[ContainerInfo]:
    """Every synchronised container that has not stopped, as a ContainerInfo carrying of
    the container's and of its pod's annotations only `keys` (a Synchronize can list
    tens of thousands of containers: nothing else is kept)."""
    keys, containers = tuple(keys), list(containers)
    # of the pods (tens of thousands, in one step), only those a container is in
    wanted = {c.pod_sandbox_id for c in containers}
    by_id: dict[str, Any] = {p.id: p for p in pods if p.id in wanted}
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
