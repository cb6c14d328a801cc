"""Allocation state: devices held by stable identity across renumbering and restarts, the
one exclusivity rule, the grant checkpoint, and what ends a grant.

The renumbered node is the demo node with its GPUs' indices shuffled and GPU 1 gone (as
after a GPU falls off the bus and the driver reloads: NVML's own documentation says
enumeration order is not stable; the UUIDs and PCI bus ids stay).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import msgspec
import pytest
from engine_testing import admit, allocated, container, demo_inventory, held, kubernetes, standalone
from grants import key
from structlog.testing import capture_logs

from nri_accel.config import Config, DevicesConfig, PolicyConfig
from nri_accel.container import ContainerInfo
from nri_accel.engine import Engine
from nri_accel.errors import AllocationError, ConfigError, StateError
from nri_accel.inventory import Inventory
from nri_accel.state import (
    CHECKPOINT_FILE,
    UNREADABLE_SUFFIX,
    Checkpoint,
    Grant,
    Holdings,
    prepare_state_dir,
)
from nri_accel.vendors.nvidia import KIND_GPU, KIND_MIG

BOOT = "6b8a1d1e-0000-4000-8000-000000000001"


def renumbered(inventory: Inventory) -> Inventory:
    """The same node after a renumbering: GPU 1 is gone, the other whole GPUs are
    numbered in reverse (their UUIDs, PCI bus ids and nodes are unchanged), MIG devices
    keep their parent and get new indices."""
    gpus = [d for d in inventory.of_kind(KIND_GPU) if d.name not in ("1", "7")]
    names = {d.name: str(len(gpus) - 1 - i) for i, d in enumerate(gpus)}
    devices = [msgspec.structs.replace(d, name=names[d.name], links=()) for d in gpus]
    devices.append(inventory.find(KIND_GPU, "7"))
    migs = inventory.of_kind(KIND_MIG)
    devices += [msgspec.structs.replace(m, name=f"7:{len(migs) - 1 - i}")
                for i, m in enumerate(migs)]
    return Inventory(devices=tuple(devices), drivers=inventory.drivers)


def uuids(engine: Engine, container_id: str) -> set[str]:
    grant = engine.holdings.get(container_id)
    assert grant is not None
    return {k.partition("=")[2] for k in grant.exclusive}


# ---- renumbering --------------------------------------------------------------------------

def test_a_renumbered_node_never_hands_a_held_device_to_a_second_container():
    engine = Engine(demo_inventory(), standalone())
    first = admit(engine, allocated("nvidia.com/gpu: 3", cid="a"))
    mig = admit(engine, allocated("nvidia.com/mig: 1", cid="m"))
    engine.swap_inventory(renumbered(demo_inventory()))
    # Everything still free is 6 GPUs minus the 3 held (one of which may be GPU 1, gone).
    taken = {d.uuid for d in first.devices}
    free = {d.uuid for d in engine.inventory.of_kind(KIND_GPU)
            if d.attributes.get("mig_mode") != "enabled"} - taken
    second = admit(engine, allocated(f"nvidia.com/gpu: {len(free)}", cid="b"))
    assert {d.uuid for d in second.devices} == free
    with pytest.raises(AllocationError, match="only 0 of"):
        admit(engine, allocated("nvidia.com/gpu: 1", cid="c"))
    other_mig = admit(engine, allocated("nvidia.com/mig: 2", cid="n"))
    assert not {d.uuid for d in other_mig.devices} & {d.uuid for d in mig.devices}


def test_a_held_device_gone_from_the_node_is_said_and_stays_held(all_logs):
    from structlog.testing import capture_logs

    engine = Engine(demo_inventory(), standalone())
    plan = admit(engine, allocated("nvidia.com/gpu=1", cid="a"))
    with capture_logs() as logs:
        engine.swap_inventory(renumbered(demo_inventory()))
    (gone,) = [e for e in logs if e["event"] == "held_device_gone"]
    assert gone["device"] == f"nvidia.com/gpu={plan.devices[0].uuid}"
    assert gone["container_id"] == "a" and gone["log_level"] == "warning"
    assert uuids(engine, "a") == {plan.devices[0].uuid}
    # Back on the bus under another index: still that container's.
    engine.swap_inventory(demo_inventory())
    with pytest.raises(AllocationError, match="is held by default/pod/main-a"):
        admit(engine, allocated("nvidia.com/gpu=1", cid="b"))


def test_restart_and_synchronize_on_a_renumbered_node_keep_every_grant():
    engine = Engine(demo_inventory(), standalone())
    plans = {cid: admit(engine, allocated(req, cid=cid))
             for cid, req in (("a", "nvidia.com/gpu: 2"), ("m", "nvidia.com/mig: 2"))}
    restarted = Engine(renumbered(demo_inventory()), standalone())
    restarted.restore_grants(restarted.grants_in(
        container(cid=cid, annotations=dict(p.annotations)) for cid, p in plans.items()))
    held_uuids = {d.uuid for p in plans.values() for d in p.devices}
    for i in range(8):
        try:
            plan = admit(restarted, allocated("nvidia.com/gpu: 1", cid=f"x{i}"))
        except AllocationError:
            break
        assert not {d.uuid for d in plan.devices} & held_uuids
    mig = admit(restarted, allocated("nvidia.com/mig: 1", cid="y"))
    assert not {d.uuid for d in mig.devices} & held_uuids


# ---- the exclusivity rule ---------------------------------------------------------------

def test_a_named_device_held_by_a_count_is_refused_naming_the_holder():
    engine = Engine(demo_inventory(), kubernetes("research"))
    counted = admit(engine, container(namespace="research", pod="trainer", cid="t",
                                      pod_annotations={"devices.nri-accel.io/pod":
                                                       "nvidia.com/gpu: 1"}))
    (gpu,) = counted.devices
    with pytest.raises(AllocationError) as e:
        admit(engine, allocated(f"nvidia.com/gpu={gpu.uuid}", pod="serving", cid="s"))
    assert e.value.source == "container annotation devices.nri-accel.io"
    assert f"nvidia.com/gpu={gpu.uuid} is held by research/trainer/main-t (id t)" in (
        e.value.message)
    assert held(engine) == {"t": (gpu.qualified_name,)}


def test_a_commit_after_another_took_the_device_since_its_plan_is_refused():
    # The device plugin's threads may commit between the daemon's plan and commit.
    engine = Engine(demo_inventory(), standalone())
    first = engine.plan(allocated("nvidia.com/gpu=0", cid="a"))
    second = engine.plan(allocated("nvidia.com/gpu=0", cid="b"))
    engine.commit(first)
    with pytest.raises(AllocationError, match=r"nvidia\.com/gpu=GPU-\S+ is held by .*\(id a\)"):
        engine.commit(second)
    assert held(engine) == {"a": ("nvidia.com/gpu=0",)}
    later = engine.plan(allocated("nvidia.com/gpu=1", cid="c"))
    engine.release("a")  # a change that frees, not takes: the commit still goes through
    engine.commit(later)
    assert held(engine) == {"c": ("nvidia.com/gpu=1",)}


def test_time_sliced_replicas_and_shared_kinds_may_be_granted_to_several_containers():
    engine = Engine(demo_inventory(), kubernetes())
    uuid = demo_inventory().find(KIND_GPU, "2").uuid
    for i in range(3):
        plan = admit(engine, allocated(f"nvidia.com/gpu={uuid}::{i}", cid=f"r{i}"))
        assert plan.qualified_names == ("nvidia.com/gpu=2",)
        assert plan.annotations["nri-accel.io/shared"] == f"nvidia.com/gpu={uuid}"
    assert held(engine) == {}
    shared = Engine(demo_inventory(), Config(devices=DevicesConfig(
        shared_kinds=frozenset({KIND_GPU}))))
    for cid in ("a", "b"):
        assert admit(shared, allocated("nvidia.com/gpu=3", cid=cid)).devices
    assert held(shared) == {}


def test_all_is_shared_and_neither_blocks_nor_is_blocked():
    engine = Engine(demo_inventory(), standalone())
    admit(engine, allocated("nvidia.com/gpu=0", cid="owner"))
    monitor = admit(engine, container(cid="mon", env=("NVIDIA_VISIBLE_DEVICES=all",)))
    assert "nvidia.com/gpu=0" in monitor.qualified_names
    assert held(engine) == {"owner": ("nvidia.com/gpu=0",)}


def test_a_new_create_of_the_same_pod_and_name_replaces_the_earlier_grant():
    # CRI-O runs `runc create` inside CreateContainer and sends nothing when it fails
    # (capture crio-1.36.3-failed-create): kubelet's retry is a new container id.
    engine = Engine(demo_inventory(), standalone())
    for attempt in range(3):
        admit(engine, allocated("nvidia.com/gpu: 2", cid=f"try{attempt}", name="app"))
        assert list(held(engine)) == [f"try{attempt}"]
    assert len(held(engine)["try2"]) == 2


def test_a_pod_sandbox_ending_releases_every_container_of_the_pod():
    engine = Engine(demo_inventory(), standalone())
    admit(engine, allocated("nvidia.com/gpu: 1", pod="p", cid="a"))
    admit(engine, allocated("nvidia.com/gpu: 1", pod="p", cid="b"))
    admit(engine, allocated("nvidia.com/gpu: 1", pod="q", cid="c"))
    released = engine.release_pod("uid-p", "")
    assert sorted(g.container_id for g in released) == ["a", "b"]
    assert list(held(engine)) == ["c"]


def in_sandbox(info: ContainerInfo, sandbox: str) -> ContainerInfo:
    """`info` in the runtime's pod sandbox `sandbox` (its pod uid unchanged)."""
    return msgspec.structs.replace(info, pod_id=sandbox)


def test_an_older_sandbox_of_the_pod_ending_keeps_the_newer_ones_grants():
    # The first sandbox died; kubelet made a second (same pod uid), whose container
    # holds a GPU, and removes the first one later: that must release nothing of it.
    engine = Engine(demo_inventory(), standalone())
    admit(engine, in_sandbox(allocated("nvidia.com/gpu=6", pod="p", cid="c1"), "sandbox-1"))
    engine.release_pod("uid-p", "sandbox-1")  # StopPodSandbox(sandbox-1)
    admit(engine, in_sandbox(allocated("nvidia.com/gpu=6", pod="p", cid="c2"), "sandbox-2"))
    assert engine.release_pod("uid-p", "sandbox-1") == ()  # kubelet's RemovePodSandbox
    assert held(engine) == {"c2": ("nvidia.com/gpu=6",)}
    assert [g.container_id for g in engine.release_pod("uid-p", "sandbox-2")] == ["c2"]


def test_containers_of_one_name_in_two_sandboxes_of_one_uid_do_not_replace_each_other():
    # crictl pods made from one config share the uid; so do a pod's successive sandboxes
    engine = Engine(demo_inventory(), standalone())
    admit(engine, in_sandbox(allocated("nvidia.com/gpu=1", pod="p", cid="a", name="main"),
                             "sandbox-a"))
    admit(engine, in_sandbox(allocated("nvidia.com/gpu=2", pod="p", cid="b", name="main"),
                             "sandbox-b"))
    assert held(engine) == {"a": ("nvidia.com/gpu=1",), "b": ("nvidia.com/gpu=2",)}
    # a retry in one sandbox replaces that sandbox's earlier container only
    admit(engine, in_sandbox(allocated("nvidia.com/gpu=3", pod="p", cid="b2", name="main"),
                             "sandbox-b"))
    assert held(engine) == {"a": ("nvidia.com/gpu=1",), "b2": ("nvidia.com/gpu=3",)}


def test_a_restore_keeps_every_listed_grant_whatever_the_order():
    # A Synchronize lists a running container and one of the same sandbox and name left
    # CREATED (a create whose start failed): what runs holds what it was granted.
    engine = Engine(demo_inventory(), standalone())
    running, left = (in_sandbox(container(pod="p", cid=cid, name="main", annotations={
        "nri-accel.io/granted": key(engine.inventory, f"nvidia.com/gpu={gpu}")}), "s")
        for cid, gpu in (("running", 0), ("left", 1)))
    for order in ((running, left), (left, running)):
        engine.restore_grants(engine.grants_in(order))
        assert held(engine) == {"running": ("nvidia.com/gpu=0",),
                                "left": ("nvidia.com/gpu=1",)}
        with pytest.raises(AllocationError, match="is held by"):
            engine.plan(allocated("nvidia.com/gpu=0", pod="q", cid="other"))


def test_cdi_passthrough_grants_are_held():
    config = Config(policy=PolicyConfig(mode="standalone"),
                    devices=DevicesConfig(cdi_passthrough=True))
    engine = Engine(demo_inventory(), config)
    plan = admit(engine, container(cid="cdi", annotations={"cdi.k8s.io/x": "nvidia.com/gpu=3"}))
    assert plan.cdi_devices == ("nvidia.com/gpu=3",) and plan.devices == ()
    assert held(engine) == {"cdi": ("nvidia.com/gpu=3",)}
    with pytest.raises(AllocationError, match="is held by"):
        admit(engine, allocated("nvidia.com/gpu=3", cid="other"))


# ---- the checkpoint -----------------------------------------------------------------------

def _checkpoint(tmp_path: Path, boot: str = BOOT) -> Checkpoint:
    return Checkpoint(str(tmp_path / "state"), boot_id=boot)


def test_grants_survive_a_restart_without_synchronize(tmp_path: Path):
    engine = Engine(demo_inventory(), standalone())
    plan = admit(engine, allocated("nvidia.com/gpu: 4", cid="a"))
    checkpoint = _checkpoint(tmp_path)
    checkpoint.save(engine.holdings.to_json(checkpoint.boot_id))

    restarted = Engine(demo_inventory(), standalone())
    restarted.load_checkpoint(*_checkpoint(tmp_path).load())
    assert held(restarted) == held(engine)
    other = admit(restarted, allocated("nvidia.com/gpu: 3", cid="b"))
    assert not {d.uuid for d in other.devices} & {d.uuid for d in plan.devices}


def test_a_checkpoint_of_another_boot_holds_nothing(tmp_path: Path):
    engine = Engine(demo_inventory(), standalone())
    admit(engine, allocated("nvidia.com/gpu: 4", cid="a"))
    checkpoint = _checkpoint(tmp_path)
    checkpoint.save(engine.holdings.to_json(checkpoint.boot_id))
    grants, known = _checkpoint(tmp_path, boot="another-boot").load()
    assert (grants, known) == ([], True)


def test_no_checkpoint_means_nothing_granted_on_this_boot(tmp_path: Path):
    assert _checkpoint(tmp_path).load() == ([], True)


@pytest.mark.parametrize("content", ["{not json", json.dumps({"version": 99, "grants": []}),
                                     json.dumps({"version": 1, "grants": [{"x": 1}]}),
                                     json.dumps({"version": 1, "grants": [
                                         {"container_id": "a", "wholes": {"k/p=0": 1}}]}),
                                     "[" * 100_000])  # deeper than the JSON parser goes
def test_an_unreadable_checkpoint_leaves_grants_refused_until_synchronize(tmp_path: Path,
                                                                         content: str):
    # counted or named, no device is granted exclusively while a container nri-accel no
    # longer knows of may hold it
    state = tmp_path / "state"
    state.mkdir()
    (state / CHECKPOINT_FILE).write_text(content)
    engine = Engine(demo_inventory(), standalone())
    engine.load_checkpoint(*_checkpoint(tmp_path).load())
    for asked in ("nvidia.com/gpu: 1", "nvidia.com/gpu=2"):
        with pytest.raises(StateError) as e:
            admit(engine, allocated(asked, cid="a"))
        assert e.value.source == "container annotation devices.nri-accel.io"
        assert e.value.status == "UNAVAILABLE"
    engine.restore_grants([])  # the runtime's view: nothing else runs
    assert admit(engine, allocated("nvidia.com/gpu: 1", cid="a")).devices
    assert admit(engine, allocated("nvidia.com/gpu=2", cid="named")).devices


@pytest.mark.parametrize("change", ["owner", "mode"])
def test_a_checkpoint_another_user_may_write_is_unreadable(tmp_path: Path, change: str):
    # only the directory's owner and mode were checked: a user owning grants.json itself
    # (or allowed to write it) could rewrite the grants restored at the next start
    state = tmp_path / "state"
    state.mkdir()
    engine = Engine(demo_inventory(), standalone())
    admit(engine, allocated("nvidia.com/gpu=0", cid="a"))
    checkpoint = _checkpoint(tmp_path)
    checkpoint.save(engine.holdings.to_json(checkpoint.boot_id))
    assert [g.container_id for g in checkpoint.load()[0]] == ["a"]
    path = state / CHECKPOINT_FILE
    checkpoint.save(engine.holdings.to_json(checkpoint.boot_id))
    if change == "owner":
        os.chown(path, os.geteuid() + 1000, -1)
    else:
        path.chmod(0o620)
    with capture_logs() as logs:
        assert checkpoint.load() == ([], False)
    assert "owned by uid" in logs[0]["error"] if change == "owner" else \
        "writable by its group or others" in logs[0]["error"]


@pytest.mark.parametrize("boot", [None, "", 7])
def test_a_checkpoint_that_names_no_boot_is_unreadable(tmp_path: Path, boot: object):
    # "another boot" holds nothing; a checkpoint that does not say its boot cannot tell
    state = tmp_path / "state"
    state.mkdir()
    doc = {"version": 1, "grants": []} | ({} if boot is None else {"boot_id": boot})
    (state / CHECKPOINT_FILE).write_text(json.dumps(doc))
    assert _checkpoint(tmp_path).load() == ([], False)


def test_an_unreadable_checkpoint_is_kept_aside_and_only_the_latest(tmp_path: Path):
    # "Bad input loses nothing": the file `run` could not read is renamed out of the way
    # of the one it writes next, not overwritten; a later one replaces it (bounded).
    state = tmp_path / "state"
    state.mkdir()
    kept = state / (CHECKPOINT_FILE + UNREADABLE_SUFFIX)
    for content in ('{"version":1,', '{"version": 99, "grants": []}'):
        (state / CHECKPOINT_FILE).write_text(content)
        checkpoint = _checkpoint(tmp_path)
        with capture_logs() as logs:
            assert checkpoint.load() == ([], False)
        assert kept.read_text() == content
        assert not (state / CHECKPOINT_FILE).exists()
        (line,) = logs
        assert (line["event"], line["path"], line["kept"]) == (
            "checkpoint_unreadable", checkpoint.path, str(kept))
        holdings = Holdings(known=False)
        checkpoint.save(holdings.to_json(BOOT))  # what `run` writes next
    assert sorted(p.name for p in state.iterdir()) == [CHECKPOINT_FILE, kept.name]
    assert kept.read_text() == '{"version": 99, "grants": []}'
    assert _checkpoint(tmp_path).load() == ([], False)  # what it wrote keeps "not known"


def test_a_checkpoint_that_cannot_be_set_aside_is_logged_so(tmp_path: Path):
    state = tmp_path / "state"
    (state / CHECKPOINT_FILE).mkdir(parents=True)  # unreadable: a directory
    (state / CHECKPOINT_FILE / "x").write_text("")
    (state / (CHECKPOINT_FILE + UNREADABLE_SUFFIX)).write_text("older")
    with capture_logs() as logs:
        assert _checkpoint(tmp_path).load() == ([], False)
    (line,) = logs
    assert line["kept"] is None and line["keep_error"] and line["error"]


@pytest.mark.parametrize("create", [True, False])
def test_a_state_dir_must_be_a_directory(tmp_path: Path, create: bool):
    blocker = tmp_path / "blocker"
    blocker.write_text("")
    with pytest.raises(ConfigError) as e:
        prepare_state_dir(str(blocker), source="--state-dir", create=create)
    assert str(e.value).startswith(f"--state-dir: {blocker} is not a directory")
    if create:
        with pytest.raises(ConfigError, match="cannot create the state directory"):
            prepare_state_dir(str(blocker / "sub"), source="--state-dir")
    absent = tmp_path / "a" / "b"
    prepare_state_dir(str(absent), source="--state-dir", create=create)
    assert absent.is_dir() is create  # `run` creates it; `device-plugin` waits for run


@pytest.mark.parametrize("create", [True, False])
def test_a_state_dir_others_may_write_to_is_refused(tmp_path: Path, create: bool):
    # Whoever else may write there could forge the grants `run` restores (a device
    # held twice) or the record the device plugin trusts.
    state = tmp_path / "state"
    state.mkdir(mode=0o755)
    prepare_state_dir(str(state), source="--state-dir", create=create)
    state.chmod(0o777)
    with pytest.raises(ConfigError, match=r"owned by uid 0 with mode 0777: it must be "
                                          r"this process's \(uid 0\) and writable by no one"):
        prepare_state_dir(str(state), source="--state-dir", create=create)
    state.chmod(0o755)
    os.chown(state, 1000, 1000)
    with pytest.raises(ConfigError, match="owned by uid 1000"):
        prepare_state_dir(str(state), source="--state-dir", create=create)


@pytest.mark.parametrize("plant", ["fifo", "symlink"])
def test_a_checkpoint_that_is_not_a_regular_file_is_unreadable_not_waited_on(
        tmp_path: Path, plant: str):
    # A FIFO there blocked `run` at start for ever; a link (which `run` never makes) was
    # followed to whatever grants it named.
    state = tmp_path / "state"
    state.mkdir()
    elsewhere = tmp_path / "forged.json"
    elsewhere.write_text(json.dumps({"version": 1, "boot_id": BOOT, "grants": [
        {"container_id": "x", "exclusive": ["nvidia.com/gpu=GPU-forged"]}]}))
    if plant == "fifo":
        os.mkfifo(state / CHECKPOINT_FILE)
    else:
        (state / CHECKPOINT_FILE).symlink_to(elsewhere)
    with capture_logs() as logs:
        assert _checkpoint(tmp_path).load() == ([], False)
    (line,) = logs
    assert line["event"] == "checkpoint_unreadable"
    assert ("FIFO" if plant == "fifo" else "a symbolic link") in line["error"]


def test_the_checkpoint_file_is_replaced_whole(tmp_path: Path):
    checkpoint = _checkpoint(tmp_path)
    holdings = Holdings()
    holdings.record(Grant("c1", name="ns/p/c", exclusive=frozenset({"x.io/y=a"})))
    checkpoint.save(holdings.to_json(BOOT))
    first = (tmp_path / "state" / CHECKPOINT_FILE).stat().st_ino
    checkpoint.save(holdings.to_json(BOOT))
    assert (tmp_path / "state" / CHECKPOINT_FILE).stat().st_ino != first  # renamed in
    assert sorted(p.name for p in (tmp_path / "state").iterdir()) == [CHECKPOINT_FILE]
    grants, known = checkpoint.load()
    assert known and grants == [Grant("c1", name="ns/p/c", exclusive=frozenset({"x.io/y=a"}))]


def test_a_holder_whose_id_is_its_name_is_named_once():
    """explain and demo number containers by their names (there is no runtime id)."""
    engine = Engine(demo_inventory(), standalone())
    admit(engine, allocated("nvidia.com/gpu=0", namespace="ns", pod="a", name="c",
                            cid="ns/a/c"))
    with pytest.raises(AllocationError) as e:
        engine.plan(allocated("nvidia.com/gpu=0", namespace="ns", pod="b", name="c",
                              cid="ns/b/c"))
    assert "is held by ns/a/c:" in e.value.message
    assert "(id" not in e.value.message


# ---- AMD compute partitions ---------------------------------------------------------------

def cpx_inventory() -> Inventory:
    """An MI300X node's first two GPUs in CPX mode, as the AMD discoverer lists them: 8
    partitions each, named 0-15 in PCI order, each with its own render node, its GPU's
    PCI function and its index in it, and no UUID (they share the GPU's unique_id)."""
    from types import MappingProxyType

    from nri_accel.inventory import ContainerEdits, Device, DeviceNode, Driver

    devices = []
    for g, bus in enumerate(("0000:11:00.0", "0000:2f:00.0")):
        for p in range(8):
            n = 8 * g + p
            devices.append(Device(
                kind="amd.com/gpu", name=str(n), aliases=(f"renderD{128 + n}",),
                edits=ContainerEdits(device_nodes=(DeviceNode(f"/dev/dri/renderD{128 + n}",
                                                              226, 128 + n),)),
                numa_node=0, pci_bus_id=bus, partition=p, vendor="amd"))
    return Inventory(devices=tuple(devices), drivers=MappingProxyType({"amd": Driver("amd")}))


def test_two_containers_each_get_one_partition_of_the_same_gpu(tmp_path: Path):
    """A partition held is that partition alone: its siblings on the same GPU stay free
    (one key per partition: on a CPX node all 8 of a GPU are usable), the grant
    annotation names each apart, and a restart (checkpoint or Synchronize) keeps them
    apart: neither held partition is granted again, every other one still is."""
    engine = Engine(cpx_inventory(), standalone())
    a = admit(engine, allocated("amd.com/gpu=0", cid="a"))
    b = admit(engine, allocated("amd.com/gpu=1", cid="b"))
    assert [d.pci_bus_id for d in a.devices + b.devices] == ["0000:11:00.0"] * 2
    assert held(engine) == {"a": ("amd.com/gpu=0",), "b": ("amd.com/gpu=1",)}
    assert a.annotations["nri-accel.io/granted"] == "amd.com/gpu=0000:11:00.0-p0"
    assert b.annotations["nri-accel.io/granted"] == "amd.com/gpu=0000:11:00.0-p1"
    with pytest.raises(AllocationError, match="is held by default/pod/main-a"):
        admit(engine, allocated("amd.com/gpu=0", cid="x"))

    checkpoint = _checkpoint(tmp_path)
    checkpoint.save(engine.holdings.to_json(checkpoint.boot_id))
    restored = Engine(cpx_inventory(), standalone())
    restored.load_checkpoint(*_checkpoint(tmp_path).load())
    synchronized = Engine(cpx_inventory(), standalone())
    synchronized.restore_grants(synchronized.grants_in(
        container(cid=p.grant.container_id, annotations=dict(p.annotations))
        for p in (a, b)))
    for again in (restored, synchronized):
        assert held(again) == held(engine)
        rest = admit(again, allocated("amd.com/gpu: 14", cid="c"))
        assert sorted(int(d.name) for d in rest.devices) == list(range(2, 16))


def test_a_partition_key_from_before_partitions_had_an_index_holds_its_whole_gpu():
    """Before, every partition of a GPU had the GPU's key (kind and PCI bus id). A
    container still running with that grant (its annotation, a checkpoint) holds every
    partition of that GPU until it ends, not none: no partition it may use is granted
    again; the other GPU's are."""
    engine = Engine(cpx_inventory(), standalone())
    engine.restore_grants(engine.grants_in([container(
        cid="old", annotations={"nri-accel.io/granted": "amd.com/gpu=0000:11:00.0"})]))
    with pytest.raises(AllocationError, match="is held by default/pod/main-old"):
        admit(engine, allocated("amd.com/gpu=3", cid="x"))
    rest = admit(engine, allocated("amd.com/gpu: 8", cid="c"))
    assert {d.pci_bus_id for d in rest.devices} == {"0000:2f:00.0"}
    with pytest.raises(AllocationError, match="only 0 of"):
        admit(engine, allocated("amd.com/gpu: 1", cid="d"))
    engine.release("old")
    assert len(admit(engine, allocated("amd.com/gpu: 8", cid="e")).devices) == 8
