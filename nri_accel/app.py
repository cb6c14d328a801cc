"""The composition root: what every verb builds before it does its work.

Owns: App (the configuration with its command-line overrides, logging, the inventory
source and its refresher, the event loop a daemon runs on) and the checks of what the
command line names. Imports the standard library, msgspec, nri_accel.config,
nri_accel.errors, nri_accel.inventory, nri_accel.log and nri_accel.metrics (the address,
not the server); nri_accel.discover only when a verb discovers, so `run --inventory
FILE` and `explain --inventory FILE` never load a discoverer; uvloop only in
App.run_loop.

Every verb starts with App.from_args(args, ...): `run` and `device-plugin` as daemons
(logs at the configured level, to stderr or a file; every discovery problem a warning
with its reason), the report verbs quietly (stdout is their output: errors only, or
warnings for explain), and the command line is checked once: a --root or --inventory
that does not exist is a configuration error (exit 2), never an empty node.
"""

from __future__ import annotations

import argparse
import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import IO, TYPE_CHECKING, Any, TypeVar

from msgspec import Struct
from msgspec.structs import replace

from nri_accel import log as logging_setup
from nri_accel.config import Config, load_config
from nri_accel.errors import ConfigError
from nri_accel.inventory import Inventory
from nri_accel.metrics import Address, choose_address

if TYPE_CHECKING:
    from nri_accel.discover.hostroot import HostRoot
    from nri_accel.discover.watch import Refresher

log = logging_setup.get_logger(__name__)
T = TypeVar("T")

DAEMON = "daemon"  # logs at the configured level
REPORT = "error"  # logs errors only (debug if configured): stdout is the output
DRY_RUN = "warning"  # logs warnings and up (debug if configured)


class App(Struct):
    """One verb's configuration and inventory source."""

    config: Config
    inventory_path: str | None = None
    root_dir: str | None = None
    metrics_address: Address | None = None  # where to serve /metrics; None: off
    log_file: IO[str] | None = None
    _probe: Any = None  # the refresher's probe, taken just before discovery

    @classmethod
    def from_args(cls, args: argparse.Namespace, *, mode: str,
                  log_file: str | None = None, preregistered: bool = False) -> App:
        """Read the configuration (--config), apply --state-dir, choose the metrics
        address (--metrics-address, else metrics.address), check --inventory/--root, and
        configure logging for `mode`."""
        config = load_config(getattr(args, "config", None))
        state_dir = getattr(args, "state_dir", None)
        if state_dir:
            config = replace(config, state_dir=os.path.abspath(state_dir))
        inventory_path = getattr(args, "inventory", None)
        root_dir = getattr(args, "root", None)
        if inventory_path is not None and not os.path.isfile(inventory_path):
            raise ConfigError(_not_a("file", inventory_path) + " (write one with "
                              "`nri-accel discover --json`)",
                              source=f"--inventory {inventory_path}")
        if root_dir is not None and not os.path.isdir(root_dir):
            raise ConfigError(_not_a("directory", root_dir) + ": the host root to discover",
                              source=f"--root {root_dir}")
        app = cls(config, inventory_path, root_dir, choose_address(
            getattr(args, "metrics_address", None), config.metrics.address,
            config_path=config.path))
        if mode == DAEMON:
            try:
                app.log_file = logging_setup.open_log_file(log_file,
                                                           preregistered=preregistered)
            except OSError as exc:
                raise ConfigError(f"cannot open: {exc.strerror or exc}",
                                  source=f"--log-file {log_file}") from exc
            logging_setup.configure(level=config.log.level, fmt=config.log.format,
                                    file=app.log_file)
        else:
            level = "debug" if config.log.level == "debug" else mode
            logging_setup.configure(level=level, fmt=config.log.format)
        return app

    def run_loop(self, main: Coroutine[Any, Any, T]) -> T:
        """Run `main` to its end on a new event loop of the kind nri.event_loop names:
        uvloop's (libuv, in C) for "uvloop", and for "auto" where uvloop imports;
        asyncio's own for "asyncio" (and "auto" without uvloop). uvloop takes the
        socket reads, writes and the loop's turn out of Python: `run` answers a
        container that asks for nothing in 6-8 us less CPU (bench_roundtrip.py
        prints both loops), for about 10 ms more start-up (it imports ssl). Raises
        ConfigError for "uvloop" where it cannot be imported (`main` is then closed,
        never run)."""
        try:
            factory = loop_factory(self.config)
        except ConfigError:
            main.close()
            raise
        with asyncio.Runner(loop_factory=factory) as runner:
            return runner.run(main)

    def close(self) -> None:
        if self.log_file is not None:
            self.log_file.close()
            self.log_file = None

    def host_root(self) -> HostRoot:
        from nri_accel.discover import host_root

        return host_root(self.root_dir, self.config)

    def load_inventory(self) -> Inventory:
        """The saved inventory (--inventory), or a discovery of the host root. Every
        problem it holds is logged once, as a warning with its reason (discovery logs
        none itself; on refresh, only those that appear or go away are logged)."""
        if self.inventory_path is not None:
            inventory = Inventory.load(self.inventory_path)
            log.info("inventory_loaded", path=self.inventory_path,
                     devices=len(inventory.devices))
        else:
            from nri_accel.discover import discover
            from nri_accel.discover.watch import watch_state

            root = self.host_root()
            # Before discovery: a change meanwhile is seen at the refresher's first poll.
            self._probe = watch_state(root, self.config)
            inventory = discover(root, self.config)
            log.info("inventory_discovered", root=root.root, devices=len(inventory.devices),
                     problems=len(inventory.problems))
        for p in inventory.problems:  # the refresher logs only those that change
            log.warning("discovery_problem", source=p.source, problem=p.message)
        return inventory

    def refresher(self, inventory: Inventory,
                  on_change: Callable[[Inventory], Any]) -> Refresher | None:
        """The Refresher that keeps the discovered `inventory` current (None for a saved
        inventory)."""
        if self.inventory_path is not None:
            return None
        from nri_accel.discover.watch import Refresher

        return Refresher(self.host_root(), self.config, inventory, on_change,
                         state=self._probe)


def loop_factory(config: Config) -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's new_event_loop, or None (asyncio's own loop), for config.nri.event_loop.
    Raises ConfigError for "uvloop" where it cannot be imported."""
    choice = config.nri.event_loop
    if choice == "asyncio":
        return None
    try:
        import uvloop
    except ImportError as exc:
        if choice == "auto":
            return None
        where = f"{config.path}: " if config.path else ""
        raise ConfigError(f"uvloop cannot be imported ({exc}): install it, or set "
                          "\"asyncio\"", source=f"{where}nri.event_loop") from exc
    return uvloop.new_event_loop


def _not_a(wanted: str, path: str) -> str:
    """Why `path` is not the `wanted` ("file", "directory") a flag names."""
    if not os.path.exists(path):  # (a dangling symlink too)
        return f"no such {wanted}"
    if os.path.isdir(path):
        return "is a directory, not a file"
    if wanted == "directory":
        return "is not a directory"
    return "is not a regular file"
