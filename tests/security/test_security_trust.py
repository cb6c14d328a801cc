"""Trust: what a pod author controls (pod annotations, the image's and pod's env, copies
of pod annotations the runtime puts on the container) never grants devices in Kubernetes
mode outside trusted namespaces, only narrows, and cannot forge the allocator's records."""

from __future__ import annotations

import asyncio

import pytest
from demo_node import demo_inventory
from grants import admit, held, key
from security_testing import DEVICE_PLUGIN_KEY, TRUSTED_NS, container, engine

from nri_accel.engine import ANNOTATION_GRANTED, ANNOTATION_SHARED
from nri_accel.errors import PolicyError, RequestError
from nri_accel.nri import convert
from nri_accel.nri.simulator import make_container, make_pod
from nri_accel.plugin import AccelPlugin
from nri_accel.policy import own_annotations

POD_KEY = "devices.nri-accel.io/pod"

# What a pod author can write, each of which grants in a trusted namespace.
HOSTILE: dict[str, dict[str, object]] = {
    "pod annotation ids": {"pod": {POD_KEY: "nvidia.com/gpu=0"}},
    "pod annotation count": {"pod": {"devices.nri-accel.io": "nvidia.com/gpu: 2"}},
    "pod annotation all": {"pod": {"devices.nri-accel.io/container.main": "nvidia.com/gpu=all"}},
    "pod CDI annotation": {"pod": {"cdi.k8s.io/x": "nvidia.com/gpu=0"}},
    "pod device-injector CDI": {"pod": {"cdi-devices.noderesource.dev/pod":
                                        "- nvidia.com/gpu=0"}},
    "pod annotation copied to the container": {
        "pod": {"devices.nri-accel.io": "nvidia.com/gpu=1"},
        "ctr": {"devices.nri-accel.io": "nvidia.com/gpu=1"}},
    "pod CDI annotation copied to the container": {
        "pod": {"cdi.k8s.io/x": "nvidia.com/gpu=1"}, "ctr": {"cdi.k8s.io/x": "nvidia.com/gpu=1"}},
    "NVIDIA_VISIBLE_DEVICES=all": {"env": ["NVIDIA_VISIBLE_DEVICES=all"]},
    "NVIDIA_VISIBLE_DEVICES=none": {"env": ["NVIDIA_VISIBLE_DEVICES=none"]},
    "NVIDIA_VISIBLE_DEVICES=index": {"env": ["NVIDIA_VISIBLE_DEVICES=0,1"]},
    "NV_GPU": {"env": ["NV_GPU=0 1"]},
    "legacy CUDA image": {"env": ["CUDA_VERSION=11.0"]},
    "NVIDIA_VISIBLE_DEVICES as CDI name": {"env": ["NVIDIA_VISIBLE_DEVICES=nvidia.com/gpu=0"]},
}


@pytest.mark.parametrize("case", sorted(HOSTILE))
def test_pod_author_sources_never_grant_in_kubernetes_mode(case: str) -> None:
    kw = HOSTILE[case]
    eng = engine()
    try:
        plan = admit(eng, container(**kw))  # type: ignore[arg-type]
    except RequestError:
        pass  # refused: fine
    else:
        assert plan.devices == () and not plan.annotations
        assert not (plan.edits.device_nodes or plan.edits.mounts or plan.edits.hooks)
        # the only edit: the image's own visibility variable made to grant nothing
        assert set(plan.edits.env) <= {"NVIDIA_VISIBLE_DEVICES=void"}
    assert held(eng) == {}
    # The same request grants where the policy allows it: the inputs are real requests.
    trusted = engine().plan(container(namespace=TRUSTED_NS, **kw))  # type: ignore[arg-type]
    assert trusted.edits


@pytest.mark.parametrize("value", ["NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_VISIBLE_DEVICES=0,1,2",
                                   "NV_GPU=5", "NVIDIA_VISIBLE_DEVICES=MIG-anything"])
def test_env_only_narrows_a_device_plugin_grant(value: str) -> None:
    eng = engine()
    granted = {DEVICE_PLUGIN_KEY: "nvidia.com/gpu=0"}
    try:
        plan = admit(eng, container(ctr=granted, env=[value]))
    except RequestError as e:  # naming a device that was not allocated
        assert e.source.startswith("env ")
        return
    assert plan.qualified_names in ((), ("nvidia.com/gpu=0",))


@pytest.mark.parametrize("pod", [{POD_KEY: "nvidia.com/gpu=1"}, {POD_KEY: "nvidia.com/gpu: 8"},
                                 {POD_KEY: "nvidia.com/mig=7:0"},
                                 {"cdi.k8s.io/y": "nvidia.com/gpu=3"},
                                 {POD_KEY: "nvidia.com/gpu=all"}])
def test_pod_annotations_only_narrow_a_device_plugin_grant(pod: dict[str, str]) -> None:
    granted = {DEVICE_PLUGIN_KEY: "nvidia.com/gpu=0"}
    try:
        plan = engine().plan(container(ctr=granted, pod=pod))
    except PolicyError as e:
        assert "not allocated" in e.message
        return
    assert set(plan.qualified_names) <= {"nvidia.com/gpu=0"}


def test_mig_config_and_monitor_are_refused_outside_trusted_namespaces() -> None:
    granted = {DEVICE_PLUGIN_KEY: "nvidia.com/gpu=0"}
    for var in ("NVIDIA_MIG_CONFIG_DEVICES", "NVIDIA_MIG_MONITOR_DEVICES"):
        with pytest.raises(PolicyError) as err:
            engine().plan(container(ctr=granted, env=[f"{var}=all"]))
        assert err.value.source == f"env {var}"
        plan = engine().plan(container(ctr=granted, env=[f"{var}=all"], namespace=TRUSTED_NS))
        assert any(n.path.startswith("/dev/nvidia-caps/") for n in plan.edits.device_nodes)


def test_counts_never_share_a_device() -> None:
    eng = engine("standalone")
    got: dict[str, tuple[str, ...]] = {}
    for i in range(7):  # GPUs 0-6; GPU 7 is in MIG mode and never chosen by count
        plan = admit(eng, container(pod={POD_KEY: "nvidia.com/gpu: 1"}, cid=f"c{i}"))
        assert len(plan.devices) == 1
        got[f"c{i}"] = plan.qualified_names
    assert len({names for names in got.values()}) == 7
    with pytest.raises(RequestError, match="only 0 of 8 are free"):
        admit(eng, container(pod={POD_KEY: "nvidia.com/gpu: 1"}, cid="c7"))
    eng.release("c3")
    again = admit(eng, container(pod={POD_KEY: "nvidia.com/gpu: 1"}, cid="c8"))
    assert again.qualified_names == got["c3"]


# ---- the grant records grants_in() reads ---------------------------------------------


@pytest.mark.parametrize("key", [ANNOTATION_GRANTED, ANNOTATION_SHARED])
@pytest.mark.parametrize("where", ["pod", "ctr"])
def test_a_container_carrying_a_grant_record_is_refused(key: str, where: str) -> None:
    eng = engine("standalone")
    kw = {where: {key: "nvidia.com/gpu=0", POD_KEY: "nvidia.com/gpu: 1"}}
    with pytest.raises(RequestError, match="reserved") as err:
        admit(eng, container(**kw))  # type: ignore[arg-type]
    assert err.value.source.endswith(key)
    assert held(eng) == {}


def gpu(i: int) -> str:
    """The grant record's name of demo GPU i."""
    return key(demo_inventory(), f"nvidia.com/gpu={i}")


def _synchronize(eng: object, pod_annotations: dict[str, str],
                 ctr_annotations: dict[str, str]) -> str:
    pod = make_pod({"name": "p", "namespace": "default", "annotations": pod_annotations})
    ctr = make_container(pod, {"name": "main", "state": "CONTAINER_RUNNING",
                               "annotations": ctr_annotations})
    asyncio.run(AccelPlugin(eng).synchronize([pod], [ctr]))  # type: ignore[arg-type]
    return ctr.id


def test_restore_ignores_grant_records_copied_from_the_pod() -> None:
    # A runtime that copies pod annotations into the container's: a forged record would
    # make every GPU look held after a plugin restart (count requests all fail).
    eng = engine("standalone")
    forged = {ANNOTATION_GRANTED: ",".join(gpu(i) for i in range(8))}
    _synchronize(eng, forged, forged)
    assert held(eng) == {}
    assert len(admit(eng, container(pod={POD_KEY: "nvidia.com/gpu: 2"})).devices) == 2


def test_restore_cannot_be_told_that_held_devices_are_shared() -> None:
    # The container really got GPU 0 by count (its own record); a copied pod annotation
    # calling it shared would let the allocator hand GPU 0 to a second tenant.
    eng = engine("standalone")
    cid = _synchronize(eng, {ANNOTATION_SHARED: gpu(0)},
                       {ANNOTATION_GRANTED: gpu(0), ANNOTATION_SHARED: gpu(0)})
    assert held(eng) == {cid: ("nvidia.com/gpu=0",)}
    with pytest.raises(RequestError, match="only 6 of 8 are free"):
        admit(eng, container(pod={POD_KEY: "nvidia.com/gpu: 7"}, cid="other"))


def test_restore_keeps_the_containers_own_records() -> None:
    eng = engine("standalone")
    cid = _synchronize(eng, {"unrelated": "x"}, {ANNOTATION_GRANTED: gpu(4)})
    assert held(eng) == {cid: ("nvidia.com/gpu=4",)}


def test_a_containers_own_annotations_exclude_those_its_pod_carries() -> None:
    pod = make_pod({"name": "p", "annotations": {"a": "1", "b": "2"}})
    ctr = make_container(pod, {"name": "c", "annotations": {"a": "1", "b": "other", "c": "3"}})
    (live,) = convert.live_containers([ctr], [pod], ["a", "b", "c"])
    assert own_annotations(live.container_annotations, live.pod_annotations) == {"c": "3"}
