"""The Engine end to end (request parse -> selection -> edits), allocation state, and
hostile inputs, through the same ContainerInfo the NRI handlers build."""

from __future__ import annotations

import json

import pytest
from engine_testing import (
    DEMO_INVENTORY,
    GPU_UUIDS,
    admit,
    allocated,
    container,
    demo_inventory,
    held,
    kubernetes,
    standalone,
)

from nri_accel import engine as engine_module
from nri_accel.config import DevicesConfig
from nri_accel.engine import ANNOTATION_GRANTED, ANNOTATION_SHARED, Engine
from nri_accel.errors import (
    AllocationError,
    InventoryError,
    NotFoundError,
    PolicyError,
    RequestError,
    StateError,
)
from nri_accel.inventory import Inventory


def env_of(plan) -> dict[str, str]:
    return dict(kv.split("=", 1) for kv in plan.edits.env)


@pytest.fixture
def engine() -> Engine:
    return Engine(demo_inventory(), kubernetes("research"))


# ---- granting -------------------------------------------------------------------------------

def test_device_plugin_allocation_is_granted(engine):
    plan = admit(engine, allocated("nvidia.com/gpu=2"))
    assert plan.qualified_names == ("nvidia.com/gpu=2",)
    uuid = "GPU-c3b9e1f4-7a2d-4e8c-b1f6-5d0a3e9c2b32"
    assert dict(plan.annotations) == {ANNOTATION_GRANTED: f"nvidia.com/gpu={uuid}"}
    assert env_of(plan)["NVIDIA_VISIBLE_DEVICES"] == uuid
    assert dict(plan.facts) == {"capabilities": "compute,utility"}
    assert held(engine) == {"c1": ("nvidia.com/gpu=2",)}


def test_no_request_no_plan_content(engine):
    plan = admit(engine, container(env=("PATH=/bin",)))
    assert plan.devices == () and not plan.edits and dict(plan.annotations) == {}
    assert held(engine) == {}


def test_env_narrows_the_device_plugin_allocation(engine):
    info = allocated("nvidia.com/gpu=0,1", env=(f"NVIDIA_VISIBLE_DEVICES={GPU_UUIDS['0']}",))
    assert admit(engine, info).qualified_names == ("nvidia.com/gpu=0",)


def test_env_cannot_widen_the_device_plugin_allocation(engine):
    info = allocated("nvidia.com/gpu=0", env=("NVIDIA_VISIBLE_DEVICES=0,3",))
    with pytest.raises(PolicyError) as e:
        admit(engine, info)
    assert e.value.source == "env NVIDIA_VISIBLE_DEVICES"
    assert held(engine) == {}


def test_cuda_image_all_keeps_the_allocation(engine):
    info = allocated("nvidia.com/gpu=5", env=("NVIDIA_VISIBLE_DEVICES=all",))
    assert admit(engine, info).qualified_names == ("nvidia.com/gpu=5",)


def test_standalone_env_grants():
    engine = Engine(demo_inventory(), standalone())
    plan = admit(engine, container(env=("NVIDIA_VISIBLE_DEVICES=1,3",
                                      "NVIDIA_DRIVER_CAPABILITIES=utility")))
    assert plan.qualified_names == ("nvidia.com/gpu=1", "nvidia.com/gpu=3")
    assert dict(plan.facts) == {"capabilities": "utility"}
    assert "/usr/local/nvidia/lib64/libcuda.so.1" not in {
        m.container_path for m in plan.edits.mounts}


def test_cdi_passthrough_hands_names_to_the_runtime():
    config = kubernetes(devices=DevicesConfig(cdi_passthrough=True))
    engine = Engine(demo_inventory(), config)
    plan = admit(engine, container(annotations={"cdi.k8s.io/gpu": "nvidia.com/gpu=3"}))
    assert plan.cdi_devices == ("nvidia.com/gpu=3",)
    assert plan.devices == () and not plan.edits
    # Not injected by nri-accel, but held all the same: a count cannot take it.
    assert held(engine) == {"c1": ("nvidia.com/gpu=3",)}


def test_cdi_request_resolved_into_raw_edits_without_passthrough(engine):
    plan = admit(engine, container(annotations={"cdi.k8s.io/gpu": "nvidia.com/gpu=3"}))
    assert plan.qualified_names == ("nvidia.com/gpu=3",)
    assert plan.cdi_devices == ()
    assert "/dev/nvidia3" in {n.path for n in plan.edits.device_nodes}


# ---- allocation state ----------------------------------------------------------------------

def test_counts_never_hand_one_device_to_two_running_containers(engine):
    seen: set[str] = set()
    for i in range(7):  # the 7 whole GPUs not in MIG mode
        plan = admit(engine, allocated("nvidia.com/gpu: 1", cid=f"c{i}"))
        (name,) = plan.qualified_names
        assert name not in seen
        seen.add(name)
    with pytest.raises(AllocationError) as e:
        admit(engine, allocated("nvidia.com/gpu: 1", cid="c-late"))
    assert e.value.source == "container annotation devices.nri-accel.io"
    assert "only 0 of 8 are free" in e.value.message
    engine.release("c3")
    assert admit(engine, allocated("nvidia.com/gpu: 1", cid="c-late")).qualified_names


def test_a_refused_plan_changes_no_state(engine):
    admit(engine, allocated("nvidia.com/gpu: 2", cid="a"))
    before = held(engine)
    with pytest.raises(RequestError):
        admit(engine, allocated("nvidia.com/gpu: 9", cid="b"))
    with pytest.raises(RequestError):
        admit(engine, allocated("nvidia.com/gpu: 1", cid="a", env=("NVIDIA_VISIBLE_DEVICES=7:9",)))
    assert held(engine) == before


def test_planning_a_container_again_replaces_its_allocation(engine):
    first = admit(engine, allocated("nvidia.com/gpu: 2", cid="a"))
    second = admit(engine, allocated("nvidia.com/gpu: 2", cid="a"))
    assert first.qualified_names == second.qualified_names
    assert held(engine) == {"a": first.qualified_names}


def test_release_of_an_unknown_container_is_harmless(engine):
    engine.release("nope")
    assert held(engine) == {}


def test_all_shares_and_does_not_block_counts():
    engine = Engine(demo_inventory(), standalone())
    plan = admit(engine, container(cid="monitor", env=("NVIDIA_VISIBLE_DEVICES=all",)))
    assert len(plan.devices) == 11
    assert ANNOTATION_SHARED in plan.annotations
    assert held(engine) == {}
    assert len(admit(engine, allocated("nvidia.com/gpu: 7", cid="big")).devices) == 7


def test_restore_rebuilds_holdings_from_plan_annotations(engine):
    plans = {cid: admit(engine, allocated(req, cid=cid))
             for cid, req in (("a", "nvidia.com/gpu: 2"), ("b", "nvidia.com/mig: 1"))}
    restarted = Engine(demo_inventory(), kubernetes("research"))
    restarted.restore_grants(restarted.grants_in(
        container(cid=cid, annotations=dict(p.annotations)) for cid, p in plans.items()))
    assert held(restarted) == held(engine)
    nxt = admit(restarted, allocated("nvidia.com/gpu: 2", cid="c"))
    assert not set(nxt.qualified_names) & set(plans["a"].qualified_names)


class RecordingLog:
    """Stands for the engine module's structlog logger: records (level, event, fields)."""

    def __init__(self) -> None:
        self.records: list[tuple[str, str, dict]] = []

    def __getattr__(self, level: str):
        return lambda event, **fields: self.records.append((level, event, fields))


def test_restore_keeps_shared_devices_free_and_skips_unreadable_annotations(engine,
                                                                            monkeypatch):
    logs = RecordingLog()
    monkeypatch.setattr(engine_module, "log", logs)
    admit(engine, allocated("nvidia.com/gpu: 1", cid="old"))
    gpu = {n: f"nvidia.com/gpu={GPU_UUIDS[n]}" for n in ("0", "4")}
    engine.restore_grants(engine.grants_in(container(cid=cid, annotations=a) for cid, a in (
        ("mon", {ANNOTATION_GRANTED: f"{gpu['0']},nvidia.com/gpu=GPU-other",
                 ANNOTATION_SHARED: f"{gpu['0']},nvidia.com/gpu=GPU-other"}),
        ("bad", {ANNOTATION_GRANTED: "garbage without kind"}),
        ("huge", {ANNOTATION_GRANTED: ",".join(f"x.io/y={i}" for i in range(5000))}),
        ("plain", {"other": "annotation"}),
        ("held", {ANNOTATION_GRANTED: gpu["4"]}),
    )))
    assert held(engine) == {"held": ("nvidia.com/gpu=4",)}  # "old" is gone: replaced
    unreadable = [(level, fields["container_id"]) for level, event, fields in logs.records
                  if event == "grant_annotation_unreadable"]
    assert unreadable == [("warning", "bad"), ("warning", "huge")]


def test_a_running_container_whose_grant_cannot_be_read_leaves_the_state_unknown(engine):
    # its annotations are garbage and the checkpoint does not know it: what it holds is
    # not known, so nothing is granted exclusively until a Synchronize without it
    admit(engine, allocated("nvidia.com/gpu=1", cid="known"))
    listed = [container(cid="known", annotations={ANNOTATION_GRANTED: "nvidia.com/gpu=1"}),
              container(cid="bad", annotations={ANNOTATION_GRANTED: "garbage without kind"})]
    unread: list[str] = []
    grants = engine.grants_in(listed, unread)
    assert unread == ["bad"]
    engine.restore_grants(grants, known=not unread)
    with pytest.raises(StateError):
        admit(engine, allocated("nvidia.com/gpu=2", cid="new"))
    # a garbage annotation on a container the checkpoint knows: its record is read
    unread = []
    engine.restore_grants(engine.grants_in(
        [container(cid="known", annotations={ANNOTATION_GRANTED: "garbage"})], unread),
        known=not unread)
    assert unread == [] and held(engine) == {"known": ("nvidia.com/gpu=1",)}
    assert admit(engine, allocated("nvidia.com/gpu=2", cid="new")).devices


def test_swap_inventory_keeps_holdings(engine):
    plan = admit(engine, allocated("nvidia.com/gpu: 1", cid="a"))
    engine.swap_inventory(Inventory.load(DEMO_INVENTORY))
    assert held(engine) == {"a": plan.qualified_names}
    assert plan.qualified_names[0] not in admit(engine,
        allocated("nvidia.com/gpu: 6", cid="b")).qualified_names


# ---- hostile inputs --------------------------------------------------------------------------

@pytest.mark.parametrize(("annotations", "source"), [
    ({"devices.nri-accel.io/pod": "nvidia.com/gpu=../../dev/mem"},
     "annotation devices.nri-accel.io/pod"),
    ({"devices.nri-accel.io/pod": "nvidia.com/gpu=/proc/self/root"},
     "annotation devices.nri-accel.io/pod"),
    ({"devices.nri-accel.io/pod": "../x/y=0"}, "annotation devices.nri-accel.io/pod"),
    ({"devices.nri-accel.io/pod": "nvidia.com/gpu=" + "0," * 5000},
     "annotation devices.nri-accel.io/pod"),
    ({"devices.nri-accel.io/pod": "nvidia.com/gpu=0\x00"}, "annotation devices.nri-accel.io/pod"),
])
def test_malformed_or_hostile_annotations_fail_naming_the_key(annotations, source):
    engine = Engine(demo_inventory(), kubernetes("research"))
    with pytest.raises(RequestError) as e:
        admit(engine, container(namespace="research", pod_annotations=annotations))
    assert e.value.source == source
    assert held(engine) == {}


def test_hostile_env_values_fail_naming_the_variable():
    engine = Engine(demo_inventory(), standalone())
    for env in ("NVIDIA_VISIBLE_DEVICES=../../../proc/1", "NVIDIA_VISIBLE_DEVICES=" + "9" * 9000,
                "NVIDIA_DRIVER_CAPABILITIES=compute,rootkit"):
        with pytest.raises(RequestError) as e:
            admit(engine, container(env=(env, "NV_GPU=0")))  # NV_GPU: NVIDIA_VISIBLE_DEVICES wins
        assert e.value.source == "env " + env.partition("=")[0]


def test_untrusted_namespace_asking_for_all_is_refused(engine):
    with pytest.raises(PolicyError) as e:
        admit(engine, container(namespace="sandbox",
                              pod_annotations={"devices.nri-accel.io/pod": "nvidia.com/gpu=all"}))
    assert e.value.source == "annotation devices.nri-accel.io/pod"
    assert "sandbox" in e.value.message


def test_untrusted_image_env_all_grants_nothing_and_says_why(engine):
    plan = admit(engine, container(namespace="sandbox", env=("NVIDIA_VISIBLE_DEVICES=all",)))
    assert plan.devices == ()
    # and a co-installed NVIDIA hook reading the image's variable cannot widen that
    assert plan.edits.env == ("NVIDIA_VISIBLE_DEVICES=void",)
    assert not (plan.edits.device_nodes or plan.edits.mounts)
    assert "not granted" in plan.notes[0]


@pytest.mark.parametrize("var", ["HABANA_VISIBLE_MODULES", "HABANA_VISIBLE_PCI_BUS_IDS"])
def test_an_image_naming_gaudis_by_module_or_pci_bus_id_gets_visible_devices_none(engine, var):
    # the Intel Gaudi container runtime mounts the devices these name when
    # HABANA_VISIBLE_DEVICES is unset, and reads HABANA_VISIBLE_DEVICES first
    plan = admit(engine, container(namespace="sandbox", env=(f"{var}=0,1",)))
    assert plan.devices == ()
    assert plan.edits.env == ("HABANA_VISIBLE_DEVICES=none",)


@pytest.mark.parametrize("namespace", ["sandbox", "research"])
def test_a_visibility_variable_defined_twice_is_refused(engine, namespace):
    # containerd's NRI applies an adjustment's value to a variable's first definition and
    # keeps a later one: NVIDIA_VISIBLE_DEVICES=all would survive the void written here
    env = ("NVIDIA_VISIBLE_DEVICES=void", "PATH=/bin", "NVIDIA_VISIBLE_DEVICES=all")
    with pytest.raises(RequestError) as e:
        admit(engine, container(namespace=namespace, env=env))
    assert e.value.source == "env NVIDIA_VISIBLE_DEVICES"
    assert "defined more than once" in e.value.message


def test_unknown_ids_fail_naming_the_source(engine):
    with pytest.raises(NotFoundError) as e:
        admit(engine, allocated("nvidia.com/gpu=GPU-00000000-0000-0000-0000-000000000000"))
    assert e.value.source == "container annotation devices.nri-accel.io"
    assert "unknown device" in e.value.message


def test_ld_preload_in_the_image_env_has_no_effect(engine):
    plan = admit(engine, allocated("nvidia.com/gpu=0", env=("LD_PRELOAD=/tmp/x.so",
                                                          "LD_LIBRARY_PATH=/evil")))
    env = env_of(plan)
    assert "LD_PRELOAD" not in env
    assert env["LD_LIBRARY_PATH"] == "/evil:/usr/local/nvidia/lib64"  # appended, never replaced
    assert plan.edits.hooks == ()


def test_hand_crafted_inventory_json_with_a_proc_mount_is_refused():
    data = json.loads(DEMO_INVENTORY.read_text())
    gpu3 = next(d for d in data["devices"] if d["kind"] == "nvidia.com/gpu" and d["name"] == "3")
    gpu3["edits"]["mounts"] = [{"host_path": "/etc/shadow",
                                "container_path": "/proc/sys/kernel/core_pattern"}]
    engine = Engine(Inventory.from_dict(data), kubernetes())
    with pytest.raises(AllocationError) as e:
        admit(engine, allocated("nvidia.com/gpu=3"))
    assert e.value.source == "nvidia.com/gpu=3"
    assert "/proc" in e.value.message
    assert admit(engine, allocated("nvidia.com/gpu=2", cid="c2")).qualified_names


def test_inventory_json_cannot_express_a_symlinked_device_node():
    data = json.loads(DEMO_INVENTORY.read_text())
    node = data["devices"][0]["edits"]["device_nodes"][0]
    node["symlink"] = "/dev/sda"
    with pytest.raises(InventoryError, match="unknown field 'symlink'"):
        Inventory.from_dict(data)
    # The only other way to name something: a host path, which edits keeps under /dev.
    del node["symlink"]
    node["host_path"] = "/etc/shadow"
    with pytest.raises(AllocationError, match="not under /dev"):
        Engine(Inventory.from_dict(data), kubernetes()).plan(allocated("nvidia.com/gpu=0"))
