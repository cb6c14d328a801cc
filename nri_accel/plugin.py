"""The nri-accel NRI plugin: the handlers that wire the runtime to the Engine, and `run`.

Owns: AccelPlugin (Synchronize -> Engine.restore, CreateContainer -> Engine.plan ->
adjustment, StopContainer/RemoveContainer -> Engine.release, Configure -> a warning
when the runtime hands over a plugin configuration; the one canonical log line per
CreateContainer) and main_run (the `nri-accel run` daemon: configuration,
logging, inventory, refresh, the stub). Imports nri_accel.config, errors, inventory,
log, engine and nri (stub, adjust, convert); nri_accel.discover only when it
discovers, so `run --inventory FILE` does not load the discoverers.

Logs go to stderr, or to --log-file (log.configure sends the ttrpc library's
standard-library logging to the same place). A plugin the runtime launches itself
(pre-registered: NRI_PLUGIN_SOCKET set) has stdout and stderr on /dev/null, so its
logs go to --log-file or else to DEFAULT_PREREGISTERED_LOG.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import sys
import time
from typing import IO, Any

from nri_accel import log as logging_setup
from nri_accel.config import DEFAULT_CONFIG_PATH, Config, load_config
from nri_accel.engine import Engine
from nri_accel.errors import NriAccelError
from nri_accel.inventory import Inventory
from nri_accel.nri import adjust, convert
from nri_accel.nri.stub import Stub, resolve_identity

DEFAULT_PREREGISTERED_LOG = "/var/log/nri-accel.log"
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f]")

log = logging_setup.get_logger(__name__)


class AccelPlugin:
    """NRI handlers over an Engine. Subscribes to CreateContainer, StopContainer and
    RemoveContainer (and synchronises); every handler is pure computation. These three
    events exist in every NRI v2 runtime (containerd 1.7+, CRI-O 1.26+), which matters:
    a runtime refuses a subscription to an event it does not know, and the NRI of
    containerd 1.7 (v0.3-v0.6) knows only events 1-11 (up to REMOVE_CONTAINER)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def configure(self, config: str, runtime_name: str, runtime_version: str) -> None:
        """Configure carries the runtime's plugin configuration: for a plugin it launches,
        the text of its drop-in (plugin_config_path, /etc/nri/conf.d/NN-name.conf or
        name.conf). It arrives after discovery and the Engine were built from --config,
        so nri-accel does not apply it; it says so instead of dropping it silently.
        Returns None: the subscription follows the handlers."""
        if config.strip():
            log.warning("runtime_plugin_config_ignored", runtime=runtime_name,
                        runtime_version=runtime_version, size=len(config),
                        reason="nri-accel reads its settings from --config "
                               f"(default {DEFAULT_CONFIG_PATH}), not from the runtime")

    def synchronize(self, pods: list[Any], containers: list[Any]) -> None:
        self.engine.restore(convert.live_containers(containers, pods))

    def create_container(self, pod: Any, container: Any) -> Any:
        started = time.perf_counter_ns()
        info = convert.container_info(pod, container)
        try:
            plan = self.engine.plan(info)
            result = adjust.build_adjustment(plan.edits, plan.annotations, plan.cdi_devices)
        except Exception as exc:
            duration_us = (time.perf_counter_ns() - started) // 1000
            unexpected = not isinstance(exc, NriAccelError)
            log.warning("container_refused", namespace=_shown(info.namespace),
                        pod=_shown(info.pod_name), container=_shown(info.container_name),
                        error=_shown(str(exc), 1024),
                        source=_shown(getattr(exc, "source", "")), duration_us=duration_us,
                        exc_info=exc if unexpected else None)
            if unexpected:  # a bug: the container fails with a readable reason, we go on
                raise NriAccelError(f"nri-accel internal error: {exc}") from exc
            raise
        duration_us = (time.perf_counter_ns() - started) // 1000
        log.info("container_created", namespace=_shown(info.namespace),
                 pod=_shown(info.pod_name), container=_shown(info.container_name),
                 devices=[d.qualified_name for d in plan.devices],
                 capabilities=sorted(plan.capabilities) if plan.devices else [],
                 cdi_devices=list(plan.cdi_devices), notes=list(plan.notes),
                 duration_us=duration_us)
        return result

    def stop_container(self, pod: Any, container: Any) -> None:
        self.engine.release(container.id)

    def remove_container(self, pod: Any, container: Any) -> None:
        self.engine.release(container.id)


def _shown(text: str, limit: int = 256) -> str:
    """`text` as a log field: control characters escaped (a console log is read on a
    terminal; names come from whoever wrote the pod) and cut at `limit` characters."""
    if len(text) <= limit and not _UNPRINTABLE.search(text):
        return text
    return repr(text[:limit])[1:-1] + ("..." if len(text) > limit else "")


def main_run(args: argparse.Namespace) -> int:
    """`nri-accel run`: flags --socket, --name, --idx, --config, --log-file,
    --inventory FILE | --root DIR. Returns the exit status."""
    config = load_config(args.config)
    fd = Stub.inherited_fd()
    log_file = _log_destination(args.log_file, preregistered=fd is not None)
    logging_setup.configure(level=config.log.level, fmt=config.log.format, file=log_file)
    identity = resolve_identity(args.name, args.idx, argv0=sys.argv[0],
                                default_name=config.nri.name, default_idx=config.nri.idx)
    inventory, refresher_args = _inventory(args, config)
    engine = Engine(inventory, config)
    stub = Stub(AccelPlugin(engine), identity, socket_path=args.socket or config.nri.socket,
                fd=fd)
    try:
        return asyncio.run(_serve(stub, engine, config, refresher_args))
    finally:
        if log_file is not None:
            log_file.close()


def _inventory(args: argparse.Namespace, config: Config) -> tuple[Inventory, Any]:
    """The inventory to start with, and what a Refresher needs (None: no refresh)."""
    if args.inventory:
        inventory = Inventory.load(args.inventory)
        log.info("inventory_loaded", path=args.inventory, devices=len(inventory.devices))
        return inventory, None
    from nri_accel.discover import discover, host_root
    from nri_accel.discover.watch import watch_state

    root = host_root(args.root, config)
    state = watch_state(root, config)  # before discovery: a change meanwhile is seen later
    inventory = discover(root, config)
    log.info("inventory_discovered", root=root.root, devices=len(inventory.devices),
             problems=len(inventory.problems))
    return inventory, (root, state)


async def _serve(stub: Stub, engine: Engine, config: Config, refresher_args: Any) -> int:
    stub.install_signal_handlers()
    refresh = None
    if refresher_args is not None:
        from nri_accel.discover.watch import Refresher

        root, state = refresher_args
        refresher = Refresher(root, config, engine.inventory,
                              engine.swap_inventory, state=state)
        refresh = asyncio.get_running_loop().create_task(refresher.run())
    try:
        return await stub.run()
    finally:
        if refresh is not None:
            refresh.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await refresh
        log.info("plugin_stopped", plugin=stub.identity.full_name)


def _log_destination(path: str | None, *, preregistered: bool) -> IO[str] | None:
    """The file logs go to (None: stderr)."""
    if path is None and not preregistered:
        return None
    target = path or DEFAULT_PREREGISTERED_LOG
    try:
        return open(target, "a", buffering=1, encoding="utf-8")
    except OSError as exc:
        print(f"nri-accel: cannot open log file {target}: {exc.strerror}; logging to stderr",
              file=sys.stderr)
        return None
