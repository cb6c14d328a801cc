"""Fuzz target: the NRI request decode path, CreateContainerRequest bytes ->
nri.convert.container_info -> Engine.plan -> the adjustment, then Engine.commit, as
nri_accel.plugin runs it, over the demo node (and the demo node with Neuron and CDI
devices beside it) in the kubernetes and standalone policies.

Inputs: CreateContainerRequests built from the grammar-aware annotations and env of
fuzz_inputs, serialised, then often damaged (cut, bytes flipped, bytes inserted); and
arbitrary bytes. Several requests run in turn against one Engine, so that what earlier
containers hold shapes the later plans.

Properties:
- bytes protobuf cannot decode raise DecodeError only (the stub answers those with
  INVALID_ARGUMENT); container_info never raises;
- the request is decoded as the daemon decodes it, as its view (api/nri_views.proto);
  where the whole message decodes too, it reads as the same container; the large path
  (for requests over convert.LARGE_REQUEST bytes: the pod and container left encoded,
  then decoded a run of fields at a time as the large views, annotations as their map
  entries, by convert.large_container_info; the runs cut by nri.fields.runs) decodes
  exactly the bytes the view decodes (but for its bounds, which these inputs are far
  below: 64 fields at a request's top, 1,000 in a group), to the same annotations but
  for an entry holding an unknown field (protobuf's Python decoding of a map sets such
  an entry aside among the message's unknown fields; Go's, the runtime's, keeps its
  key and value, and so do the large views); where there is none, it plans as the
  view does: the same answer, or the same refusal; the same with runs of 1 and 3
  fields;
- planning and building the answer raise only NriAccelError subclasses (never
  InternalError, the wrapper of a bug), with a `source` their text starts with;
- a refused request changes no Engine state: the holdings and their version are as
  before.
"""

from __future__ import annotations

import functools
from typing import Any
from unittest.mock import patch

from demo_node import demo_inventory
from fuzz_inputs import annotations, env, mixed_inventory, namespace
from google.protobuf.message import DecodeError
from google.protobuf.unknown_fields import UnknownFieldSet
from hypothesis import given
from hypothesis import strategies as st
from steps import finished

from nri_accel.config import Config, PolicyConfig
from nri_accel.container import ContainerInfo
from nri_accel.engine import ENV_SCOPE, Engine
from nri_accel.errors import InternalError, NriAccelError
from nri_accel.nri import fields
from nri_accel.nri import nri_pb2 as pb
from nri_accel.nri import nri_views_pb2 as views
from nri_accel.nri.adjust import build_adjustment
from nri_accel.nri.convert import (
    REQUEST_DECODERS,
    container_info,
    decode_large,
    large_container_info,
    read_container_info,
)
from nri_accel.nri.fields import RUN_FIELDS
from nri_accel.plugin import CONTAINER_KEYS, AccelPlugin
from nri_accel.request import ANNOTATION_PREFIXES

CONFIGS = {
    "kubernetes": Config(),
    "standalone": Config(policy=PolicyConfig(mode="standalone")),
    "trusting": Config(policy=PolicyConfig("kubernetes", frozenset({"gpu-operator"}))),
}
NODES = {"demo": demo_inventory, "mixed": mixed_inventory}
SERVED = AccelPlugin(Engine(demo_inventory(), Config())).request_decoders["CreateContainer"]
"""How the daemon decodes a CreateContainer (its Engine holds no grant, so every
container that asks for nothing is answered at a glance)."""


@functools.cache
def engine(node: str, config: str) -> Engine:
    return Engine(NODES[node](), CONFIGS[config])


def _wire(s: str) -> str:
    """`s` as protobuf can carry it (valid UTF-8: a lone surrogate becomes U+FFFD)."""
    return s.encode("utf-8", "surrogatepass").decode("utf-8", "replace")


@st.composite
def create_request(draw: st.DrawFn) -> bytes:
    pod_ann = draw(annotations)
    ctr_ann = draw(annotations)
    for key in sorted(pod_ann):  # CRI-O copies the pod's annotations to the container
        if draw(st.booleans()):
            ctr_ann[key] = pod_ann[key]
    pod = pb.PodSandbox(
        id=draw(st.sampled_from(("sandbox-1", "sandbox-2", ""))),
        name=draw(st.sampled_from(("pod-a", "pod-b"))),
        uid=draw(st.sampled_from(("uid-a", "uid-b", ""))),
        namespace=draw(namespace),
        annotations={_wire(k): _wire(v) for k, v in pod_ann.items()},
    )
    container = pb.Container(
        id=draw(st.sampled_from(("c1", "c2", "c3", ""))),
        pod_sandbox_id=pod.id,
        name=draw(st.sampled_from(("main", "side", ""))),
        annotations={_wire(k): _wire(v) for k, v in ctr_ann.items()},
        env=[_wire(e) for e in draw(env)],
    )
    for path in draw(st.lists(st.sampled_from(("/dev/nvidia0", "/dev/fuse", "")), max_size=2)):
        container.linux.devices.add(path=path, type="c", major=195, minor=0)
    for dest in draw(st.lists(st.sampled_from(("/usr/bin/nvidia-smi", "/tmp")), max_size=2)):
        container.mounts.add(destination=dest, source="/x", type="bind")
    data = pb.CreateContainerRequest(pod=pod, container=container).SerializeToString()
    return draw(damaged(data))


@st.composite
def damaged(draw: st.DrawFn, data: bytes) -> bytes:
    """`data`, or `data` cut, with bytes flipped or inserted."""
    how = draw(st.sampled_from(("intact", "intact", "cut", "flip", "insert")))
    if how == "intact" or not data:
        return data
    at = draw(st.integers(0, len(data) - 1))
    if how == "cut":
        return data[:at]
    if how == "flip":
        return data[:at] + bytes([data[at] ^ draw(st.integers(1, 255))]) + data[at + 1:]
    return data[:at] + draw(st.binary(min_size=1, max_size=8)) + data[at:]


def create(eng: Engine, data: bytes) -> None:
    """One CreateContainer as nri_accel.plugin serves it: decoded at a glance, then as
    its view when it asks (these requests are under convert.LARGE_REQUEST bytes: the
    view with annotation maps), and read keeping the annotations the Engine reads; each
    step held to what the whole message and the large view give."""
    try:
        req = REQUEST_DECODERS["CreateContainer"](data)
    except DecodeError:
        req = None
    large = {most: read_large(data, most) for most in (RUN_FIELDS, 1, 3)}
    assert {most: read is None for most, read in large.items()} == dict.fromkeys(
        large, req is None)
    if req is None:
        return
    whole = decode_large(data)
    set_aside = False  # an entry holding an unknown field
    for mine, part, view in ((req.pod, whole.pod, views.LargePodSandbox),
                             (req.container, whole.container, views.LargeContainer)):
        entries = view.FromString(part.data).annotations
        unknown = [len(UnknownFieldSet(a)) > 0 for a in entries]
        assert {a.key: a.value for a, odd in zip(entries, unknown, strict=True)
                if not odd} == dict(mine.annotations)
        set_aside |= any(unknown)
    info = container_info(req.pod, req.container)
    if not set_aside:
        for read in large.values():
            assert planned(eng, read) == planned(eng, info)
    served = SERVED(data)
    if isinstance(served, bytes):  # answered at a glance: the whole path answers nothing
        answer = planned(eng, info)
        assert len(answer) > 2 and not any(answer[:5]), answer
    else:
        read = read_container_info(served.pod, served.container, ENV_SCOPE,
                                   ANNOTATION_PREFIXES, CONTAINER_KEYS)
        assert planned(eng, read) == planned(eng, info)
    try:
        full = pb.CreateContainerRequest.FromString(data)
    except DecodeError:  # damage in a field the view skips: the daemon never reads it
        pass
    else:
        assert container_info(full.pod, full.container) == info
    before = (eng.holdings.grants(), eng.holdings.version)
    try:
        plan = eng.plan(info)
        build_adjustment(plan.edits, plan.annotations, plan.cdi_devices)
        eng.commit(plan)
    except NriAccelError as err:
        assert not isinstance(err, InternalError)
        assert err.source and str(err).startswith(err.source + ": ")
        assert (eng.holdings.grants(), eng.holdings.version) == before


def read_large(data: bytes, most: int) -> ContainerInfo | None:
    """What the daemon reads of `data` over convert.LARGE_REQUEST bytes (decode_large,
    then large_container_info's steps, runs of `most` fields); None where it refuses
    the bytes (DecodeError, at any step)."""
    with patch.object(fields, "RUN_FIELDS", most):
        try:
            large = decode_large(data)
            return finished(large_container_info(large.pod, large.container, ENV_SCOPE,
                                                 ANNOTATION_PREFIXES, CONTAINER_KEYS))
        except DecodeError:
            return None


def planned(eng: Engine, info: ContainerInfo) -> tuple[Any, ...]:
    """Engine.plan's answer for `info` (nothing recorded), or its refusal."""
    try:
        plan = eng.plan(info)
    except NriAccelError as err:
        return type(err).__name__, str(err)
    return (plan.devices, plan.edits, plan.annotations, plan.cdi_devices,
            plan.notes)


node = st.sampled_from(sorted(NODES))
config = st.sampled_from(sorted(CONFIGS))


@given(node, config, st.booleans(), st.lists(create_request(), min_size=1, max_size=3))
def test_create_container_requests(node: str, config: str, known: bool,
                                   requests: list[bytes]) -> None:
    eng = engine(node, config)
    eng.holdings.replace_all((), known=known)
    for data in requests:
        create(eng, data)


@given(node, config, st.binary(max_size=300))
def test_create_container_arbitrary_bytes(node: str, config: str, data: bytes) -> None:
    eng = engine(node, config)
    eng.holdings.replace_all((), known=True)
    create(eng, data)

