"""Refresh: notice that the node changed, rediscover, hand the new Inventory over.

Owns: watch_state() (the cheap change probe), nodes_match(), diff() and Refresher (the
background asyncio task). Imports the standard library, nri_accel.config,
nri_accel.errors, nri_accel.inventory, nri_accel.log and nri_accel.discover (discover,
lstat_device, HostRoot).

A poll every `discovery.refresh_interval` seconds (0 disables) costs a few dozen
stat()s and two tiny reads; nothing is rediscovered unless one of these moved:

- driver versions: /proc/driver/nvidia/version, /sys/module/nvidia/version,
  /sys/module/neuron/version (a driver upgrade or reload);
- the vendor entries of /dev (nvidia*, neuron*) and /dev/nvidia-caps (hot-plug, a
  driver creating or removing nodes), each with its lstat identity;
- the MIG capability tree /proc/driver/nvidia/capabilities/gpuN/mig/giM/ciK
  (MIG reconfiguration creates and removes these directories);
- each CDI spec directory and its spec files (name, size, mtime, inode);
- the nodes of the static config entries;
- and every device node of the current Inventory still being the node it recorded
  (type, major, minor), which catches a CDI vendor's node disappearing or renumbered.

On a change the whole discovery runs again in a worker thread (the event loop keeps
serving CreateContainer meanwhile); if the new Inventory differs, `inventory_changed`
is logged with what was added, removed and changed, and the callback receives it. The
caller swaps its reference in one assignment: readers see the old or the new
Inventory, never a mix. The probe is taken before discovery, so a change during
discovery is seen at the next poll, and recorded only once discovery succeeded, so a
failed one is retried. The task never dies of an error: it logs `refresh_failed` and
polls again.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import stat
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from nri_accel.config import Config
from nri_accel.discover import discover
from nri_accel.discover.base import lstat_device
from nri_accel.discover.hostroot import HostRoot
from nri_accel.errors import DiscoveryError
from nri_accel.inventory import DeviceNode, Inventory
from nri_accel.log import get_logger

log = get_logger(__name__)

PROC_VERSION_FILES = ("/proc/driver/nvidia/version",)
SYS_VERSION_FILES = ("module/nvidia/version", "module/neuron/version")  # under HostRoot.sys
DEV_PREFIXES = ("nvidia", "neuron")
MIG_CAPS_DIR = "/proc/driver/nvidia/capabilities"

State = tuple[tuple[str, Any], ...]
OnChange = Callable[[Inventory], Awaitable[None] | None]


def watch_state(root: HostRoot, config: Config) -> State:
    """The cheap probe: everything whose change means the node may have changed."""
    out: list[tuple[str, Any]] = []
    for path in (*PROC_VERSION_FILES, *(root.sys_path(rel) for rel in SYS_VERSION_FILES)):
        try:
            out.append((path, root.read_text(path)))
        except (OSError, ValueError):
            out.append((path, None))
    for name in root.listdir(root.dev):
        if name.startswith(DEV_PREFIXES):
            path = root.dev_path(name)
            out.append((path, _identity(root, path)))
    caps = root.dev_path("nvidia-caps")
    for name in root.listdir(caps):
        path = f"{caps}/{name}"
        out.append((path, _identity(root, path)))
    for gpu in root.listdir(MIG_CAPS_DIR):
        mig = f"{MIG_CAPS_DIR}/{gpu}/mig"
        for gi in root.listdir(mig):
            if gi.startswith("gi"):
                out.append((f"{mig}/{gi}", tuple(c for c in root.listdir(f"{mig}/{gi}")
                                                 if c.startswith("ci"))))
    for spec_dir in config.discovery.cdi_spec_dirs:
        out.append((spec_dir, _identity(root, spec_dir)))
        for name in root.listdir(spec_dir):
            path = f"{spec_dir.rstrip('/')}/{name}"
            out.append((path, _identity(root, path, content=True)))
    for entry in config.static_devices:
        for path in entry.device_nodes:
            out.append((path, _identity(root, path)))
    return tuple(out)


def _identity(root: HostRoot, host_path: str, *, content: bool = False) -> tuple[int, ...] | None:
    """lstat identity: file type, device number and inode; with `content`, size and mtime
    too (spec files). Device nodes leave mtime out: some drivers' nodes change it on use."""
    try:
        st = root.lstat(host_path)
    except (OSError, ValueError):
        return None
    ident = (stat.S_IFMT(st.st_mode), st.st_rdev, st.st_ino)
    return (*ident, st.st_size, st.st_mtime_ns) if content else ident


def nodes_match(root: HostRoot, inventory: Inventory) -> bool:
    """Whether every device node the Inventory grants is still that node on the host."""
    nodes: dict[str, DeviceNode] = {}
    for device in inventory.devices:
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
        except DiscoveryError:  # gone, a symlink now, or no longer a device
            return False
        if (kind, os.major(st.st_rdev), os.minor(st.st_rdev)) != (n.type, n.major, n.minor):
            return False
    return True


@dataclass(frozen=True, slots=True)
class Change:
    """What differs between two inventories (qualified device names, driver vendors)."""

    added: tuple[str, ...] = ()
    removed: tuple[str, ...] = ()
    changed: tuple[str, ...] = ()
    drivers: tuple[str, ...] = ()  # "nvidia 550.54.15 -> 550.90.07", "+neuron 2.19", "-cdi:..."
    problems: int = 0  # problems in the new inventory

    def __bool__(self) -> bool:
        return bool(self.added or self.removed or self.changed or self.drivers)


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
        new = await asyncio.to_thread(self._discover, self.root, self.config)
        self._state = state  # only now: a failed discovery is retried at the next poll
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
