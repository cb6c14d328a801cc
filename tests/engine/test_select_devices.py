"""Selection: id resolution, `all`, MIG rules, the allocator, limits and requirements."""

from __future__ import annotations

from types import MappingProxyType

import pytest
from engine_testing import GPU_UUIDS, MIG_UUIDS, demo_inventory, held_names, keys, request

from nri_accel import select as select_module
from nri_accel.errors import AllocationError, NotFoundError, PolicyError, RequestError
from nri_accel.inventory import ContainerEdits, Device, DeviceNode, Inventory
from nri_accel.policy import Request
from nri_accel.select import DeviceIndex, choose, select
from nri_accel.syntax import DeviceClaim
from nri_accel.vendors.nvidia import KIND_GPU, KIND_MIG
from nri_accel.vendors.nvidia.requirements import Requirements, parse_requirement

SRC = "annotation devices.nri-accel.io/pod"


def names(selection) -> list[str]:
    return [d.qualified_name for d in selection.devices]


def ids(*idents: str, kind: str = KIND_GPU, source: str = SRC, cdi: bool = False) -> Request:
    return request(grants=(DeviceClaim(kind, ids=idents, source=source, cdi=cdi),))


def count(n: int, kind: str = KIND_GPU) -> Request:
    return request(grants=(DeviceClaim(kind, count=n, source=SRC),))


@pytest.fixture(scope="module")
def index() -> DeviceIndex:
    return DeviceIndex(demo_inventory())


# ---- ids ---------------------------------------------------------------------------------

@pytest.mark.parametrize(("ident", "expected"), [
    ("0", "nvidia.com/gpu=0"),
    ("3", "nvidia.com/gpu=3"),
    (GPU_UUIDS["4"], "nvidia.com/gpu=4"),
    (GPU_UUIDS["4"].lower(), "nvidia.com/gpu=4"),
    ("00000000:17:00.0", "nvidia.com/gpu=0"),   # NVML form
    ("0000:31:00.0", "nvidia.com/gpu=1"),       # sysfs form
    ("0:4B:0.0", "nvidia.com/gpu=2"),           # no zero padding (libnvidia-container accepts)
    (MIG_UUIDS["7:2"], "nvidia.com/mig=7:2"),   # a MIG UUID under nvidia.com/gpu
    ("7:0", "nvidia.com/mig=7:0"),              # gpu:mig
])
def test_gpu_ids_resolve_like_nvidia_visible_devices(index, ident, expected):
    assert names(select(ids(ident), index)) == [expected]


def test_explicit_ids_are_sorted_and_deduplicated(index):
    sel = select(ids("5", GPU_UUIDS["0"], "0", "00000000:17:00.0"), index)
    assert names(sel) == ["nvidia.com/gpu=0", "nvidia.com/gpu=5"]
    assert held_names(sel) == {"nvidia.com/gpu=0", "nvidia.com/gpu=5"}
    assert sel.shared == frozenset()


def test_unknown_id_names_the_source_and_what_exists(index):
    with pytest.raises(NotFoundError) as e:
        select(ids("9", source="env NVIDIA_VISIBLE_DEVICES"), index)
    assert e.value.source == "env NVIDIA_VISIBLE_DEVICES"
    assert "'9'" in e.value.message
    assert "nvidia.com/gpu 0, 1, 2, 3, 4, 5, 6, 7" in e.value.message
    assert "nvidia.com/mig 7:0, 7:1, 7:2" in e.value.message


def test_unknown_id_of_an_absent_kind(index):
    with pytest.raises(NotFoundError, match=r"no aws\.amazon\.com/neuron devices"):
        select(ids("0", kind="aws.amazon.com/neuron"), index)


def test_oversized_unknown_id_is_not_echoed_whole(index):
    with pytest.raises(NotFoundError) as e:
        select(ids("x" * 5000), index)
    assert len(str(e.value)) < 400


def test_whole_mig_gpu_is_refused_with_its_mig_devices_named(index):
    with pytest.raises(AllocationError) as e:
        select(ids("7"), index)
    assert e.value.source == SRC
    assert "MIG mode" in e.value.message
    assert "nvidia.com/mig=7:0, nvidia.com/mig=7:1, nvidia.com/mig=7:2" in e.value.message


def test_whole_mig_gpu_is_allowed_for_mig_config(index):
    req = request(grants=ids("7").grants, mig_config=True)
    assert names(select(req, index)) == ["nvidia.com/gpu=7"]


@pytest.mark.parametrize("claim", [
    DeviceClaim(KIND_GPU, ids=("7:0",), source="env NVIDIA_VISIBLE_DEVICES"),  # by index
    DeviceClaim(KIND_GPU, ids=(MIG_UUIDS["7:2"],), source=SRC),  # by UUID
    DeviceClaim(KIND_MIG, count=1, source=SRC),  # counted
])
@pytest.mark.parametrize(("config", "monitor", "var"), [
    (True, False, "NVIDIA_MIG_CONFIG_DEVICES"), (False, True, "NVIDIA_MIG_MONITOR_DEVICES")])
def test_mig_caps_are_refused_beside_specific_mig_devices(index, claim, config, monitor, var):
    # nvidia-container-toolkit's migCapsDevices.Validate: the capabilities act on whole GPUs.
    with pytest.raises(RequestError, match="specific MIG devices") as e:
        select(request(grants=(claim,), mig_config=config, mig_monitor=monitor), index)
    assert e.value.source == f"env {var}"


def test_mig_caps_are_refused_when_a_limit_narrows_all_to_mig_devices(index):
    req = request(grants=(DeviceClaim(KIND_GPU, all=True, source=SRC),),
                  limits=(DeviceClaim(KIND_GPU, ids=("7:0",), source="env X"),),
                  mig_monitor=True)
    with pytest.raises(RequestError, match=r"nvidia\.com/mig=7:0"):
        select(req, index)


def test_mig_caps_with_all_or_whole_gpus(index):
    every = select(request(grants=(DeviceClaim(KIND_GPU, all=True, source=SRC),),
                           mig_config=True, mig_monitor=True), index)
    assert "nvidia.com/mig=7:0" in names(every)  # all: the MIG manager's own request
    req = request(grants=ids("0", "7").grants, mig_monitor=True)
    assert names(select(req, index)) == ["nvidia.com/gpu=0", "nvidia.com/gpu=7"]


# ---- all -----------------------------------------------------------------------------------

def test_all_is_every_healthy_gpu_and_mig_device_and_holds_nothing(index):
    sel = select(request(grants=(DeviceClaim(KIND_GPU, all=True, source=SRC),)), index)
    assert names(sel) == [f"nvidia.com/gpu={i}" for i in range(8)] + [
        "nvidia.com/mig=7:0", "nvidia.com/mig=7:1", "nvidia.com/mig=7:2"]
    assert held_names(sel) == frozenset()


def test_all_skips_unhealthy_devices():
    inv = _gpus(3, unhealthy={"1"})
    sel = select(request(grants=(DeviceClaim(KIND_GPU, all=True, source=SRC),)),
                 DeviceIndex(inv))
    assert names(sel) == ["nvidia.com/gpu=0", "nvidia.com/gpu=2"]


def test_all_on_a_node_without_the_kind_grants_nothing_with_a_note(index):
    sel = select(request(grants=(DeviceClaim("aws.amazon.com/neuron", all=True, source=SRC),)),
                 index)
    assert sel.devices == ()
    assert "no healthy aws.amazon.com/neuron" in sel.notes[0]


def test_explicit_and_all_grants_combine_explicit_ones_held(index):
    req = request(grants=(DeviceClaim("nvidia.com/mig", ids=("7:1",), source=SRC),
                          DeviceClaim(KIND_GPU, all=True, source="env NVIDIA_VISIBLE_DEVICES")))
    sel = select(req, index)
    assert held_names(sel) == {"nvidia.com/mig=7:1"}
    assert set(keys(demo_inventory(), "nvidia.com/gpu=0")) <= sel.shared


def test_an_unhealthy_device_is_granted_to_no_new_container():
    with pytest.raises(AllocationError) as e:
        select(ids("1"), DeviceIndex(_gpus(2, unhealthy={"1"})))
    assert e.value.source == SRC
    assert "nvidia.com/gpu=1 is unhealthy" in e.value.message
    assert names(select(ids("0"), DeviceIndex(_gpus(2, unhealthy={"1"})))) == [
        "nvidia.com/gpu=0"]


# ---- the allocator -------------------------------------------------------------------------

def test_count_prefers_an_nvlink_pair_on_one_numa_node(index):
    # Both NUMA nodes hold a free pair; NUMA 1 (free: 4, 5, 6) is the better fit.
    assert names(select(count(2), index)) == ["nvidia.com/gpu=4", "nvidia.com/gpu=5"]
    busy = keys(demo_inventory(), "nvidia.com/gpu=4")
    assert names(select(count(2), index, busy)) == ["nvidia.com/gpu=0", "nvidia.com/gpu=1"]


def test_count_never_picks_busy_devices(index):
    busy = keys(demo_inventory(), "nvidia.com/gpu=0", "nvidia.com/gpu=2")
    sel = select(count(2), index, busy)
    assert not {d.key for d in sel.devices} & busy.keys()
    # NUMA 0 has 1 and 3 free but unlinked; NUMA 1 has the 4-5 pair.
    assert names(sel) == ["nvidia.com/gpu=4", "nvidia.com/gpu=5"]


def test_count_one_keeps_linked_pairs_whole(index):
    # With 0 busy, GPU 1 has lost its peer: taking it breaks no free link.
    assert names(select(count(1), index, keys(demo_inventory(), "nvidia.com/gpu=0"))) == [
        "nvidia.com/gpu=1"]


def test_count_one_prefers_the_fullest_numa_node_best_fit(index):
    # GPU 6's NVLink peer is GPU 7 (MIG mode: not countable), so 6 breaks nothing and
    # NUMA 1 has fewer free GPUs than NUMA 0.
    assert names(select(count(1), index)) == ["nvidia.com/gpu=6"]


def test_count_choices_are_remembered_per_free_set_within_a_bound(monkeypatch):
    idx = DeviceIndex(demo_inventory())
    searched: list[tuple[tuple[int, ...], int]] = []
    real = select_module.choose_positions

    def counting(topology, free, count):
        searched.append((free, count))
        return real(topology, free, count)

    monkeypatch.setattr(select_module, "choose_positions", counting)
    first = names(select(count(2), idx))
    assert names(select(count(2), idx)) == first == ["nvidia.com/gpu=4", "nvidia.com/gpu=5"]
    assert len(searched) == 1  # the same free set and count: remembered
    busy = keys(demo_inventory(), "nvidia.com/gpu=4")
    assert names(select(count(2), idx, busy)) == ["nvidia.com/gpu=0", "nvidia.com/gpu=1"]
    assert len(searched) == 2  # another free set: searched
    monkeypatch.setattr(select_module, "_CHOICES_SIZE", 2)
    assert names(select(count(1), idx)) == ["nvidia.com/gpu=6"]
    assert len(searched) == 3 and len(idx._choices) == 1  # full: started over
    # The device plugin's preferred allocation goes through the same memo.
    assert [d.name for d in choose(idx, idx.devices[:7], 1)] == ["6"]
    assert len(searched) == 3


def test_count_never_picks_a_mig_mode_gpu(index):
    sel = select(count(7), index)
    assert "nvidia.com/gpu=7" not in names(sel)
    with pytest.raises(AllocationError) as e:
        select(count(8), index)
    assert e.value.source == SRC
    assert "only 7 of 8 are free" in e.value.message


def test_count_spans_numa_nodes_only_when_it_must(index):
    sel = select(count(5), index)
    assert len(sel.devices) == 5
    assert {d.numa_node for d in sel.devices} == {0, 1}
    assert all(d.numa_node == 0 for d in select(count(4), index).devices)


def test_count_avoids_devices_this_request_named_explicitly(index):
    req = request(grants=(DeviceClaim(KIND_GPU, ids=("6",), source=SRC),
                          DeviceClaim(KIND_GPU, count=1, source="annotation other")))
    sel = select(req, index)
    assert len(sel.devices) == 2
    assert held_names(sel) == frozenset(names(sel))


def test_count_of_mig_devices(index):
    sel = select(count(2, KIND_MIG), index, keys(demo_inventory(), "nvidia.com/mig=7:0"))
    assert names(sel) == ["nvidia.com/mig=7:1", "nvidia.com/mig=7:2"]


def test_count_on_a_node_without_the_kind(index):
    with pytest.raises(AllocationError, match="this node has none"):
        select(count(1, "aws.amazon.com/neuron"), index)


def test_select_resolves_named_devices_and_leaves_exclusivity_to_the_holdings(index):
    # Whether a named device may be taken while another container holds it is
    # nri_accel.state.Holdings.check's one rule (tests/engine/test_allocation_state.py).
    sel = select(ids("0"), index, keys(demo_inventory(), "nvidia.com/gpu=0"))
    assert names(sel) == ["nvidia.com/gpu=0"]


def test_a_refused_count_names_the_holders(index):
    busy = {k: f"ml/p{i}/c (id {i})" for i, k in enumerate(keys(
        demo_inventory(), *(f"nvidia.com/gpu={g}" for g in range(7))))}
    with pytest.raises(AllocationError) as e:
        select(count(1), index, busy)
    assert "only 0 of 8 are free" in e.value.message
    assert "held: 0 by ml/p0/c (id 0); 1 by ml/p1/c (id 1)" in e.value.message
    assert "6 by ml/p6/c (id 6);" in e.value.message


def test_allocator_maximises_links_inside_the_set():
    # A 4-ring 0-1-2-3-0 plus an isolated GPU 4, all on one NUMA node.
    inv = _gpus(5, links={"0": ("1", "3"), "1": ("2",), "2": ("3",)})
    index = DeviceIndex(inv)
    assert [d.name for d in choose(index, list(inv.devices), 3)] == ["0", "1", "2"]
    assert [d.name for d in choose(index, list(inv.devices), 1)] == ["4"]


def test_allocator_is_deterministic():
    inv = _gpus(8, numa=lambda i: i % 2)
    index = DeviceIndex(inv)
    first = choose(index, list(inv.devices), 3)
    assert all(choose(index, list(reversed(inv.devices)), 3) == first for _ in range(3))
    assert {d.numa_node for d in first} == {0}


# ---- what is remembered --------------------------------------------------------------------

def test_a_selection_is_remembered_per_index_and_a_count_by_what_it_chose():
    index = DeviceIndex(demo_inventory())
    named = ids("0", "3")
    first = select(named, index)
    assert select(ids("0", "3"), index) is first  # an equal request, another object
    assert select(named, index, cdi_passthrough=True) is not first
    assert select(named, DeviceIndex(demo_inventory())) is not first  # another inventory
    # a count chooses among the free devices of each call: held ones are never served
    # from an earlier choice, and the same choice is the same selection
    free = select(count(2), index)
    busy = {k: "other" for k in free.device_keys}
    again = select(count(2), index, busy)
    assert again is not free and set(again.device_keys).isdisjoint(free.device_keys)
    assert select(count(2), index, busy) is again
    # another free set that leads to the same choice: the same selection
    others = [d.key for d in index.devices if d.key not in free.device_keys]
    same = [select(count(2), index, {k: "other"}) for k in others]
    assert any(s.device_keys == free.device_keys for s in same)
    assert all(s is free for s in same if s.device_keys == free.device_keys)


def test_a_refusal_is_not_remembered_as_a_selection():
    index = DeviceIndex(demo_inventory())
    for _ in range(2):
        with pytest.raises(NotFoundError):
            select(ids("42"), index)
    assert len(index.selections) == 0


# ---- limits -------------------------------------------------------------------------------

def _limited(grants: tuple[DeviceClaim, ...], *limits: DeviceClaim) -> Request:
    return request(grants=grants, limits=limits)


GRANT_0_1 = (DeviceClaim(KIND_GPU, ids=("0", "1"), source="container annotation x"),)
ENV = "env NVIDIA_VISIBLE_DEVICES"


def test_limit_narrows_the_grant(index):
    req = _limited(GRANT_0_1, DeviceClaim(KIND_GPU, ids=(GPU_UUIDS["0"],), source=ENV))
    assert names(select(req, index)) == ["nvidia.com/gpu=0"]


def test_limit_naming_a_device_not_granted_is_refused(index):
    req = _limited(GRANT_0_1, DeviceClaim(KIND_GPU, ids=("3",), source=ENV))
    with pytest.raises(PolicyError) as e:
        select(req, index)
    assert e.value.source == ENV
    assert "nvidia.com/gpu=3 was not allocated" in e.value.message
    assert "allocated: nvidia.com/gpu=0, nvidia.com/gpu=1" in e.value.message


def test_limit_all_limits_nothing(index):
    req = _limited(GRANT_0_1, DeviceClaim(KIND_GPU, all=True, source=ENV),
                   DeviceClaim(KIND_GPU, ids=("0",), source="annotation y"))
    assert names(select(req, index)) == ["nvidia.com/gpu=0", "nvidia.com/gpu=1"]


def test_count_limit_keeps_at_most_n(index):
    req = _limited(GRANT_0_1, DeviceClaim(KIND_GPU, count=1, source=SRC))
    assert names(select(req, index)) == ["nvidia.com/gpu=0"]
    req = _limited(GRANT_0_1, DeviceClaim(KIND_GPU, count=5, source=SRC))
    assert names(select(req, index)) == ["nvidia.com/gpu=0", "nvidia.com/gpu=1"]


def test_limits_act_per_vendor(index):
    grants = (*GRANT_0_1, DeviceClaim(KIND_MIG, ids=("7:0",), source="container annotation x"))
    req = _limited(grants, DeviceClaim(KIND_MIG, ids=("7:0",), source=ENV))
    # nvidia.com/mig and nvidia.com/gpu are one vendor: the MIG limit drops the GPUs.
    assert names(select(req, index)) == ["nvidia.com/mig=7:0"]


def test_nvidia_none_leaves_no_nvidia_device(index):
    req = request(grants=GRANT_0_1, nvidia_none=True)
    assert select(req, index).devices == ()


# ---- CDI ----------------------------------------------------------------------------------

def test_cdi_claims_resolve_against_the_inventory(index):
    sel = select(ids("0", source="container annotation cdi.k8s.io/x", cdi=True), index)
    assert names(sel) == ["nvidia.com/gpu=0"]
    assert sel.cdi_devices == ()


def test_cdi_passthrough_hands_names_to_the_runtime_unresolved(index):
    req = request(grants=(DeviceClaim("vendor.example/npu", ids=("x",), source="s", cdi=True),),
                  cdi_names=("vendor.example/npu=x",))
    sel = select(req, index, cdi_passthrough=True)
    assert sel.devices == ()
    assert sel.cdi_devices == ("vendor.example/npu=x",)


def test_unknown_cdi_device_without_passthrough_is_an_error(index):
    with pytest.raises(NotFoundError, match=r"vendor\.example/npu='x'"):
        select(ids("x", kind="vendor.example/npu", source="s", cdi=True), index)


# ---- requirements -------------------------------------------------------------------------

def _requires(text: str, var: str = "NVIDIA_REQUIRE_CUDA") -> Requirements:
    return Requirements((parse_requirement(f"env {var}", text),))


def test_requirements_hold(index):
    req = request(grants=ids("0").grants, requirements=_requires("cuda>=12.0 brand=tesla"))
    assert names(select(req, index)) == ["nvidia.com/gpu=0"]


def test_unmet_requirement_names_the_variable_and_the_device(index):
    req = request(grants=ids("0").grants, requirements=_requires("cuda>=12.6"))
    with pytest.raises(RequestError) as e:
        select(req, index)
    assert e.value.source == "env NVIDIA_REQUIRE_CUDA"
    assert e.value.message.startswith("nvidia.com/gpu=0: ")
    assert "cuda>=12.6" in e.value.message


def test_a_grant_checked_again_is_refused_or_granted_as_the_first_time(index):
    # the second check of the same devices and requirements is answered from the memo
    refused = request(grants=ids("2", "0", "1").grants, requirements=_requires("cuda>=12.6"))
    granted = request(grants=ids("2", "0", "1").grants, requirements=_requires("cuda>=12.0"))
    for _ in range(2):
        with pytest.raises(RequestError) as e:
            select(refused, index)
        assert e.value.message.startswith("nvidia.com/gpu=0: ")  # the first in node order
        assert e.value.source == "env NVIDIA_REQUIRE_CUDA"
        assert names(select(granted, index)) == [f"nvidia.com/gpu={i}" for i in (0, 1, 2)]


def test_mig_device_is_checked_with_its_parent_arch(index):
    req = request(grants=ids("7:0", kind=KIND_MIG).grants,
                  requirements=_requires("arch>=9.0", "NVIDIA_REQUIRE_ARCH"))
    with pytest.raises(RequestError, match=r"arch=8\.0"):
        select(req, index)


def test_driver_only_container_checks_driver_facts(index):
    req = request(nvidia_none=True, requirements=_requires("driver>=555"))
    with pytest.raises(RequestError, match="driver>=555"):
        select(req, index)
    assert select(request(nvidia_none=True, requirements=_requires("driver>=550")),
                  index).devices == ()


# ---- helpers ------------------------------------------------------------------------------


def _gpus(n: int, *, unhealthy: set[str] = frozenset(), links: dict | None = None,
          numa=lambda i: 0) -> Inventory:  # type: ignore[assignment]
    """A bare n-GPU inventory with chosen health, NVLinks and NUMA nodes."""
    links = links or {}
    return Inventory(devices=tuple(
        Device(kind=KIND_GPU, name=str(i), uuid=f"GPU-{i:08d}",
               edits=ContainerEdits(device_nodes=(DeviceNode(f"/dev/nvidia{i}", 195, i),)),
               numa_node=numa(i), healthy=str(i) not in unhealthy,
               links=tuple(links.get(str(i), ())), vendor="nvidia",
               attributes=MappingProxyType({}))
        for i in range(n)))
