"""Device health: which NVIDIA devices are unhealthy, why, and when they are healthy again.

Owns: the health decisions (HealthState, pure: events and recheck results in, the map
of unhealthy devices out), which inventory devices are followed (watched_devices) and
HealthMonitor, the worker thread that feeds HealthState from NVML and hands each new
map to the asyncio loop. Imports the standard library, msgspec, nri_accel.discover.nvml
(EventWatch, GpuEvent; never pynvml itself), nri_accel.inventory and nri_accel.log.

What makes a device unhealthy (as NVIDIA's k8s-device-plugin, internal/rm/health.go,
where it has a rule):
- a critical XID (application XIDs and the configured ones are ignored by the watch)
  with GPU and compute instance ids: that MIG device only; with a GPU instance id
  alone: every MIG device of that GPU instance (health.go takes this case as the whole
  GPU); with neither: the GPU and all its MIG devices. Reason "XID <n>".
- a double-bit ECC error: the GPU and all its MIG devices. Reason "double-bit ECC
  error" (health.go registers these events but acts on XIDs only).
- the GPU falling off the bus, or NVML no longer listing it: the GPU and all its MIG
  devices. Reason "GPU lost".
- the event watch itself failing (NVML answering the wait with an error): every device,
  as health.go does. Reason "NVML health watch failed: <error>".
A new event on an unhealthy device replaces its reason with the newest.

How a device comes back (health.go has no way back but a restart of the plugin): once
it has been quiet, with no new critical event, for `recheck_interval` seconds, it is
rechecked through NVML (EventWatch.check): its GPU is listed and answers (not lost),
no page retirement or row remapping is pending (they need a GPU reset; an uncorrectable
ECC error queues one), no row remapping has failed, and a MIG device still exists. If
the recheck passes, the device is healthy again; if not, its reason gains
"(recheck: <why>)" and it is rechecked every `recheck_interval` seconds until it passes
or a new event restarts the quiet period. So a device returns at the earliest
`recheck_interval` after its last critical event. On a MIG-enabled GPU with active
instances NVML cannot report row remapping, so that part of the recheck is skipped there.
Each time the watch opens, every device is checked so once: a repair that was already
pending (it raises no event of its own) marks the device from the start, with the
check's reason. A watch that replaces another (nri_accel.health.HealthWatches restarts
it when the family's devices change) starts with that one's marks of the devices it
still follows.

The monitor's thread owns its NVML session (nri_accel.discover.nvml explains how it
coexists with discovery). It waits for events in turns of WAIT_MS, so stop() returns
within about that time; it never dies of an NVML failure: it logs, marks as above,
and reopens the watch after `recheck_interval`.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from types import MappingProxyType
from typing import NamedTuple

from msgspec import Struct

from nri_accel.discover import nvml
from nri_accel.inventory import Device
from nri_accel.log import get_logger
from nri_accel.vendors.nvidia import KIND_GPU, KIND_MIG

log = get_logger(__name__)

DEFAULT_RECHECK_INTERVAL = 60.0  # seconds
WAIT_MS = 500  # one NVML wait; bounds how long stop() takes
REASON_DBE = "double-bit ECC error"
REASON_LOST = "GPU lost"

OnChange = Callable[[Mapping[str, str]], None]


class WatchedDevice(NamedTuple):
    """A device whose health is followed: a GPU (parent None) or a MIG device of GPU
    `parent` with GPU instance `gi` and compute instance `ci`. UUIDs as NVML gives them."""

    uuid: str
    parent: str | None = None
    gi: int | None = None
    ci: int | None = None


def watched_devices(devices: Sequence[Device]) -> list[WatchedDevice]:
    """The NVIDIA GPUs and MIG devices among inventory `devices`, as HealthMonitor
    takes them (a MIG device's parent and instance ids from nvidia discovery)."""
    gpus = {d.name: d.uuid for d in devices if d.kind == KIND_GPU and d.uuid}
    out = []
    for d in devices:
        if d.kind == KIND_GPU and d.uuid:
            out.append(WatchedDevice(d.uuid))
        elif d.kind == KIND_MIG and d.uuid and d.parent in gpus:
            out.append(WatchedDevice(d.uuid, gpus[d.parent], int(d.attributes["gi_id"]),
                                     int(d.attributes["ci_id"])))
    return out


def reason(event: nvml.GpuEvent) -> str:
    """The reason text an event gives the devices it makes unhealthy."""
    if event.kind == "xid":
        return f"XID {event.xid}"
    if event.kind == "dbe":
        return REASON_DBE
    return REASON_LOST


class _Mark(Struct):
    cause: str
    due: float  # time of the next recheck (time.monotonic() scale)
    blocker: str = ""  # why the last recheck failed


class HealthState:
    """The unhealthy devices among `devices` and why. Pure: every method takes the time
    `now` (seconds, monotonic) it is called at; nothing here waits or calls NVML."""

    def __init__(self, devices: Iterable[WatchedDevice], recheck_interval: float, *,
                 marked: Mapping[str, str] = MappingProxyType({}), now: float = 0.0) -> None:
        """`marked`: UUID -> reason of devices already unhealthy (an earlier watch's
        marks), rechecked `recheck_interval` after `now` as a new mark would be."""
        if recheck_interval <= 0:
            raise ValueError("recheck_interval must be > 0")
        self._devices = {d.uuid: d for d in devices}
        self._interval = recheck_interval
        self._marks: dict[str, _Mark] = {
            u: _Mark(why, now + recheck_interval) for u, why in marked.items()
            if u in self._devices}

    @property
    def devices(self) -> tuple[WatchedDevice, ...]:
        """The devices followed, sorted by UUID."""
        return tuple(self._devices[u] for u in sorted(self._devices))

    @property
    def gpus(self) -> tuple[str, ...]:
        """The GPUs to watch: the GPUs among the devices and the parents of MIG devices."""
        return tuple(sorted({d.parent or d.uuid for d in self._devices.values()}))

    def affected(self, event: nvml.GpuEvent) -> list[str]:
        """UUIDs of the devices `event` makes unhealthy, sorted."""
        out = []
        for d in self._devices.values():
            if d.parent is None:
                hit = d.uuid == event.uuid and event.gi is None
            else:
                hit = d.parent == event.uuid and (event.gi is None or (
                    d.gi == event.gi and event.ci in (None, d.ci)))
            if hit:
                out.append(d.uuid)
        return sorted(out)

    def apply(self, event: nvml.GpuEvent, now: float) -> bool:
        """Mark the devices `event` affects; True if the map of unhealthy devices changed."""
        return self._mark(self.affected(event), reason(event), now)

    def found(self, problems: Mapping[str, str], now: float) -> bool:
        """Mark the devices a check found unhealthy (UUID -> why) that are not marked
        already; True if the map changed."""
        before = self.unhealthy()
        for uuid, why in problems.items():
            if uuid in self._devices and uuid not in self._marks:
                self._marks[uuid] = _Mark(why, now + self._interval)
        return self.unhealthy() != before

    def fail_all(self, cause: str, now: float) -> bool:
        """Mark every device (the watch itself failed); True if the map changed."""
        return self._mark(list(self._devices), cause, now)

    def _mark(self, uuids: list[str], cause: str, now: float) -> bool:
        before = self.unhealthy()
        for uuid in uuids:
            self._marks[uuid] = _Mark(cause, now + self._interval)
        return self.unhealthy() != before

    def due(self, now: float) -> list[WatchedDevice]:
        """The unhealthy devices to recheck at `now`, sorted by UUID."""
        return [self._devices[u] for u, m in sorted(self._marks.items()) if m.due <= now]

    def rechecked(self, uuid: str, problem: str | None, now: float) -> bool:
        """Record a recheck of `uuid`: healthy again when `problem` is None, else still
        unhealthy and rechecked after another interval. True if the map changed."""
        mark = self._marks.get(uuid)
        if mark is None:
            return False
        before = self.unhealthy()
        if problem is None:
            del self._marks[uuid]
        else:
            mark.blocker = problem
            mark.due = now + self._interval
        return self.unhealthy() != before

    def unhealthy(self) -> Mapping[str, str]:
        """UUID -> reason of every unhealthy device, sorted by UUID; read-only."""
        return MappingProxyType({
            u: f"{m.cause} (recheck: {m.blocker})" if m.blocker else m.cause
            for u, m in sorted(self._marks.items())})


class HealthMonitor:
    """Follows the health of `devices` through the NVML library file `library_path`
    (the one discovery loaded) in a worker thread, and calls `on_change` on the asyncio
    loop that called start() with the new map (UUID -> reason) of unhealthy devices
    each time it changes. The devices of `marked` (UUID -> reason: an earlier watch's
    marks) start unhealthy, the others healthy; each time the watch opens, every device
    is checked once (EventWatch.check), so that one with a repair pending before any
    event (a row remapping that waits for a GPU reset) is marked from the start.

    `ignored_xids`: XIDs that do not make a device unhealthy, besides
    nvml.APPLICATION_XIDS. `recheck_interval`: seconds (> 0) an unhealthy device must
    stay quiet before it is rechecked, and between rechecks (see the module docstring).
    """

    def __init__(self, library_path: str,
                 devices: Iterable[tuple[str, str | None, int | None, int | None]], *,
                 on_change: OnChange, ignored_xids: Iterable[int] = (),
                 recheck_interval: float = DEFAULT_RECHECK_INTERVAL,
                 marked: Mapping[str, str] = MappingProxyType({})) -> None:
        self._library = library_path
        self._state = HealthState((WatchedDevice(*d) for d in devices), recheck_interval,
                                  marked=marked, now=time.monotonic())
        self._interval = recheck_interval
        self._ignored = frozenset(ignored_xids)
        self._on_change = on_change
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._watching = threading.Event()

    def start(self) -> None:
        """Start the worker thread; call from a coroutine or callback of the loop that
        is to receive on_change. Returns at once: NVML opens in the thread."""
        if self._thread is not None:
            raise RuntimeError("HealthMonitor already started")
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="nri-accel-health",
                                        daemon=True)
        self._thread.start()

    def watching(self, timeout: float | None = None) -> bool:
        """Wait up to `timeout` seconds until the devices are registered for events;
        whether they are (False again while the watch reopens after a failure). Blocks:
        from the loop, call it through asyncio.to_thread."""
        return self._watching.wait(timeout)

    def stop(self) -> None:
        """Stop the thread and wait for it (about WAIT_MS at most, plus the NVML calls
        under way). No on_change is called once stop() has begun. Blocks: from the loop,
        call it through asyncio.to_thread. Idempotent."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()

    # ---- the worker thread ----------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopping.is_set():
                try:
                    watch = nvml.EventWatch(self._library, self._state.gpus, self._ignored)
                except nvml.NvmlUnavailable as e:
                    log.warning("health_watch_unavailable", error=str(e),
                                retry_in_s=self._interval)
                    self._stopping.wait(self._interval)
                    continue
                try:
                    self._follow(watch)
                except nvml.NvmlUnavailable as e:
                    log.error("health_watch_failed", error=str(e), retry_in_s=self._interval)
                    if self._state.fail_all(f"NVML health watch failed: {e}", time.monotonic()):
                        self._publish()
                    self._stopping.wait(self._interval)
                finally:
                    self._watching.clear()
                    watch.close()
        except Exception:  # a defect: say so rather than let health go stale silently
            log.exception("health_monitor_crashed")

    def _follow(self, watch: nvml.EventWatch) -> None:
        for gpu, why in sorted(watch.unwatched.items()):
            log.warning("gpu_health_not_watched", gpu=gpu, reason=why)
        if self._state.found(_problems(watch, self._state.devices), time.monotonic()):
            self._publish()
        self._watching.set()
        log.info("health_watch_started", gpus=len(self._state.gpus))
        while not self._stopping.is_set():
            events = watch.wait(WAIT_MS)
            now = time.monotonic()
            changed = False
            for event in events:
                log.warning("gpu_health_event", gpu=event.uuid, kind=event.kind, xid=event.xid,
                            gi=event.gi, ci=event.ci)
                changed |= self._state.apply(event, now)
            for device in self._state.due(now):
                problem = watch.check(device.parent or device.uuid,
                                      device.uuid if device.parent else None)
                changed |= self._state.rechecked(device.uuid, problem, now)
            if changed:
                self._publish()

    def _publish(self) -> None:
        unhealthy = self._state.unhealthy()
        log.info("device_health_changed", unhealthy=dict(unhealthy))
        assert self._loop is not None
        try:
            self._loop.call_soon_threadsafe(self._deliver, unhealthy)
        except RuntimeError:  # the loop is closed: nobody is left to tell
            log.warning("health_monitor_loop_closed")
            self._stopping.set()

    def _deliver(self, unhealthy: Mapping[str, str]) -> None:
        if not self._stopping.is_set():
            self._on_change(unhealthy)


def _problems(watch: nvml.EventWatch, devices: Iterable[WatchedDevice]) -> dict[str, str]:
    """UUID -> why, of the `devices` EventWatch.check finds unhealthy now."""
    found = {}
    for d in devices:
        problem = watch.check(d.parent or d.uuid, d.uuid if d.parent else None)
        if problem is not None:
            found[d.uuid] = problem
    return found
