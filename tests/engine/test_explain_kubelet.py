"""explain's simulated kubelet (KubeletDevices, pod_containers): the device plugin's
resources are allocated as kubelet would, and the plugin's Allocate annotations become
the container annotations the Engine reads.

The node is the built-in demo node (engine_testing.demo_inventory: GPUs 0-6 whole, GPU 7
in MIG mode with one MIG device each of 3g.40gb, 2g.20gb and 1g.10gb).
"""

from __future__ import annotations

import io
import re

import msgspec
import pytest
import yaml
from engine_testing import (
    DEMO_CONFIG,
    DEMO_INVENTORY,
    MIG_UUIDS,
    cli_logs_to_sink,
    demo_inventory,
    kubernetes,
)

from nri_accel.cli import main
from nri_accel.config import DevicePluginConfig
from nri_accel.engine import Engine
from nri_accel.errors import AllocationError, ConfigError
from nri_accel.explain import KubeletDevices, explain, pod_containers
from nri_accel.inventory import Inventory

GPU_KEY = "devices.nri-accel.io/resource.nvidia.com_gpu"
WHOLE_GPUS = {d.uuid for d in demo_inventory().of_kind("nvidia.com/gpu")
              if d.attributes.get("mig_mode") != "enabled"}


def pod(*containers: dict, init: tuple[dict, ...] = (), name: str = "p") -> dict:
    return {"kind": "Pod", "metadata": {"name": name, "namespace": "ml"},
            "spec": {"initContainers": list(init), "containers": list(containers)}}


def ctr(name: str, limits: dict | None = None, **extra) -> dict:
    return {"name": name, "resources": {"limits": limits or {}}, **extra}


def granted(annotation: str, kind: str = "nvidia.com/gpu") -> list[str]:
    """The device IDs of one grant annotation value ("<kind>=<id>,...")."""
    out = []
    for item in annotation.split(","):
        k, _, ident = item.partition("=")
        assert k == kind
        out.append(ident)
    return out


def annotations(kubelet: KubeletDevices, manifest: dict) -> dict[str, dict[str, str]]:
    return {c.info.container_name: dict(c.info.container_annotations)
            for c in pod_containers(manifest, "pod.yaml", kubelet)}


@pytest.fixture
def kubelet() -> KubeletDevices:
    return KubeletDevices(demo_inventory(), kubernetes())


def test_a_gpu_limit_becomes_the_plugins_grant_of_specific_gpus(kubelet):
    got = annotations(kubelet, pod(ctr("main", {"nvidia.com/gpu": 2, "cpu": "1"})))["main"]
    assert list(got) == [GPU_KEY]  # no "devices.nri-accel.io: KIND: N" count any more
    ids = granted(got[GPU_KEY])
    assert len(ids) == 2 and set(ids) <= WHOLE_GPUS
    # The plugin's preferred allocation: an NVLink pair on one NUMA node.
    devs = [d for d in demo_inventory().devices if d.uuid in ids]
    assert devs[0].numa_node == devs[1].numa_node and devs[1].name in devs[0].links


def test_each_resource_writes_its_own_key(kubelet):
    got = annotations(kubelet, pod(ctr("main", {"nvidia.com/gpu": 1,
                                                "nvidia.com/mig-1g.10gb": 1})))["main"]
    assert sorted(got) == [GPU_KEY, "devices.nri-accel.io/resource.nvidia.com_mig-1g.10gb"]
    assert got["devices.nri-accel.io/resource.nvidia.com_mig-1g.10gb"] == (
        f"nvidia.com/mig={MIG_UUIDS['7:2']}")


def test_mig_profile_resource_and_the_engine_grants_that_mig_device(kubelet):
    (c,) = pod_containers(pod(ctr("srv", {"nvidia.com/mig-3g.40gb": 1})), "pod.yaml", kubelet)
    assert dict(c.info.container_annotations) == {
        "devices.nri-accel.io/resource.nvidia.com_mig-3g.40gb":
            f"nvidia.com/mig={MIG_UUIDS['7:0']}"}
    plan = Engine(demo_inventory(), kubernetes()).plan(c.info)
    assert [d.qualified_name for d in plan.devices] == ["nvidia.com/mig=7:0"]
    # There is one 3g.40gb device: a second pod cannot have it.
    with pytest.raises(AllocationError, match=re.escape("Insufficient nvidia.com/mig-3g.40gb")):
        pod_containers(pod(ctr("srv", {"nvidia.com/mig-3g.40gb": 1}), name="q"), "pod.yaml",
                       kubelet)


def test_a_kind_that_is_not_a_resource_is_noted_with_what_is_advertised(kubelet):
    (c,) = pod_containers(pod(ctr("srv", {"nvidia.com/mig": 1, "example.com/fpga": 1})),
                          "pod.yaml", kubelet)
    assert dict(c.info.container_annotations) == {}
    notes = "\n".join(c.notes)
    assert "resource nvidia.com/mig: not advertised" in notes
    assert "resource example.com/fpga: not advertised" in notes
    assert "nvidia.com/mig-1g.10gb, nvidia.com/mig-2g.20gb, nvidia.com/mig-3g.40gb" in notes


def test_containers_and_pods_never_share_devices(kubelet):
    first = annotations(kubelet, pod(ctr("a", {"nvidia.com/gpu": 2}),
                                     ctr("b", {"nvidia.com/gpu": 2})))
    second = annotations(kubelet, pod(ctr("c", {"nvidia.com/gpu": 3}), name="q"))
    ids = [i for got in (first["a"], first["b"], second["c"]) for i in granted(got[GPU_KEY])]
    assert len(ids) == len(set(ids)) == 7 and set(ids) == WHOLE_GPUS


def test_insufficient_devices_name_the_resource_and_allocate_nothing(kubelet):
    annotations(kubelet, pod(ctr("a", {"nvidia.com/gpu": 5})))
    big = pod(ctr("ok", {"nvidia.com/gpu": 1}), ctr("big", {"nvidia.com/gpu": 2}), name="q")
    with pytest.raises(AllocationError) as e:
        pod_containers(big, "pod.yaml", kubelet)
    assert "Insufficient nvidia.com/gpu: asks for 2, 1 of the node's 7 are free" in str(e.value)
    assert e.value.source == "pod.yaml: pod q: spec.containers[1].resources"
    # The refused pod holds nothing: the two GPUs left are still free.
    got = annotations(kubelet, pod(ctr("c", {"nvidia.com/gpu": 2}), name="r"))
    assert len(granted(got["c"][GPU_KEY])) == 2


def test_unhealthy_devices_are_not_allocated():
    inv = demo_inventory()
    sick = {"0", "1", "2", "3"}
    node = Inventory(devices=tuple(msgspec.structs.replace(d, healthy=d.name not in sick)
                                   if d.kind == "nvidia.com/gpu" else d for d in inv.devices),
                     drivers=inv.drivers)
    kubelet = KubeletDevices(node, kubernetes())
    got = annotations(kubelet, pod(ctr("a", {"nvidia.com/gpu": 3})))
    assert {d.name for d in inv.devices if d.uuid in granted(got["a"][GPU_KEY])} == {
        "4", "5", "6"}
    with pytest.raises(AllocationError, match="asks for 1, 0 of the node's 7 are free"):
        pod_containers(pod(ctr("b", {"nvidia.com/gpu": 1}), name="q"), "pod.yaml", kubelet)


def test_init_container_devices_are_handed_on_as_kubelet_does(kubelet):
    got = annotations(kubelet, pod(ctr("app", {"nvidia.com/gpu": 3}),
                                   ctr("app2", {"nvidia.com/gpu": 2}),
                                   init=(ctr("init", {"nvidia.com/gpu": 2}),)))
    init, app, app2 = (set(granted(got[n][GPU_KEY])) for n in ("init", "app", "app2"))
    assert init < app  # the first app container reuses the init container's two
    assert not app2 & app  # ... and then holds them: the next one gets others
    # The pod holds 5 GPUs, not 7: two are free for the next pod.
    annotations(kubelet, pod(ctr("c", {"nvidia.com/gpu": 2}), name="q"))


@pytest.mark.parametrize("app_limits", [{"nvidia.com/gpu": 1}, {"nvidia.com/gpu": 3}])
def test_the_engine_grants_an_app_container_the_gpus_of_an_init_container_that_exited(
        kubelet, app_limits):
    # The runtime's StopContainer of an exited init container releases its grant before
    # kubelet creates the next container, which kubelet gives the same GPUs.
    containers = pod_containers(pod(ctr("app", app_limits),
                                    init=(ctr("init", {"nvidia.com/gpu": 1}),)),
                                "pod.yaml", kubelet)
    engine = Engine(demo_inventory(), kubernetes())
    out, err = io.StringIO(), io.StringIO()
    assert explain(containers, engine, out=out, err=err) == 0, err.getvalue()
    init, app = (set(granted(c.info.container_annotations[GPU_KEY])) for c in containers)
    assert init <= app
    assert engine.holdings.get("ml/p/init") is None
    assert len(engine.holdings.get("ml/p/app").exclusive) == len(app)


def test_a_sidecar_init_container_keeps_its_devices(kubelet):
    sidecar = ctr("proxy", {"nvidia.com/gpu": 1}, restartPolicy="Always")
    got = annotations(kubelet, pod(ctr("app", {"nvidia.com/gpu": 1}), init=(sidecar,)))
    assert not set(granted(got["proxy"][GPU_KEY])) & set(granted(got["app"][GPU_KEY]))


@pytest.mark.parametrize("count", [True, -1, 1.5, "2k", "²"])
def test_counts_must_be_whole_numbers(kubelet, count):
    with pytest.raises(ConfigError, match="a device count must be a whole number"):
        pod_containers(pod(ctr("a", {"nvidia.com/gpu": count})), "pod.yaml", kubelet)


def test_cli_insufficient_is_an_error_naming_the_resource(capsys, tmp_path, monkeypatch):
    path = tmp_path / "pod.yaml"
    path.write_text(yaml.safe_dump(pod(ctr("a", {"nvidia.com/gpu": 8}))))
    with cli_logs_to_sink(monkeypatch):
        rc = main(["explain", "--inventory", str(DEMO_INVENTORY), "--config",
                   str(DEMO_CONFIG), "--pod", str(path)])
    out, err = capsys.readouterr()
    assert rc == 1 and out == ""
    assert "Insufficient nvidia.com/gpu: asks for 8, 7 of the node's 7 are free" in err
    assert "the scheduler would leave the pod Pending" in err


def test_explain_follows_the_device_plugin_settings():
    # Renamed resources and time-slicing replicas, as the device plugin advertises them:
    # two pods of one replica each share a GPU, and `run` grants it to both, shared.
    config = msgspec.structs.replace(kubernetes(), device_plugin=DevicePluginConfig(
        resource_names=(("nvidia.com/gpu", "nri-accel.io/gpu"),),
        replicas=(("nri-accel.io/gpu", 2),)))
    one = Inventory(devices=tuple(d for d in demo_inventory().devices if d.name == "0"),
                    drivers=demo_inventory().drivers)
    kubelet = KubeletDevices(one, config)
    assert kubelet.resource_names == ("nri-accel.io/gpu",)
    key = "devices.nri-accel.io/resource.nri-accel.io_gpu"
    engine = Engine(one, config)
    for name in ("p", "q"):
        (c,) = pod_containers(pod(ctr("c", {"nri-accel.io/gpu": 1}), name=name), "pod.yaml",
                              kubelet)
        assert re.fullmatch(r"nvidia\.com/gpu=GPU-[0-9a-f-]+::[01]",
                            c.info.container_annotations[key])
        plan = engine.plan(c.info)
        engine.commit(plan)
        assert plan.qualified_names == ("nvidia.com/gpu=0",) and plan.grant.shared
    with pytest.raises(AllocationError, match=r"Insufficient nri-accel\.io/gpu"):
        pod_containers(pod(ctr("c", {"nri-accel.io/gpu": 1}), name="r"), "pod.yaml", kubelet)
