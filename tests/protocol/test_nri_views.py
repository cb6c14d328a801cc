"""The request views (api/nri_views.proto): each field is nri.proto's (or, declared as
bytes, a message field's encoding), and a captured request decodes to the same values
through its views as through the full message, and reads the same taken as a large one
(its pod and container decoded a run of fields at a time)."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from demo_node import demo_inventory
from google.protobuf.descriptor import Descriptor, FieldDescriptor
from msgspec.structs import replace
from steps import finished
from wire import CAPTURES, relay_conns, runtime_requests

from nri_accel.config import Config, PolicyConfig
from nri_accel.container import ContainerInfo
from nri_accel.engine import ENV_SCOPE, Engine
from nri_accel.nri import convert
from nri_accel.nri import nri_pb2 as pb
from nri_accel.nri import nri_views_pb2 as views
from nri_accel.nri.simulator import make_container, make_pod
from nri_accel.nri.stub import Identity, Stub, length_delimited
from nri_accel.plugin import CONTAINER_KEYS, AccelPlugin
from nri_accel.request import ANNOTATION_PREFIXES

# view message -> the nri.proto message it stands for (by default, the same name)
STANDS_FOR = {"SyncedContainer": "Container", "LargePodSandbox": "PodSandbox",
              "LargeContainer": "Container", "EndedPod": "PodSandbox",
              "EndedContainer": "Container", "GlanceCreateContainerRequest":
              "CreateContainerRequest", "GlanceContainer": "Container",
              "BareSynchronizeRequest": "SynchronizeRequest", "BarePodSandbox": "PodSandbox",
              "BareSyncedContainer": "Container", "LargeSyncedContainer": "Container"}
FULL_REQUESTS = {"CreateContainer": pb.CreateContainerRequest,
                 "Synchronize": pb.SynchronizeRequest,
                 "StopContainer": pb.StopContainerRequest,
                 "RemoveContainer": pb.RemoveContainerRequest,
                 "StopPodSandbox": pb.StopPodSandboxRequest,
                 "RemovePodSandbox": pb.RemovePodSandboxRequest,
                 "StateChange": pb.StateChangeEvent}
ANNOTATIONS_ENTRY = pb.PodSandbox.DESCRIPTOR.fields_by_name["annotations"].message_type


def _counterpart(view: Descriptor) -> Descriptor:
    if view.name == "Annotation":  # a map<string, string> annotations' entry
        return ANNOTATIONS_ENTRY
    return pb.DESCRIPTOR.message_types_by_name[STANDS_FOR.get(view.name, view.name)]


def _mismatches(view: Descriptor, full: Descriptor) -> list[str]:
    """Every way a field of `view` differs from the same-named field of `full`."""
    found = []
    for field in view.fields:
        theirs = full.fields_by_name.get(field.name)
        where = f"{view.name}.{field.name}"
        if theirs is None:
            found.append(f"{where}: not a field of {full.name}")
            continue
        if field.number != theirs.number:
            found.append(f"{where}: number {field.number}, nri.proto {theirs.number}")
        if field.type == FieldDescriptor.TYPE_BYTES and theirs.message_type is not None \
                and not theirs.is_repeated:
            # a message field taken as its encoding (api/nri_views.proto): repeated, to
            # keep every occurrence, which protobuf would merge into one message
            if not field.is_repeated:
                found.append(f"{where}: a message taken as bytes, not repeated")
            continue
        if field.is_repeated != theirs.is_repeated:
            found.append(f"{where}: repeated differs")
        enum_as_int = (theirs.type == FieldDescriptor.TYPE_ENUM
                       and field.type == FieldDescriptor.TYPE_INT32)
        if field.type != theirs.type and not enum_as_int:
            found.append(f"{where}: type {field.type}, nri.proto {theirs.type}")
        if field.message_type is not None and theirs.message_type is not None:
            if theirs.message_type.GetOptions().map_entry:  # a map, or its entries
                found += _mismatches(field.message_type, theirs.message_type)
            elif _counterpart(field.message_type) is not theirs.message_type:
                found.append(f"{where}: a {field.message_type.name}, nri.proto a "
                             f"{theirs.message_type.name}")
    return found


def test_every_view_field_is_the_nri_field_of_that_name() -> None:
    messages = list(views.DESCRIPTOR.message_types_by_name.values())
    assert len(messages) == 22
    assert [m for view in messages for m in _mismatches(view, _counterpart(view))] == []


def test_a_view_field_unlike_nri_proto_is_found() -> None:
    # the check above can fail: the view's Container read as if it stood for a pod
    assert _mismatches(views.Container.DESCRIPTOR, pb.PodSandbox.DESCRIPTOR) == [
        "Container.name: number 3, nri.proto 2",
        "Container.env: not a field of PodSandbox",
        "Container.mounts: not a field of PodSandbox",
        "Container.linux: number 11, nri.proto 8",
        "Container.linux: a LinuxContainer, nri.proto a LinuxPodSandbox",
    ]


def _same(view: Any, full: Any) -> list[str]:
    """The declared fields of `view` whose values differ from `full`'s."""
    differ = []
    for field in view.DESCRIPTOR.fields:
        mine, theirs = getattr(view, field.name), getattr(full, field.name)
        entry = full.DESCRIPTOR.fields_by_name[field.name].message_type
        if entry is not None and entry.GetOptions().map_entry:
            # a map, or its entries in the large views: the last entry of a key wins
            read = dict(mine) if field.message_type.GetOptions().map_entry else {
                a.key: a.value for a in mine}
            if read != dict(theirs):
                differ.append(field.name)
        elif field.is_repeated and field.message_type is not None:
            if len(mine) != len(theirs):
                differ.append(field.name)
            else:
                differ += [d for m, t in zip(mine, theirs, strict=True) for d in _same(m, t)]
        elif field.message_type is not None:
            differ += _same(mine, theirs)
        elif field.is_repeated:
            if list(mine) != list(theirs):
                differ.append(field.name)
        elif mine != theirs:
            differ.append(field.name)
    return differ


@pytest.mark.parametrize("capture", CAPTURES)
def test_captured_requests_read_the_same_through_their_views(nri_wire_dir: Path,
                                                             capture: str) -> None:
    checked = 0
    for relay in relay_conns(nri_wire_dir, capture):
        for _, method, payload in runtime_requests(nri_wire_dir, capture, relay):
            if method in convert.REQUEST_DECODERS:
                full = FULL_REQUESTS[method].FromString(payload)
                assert _same(convert.REQUEST_DECODERS[method](payload), full) == [], (
                    capture, method)
                if method == "CreateContainer":
                    glance = views.GlanceCreateContainerRequest.FromString(payload)
                    assert _same(glance, full) == [], capture
                    assert _read_large(payload) == _read(payload), capture
                checked += 1
    assert checked


def test_a_view_decodes_what_it_declares_and_skips_the_rest() -> None:
    pod = make_pod({"name": "p", "annotations": {"a": "1"}, "labels": {"l": "x"}})
    ctr = make_container(pod, {"name": "c", "env": ["A=1"], "args": ["sleep"],
                               "mounts": [{"destination": "/d", "source": "/s"}],
                               "linux": {"devices": [{"path": "/dev/fuse", "major": 10}]}})
    payload = pb.CreateContainerRequest(pod=pod, container=ctr).SerializeToString()
    view = views.CreateContainerRequest.FromString(payload)
    assert (view.pod.name, dict(view.pod.annotations)) == ("p", {"a": "1"})
    assert (view.container.name, list(view.container.env)) == ("c", ["A=1"])
    assert [m.destination for m in view.container.mounts] == ["/d"]
    assert [d.path for d in view.container.linux.devices] == ["/dev/fuse"]
    assert not hasattr(view.container, "args") and not hasattr(view.pod, "labels")
    # what it skipped is still there, as unknown fields: the bytes round-trip whole
    assert pb.CreateContainerRequest.FromString(view.SerializeToString()) == \
        pb.CreateContainerRequest.FromString(payload)


def _read(payload: bytes) -> ContainerInfo:
    """What the daemon reads of a CreateContainer's view, as it keeps it of a large one:
    the annotations it reads, and of the env only the entries in scope."""
    view = views.CreateContainerRequest.FromString(payload)
    info = convert.read_container_info(view.pod, view.container, ENV_SCOPE,
                                       ANNOTATION_PREFIXES, CONTAINER_KEYS)
    return replace(info, env=convert.env_entries(info.env, ENV_SCOPE))


def _read_large(payload: bytes) -> ContainerInfo:
    """What the daemon reads of a CreateContainer over convert.LARGE_REQUEST bytes."""
    large = convert.decode_large(payload)
    return finished(convert.large_container_info(large.pod, large.container, ENV_SCOPE,
                                                 ANNOTATION_PREFIXES, CONTAINER_KEYS))


class _Seen:
    """A plugin recording the message types the stub hands it."""

    def __init__(self, request_decoders: dict[str, Any] | None = None) -> None:
        if request_decoders is not None:
            self.request_decoders = request_decoders
        self.types: list[str] = []

    def create_container(self, pod: Any, container: Any) -> None:
        self.types += [_type_name(pod), _type_name(container)]

    def synchronize(self, pods: Any, containers: Any) -> None:
        self.types += [c.DESCRIPTOR.full_name for c in containers]


def _type_name(item: Any) -> str:
    """A message's full name; else its Python class's (convert.Encoded)."""
    if hasattr(item, "DESCRIPTOR"):
        return str(item.DESCRIPTOR.full_name)
    return f"{type(item).__module__}.{type(item).__qualname__}"


def test_the_stub_decodes_as_the_plugin_asks_and_in_full_otherwise() -> None:
    pod = make_pod({"name": "p"})
    ctr = make_container(pod, {"name": "c"})
    create = pb.CreateContainerRequest(pod=pod, container=ctr).SerializeToString()
    sync = pb.SynchronizeRequest(pods=[pod], containers=[ctr]).SerializeToString()
    for plugin, package, synced in ((_Seen(convert.REQUEST_DECODERS), "nri_accel.views.v1",
                                     "SyncedContainer"),
                                    (_Seen(), "nri.pkg.api.v1alpha1", "Container")):
        stub = Stub(plugin, Identity("seen", "50"), socket_path="/nonexistent")
        assert stub._create_container(None, create) == b""
        stub._synchronize(None, sync)
        assert plugin.types == [f"{package}.PodSandbox", f"{package}.Container",
                                f"{package}.{synced}"]


def test_an_annotation_entry_with_an_unknown_field_is_kept_by_the_large_view_only() -> None:
    # Found by the NRI fuzz target: protobuf's Python decoding of a map sets aside an
    # entry holding a field other than key and value (among the message's unknown
    # fields); Go's keeps its key and value, and so does the large view. A runtime
    # never writes such an entry.
    odd = views.Annotation.FromString(b"\n\x0ccdi.k8s.io/x\x12\x01v\xd8\x01\x20")
    large = views.LargeContainer()
    large.annotations.append(odd)
    large.annotations.add(key="devices.nri-accel.io", value="")
    data = large.SerializeToString()
    assert dict(views.Container.FromString(data).annotations) == {"devices.nri-accel.io": ""}
    assert [(a.key, a.value) for a in views.LargeContainer.FromString(data).annotations] == [
        ("cdi.k8s.io/x", "v"), ("devices.nri-accel.io", "")]


def test_a_create_over_large_request_bytes_is_decoded_as_the_large_view() -> None:
    def create(filler: int) -> bytes:
        pod = make_pod({"name": "p", "annotations": {"filler": "x" * filler}})
        ctr = make_container(pod, {"name": "c"})
        return pb.CreateContainerRequest(pod=pod, container=ctr).SerializeToString()

    at_limit = next(create(n) for n in range(convert.LARGE_REQUEST - 400, convert.LARGE_REQUEST)
                    if len(create(n)) == convert.LARGE_REQUEST)
    over = create(at_limit.count(b"x") + 1)
    assert len(over) == convert.LARGE_REQUEST + 1
    seen = []
    for payload in (at_limit, over):
        plugin = _Seen(convert.REQUEST_DECODERS)
        stub = Stub(plugin, Identity("seen", "50"), socket_path="/nonexistent")
        assert stub._create_container(None, payload) == b""
        seen.append(plugin.types)
    assert seen == [["nri_accel.views.v1.PodSandbox", "nri_accel.views.v1.Container"],
                    ["nri_accel.nri.convert.Encoded"] * 2]


def test_the_daemon_reads_creates_and_synchronize_through_the_views() -> None:
    assert set(convert.REQUEST_DECODERS) == set(FULL_REQUESTS)
    decoders = AccelPlugin(Engine(demo_inventory(), Config())).request_decoders
    assert {m: d for m, d in decoders.items() if m != "CreateContainer"} == {
        m: d for m, d in convert.REQUEST_DECODERS.items() if m != "CreateContainer"}
    # a CreateContainer at a glance, answered so when it asks nothing, and in the full
    # view only when it asks
    pod = make_pod({"name": "p", "annotations": {"prometheus.io/scrape": "true"}})
    ctr = make_container(pod, {"name": "c", "env": ["PATH=/bin"]})
    payload = pb.CreateContainerRequest(pod=pod, container=ctr).SerializeToString()
    assert decoders["CreateContainer"](payload) == convert.ASKED_NOTHING
    env = ["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=0"]
    ctr = make_container(pod, {"name": "c", "env": env})
    payload = pb.CreateContainerRequest(pod=pod, container=ctr).SerializeToString()
    req = decoders["CreateContainer"](payload)
    assert req.container.DESCRIPTOR.full_name == "nri_accel.views.v1.Container"
    assert list(req.container.env) == env


def test_the_requests_that_end_a_container_or_a_pod_are_read_for_their_ids() -> None:
    # a container with 100,000 annotations: as a map, some 50 ms of decoding per request;
    # over convert.LARGE_REQUEST, a StopContainer's or RemoveContainer's container comes
    # as its encoding, its id read a run of fields at a time
    pod = make_pod({"name": "p", "uid": "u-1"})
    ctr = make_container(pod, {"name": "c", "id": "c-1", "annotations": {
        f"k{i:06d}": "v" for i in range(100_000)}})
    seen: list[tuple[str, ...]] = []

    class Ends:
        request_decoders = convert.REQUEST_DECODERS

        def stop_container(self, pod: Any, container: Any) -> None:
            if convert.is_large(container):
                seen.append(("Encoded", finished(convert.ended_id(container))))
            else:
                seen.append((container.DESCRIPTOR.name, container.id))

        remove_container = stop_container

        def stop_pod_sandbox(self, pod: Any) -> None:
            seen.append((pod.DESCRIPTOR.name, pod.id, pod.uid))

        remove_pod_sandbox = stop_pod_sandbox

    services = Stub(Ends(), Identity("ends", "50"), socket_path="/nonexistent")._services()
    for method in ("StopContainer", "RemoveContainer", "StopPodSandbox", "RemovePodSandbox"):
        payload = FULL_REQUESTS[method](pod=pod, container=ctr).SerializeToString() \
            if "Container" in method else FULL_REQUESTS[method](pod=pod).SerializeToString()
        services[method](None, payload)
    for event in (pb.REMOVE_CONTAINER, pb.STOP_POD_SANDBOX):  # NRI before v0.7
        services["StateChange"](None, pb.StateChangeEvent(
            event=event, pod=pod, container=ctr).SerializeToString())
    assert seen == [("Encoded", "c-1")] * 2 + [("EndedPod", pod.id, "u-1")] * 2 + [
        ("EndedContainer", "c-1"), ("EndedPod", pod.id, "u-1")]


@pytest.mark.parametrize("method", ["StopContainer", "RemoveContainer"])
def test_a_large_end_of_a_container_releases_its_grant(method: str) -> None:
    # the container of the end as a CRI client may send it: 100,000 one-byte env entries
    # (a view would skip them in one C call of some 5 ms); its id given twice, the last
    # one counts, as protobuf reads it
    plugin = AccelPlugin(Engine(demo_inventory(), Config(policy=PolicyConfig("standalone"))))
    pod = make_pod({"name": "p", "namespace": "ml", "annotations": {
        "devices.nri-accel.io/container.c": "nvidia.com/gpu=0"}})
    ctr = make_container(pod, {"name": "c", "id": "c-1"})
    assert plugin.create_container(*_view(plugin, pod, ctr))  # the GPU granted
    assert plugin.engine.holds("c-1", "", "")
    ended = pb.Container(id="decoy", env=["A"] * 100_000)
    data = ended.SerializeToString() + pb.Container(id="c-1").SerializeToString()
    payload = length_delimited(1, pod.SerializeToString()) + length_delimited(2, data)
    assert len(payload) > convert.LARGE_REQUEST
    services = Stub(plugin, Identity("nri-accel", "40"), socket_path="/nonexistent")._services()
    answer = services[method](None, payload)
    assert not isinstance(answer, bytes)  # the id is read in steps
    assert asyncio.run(_awaited(answer)) == b""
    assert not plugin.engine.holds("c-1", "", "")


def _view(plugin: AccelPlugin, pod: Any, ctr: Any) -> tuple[Any, Any]:
    req = plugin.request_decoders["CreateContainer"](
        pb.CreateContainerRequest(pod=pod, container=ctr).SerializeToString())
    return req.pod, req.container


async def _awaited(answer: Any) -> Any:
    return await answer
