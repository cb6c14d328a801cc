"""The NVML event watch (nri_accel.discover.nvml.EventWatch) with the real pynvml against
the fake libnvidia-ml (tests/fakes/nvml), events injected at run time through the
fake's events file (fakes.nvml.node.FakeNode), as the driver would raise them."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator

import pytest
from fakes.nvml import build
from fakes.nvml.node import FakeNode
from fakes.roots import ROOTS_DIR

from nri_accel.discover import nvml
from nri_accel.discover.hostroot import HostRoot
from nri_accel.discover.nvml import EventWatch, GpuEvent, NvmlUnavailable
from nri_accel.vendors.nvidia import KIND_GPU
from nri_accel.vendors.nvidia.discover import discover_nvidia, nvml_library

# a100-mig: GPU 0 has MIG devices on GIs 2, 3, 9, 10; GPU 1 has GI 1 (CIs 0, 1) and GI 2.
A100_0 = "GPU-c4f82fda-f11d-4492-a176-950eab898aad"
A100_1 = "GPU-cedc8ef5-2012-4e98-be22-5cdcb615ef10"
A100_2 = "GPU-e06ef9fc-7497-0c8b-ce6c-fb2db8673096"
MIG_1_GI1_CI1 = "MIG-da60c3d5-c290-16b7-7e01-7fe7cee2fde3"
H100 = ["GPU-74106407-f32f-0663-90a7-a1acf7eb04ae", "GPU-08f22e65-3b2d-59a7-2659-c71f416a3808",
        "GPU-126d4085-7b1a-a246-402b-e786f0d2a595", "GPU-d6a0ae3c-5011-a59d-c8a7-2b61c6a912e7"]
V100_0 = "GPU-5a9e5b38-bd6d-2f23-3b22-d42f6e26aa55"
WAIT_MS = 200


@pytest.fixture
def node(fake_root: Callable[[str], HostRoot]) -> Callable[[str], FakeNode]:
    return lambda name: FakeNode(fake_root(name))


@pytest.fixture
def watches() -> Iterator[Callable[..., EventWatch]]:
    """Opens EventWatches and closes them after the test, whatever it asserted."""
    opened: list[EventWatch] = []

    def open_watch(lib: str, gpus: list[str], ignored: tuple[int, ...] = ()) -> EventWatch:
        opened.append(EventWatch(lib, gpus, ignored))
        return opened[-1]

    yield open_watch
    for w in opened:
        w.close()


def wait_for(watch: EventWatch, tries: int = 25) -> list[GpuEvent]:
    """The first non-empty answer of wait(), within tries * WAIT_MS."""
    for _ in range(tries):
        events = watch.wait(WAIT_MS)
        if events:
            return events
    return []


def test_xid_arrives_for_its_gpu(node, watches) -> None:
    n = node("h100")
    w = watches(n.lib, H100)
    assert w.unwatched == {}
    assert w.wait(WAIT_MS) == []  # nothing happened: the wait times out empty
    n.inject(f"xid {H100[2]} 79")
    assert wait_for(w) == [GpuEvent(H100[2], "xid", 79)]


def test_queued_events_come_out_together_in_order(node, watches) -> None:
    n = node("h100")
    w = watches(n.lib, H100)
    n.inject(f"xid {H100[0]} 48", f"dbe {H100[1]}", f"xid {H100[3]} 94")
    assert wait_for(w) == [GpuEvent(H100[0], "xid", 48), GpuEvent(H100[1], "dbe"),
                           GpuEvent(H100[3], "xid", 94)]


def test_application_and_configured_xids_are_ignored(node, watches) -> None:
    n = node("h100")
    w = watches(n.lib, H100, (48,))
    n.inject(*(f"xid {H100[0]} {x}" for x in sorted(nvml.APPLICATION_XIDS)),
             f"xid {H100[0]} 48", f"xid {H100[0]} 79")
    assert wait_for(w) == [GpuEvent(H100[0], "xid", 79)]


def test_events_of_gpus_not_watched_are_not_reported(node, watches) -> None:
    n = node("h100")
    w = watches(n.lib, H100[:2])
    n.inject(f"xid {H100[3]} 79", f"xid {H100[1]} 79")
    assert wait_for(w) == [GpuEvent(H100[1], "xid", 79)]


def test_mig_xids_carry_the_instance_ids(node, watches) -> None:
    n = node("a100-mig")
    w = watches(n.lib, [A100_0, A100_1])
    n.inject(f"xid {A100_1} 94 1 1", f"xid {A100_1} 79 2 4294967295", f"xid {A100_0} 79")
    assert wait_for(w) == [GpuEvent(A100_1, "xid", 94, 1, 1), GpuEvent(A100_1, "xid", 79, 2),
                           GpuEvent(A100_0, "xid", 79)]


def test_unversioned_wait_of_older_drivers_has_no_instance_ids(tmp_path) -> None:
    # Drivers before R450 lack nvmlEventSetWait_v2; the old wait's nvmlEventData_t ends
    # before the instance ids, so an event is never attributed to a MIG instance.
    lib = build.build(tmp_path / "lib", "omit-event-wait-v2")
    (lib.parent / "fake_nvml.conf").write_text((ROOTS_DIR / "a100-mig/nvml.conf").read_text())
    w = EventWatch(str(lib), [A100_1])
    try:
        (lib.parent / "fake_nvml.events").write_text(f"xid {A100_1} 94 1 1\n")
        assert wait_for(w) == [GpuEvent(A100_1, "xid", 94)]
    finally:
        w.close()


def test_gpu_without_event_support_is_unwatched(node, watches) -> None:
    n = node("h100")
    n.set_gpu_key(H100[1], "events none")
    w = watches(n.lib, H100)
    assert list(w.unwatched) == [H100[1]]
    assert "does not support events" in w.unwatched[H100[1]]
    n.inject(f"xid {H100[1]} 79", f"xid {H100[0]} 79")
    assert wait_for(w) == [GpuEvent(H100[0], "xid", 79)]


def test_ecc_events_only_where_the_gpu_offers_them(node, watches) -> None:
    # ECC disabled: the GPU offers XID events but no ECC events; the watch registers
    # what is offered (asking for more would fail with NOT_SUPPORTED).
    n = node("h100")
    n.set_gpu_key(H100[0], "events 0x8")
    w = watches(n.lib, H100)
    assert w.unwatched == {}
    n.inject(f"dbe {H100[0]}", f"xid {H100[0]} 79")
    assert wait_for(w) == [GpuEvent(H100[0], "xid", 79)]


def test_lost_gpu_is_reported_and_the_others_stay_watched(node, watches) -> None:
    n = node("h100")
    w = watches(n.lib, H100)
    n.inject(f"lost {H100[2]}")
    assert wait_for(w) == [GpuEvent(H100[2], "lost")]
    n.inject(f"xid {H100[0]} 79", f"xid {H100[2]} 79")
    assert wait_for(w) == [GpuEvent(H100[0], "xid", 79)]
    assert w.check(H100[2]) == "GPU does not answer NVML"


def test_gpu_back_passes_the_check_and_is_watched_again(node, watches) -> None:
    n = node("h100")
    w = watches(n.lib, H100)
    n.inject(f"lost {H100[2]}")
    assert wait_for(w) == [GpuEvent(H100[2], "lost")]
    n.inject(f"back {H100[2]}")
    assert w.check(H100[2]) is None
    n.inject(f"xid {H100[2]} 79")
    assert wait_for(w) == [GpuEvent(H100[2], "xid", 79)]


def test_gpus_lost_or_missing_at_open_come_first(node, watches) -> None:
    n = node("h100")
    n.inject(f"lost {H100[1]}")
    w = watches(n.lib, [*H100, "GPU-00000000-0000-0000-0000-000000000000"])
    assert w.wait(WAIT_MS) == [GpuEvent(H100[1], "lost"),
                               GpuEvent("GPU-00000000-0000-0000-0000-000000000000", "lost")]


def test_check_sees_a_pending_row_remapping_until_the_gpu_is_reset(node, watches) -> None:
    n = node("h100")
    w = watches(n.lib, H100)
    assert w.check(H100[0]) is None
    n.inject(f"dbe {H100[0]}")
    assert wait_for(w) == [GpuEvent(H100[0], "dbe")]
    assert w.check(H100[0]) == "row remapping pending a GPU reset"
    assert w.check(H100[1]) is None
    n.inject(f"reset {H100[0]}")
    assert w.check(H100[0]) is None


def test_check_sees_a_failed_row_remapping(node, watches) -> None:
    n = node("h100")
    n.set_gpu_key(H100[3], "row_remapping 0 1 0 1")
    w = watches(n.lib, H100)
    assert w.check(H100[3]) == "row remapping failed"


def test_check_sees_pending_page_retirement_before_ampere(node, watches) -> None:
    n = node("old-driver")
    w = watches(n.lib, [V100_0])
    n.inject(f"dbe {V100_0}")
    assert wait_for(w) == [GpuEvent(V100_0, "dbe")]
    assert w.check(V100_0) == "page retirement pending a GPU reset"
    n.inject(f"reset {V100_0}")
    assert w.check(V100_0) is None


def test_check_of_mig_devices(node, watches) -> None:
    # Row remapping is not reported on a MIG-enabled GPU with active instances.
    n = node("a100-mig")
    w = watches(n.lib, [A100_1])
    n.inject(f"dbe {A100_1}")
    assert wait_for(w) == [GpuEvent(A100_1, "dbe")]
    assert w.check(A100_1, MIG_1_GI1_CI1) is None
    assert w.check(A100_1, "MIG-00000000-0000-0000-0000-000000000000") == \
        "MIG device no longer exists"
    n.inject(f"lost {A100_1}")
    assert w.check(A100_1, MIG_1_GI1_CI1) == "GPU does not answer NVML"


def test_discovery_runs_while_the_watch_waits(node, watches) -> None:
    n = node("a100-mig")
    w = watches(n.lib, [A100_0, A100_2])
    got: list[GpuEvent] = []
    waiter = threading.Thread(target=lambda: got.extend(w.wait(60_000)))
    waiter.start()
    try:
        found = discover_nvidia(n.root)  # the same library, NVML held open by the watch
        assert waiter.is_alive(), "the wait ended before any event"
    finally:
        n.inject(f"xid {A100_2} 79")
        waiter.join(60)
    assert len([d for d in found.devices if d.kind == KIND_GPU]) == 8
    assert not [p for p in found.problems if "NVML" in p.message]
    assert got == [GpuEvent(A100_2, "xid", 79)]


def test_a_failing_wait_makes_the_watch_unavailable(node, watches, capfd) -> None:
    n = node("h100")
    w = watches(n.lib, H100)
    n.inject("bogus")
    with pytest.raises(NvmlUnavailable, match="nvmlEventSetWait failed: Unknown Error"):
        w.wait(WAIT_MS)
    assert "fake_nvml.events:1: expected '<xid|dbe|lost|back|reset> <GPU uuid>" in \
        capfd.readouterr().err


def test_watch_of_a_library_that_does_not_initialise(fake_root) -> None:
    root = fake_root("nvml-init-fails")
    lib = nvml_library(root)
    assert lib is not None
    with pytest.raises(NvmlUnavailable, match="Driver Not Loaded"):
        EventWatch(lib, [H100[0]])
