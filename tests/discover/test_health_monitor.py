"""HealthMonitor end to end: the real pynvml against the fake libnvidia-ml
(tests/fakes/nvml) of a fake root, devices from discovery, events injected through the
fake's events file as the driver would raise them, health delivered on an asyncio loop.
Waits are bounded waits for an expected change; nothing measures speed."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Awaitable, Callable, Iterator, Mapping
from typing import Any

import pytest
import structlog
from fakes.nvml.node import FakeNode

from nri_accel.discover.hostroot import HostRoot
from nri_accel.vendors.nvidia.discover import discover_nvidia
from nri_accel.vendors.nvidia.health import HealthMonitor, WatchedDevice, watched_devices

H100 = ["GPU-74106407-f32f-0663-90a7-a1acf7eb04ae", "GPU-08f22e65-3b2d-59a7-2659-c71f416a3808",
        "GPU-126d4085-7b1a-a246-402b-e786f0d2a595", "GPU-d6a0ae3c-5011-a59d-c8a7-2b61c6a912e7"]
A100_0 = "GPU-c4f82fda-f11d-4492-a176-950eab898aad"
A100_0_MIGS = ["MIG-00d387ff-3b21-3583-7f93-d807fd70c5bc",
               "MIG-46403463-e963-3405-3e03-74a2cd8feaf9",
               "MIG-ae51fb4a-d899-1b87-7a17-4b828b89f52c",
               "MIG-d1e2cc96-97d7-8e4c-741d-affa84566ae3"]
A100_1 = "GPU-cedc8ef5-2012-4e98-be22-5cdcb615ef10"
MIG_1_GI1_CI1 = "MIG-da60c3d5-c290-16b7-7e01-7fe7cee2fde3"
BOUND = 10.0  # seconds: the longest any expected change may take to arrive
THREAD = "nri-accel-health"

Changes = asyncio.Queue[Mapping[str, str]]
Scenario = Callable[[Changes], Awaitable[None]]


@pytest.fixture
def node(fake_root: Callable[[str], HostRoot]) -> Callable[[str], FakeNode]:
    return lambda name: FakeNode(fake_root(name))


def devices_of(n: FakeNode) -> list[WatchedDevice]:
    return watched_devices(discover_nvidia(n.root).devices)


def run(n: FakeNode, scenario: Scenario, *, recheck_interval: float = 3600.0,
        ignored_xids: tuple[int, ...] = (), marked: Mapping[str, str] | None = None) -> None:
    """Start a monitor of every device of `n`, wait until it watches, play `scenario`
    with the queue of delivered maps, stop the monitor; no monitor thread may be left."""

    async def main() -> None:
        changes: Changes = asyncio.Queue()
        monitor = HealthMonitor(n.lib, devices_of(n), on_change=changes.put_nowait,
                                ignored_xids=ignored_xids, recheck_interval=recheck_interval,
                                marked=marked or {})
        monitor.start()
        try:
            assert await asyncio.to_thread(monitor.watching, BOUND)
            await scenario(changes)
        finally:
            await asyncio.to_thread(monitor.stop)
        assert changes.empty(), "a change nobody expected"

    asyncio.run(main())
    assert THREAD not in [t.name for t in threading.enumerate()]


async def next_change(changes: Changes) -> dict[str, str]:
    return dict(await asyncio.wait_for(changes.get(), BOUND))


def test_xid_makes_a_gpu_unhealthy_until_a_quiet_recheck(node) -> None:
    n = node("h100")

    async def scenario(changes: Changes) -> None:
        n.inject(f"xid {H100[1]} 79")
        assert await next_change(changes) == {H100[1]: "XID 79"}
        assert await next_change(changes) == {}  # quiet for recheck_interval, recheck passed

    run(n, scenario, recheck_interval=0.3)


def test_ignored_xids_change_nothing(node) -> None:
    n = node("h100")

    async def scenario(changes: Changes) -> None:
        # Events are handled in order: the first change shows the ignored ones did nothing.
        n.inject(f"xid {H100[0]} 13", f"xid {H100[0]} 109", f"xid {H100[0]} 48",
                 f"xid {H100[3]} 94")
        assert await next_change(changes) == {H100[3]: "XID 94"}

    run(n, scenario, ignored_xids=(48,))


def test_xid_of_a_mig_device_marks_that_mig_device_only(node) -> None:
    n = node("a100-mig")

    async def scenario(changes: Changes) -> None:
        n.inject(f"xid {A100_1} 94 1 1")
        assert await next_change(changes) == {MIG_1_GI1_CI1: "XID 94"}
        n.inject(f"xid {A100_0} 79")
        assert await next_change(changes) == {
            MIG_1_GI1_CI1: "XID 94", A100_0: "XID 79", **dict.fromkeys(A100_0_MIGS, "XID 79")}

    run(n, scenario)


def test_a_repair_pending_before_any_event_is_found_when_the_watch_opens(node) -> None:
    # a row remapping that waits for a GPU reset raises no event of its own: the watch
    # checks every GPU as it opens, and the GPU is unhealthy until it is reset
    n = node("h100")
    n.set_gpu_key(H100[1], "row_remapping 0 1 1 0")

    async def scenario(changes: Changes) -> None:
        assert await next_change(changes) == {H100[1]: "row remapping pending a GPU reset"}
        n.inject(f"reset {H100[1]}")
        assert await next_change(changes) == {}

    run(n, scenario, recheck_interval=0.3)


def test_an_earlier_watchs_mark_holds_until_its_recheck(node) -> None:
    n = node("h100")

    async def scenario(changes: Changes) -> None:
        assert await next_change(changes) == {}  # rechecked after the interval, passed

    run(n, scenario, recheck_interval=0.3, marked={H100[2]: "XID 48"})


def test_double_bit_ecc_error_holds_until_the_gpu_is_reset(node) -> None:
    n = node("h100")

    async def scenario(changes: Changes) -> None:
        n.inject(f"dbe {H100[2]}")
        assert await next_change(changes) == {H100[2]: "double-bit ECC error"}
        assert await next_change(changes) == {
            H100[2]: "double-bit ECC error (recheck: row remapping pending a GPU reset)"}
        n.inject(f"reset {H100[2]}")
        assert await next_change(changes) == {}

    run(n, scenario, recheck_interval=0.3)


def test_lost_gpu_is_unhealthy_until_it_answers_again(node) -> None:
    n = node("h100")

    async def scenario(changes: Changes) -> None:
        n.inject(f"lost {H100[0]}")
        assert await next_change(changes) == {H100[0]: "GPU lost"}
        assert await next_change(changes) == {
            H100[0]: "GPU lost (recheck: GPU does not answer NVML)"}
        n.inject(f"back {H100[0]}")
        assert await next_change(changes) == {}
        n.inject(f"xid {H100[0]} 79")  # watched again
        assert await next_change(changes) == {H100[0]: "XID 79"}
        assert await next_change(changes) == {}

    run(n, scenario, recheck_interval=0.3)


def test_gpu_without_event_support_stays_healthy(node) -> None:
    n = node("h100")
    n.set_gpu_key(H100[1], "events none")

    async def scenario(changes: Changes) -> None:
        n.inject(f"xid {H100[1]} 79", f"xid {H100[2]} 79")
        assert await next_change(changes) == {H100[2]: "XID 79"}

    with structlog.testing.capture_logs() as logs:
        run(n, scenario)
    assert [e["gpu"] for e in logs if e["event"] == "gpu_health_not_watched"] == [H100[1]]


def test_a_failing_watch_marks_every_device(node) -> None:
    n = node("h100")

    async def scenario(changes: Changes) -> None:
        n.inject("lost GPU-not-on-this-node")  # the fake's wait now fails: Unknown Error
        assert await next_change(changes) == dict.fromkeys(
            H100, "NVML health watch failed: nvmlEventSetWait failed: Unknown Error")

    run(n, scenario)


def test_stop_returns_leaves_no_thread_and_drops_undelivered_changes(node) -> None:
    n = node("h100")
    delivered: list[Mapping[str, str]] = []

    async def main(published: threading.Event) -> None:
        monitor = HealthMonitor(n.lib, devices_of(n), on_change=delivered.append)
        monitor.start()
        assert await asyncio.to_thread(monitor.watching, BOUND)
        n.inject(f"xid {H100[0]} 79")
        # Block the loop until the change is published: it cannot be delivered before stop().
        assert published.wait(BOUND)
        stopper = threading.Thread(target=monitor.stop)
        stopper.start()
        stopper.join(BOUND)
        assert not stopper.is_alive(), "stop() did not return"
        for _ in range(3):
            await asyncio.sleep(0)  # the delivery scheduled before stop() runs now
        monitor.stop()  # idempotent

    with logged("device_health_changed") as published:
        asyncio.run(main(published))
    assert THREAD not in [t.name for t in threading.enumerate()]
    assert delivered == []


def test_monitor_without_a_usable_nvml_keeps_trying_and_stops(fake_root) -> None:
    n = FakeNode(fake_root("nvml-init-fails"))

    async def main(unavailable: threading.Event) -> None:
        monitor = HealthMonitor(n.lib, [WatchedDevice(H100[0])], on_change=pytest.fail,
                                recheck_interval=0.1)
        monitor.start()
        try:
            assert await asyncio.to_thread(unavailable.wait, BOUND)
            assert not monitor.watching(0)
        finally:
            await asyncio.to_thread(monitor.stop)

    with logged("health_watch_unavailable") as unavailable:
        asyncio.run(main(unavailable))
    assert THREAD not in [t.name for t in threading.enumerate()]


@contextlib.contextmanager
def logged(name: str) -> Iterator[threading.Event]:
    """An Event set when any thread logs event `name` (the other processors still run)."""
    seen = threading.Event()

    def watch(_: Any, __: str, event: dict[str, Any]) -> dict[str, Any]:
        if event["event"] == name:
            seen.set()
        return event

    saved = structlog.get_config()
    structlog.configure(processors=[watch, *saved["processors"]])
    try:
        yield seen
    finally:
        structlog.configure(**saved)
