"""NRI pods and containers -> ContainerInfo, on the real CRI-generated CreateContainer."""

from __future__ import annotations

from pathlib import Path

from steps import finished
from wire import runtime_requests

from nri_accel.nri import convert
from nri_accel.nri import nri_pb2 as pb
from nri_accel.nri.simulator import make_container, make_pod


def _captured_create(wire_dir: Path) -> pb.CreateContainerRequest:
    payload = next(p for _, m, p in runtime_requests(wire_dir, "containerd-2.3.4-e2e", 1)
                   if m == "CreateContainer")
    return pb.CreateContainerRequest.FromString(payload)


def test_container_info_from_a_real_cri_spec(nri_wire_dir: Path) -> None:
    req = _captured_create(nri_wire_dir)
    info = convert.container_info(req.pod, req.container)
    assert (info.namespace, info.pod_name, info.container_name) == ("default", "bbdev0", "c0")
    assert info.pod_uid == "6f1c2d3e-4b5a-4c7d-8e9f-0a1b2c3d4e5f"
    assert info.container_id == req.container.id and len(info.container_id) == 64
    assert info.env == ("PATH=/bin", "HOSTNAME=vm")
    assert info.pod_annotations["io.kubernetes.cri.sandbox-name"] == "bbdev0"
    assert info.container_annotations["io.kubernetes.cri.container-name"] == "c0"
    assert {"/proc", "/dev", "/etc/hosts", "/dev/shm"} <= info.mount_destinations
    assert info.spec_devices == {}


def test_container_info_is_plain_data_detached_from_the_message() -> None:
    pod = make_pod({"name": "p", "annotations": {"k": "v"}})
    ctr = make_container(pod, {"name": "c", "linux": {"devices": [
        {"path": "/dev/fuse", "type": "c", "major": 10, "minor": 229}]}})
    info = convert.container_info(pod, ctr)
    pod.annotations["k"] = "changed"
    assert info.pod_annotations == {"k": "v"}
    assert info.spec_devices == {"/dev/fuse": ("c", 10, 229)}
    assert info.namespace == "default"


def test_live_containers_skip_stopped_ones() -> None:
    pod = make_pod({"name": "p"})
    running = make_container(pod, {"name": "a", "state": "CONTAINER_RUNNING",
                                   "annotations": {"nri-accel.io/granted": "nvidia.com/gpu=0"}})
    created = make_container(pod, {"name": "b", "state": "CONTAINER_CREATED"})
    stopped = make_container(pod, {"name": "c", "state": "CONTAINER_STOPPED",
                                   "annotations": {"nri-accel.io/granted": "nvidia.com/gpu=1"}})
    live = {c.container_id: c for c in convert.live_containers(
        [running, created, stopped], [pod], ["nri-accel.io/granted"])}
    assert set(live) == {running.id, created.id}
    assert live[running.id].container_annotations == {"nri-accel.io/granted": "nvidia.com/gpu=0"}
    assert live[running.id].label == "default/p/a"
    assert live[running.id].pod_uid == pod.uid and live[running.id].pod_id == pod.id


def test_live_containers_keep_only_the_keys_asked_for() -> None:
    pod = make_pod({"name": "p", "annotations": {"nri-accel.io/granted": "x.io/y=1",
                                                 "big": "x" * 1000}})
    ctr = make_container(pod, {"name": "a", "annotations": {"nri-accel.io/granted": "x.io/y=2",
                                                            "other": "y" * 1000}})
    (live,) = convert.live_containers([ctr], [pod], ["nri-accel.io/granted"])
    assert live.container_annotations == {"nri-accel.io/granted": "x.io/y=2"}
    assert live.pod_annotations == {"nri-accel.io/granted": "x.io/y=1"}


def test_a_container_without_a_name_is_named_from_cri_o_metadata() -> None:
    # CRI-O 1.36.3 (crio-1.36.3-lifecycle capture): a container created without kubelet's
    # labels has no NRI name; CRI-O's own metadata annotation holds its CRI name.
    pod = make_pod({"name": "p"})
    ctr = make_container(pod, {"annotations": {"io.kubernetes.cri-o.Metadata":
                                               '{"name":"ctr-b"}'}})
    assert ctr.name == ""
    assert convert.container_info(pod, ctr).container_name == "ctr-b"
    for junk in ("", "not json", '["x"]', '{"name": 3}', '{"name":"' + "x" * 5000 + '"}'):
        ctr = make_container(pod, {"annotations": {"io.kubernetes.cri-o.Metadata": junk}})
        assert convert.container_info(pod, ctr).container_name == ""


def test_make_pod_gives_stable_ids() -> None:
    a, b = make_pod({"name": "p", "namespace": "ns"}), make_pod({"name": "p", "namespace": "ns"})
    assert a.id == b.id and a.uid == b.uid and a.id != make_pod({"name": "q"}).id
    assert make_container(a, {"name": "c"}).pod_sandbox_id == a.id


def test_synced_keeps_of_the_containers_those_with_a_key_or_a_listed_id() -> None:
    pod = make_pod({"name": "p"})
    granted = make_container(pod, {"name": "a", "annotations": {"nri-accel.io/granted": "x"}})
    listed = make_container(pod, {"name": "b"})
    other = make_container(pod, {"name": "c", "annotations": {"unrelated": "y"}})
    keys = ["nri-accel.io/granted"]
    pods, kept = finished(convert.synced([pod], [granted, listed, other], keys,
                                         ids={listed.id}))
    assert [c.id for c in kept] == [granted.id, listed.id] and [p.id for p in pods] == [pod.id]
    _, every = finished(convert.synced([pod], [granted, listed, other], keys))
    assert [c.id for c in every] == [granted.id, listed.id, other.id]
