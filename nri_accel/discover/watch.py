"""Refresh: notice that the node changed, rediscover, hand the new Inventory over.

Owns: watch_state() (the cheap change probe), nodes_match(), diff() and Refresher (the
background asyncio task). Imports the standard library, msgspec, nri_accel.config,
nri_accel.errors, nri_accel.health (carry_vanished), nri_accel.inventory,
nri_accel.log, nri_accel.discover (discover, lstat_device, HostRoot) and
nri_accel.vendors (each family's probe()).

A poll every `discovery.refresh_interval` seconds (0 disables) costs a few dozen
stat()s and a few tiny reads; nothing is rediscovered unless something moved:

- what each family's probe() reads: its driver version files (a driver upgrade or
  reload), its /dev entries with their lstat identity (hot-plug, a driver creating or
  removing nodes), NVIDIA's MIG capability tree (MIG reconfiguration creates and removes
  its directories), each CDI spec directory and file (name, size, mtime, inode), the
  nodes of the static config entries;
- and every device node of the current Inventory still being the node it recorded
  (type, major, minor), which catches a CDI vendor's node disappearing or renumbered.

A device a rediscovery no longer finds is kept, unhealthy (nri_accel.health,
carry_vanished), and its nodes are no longer compared.

On a change the whole discovery runs again in a worker thread (the event loop keeps
serving CreateContainer meanwhile); if the new Inventory differs, `inventory_changed`
is logged with what was added, removed and changed, and the callback receives it. The
caller swaps its reference in one assignment: readers see the old or the new
Inventory, never a mix. The probe is taken before discovery, so a change during
discovery is seen at the next poll, and recorded only once discovery succeeded, so a
failed one is retried. The task never dies of an error: it logs `refresh_failed` and
polls again.

Problems are logged when they change, not on every rediscovery (a spec rewritten every
10 ms would otherwise repeat every other spec's problem in the log): log_problems()
warns `discovery_problem` for each one the new Inventory has and the previous one had
not, and logs `discovery_problem_resolved` once for each that went away. Start-up logs
the first Inventory's (nri_accel.app); `discover` and `check` print the whole list.
"""

from __future__ import annotations

import asyncio
import inspect
import os
from collections.abc import Awaitable, Callable
from typing import Any

from msgspec import Struct

from nri_accel.config import Config
from nri_accel.discover import discover
from nri_accel.discover.base import lstat_device
from nri_accel.discover.hostroot import HostRoot
from nri_accel.errors import DiscoveryError
from nri_accel.health import carry_vanished
from nri_accel.inventory import DeviceNode, Inventory
from nri_accel.log import get_logger
from nri_accel.vendors import PROFILES

log = get_logger(__name__)

State = tuple[tuple[str, Any], ...]
OnChange = Callable[[Inventory], Awaitable[None] | None]


def watch_state(root: HostRoot, config: Config) -> State:
    """The cheap probe: everything whose change means the node may have changed."""
    return tuple(entry for p in PROFILES for entry in p.probe(root, config))


def nodes_match(root: HostRoot, inventory: Inventory) -> bool:
    """Whether every device node the Inventory grants is still that node on the host. A
    node the host lacked at discovery (one a family grants anyway, a Problem naming its
    path) matches while it is still missing."""
    absent = {p.source for p in inventory.problems}
    nodes: dict[str, DeviceNode] = {}
    for device in inventory.devices:
        if not device.healthy:
            continue  # its node may be gone: that is what made it unhealthy
        for n in device.edits.device_nodes:
            nodes.setdefault(n.source, n)
    for vendor in {d.vendor for d in inventory.devices}:
        driver = inventory.driver(vendor)
        for edits in driver.capabilities.values() if driver is not None else ():
            for n in edits.device_nodes:
                nodes.setdefault(n.source, n)
    for path, n in nodes.items():
        try:
            kind, st = lstat_device(root, path)
        except DiscoveryError as e:  # gone, a symlink now, or no longer a device
            if path in absent and isinstance(e.__cause__, FileNotFoundError):
                continue
            return False
        if (kind, os.major(st.st_rdev), os.minor(st.st_rdev)) != (n.type, n.major, n.minor):
            return False
    return True


class Change(Struct, frozen=True):
    """What differs between two inventories (qualified device names, driver vendors)."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()
    drivers: tuple[str, ...] = ()  # "nvidia 550.54.15 -> 550.90.07", "+neuron 2.19", "-cdi:..."
    problems: int = 0  # problems in the new inventory

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed or self.drivers)


def log_problems(old: Inventory | None, new: Inventory) -> None:
    """Log the problems of `new` that `old` did not have (every one when `old` is None),
    and those of `old` that `new` no longer has."""
    before = set(old.problems) if old is not None else set()
    after = set(new.problems)
    for p in new.problems:
        if p not in before:
            log.warning("discovery_problem", source=p.source, problem=p.message)
    for p in old.problems if old is not None else ():
        if p not in after:
            log.info("discovery_problem_resolved", source=p.source, problem=p.message)


def diff(old: Inventory, new: Inventory) -> Change:
    before = {d.qualified_name: d for d in old.devices}
    after = {d.qualified_name: d for d in new.devices}
    drivers = []
    for vendor in sorted(set(old.drivers) | set(new.drivers)):
        a, b = old.drivers.get(vendor), new.drivers.get(vendor)
        if a is None and b is not None:
            drivers.append(f"+{vendor} {b.version}".rstrip())
        elif b is None and a is not None:
            drivers.append(f"-{vendor} {a.version}".rstrip())
        elif a is not None and b is not None and a != b:
            drivers.append(f"{vendor} {a.version} -> {b.version}" if a.version != b.version
                           else f"{vendor} files changed")
    return Change(
        added=tuple(q for q in after if q not in before),
        removed=tuple(q for q in before if q not in after),
        changed=tuple(q for q in after if q in before and before[q] != after[q]),
        drivers=tuple(drivers),
        problems=len(new.problems),
    )


class Refresher:
    """Polls for node changes and hands each new Inventory to `on_change`.

    `interval` defaults to config.discovery.refresh_interval; `discover_fn` and `sleep`
    are injectable so tests run without waiting. `state` is the probe taken before the
    discovery that produced `inventory`; without it the first poll rediscovers once.
    """

    def __init__(
        self,
        root: HostRoot,
        config: Config,
        inventory: Inventory,
        on_change: OnChange,
        *,
        state: State | None = None,
        interval: float | None = None,
        discover_fn: Callable[[HostRoot, Config], Inventory] = discover,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ) -> None:
        self.root = root
        self.config = config
        self.inventory = inventory
        self._on_change = on_change
        self._state = state
        self.interval = config.discovery.refresh_interval if interval is None else interval
        self._discover = discover_fn
        self._sleep = sleep

    async def run(self) -> None:
        """Poll until cancelled. Returns at once when the interval is 0 (refresh off)."""
        if self.interval <= 0:
            log.info("refresh_disabled")
            return
        log.info("refresh_started", interval=self.interval)
        while True:
            await self._sleep(self.interval)
            try:
                await self.check()
            except asyncio.CancelledError:
                raise
            except Exception:  # the watcher outlives any one failure
                log.exception("refresh_failed")

    async def check(self) -> Inventory | None:
        """One poll: the new Inventory if the node changed and it differs, else None."""
        state = await asyncio.to_thread(watch_state, self.root, self.config)
        if state == self._state and await asyncio.to_thread(nodes_match, self.root,
                                                            self.inventory):
            return None
        new = carry_vanished(self.inventory,
                             await asyncio.to_thread(self._discover, self.root, self.config))
        self._state = state  # only now: a failed discovery is retried at the next poll
        if new.problems != self.inventory.problems:
            log_problems(self.inventory, new)
        change = diff(self.inventory, new)
        if new == self.inventory:
            log.debug("inventory_unchanged")
            return None
        log.info("inventory_changed", added=list(change.added), removed=list(change.removed),
                 changed=list(change.changed), drivers=list(change.drivers),
                 problems=change.problems)
        self.inventory = new
        result = self._on_change(new)
        if inspect.isawaitable(result):
            await result
        return new
