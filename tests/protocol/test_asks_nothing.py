"""AccelPlugin's answer to a container that asks for nothing, over the real Engine.

A container none of whose annotation keys or env entries the request parser reads is
answered at once, empty, and logged at debug only (the fast path of
AccelPlugin.create_container). Everything that does read as a request still takes the
full path: a visibility variable in the env (rewritten to "void" where env may not
grant), the annotations nri-accel refuses, and a container whose creation replaces a
grant. Large envs (over convert.LARGE_ENV entries, searched as one string) behave as
small ones; so do requests over convert.LARGE_REQUEST bytes (huge envs or annotations,
their pod and container decoded a run of fields.RUN_FIELDS fields at a time, with the
event loop free in between). The inventory is the built-in demo node (8 A100s,
tests/demo_node.py).
"""

from __future__ import annotations

import asyncio
import inspect
import random
from types import MappingProxyType
from typing import Any

import pytest
from demo_node import demo_inventory
from google.protobuf.empty_pb2 import Empty
from google.protobuf.unknown_fields import UnknownFieldSet
from msgspec.structs import replace
from steps import finished
from structlog.testing import capture_logs

from nri_accel.config import Config, PolicyConfig
from nri_accel.container import ContainerInfo
from nri_accel.engine import Engine
from nri_accel.errors import PolicyError, RequestError
from nri_accel.nri import convert
from nri_accel.nri import nri_pb2 as pb
from nri_accel.nri.fields import RUN_FIELDS
from nri_accel.nri.simulator import make_container, make_pod
from nri_accel.nri.stub import Identity, Stub, _created, length_delimited
from nri_accel.plugin import AccelPlugin
from nri_accel.request import ANNOTATION_PREFIXES, ENV_PREFIXES, Parsed, parse
from nri_accel.ttrpc import Code, TtrpcError

pytestmark = pytest.mark.usefixtures("all_logs")  # tests/conftest.py: debug lines too

UNRELATED_POD = {"kubernetes.io/config.seen": "2024-05-01T10:00:00Z",
                 "prometheus.io/scrape": "true", "mounts.noderesource.dev/container.c0": "x"}
UNRELATED_ENV = ["PATH=/bin", "HOSTNAME=vm", "NVIDIA=1", "NVIDIA_VISIBLE_DEVICES",
                 "MY_NVIDIA_VISIBLE_DEVICES=all", "LD_LIBRARY_PATH=/opt/lib"]
BIG = convert.LARGE_ENV + 100  # entries: the large-env path
SLICE = RUN_FIELDS  # fields of a large request's pod or container read in one step


def plugin(*trusted: str) -> AccelPlugin:
    config = Config(policy=PolicyConfig("kubernetes", frozenset(trusted)))
    return AccelPlugin(Engine(demo_inventory(), config))


def create(accel: AccelPlugin, *, namespace: str = "sandbox", name: str = "main",
           pod_annotations: dict[str, str] | None = None,
           annotations: dict[str, str] | None = None,
           env: list[str] | None = None, cid: str = "") -> tuple[Any, list[dict[str, Any]]]:
    pod = make_pod({"name": "p", "namespace": namespace,
                    "annotations": pod_annotations or UNRELATED_POD})
    ctr = make_container(pod, {"name": name, "env": env if env is not None else UNRELATED_ENV,
                               "annotations": annotations or {}, "id": cid})
    with capture_logs() as logs:
        req = served(accel, pod, ctr)
        if asked_nothing(req):  # answered by the decoder: create_container is not called
            return None, logs
        encoded = accel.create_container(req.pod, req.container)  # the adjustment, or None
        if inspect.iscoroutine(encoded):  # a large env: searched in parts, the loop free
            encoded = asyncio.run(encoded)
    return None if encoded is None else pb.ContainerAdjustment.FromString(encoded), logs


def served(accel: AccelPlugin, pod: Any, ctr: Any) -> Any:
    """The request as the daemon's stub hands it to `accel`: encoded, then decoded as
    the plugin asks (answered at a glance, or as the full or the large view)."""
    payload = pb.CreateContainerRequest(pod=pod, container=ctr).SerializeToString()
    return accel.request_decoders["CreateContainer"](payload)


def asked_nothing(req: Any) -> bool:
    """Whether the plugin's decoder answered the request itself (the stub then sends
    its bytes): the container asks for nothing and replaces no grant."""
    return isinstance(req, bytes)


def infos(logs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in logs if e["log_level"] != "debug"]


@pytest.mark.parametrize("env", [UNRELATED_ENV, [f"V{i}=x" for i in range(BIG)]],
                         ids=["small env", "large env"])
def test_a_container_with_only_unrelated_env_and_annotations_gets_an_empty_answer(
    env: list[str],
) -> None:
    accel = plugin()
    result, logs = create(accel, env=env,
                          annotations={"io.kubernetes.cri.container-name": "main"})
    assert result is None and _created(result) == b""
    assert infos(logs) == []
    (line,) = logs
    assert (line["event"], line["devices"]) == ("container_created", [])
    counts, _, _ = accel.requests["create_container"].snapshot()
    assert counts["ok"] == 1


@pytest.mark.parametrize("env", [
    ["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=all"],
    [f"V{i}=x" for i in range(BIG)] + ["NVIDIA_VISIBLE_DEVICES=all"],
], ids=["small env", "large env"])
def test_nvidia_visible_devices_all_in_an_untrusted_namespace_is_still_rewritten_to_void(
    env: list[str],
) -> None:
    result, logs = create(plugin(), env=env)
    assert [(kv.key, kv.value) for kv in result.env] == [("NVIDIA_VISIBLE_DEVICES", "void")]
    assert not result.linux.devices
    (line,) = infos(logs)
    assert line["event"] == "container_created" and line["devices"] == []
    assert "env NVIDIA_VISIBLE_DEVICES=all not granted" in line["notes"][0]


def test_a_note_shows_a_value_escaped_where_it_holds_text_that_reorders_a_line() -> None:
    # U+2028 and U+2029 (line and paragraph separators) pass the grammar's control
    # check, and "all" still reads as the request (they are blanks around it); the log
    # line, read on a terminal, shows them escaped.
    result, logs = create(plugin(), env=["NVIDIA_VISIBLE_DEVICES=\u2028all\u2029"])
    assert [(kv.key, kv.value) for kv in result.env] == [("NVIDIA_VISIBLE_DEVICES", "void")]
    (line,) = infos(logs)
    (note,) = line["notes"]
    assert note.startswith("env NVIDIA_VISIBLE_DEVICES=\\u2028all\\u2029 not granted: ")
    assert note.isprintable()


def served_large(accel: AccelPlugin, pod: Any, ctr: Any) -> tuple[Any, int]:
    """A create over convert.LARGE_REQUEST bytes as the daemon serves it (its pod and
    container left encoded, answered by a coroutine): the answer, and how often the loop
    turned."""
    req = served(accel, pod, ctr)
    assert convert.is_large(req.container)
    assert pb.PodSandbox.FromString(req.pod.data) == pod
    assert pb.Container.FromString(req.container.data) == ctr
    turns = 0

    async def main() -> Any:
        nonlocal turns
        answer = asyncio.ensure_future(accel.create_container(req.pod, req.container))
        while not answer.done():
            turns += 1
            await asyncio.sleep(0)
        return answer.result()

    return asyncio.run(main()), turns


def steps(pod: Any, ctr: Any) -> int:
    """The loop turns served_large() sees for `pod` and `ctr`: two before their fields are
    read, then one after each run of SLICE fields of the pod, of the container, and of
    the container's linux part, whose fields protobuf counts (as the unknown fields of
    an empty message)."""
    runs = [-(-len(UnknownFieldSet(Empty.FromString(m.SerializeToString()))) // SLICE)
            for m in (pod, ctr, ctr.linux)]
    return 2 + sum(runs)


def gpus(encoded: bytes | None) -> list[str]:
    adjustment = pb.ContainerAdjustment.FromString(encoded or b"")
    return [d.path for d in adjustment.linux.devices if d.path[11:].isdigit()]


def test_a_huge_env_is_searched_in_parts_with_the_event_loop_free_between() -> None:
    # 2.5 parts of filler, then a request in the last: found, the loop free in between
    env = [f"V{i}={i:032d}" for i in range(SLICE * 5 // 2)] + ["NVIDIA_VISIBLE_DEVICES=0"]
    pod = make_pod({"name": "p", "namespace": "ml"})
    ctr = make_container(pod, {"name": "main", "env": env})
    result, turns = served_large(plugin("ml"), pod, ctr)
    assert turns == steps(pod, ctr) == 2 + 1 + 3 + 0  # the env fills 3 runs, no linux part
    assert gpus(result) == ["/dev/nvidia0"]


def test_huge_annotations_are_read_in_parts_with_the_event_loop_free_between() -> None:
    # 100,000 annotations (3 MB): protobuf would build the map in one call of some 50 ms
    filler = {f"example.com/key-{i:06d}": "v" * 8 for i in range(SLICE * 20)}
    pod = make_pod({"name": "p", "namespace": "ml",
                    "annotations": {**filler, "devices.nri-accel.io/container.main":
                                    "nvidia.com/gpu=1"}})
    ctr = make_container(pod, {"name": "main", "env": [], "annotations": filler})
    accel = plugin("ml")
    result, turns = served_large(accel, pod, ctr)
    assert turns == steps(pod, ctr) >= 2 + 21 + 20  # the fields: 40,000 annotations and more
    assert gpus(result) == ["/dev/nvidia1"]
    # among them, what the parser refuses is still refused, naming its key
    ctr.annotations["nri-accel.io/granted"] = "nvidia.com/gpu=2"
    with pytest.raises(RequestError) as raised:
        served_large(accel, pod, ctr)
    assert raised.value.source == "container annotation nri-accel.io/granted"


def test_tens_of_thousands_of_mounts_and_devices_are_read_in_parts() -> None:
    # the container already has the GPU's node (the same device: its type and numbers)
    # and nvidia-smi: they are not added again
    pod = make_pod({"name": "p", "namespace": "ml"})
    ctr = make_container(pod, {"name": "main", "env": ["NVIDIA_VISIBLE_DEVICES=0"],
                               "mounts": [{"destination": f"/m/{i:06d}", "source": "/s"}
                                          for i in range(SLICE * 3)]
                               + [{"destination": "/usr/bin/nvidia-smi", "source": "/x"}],
                               "linux": {"devices": [{"path": f"/dev/x{i:06d}"}
                                                     for i in range(SLICE * 2)]
                                         + [{"path": "/dev/nvidia0", "type": "c",
                                             "major": 195, "minor": 0}]}})
    result, turns = served_large(plugin("ml"), pod, ctr)
    assert turns == steps(pod, ctr) == 2 + 1 + 4 + 3  # 6,002 mounts and more, 4,001 devices
    adjustment = pb.ContainerAdjustment.FromString(result)
    paths = {d.path for d in adjustment.linux.devices}
    assert "/dev/nvidiactl" in paths and "/dev/nvidia0" not in paths
    assert "/usr/bin/nvidia-smi" not in {m.destination for m in adjustment.mounts}
    alone, _ = create(plugin("ml"), namespace="ml", env=["NVIDIA_VISIBLE_DEVICES=0"])
    assert "/usr/bin/nvidia-smi" in {m.destination for m in alone.mounts}
    assert "/dev/nvidia0" in {d.path for d in alone.linux.devices}


@pytest.mark.parametrize("tail, error", [
    (b"\x42\x05AB", "a field runs 3 bytes past the end of its message"),  # an entry cut short
    (b"\x42\x02\xff\xfe", "Error parsing message"),  # an env entry that is not UTF-8
])
def test_a_huge_create_whose_container_does_not_decode_is_refused_as_malformed(
        tail: bytes, error: str) -> None:
    # the pod and container are decoded a run at a time, after the stub has handed them
    # over: damage in the last run is refused as the stub refuses a request it cannot
    # decode, INVALID_ARGUMENT naming the message, not as a handler's failure
    pod = make_pod({"name": "p", "namespace": "ml"})
    env = [f"V{i:06d}=xxxxxxxx" for i in range(8 * SLICE)]
    ctr = make_container(pod, {"name": "main", "env": env})
    payload = (length_delimited(1, pod.SerializeToString())
               + length_delimited(2, ctr.SerializeToString() + tail))
    assert len(payload) > convert.LARGE_REQUEST
    stub = Stub(plugin("ml"), Identity("nri-accel", "40"), socket_path="/nonexistent")
    with capture_logs() as logs, pytest.raises(TtrpcError) as raised:
        asyncio.run(stub._create_container(None, payload))
    assert raised.value.code == Code.INVALID_ARGUMENT
    assert str(raised.value.message).startswith("malformed CreateContainerRequest: ")
    assert error in raised.value.message
    assert not [line for line in logs if line["log_level"] == "error"]


_MANY_KEYS = {f"cdi.k8s.io/k{i:06d}": "vendor.com/class=a" for i in range(8 * SLICE)}


@pytest.mark.parametrize("source, pod_annotations, ctr_fields", [
    ("pod annotations", _MANY_KEYS, {}),
    ("container annotations", {}, {"annotations": _MANY_KEYS}),
    ("container mounts", {}, {"mounts": [{"destination": f"/m/{i:06d}", "source": "/s"}
                                         for i in range(8 * SLICE)]}),
    ("container devices", {}, {"linux": {"devices": [{"path": f"/dev/x{i:06d}"}
                                                     for i in range(8 * SLICE)]}}),
    ("container env entries", {}, {"env": [f"NV_GPU={i}" for i in range(8 * SLICE)]}),
])
def test_a_huge_create_of_more_of_a_kind_than_is_kept_is_refused_naming_it(
        monkeypatch: pytest.MonkeyPatch, source: str, pod_annotations: dict[str, str],
        ctr_fields: dict[str, Any]) -> None:
    # each kind is kept in a set, list or dict copied whole in one step: more than
    # MOST_KEPT (65,536; 2,000 here) is refused as it is found, the request unread
    monkeypatch.setattr(convert, "MOST_KEPT", 2 * SLICE)
    pod = make_pod({"name": "p", "namespace": "ml", "annotations": pod_annotations})
    ctr = make_container(pod, {"name": "main", **ctr_fields})
    with capture_logs() as logs, pytest.raises(RequestError) as raised:
        served_large(plugin("ml"), pod, ctr)
    kind = source.split(" ", 1)[1]
    assert raised.value.source == source
    assert f"more than {2 * SLICE} {kind} in one request" in str(raised.value)
    (line,) = [line for line in logs if line["event"] == "container_refused"]
    assert line["source"] == source and line["container"] == ""


def test_a_huge_create_that_asks_nothing_is_answered_empty() -> None:
    filler = {f"example.com/key-{i:06d}": "v" * 8 for i in range(SLICE * 3)}
    pod = make_pod({"name": "p", "annotations": filler})
    ctr = make_container(pod, {"name": "main", "annotations": filler,
                               "env": [f"V{i}=x" for i in range(2 * SLICE)]})
    result, _ = served_large(plugin(), pod, ctr)
    assert pb.ContainerAdjustment.FromString(result) == pb.ContainerAdjustment()


def test_a_huge_create_of_a_cri_o_container_is_named_from_its_metadata() -> None:
    filler = {f"example.com/key-{i:06d}": "v" * 8 for i in range(SLICE * 3)}
    pod = make_pod({"name": "p", "namespace": "ml", "annotations": {
        **filler, "devices.nri-accel.io/container.trainer": "nvidia.com/gpu=3"}})
    ctr = make_container(pod, {"name": "", "annotations": {
        **filler, convert.CRIO_METADATA: '{"name": "trainer"}'}})
    result, _ = served_large(plugin("ml"), pod, ctr)
    assert gpus(result) == ["/dev/nvidia3"]


def test_a_cuda_image_in_a_trusted_namespace_gets_its_gpus() -> None:
    result, _ = create(plugin("ml"), namespace="ml", env=["NVIDIA_VISIBLE_DEVICES=0"])
    assert "/dev/nvidia0" in [d.path for d in result.linux.devices]


@pytest.mark.parametrize("pod_annotations, annotations, error, source", [
    ({"nri-accel.io/granted": "nvidia.com/gpu=0"}, {}, RequestError,
     "annotation nri-accel.io/granted"),
    ({}, {"nri-accel.io/shared": "nvidia.com/gpu=0"}, RequestError,
     "container annotation nri-accel.io/shared"),
    ({"devices.nri-accel.io/pods": "nvidia.com/gpu=0"}, {}, RequestError,
     "annotation devices.nri-accel.io/pods"),
    ({"devices.nri-accel.io/pod": "nvidia.com/gpu=0"}, {}, PolicyError,
     "annotation devices.nri-accel.io/pod"),
], ids=["reserved on the pod", "reserved on the container", "misspelt key",
        "pod annotation in an untrusted namespace"])
def test_annotations_the_parser_refuses_are_still_refused(
    pod_annotations: dict[str, str], annotations: dict[str, str], error: type[Exception],
    source: str,
) -> None:
    with pytest.raises(error) as raised:
        create(plugin(), pod_annotations={**UNRELATED_POD, **pod_annotations},
               annotations=annotations)
    assert raised.value.source == source  # type: ignore[attr-defined]


def test_a_new_create_of_the_same_pod_and_name_asking_nothing_still_ends_the_old_grant() -> None:
    accel = plugin()
    granted, _ = create(accel, annotations={"devices.nri-accel.io": "nvidia.com/gpu=0"},
                        cid="first")
    assert granted.linux.devices
    assert accel.engine.holdings.get("first") is not None
    again, logs = create(accel, cid="second")  # kubelet's retry, now asking nothing
    assert not again.linux.devices and not again.annotations
    assert accel.engine.holdings.get("first") is None
    assert [e["event"] for e in infos(logs)] == ["grant_replaced", "container_created"]


def test_a_cri_o_container_asking_nothing_still_ends_the_old_grant_of_its_name() -> None:
    # CRI-O without kubelet's labels: no NRI name; at a glance, the name the grant is
    # recorded under is read from CRI-O's metadata, as the full path reads it
    accel = plugin()
    metadata = {convert.CRIO_METADATA: '{"name":"main","attempt":0}'}
    granted, _ = create(accel, name="", cid="first", annotations={
        **metadata, "devices.nri-accel.io": "nvidia.com/gpu=0"})
    assert granted.linux.devices
    again, logs = create(accel, name="", cid="second", annotations=metadata)
    assert again is not None and not again.linux.devices
    assert accel.engine.holdings.get("first") is None
    assert [e["event"] for e in infos(logs)] == ["grant_replaced", "container_created"]


def test_a_large_env_keeps_the_container_ld_library_path_when_it_is_extended() -> None:
    env = [*(f"V{i}=x" for i in range(BIG)), "LD_LIBRARY_PATH=/opt/own"]
    result, _ = create(plugin(), env=env,
                       annotations={"devices.nri-accel.io": "nvidia.com/gpu=0"})
    (ld,) = [kv.value for kv in result.env if kv.key == "LD_LIBRARY_PATH"]
    assert ld.startswith("/opt/own:")


@pytest.mark.parametrize("size", [0, 3, convert.LARGE_ENV, convert.LARGE_ENV + 1, 5000])
def test_env_entries_are_the_entries_starting_with_a_prefix_in_order(size: int) -> None:
    prefixes = ("NVIDIA_VISIBLE_DEVICES=", "NVIDIA_REQUIRE_", "NV_GPU=", "LD_LIBRARY_PATH=",
                "Ü=")
    env = [f"V{i}=NVIDIA_VISIBLE_DEVICES=x" for i in range(size)]
    for i, entry in enumerate(("NVIDIA_REQUIRE_CUDA=cuda>=12", "LD_LIBRARY_PATH=/a", "Ü=1",
                               "NVIDIA_VISIBLE_DEVICES=0", "NVIDIA_REQUIRE", "NVIDIA_X=1",
                               "NV_GPU=1", "NV_GPU=2")):
        env.insert(i * size // 8, entry)
    expected = tuple(e for e in env if e.startswith(prefixes))
    assert len(expected) == 6
    assert convert.env_entries(env, prefixes) == expected
    assert convert.env_entries(["NV_GPU=0", *env], prefixes) == ("NV_GPU=0", *expected)
    assert convert.env_entries([*env, "NV_GPU="], prefixes) == (*expected, "NV_GPU=")
    assert convert.env_entries(env, ("NOT_THERE=",)) == ()
    ctr = make_container(make_pod({"name": "p"}), {"name": "c", "env": env})
    kept = convert.container_env(ctr, prefixes)
    assert kept == (tuple(env) if len(env) <= convert.LARGE_ENV else expected)


def test_a_large_env_whose_entries_hold_a_nul_is_still_searched_exactly() -> None:
    env = [f"V{i}=x\0NV_GPU=9" for i in range(convert.LARGE_ENV + 1)] + ["NV_GPU=0"]
    assert convert.env_entries(env, ("NV_GPU=",)) == ("NV_GPU=0",)


KEYS = ("devices.nri-accel.io", "devices.nri-accel.io/pod", "devices.nri-accel.io/pods",
        "devices.nri-accel.io/container.main", "devices.nri-accel.io/resource.gpu",
        "capabilities.nri-accel.io", "capabilities.nri-accel.io/pod", "cdi.k8s.io/x",
        "nvidia.cdi.k8s.io/y", "cdi-devices.noderesource.dev", "cdi-devices.nri.io/pod",
        "nri-accel.io/granted", "nri-accel.io/shared", "devices.noderesource.dev/pod",
        "io.kubernetes.cri.container-name", "nri-accel.io", "cdi.k8s.io", "devices.nri",
        "x.devices.nri-accel.io", "mounts.noderesource.dev/container.main")
VALUES = ("nvidia.com/gpu=0", "nvidia.com/gpu: 1", "", "garbage=", "- a/b=c\n",
          "compute,utility", "nvidia.com/gpu=all")
ENV = (*(f"{n}{v}" for n in ("NVIDIA_VISIBLE_DEVICES", "NV_GPU", "CUDA_VERSION",
                             "NVIDIA_DRIVER_CAPABILITIES", "NVIDIA_REQUIRE_CUDA",
                             "NVIDIA_MIG_CONFIG_DEVICES", "AWS_NEURON_VISIBLE_DEVICES",
                             "HABANA_VISIBLE_DEVICES", "AMD_VISIBLE_DEVICES",
                             "NVIDIA_DISABLE_REQUIRE", "NVIDIA_VISIBLE_DEVICESX", "LD_LIBRARY_PATH",
                             "PATH", "nvidia_visible_devices")
                 for v in ("=all", "=0", "=", "=void", "=cuda>=11.0", "")),)


def test_what_the_fast_path_answers_empty_the_parser_would_have_asked_nothing_of() -> None:
    """Random containers over the keys and variables the families read and their near
    misses: the fast path's test (the plugin's glance decoder) finds that a container
    asks exactly when one of its keys or entries starts as one the parser reads; and
    whenever none does, parse() finds nothing to ask, raises nothing, and the Engine's
    full path answers an empty adjustment."""
    rng = random.Random(10)
    engine = Engine(demo_inventory(), Config(policy=PolicyConfig("standalone")))
    accel = AccelPlugin(engine)
    empty = 0
    for i in range(3000):
        pod = {rng.choice(KEYS): rng.choice(VALUES) for _ in range(rng.randrange(3))}
        ctr = {rng.choice(KEYS): rng.choice(VALUES) for _ in range(rng.randrange(3))}
        env = tuple(rng.choice(ENV) for _ in range(rng.randrange(4)))
        mentioned = (any(k.startswith(ANNOTATION_PREFIXES) for k in (*pod, *ctr))
                     or any(e.startswith(ENV_PREFIXES) for e in env))
        message = make_pod({"name": "p", "annotations": pod})
        req = served(accel, message, make_container(message, {
            "name": "main", "annotations": ctr, "env": list(env)}))
        assert asked_nothing(req) is not mentioned, (pod, ctr, env)
        if mentioned:
            continue
        empty += 1
        info = ContainerInfo("ns", "p", "uid", "main", f"c{i}", MappingProxyType(pod),
                             MappingProxyType(ctr), env)
        assert parse(info) == Parsed(())
        plan = engine.plan(info)
        assert not (plan.devices or plan.edits.env or plan.edits.device_nodes
                    or plan.edits.mounts or plan.annotations)
    assert empty > 100


@pytest.mark.parametrize("strings, expected", [
    ((), False),
    (("cdi.k8s.io",), False),  # shorter than the shortest prefix
    (("devices.nri", "nri-accel.io/grant"), False),  # the first characters of a prefix only
    (("x", "nri-accel.io/granted"), True),
    (("cdi.k8s.io/vendor",), True),  # the shortest prefix, and more
    (("io.kubernetes.cri.container-name", ""), False),  # no first character of a prefix
    (("checksum/config", "d"), False),  # first characters, no first n of a prefix
], ids=["none", "short", "first characters", "a prefix", "the shortest", "the runtime's",
        "a first character"])
def test_prefix_test_is_str_startswith_over_any_string(strings: tuple[str, ...],
                                                       expected: bool) -> None:
    assert convert.PrefixTest(ANNOTATION_PREFIXES)(strings) is expected
    assert any(s.startswith(ANNOTATION_PREFIXES) for s in strings) is expected
    assert convert.PrefixTest(())(strings) is False


def test_an_empty_prefix_is_refused() -> None:
    # it would start every string, which the first-character step cannot see
    with pytest.raises(ValueError, match="an empty prefix"):
        convert.PrefixTest(("cdi.k8s.io/", ""))


@pytest.mark.parametrize("where", ["pod", "container", "env"])
def test_each_step_of_the_glance_test_passes_a_near_miss_and_stops_at_a_key_it_reads(
        where: str) -> None:
    # glance_decoder() tests the pod's keys and the env by their first n characters and
    # the container's keys by their first character, inline, then the whole PrefixTest
    # where that finds something: a near miss at any step is still answered at a glance
    accel = plugin()
    near = {"pod": "devices.nri.example/x", "container": "cni.projectcalico.org/podIP",
            "env": "NVIDIA_VISIBLE=0"}
    read = {"pod": "cdi.k8s.io/x", "container": "devices.nri-accel.io/container.main",
            "env": "NVIDIA_VISIBLE_DEVICES=0"}
    for text, asks in ((near[where], False), (read[where], True)):
        annotations = {text: "vendor.com/class=a"} if where != "env" else {}
        pod = make_pod({"name": "p", "annotations": annotations if where == "pod" else {}})
        ctr = make_container(pod, {
            "name": "main", "env": ["PATH=/bin", *([text] if where == "env" else [])],
            "annotations": {"io.kubernetes.cri.container-type": "container",
                            **(annotations if where == "container" else {})}})
        req = served(accel, pod, ctr)
        assert asked_nothing(req) is not asks, text
        assert req == convert.ASKED_NOTHING if not asks else (
            req.container.id == ctr.id and req.pod.id == pod.id)


def test_a_container_is_read_as_the_large_view_reads_it_keeping_the_keys_the_engine_reads(
) -> None:
    # CRI-O: no NRI name (named from its metadata), and a copy of the pod's annotation
    pod = make_pod({"name": "p", "namespace": "ml", "annotations": {
        "prometheus.io/scrape": "true", "devices.nri-accel.io/container.main": "nvidia.com/gpu=0"}})
    ctr = make_container(pod, {"name": "", "env": ["PATH=/bin", "NVIDIA_VISIBLE_DEVICES=1"],
                               "annotations": {
                                   "io.kubernetes.cri.sandbox-id": "s1",
                                   "devices.nri-accel.io/container.main": "nvidia.com/gpu=0",
                                   convert.CRIO_METADATA: '{"name": "main"}',
                                   "cdi.k8s.io/x": "vendor.com/class=a"}})
    payload = pb.CreateContainerRequest(pod=pod, container=ctr).SerializeToString()
    keys = (ANNOTATION_PREFIXES, (*ANNOTATION_PREFIXES, convert.CRIO_METADATA))
    view = convert.decode_create(payload)
    small = convert.read_container_info(view.pod, view.container, ENV_PREFIXES, *keys)
    read = finished(convert.large_container_info(convert.Encoded(pod.SerializeToString()),
                                                 convert.Encoded(ctr.SerializeToString()),
                                                 ENV_PREFIXES, *keys))
    # of the env, only the entries in scope; a small env is whole
    assert read.env == convert.env_entries(small.env, ENV_PREFIXES) == (
        "NVIDIA_VISIBLE_DEVICES=1",)
    assert replace(small, env=read.env) == read
    assert small.container_name == "main"
    assert dict(small.pod_annotations) == {
        "devices.nri-accel.io/container.main": "nvidia.com/gpu=0"}
    assert sorted(small.container_annotations) == [
        "cdi.k8s.io/x", "devices.nri-accel.io/container.main", convert.CRIO_METADATA]
