"""The nri-accel NRI plugin: the handlers that wire the runtime to the Engine, and `run`.

Owns: AccelPlugin (Synchronize -> Engine.grants_in and restore_grants, CreateContainer
-> Engine.plan -> adjustment -> size check -> Engine.commit,
StopContainer/RemoveContainer and Stop/RemovePodSandbox -> release, Configure -> a
warning when the runtime hands over a plugin configuration, and whether it drops an
adjustment's CDI names (a create handing it some is then refused: drops_cdi_devices);
the canonical log line of each CreateContainer that asks; each request counted and timed
for the metrics) and main_run (the `nri-accel run` daemon: the App, the grant
checkpoint, the state shared with the device plugin, the refresher, the families' health
watches (on a discovered node an unhealthy device is granted to no new container), the
metrics server when an address is given, and the stub). Imports nri_accel.app,
nri_accel.config, nri_accel.container, nri_accel.engine, nri_accel.errors,
nri_accel.health, nri_accel.inventory, nri_accel.log, nri_accel.metrics
(nri_accel.metrics.server, with prometheus-client, only when metrics are on),
nri_accel.request (the grant annotation keys, and the annotation keys and env entries it
reads), nri_accel.state, nri_accel.ttrpc (the message size limit) and nri_accel.nri
(stub, adjust, convert).

Most containers on a node ask for nothing: a CreateContainer whose pod and container
carry no annotation key and no env entry the request parser reads, and whose creation
replaces no grant, is answered empty at once by the decoder the stub runs on its bytes
(convert.glance_decoder): decoded only at a glance, no ContainerInfo, no parse, no
call of create_container, logged at debug only (_asked_nothing); every other
one gets the canonical info line, devices or not.

Logs go to stderr, or to --log-file. A plugin the runtime launches itself
(pre-registered: NRI_PLUGIN_SOCKET set) has stdout and stderr on /dev/null, so its
logs, fatal errors included, go to --log-file or else to /var/log/nri-accel.log
(size-bounded, see nri_accel.log).

`run` stops at start (a ConfigError: exit status 2, a fatal_error line) rather than
serve what could never work: an inherited NRI_PLUGIN_SOCKET that is not a connected
unix socket (Stub.inherited_fd), a state directory that is not a directory or cannot be
created (nri_accel.state.prepare_state_dir), a grant checkpoint that cannot be written
there (it writes one before it serves).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import os
import re
import sys
import time
from collections.abc import Awaitable, Callable, Generator, Iterator
from logging import DEBUG
from typing import Any

from google.protobuf.message import DecodeError

from nri_accel import log as logging_setup
from nri_accel.app import DAEMON, App
from nri_accel.config import DEFAULT_CONFIG_PATH
from nri_accel.container import ContainerInfo
from nri_accel.engine import ENV_SCOPE, Engine, Plan, restore_slices
from nri_accel.errors import (
    ConfigError,
    InternalError,
    NriAccelError,
    RequestError,
    StateError,
)
from nri_accel.health import HealthWatches
from nri_accel.inventory import Inventory
from nri_accel.metrics import ERROR, OK, REFUSED, RUN_EVENTS, RequestRecorder, device_counts
from nri_accel.nri import adjust, convert
from nri_accel.nri.stub import ENV_PLUGIN_SOCKET, Stub, malformed, resolve_identity, run_steps
from nri_accel.request import ANNOTATION_PREFIXES, ENV_PREFIXES, RESERVED_KEYS
from nri_accel.state import (
    Checkpoint,
    CheckpointWriter,
    NriStatus,
    boottime,
    lock_state_dir,
    prepare_state_dir,
    state_dir_source,
)
from nri_accel.ttrpc import MAX_MESSAGE_SIZE

# What the runtime can receive: the ttrpc message limit, less room for the response
# envelope around the adjustment (field tags and lengths, the status).
MAX_ADJUSTMENT_BYTES = MAX_MESSAGE_SIZE - 1024
RESTORE_SLICE = 100  # granted containers restored between two turns of the event loop
# (fewer when their grants hold many keys: engine.restore_slices)
# The keys of a container's own annotations that are read: those read of its pod's
# (ANNOTATION_PREFIXES), and the CRI metadata CRI-O names it in (convert.container_name).
CONTAINER_KEYS = (*ANNOTATION_PREFIXES, convert.CRIO_METADATA)

log = logging_setup.get_logger(__name__)


class AccelPlugin:
    """NRI handlers over an Engine. Subscribes to StopPodSandbox, RemovePodSandbox,
    CreateContainer, StopContainer and RemoveContainer (and synchronises); every handler
    is pure computation. These events exist in every NRI v2 runtime (containerd 1.7+,
    CRI-O 1.26+), which matters: a runtime refuses a subscription to an event it does not
    know, and the NRI of containerd 1.7 (v0.3-v0.6) knows only events 1-11 (up to
    REMOVE_CONTAINER). `on_change` is called after every change of the holdings (the
    checkpoint writer's changed()); until a Synchronize has come, a create that grants
    answers once what that returns (an awaitable, or None: at once) is done (_once)."""

    def __init__(self, engine: Engine,
                 on_change: Callable[[], Awaitable[bool] | None] | None = None) -> None:
        # The stub decodes what convert reads, a CreateContainer first at a glance:
        # a container that asks for nothing is answered so (_asked_nothing), that
        # glance all there is to read. It asks when one of its pod's or its own
        # annotation keys, or an entry of its env, is one the request parser reads
        # (else Engine.plan would answer an empty adjustment; an env that sets a
        # visibility variable is read, and rewritten).
        self.engine = engine
        self._on_change = on_change or (lambda: None)
        self.requests = RequestRecorder.for_events(RUN_EVENTS)
        self._created = self.requests["create_container"]
        self.request_decoders = {**convert.REQUEST_DECODERS, "CreateContainer":
                                 convert.glance_decoder(ANNOTATION_PREFIXES, ENV_PREFIXES,
                                                        ENV_SCOPE, engine.holds,
                                                        self._asked_nothing)}
        self._synchronized = False  # a runtime that synchronises this plugin once does again
        self._cdi_dropped_by = ""  # the runtime, where it drops CDI names (drops_cdi_devices)

    def configure(self, config: str, runtime_name: str, runtime_version: str) -> None:
        """Configure carries the runtime's plugin configuration: for a plugin it launches,
        the text of its drop-in (plugin_config_path, /etc/nri/conf.d/NN-name.conf or
        name.conf). It arrives after discovery and the Engine were built from --config,
        so nri-accel does not apply it; it says so instead of dropping it silently.
        Returns None: the subscription follows the handlers. It also learns whether the
        runtime applies the CDI device names of an adjustment (drops_cdi_devices)."""
        self._cdi_dropped_by = (f"{runtime_name} {runtime_version}"
                                if drops_cdi_devices(runtime_name, runtime_version) else "")
        if config.strip():
            log.warning("runtime_plugin_config_ignored", runtime=runtime_name,
                        runtime_version=runtime_version, size=len(config),
                        reason="nri-accel reads its settings from --config "
                               f"(default {DEFAULT_CONFIG_PATH}), not from the runtime")

    def keep_synchronized(self, pods: Any, containers: Any,
                          ) -> Generator[None, None, tuple[list[Any], list[Any]]]:
        """What the stub keeps of each part of a Synchronize until the last: what
        synchronize() reads (tens of thousands of containers: not their messages), and
        of the containers only those that can hold a grant, one carrying a grant
        annotation or one the holdings list (Engine.grants_in reads a grant from the
        first, else from the second; on a node of 60,000 containers, a few hundred). A
        generator of steps (convert.synced()), which the stub runs."""
        return convert.synced(pods, containers, RESERVED_KEYS, self.engine.held_containers())

    async def synchronize(self, pods: list[Any], containers: list[Any]) -> None:
        """Engine.grants_in over the running containers, RESTORE_SLICE at a time with the
        event loop free in between (a node may run thousands of granted containers).
        Nothing else changes the holdings meanwhile: the runtime sends a plugin no event
        until it has answered the Synchronize (NRI's adaptation adds it to the plugins it
        calls only then)."""
        with self._timed("synchronize"):
            live = convert.live_containers(containers, pods, RESERVED_KEYS)
            grants: list[Any] = []
            unread: list[str] = []
            for part in restore_slices(live, RESTORE_SLICE):
                grants += self.engine.grants_in(part, unread)
                await asyncio.sleep(0)
            if unread:
                log.error("grant_state_unknown", containers=len(unread),
                          container_ids=[_shown(c) for c in unread[:8]],
                          effect="their grant annotations cannot be read, nor does the "
                                 "checkpoint know them: no device is granted exclusively "
                                 "until a Synchronize without them")
            self.engine.restore_grants(grants, known=not unread)
        self._synchronized = True
        self._on_change()

    def create_container(self, pod: Any, container: Any) -> Any:
        started = time.perf_counter_ns()
        if convert.is_large(container):
            return self._create_large(pod, container, started)
        return self._create(convert.read_container_info(
            pod, container, ENV_SCOPE, ANNOTATION_PREFIXES, CONTAINER_KEYS), started)

    def _asked_nothing(self, container_id: str, nanoseconds: int) -> None:
        """A container that asks for nothing, and whose creation replaces no grant (which
        plan() and commit() would release), answered empty by the stub's decoder at a
        glance (request_decoders): counted and timed, without a ContainerInfo, a parse
        or an info line (about a tenth of what the full path costs; bench_roundtrip.py)."""
        self._created.record_quick(nanoseconds)
        if log.is_enabled_for(DEBUG):
            log.debug("container_created", container_id=container_id, devices=[],
                      asked="nothing")

    async def _create_large(self, pod: Any, container: Any, started: int) -> Any:
        """A request over convert.LARGE_REQUEST bytes, its pod and container undecoded
        (a 4 MiB one holds 100,000 env variables or annotations, 60,000 mounts, or 1.3
        million one-byte env entries): what the Engine reads of it is decoded and
        gathered a run of fields at a time (convert.large_container_info), the event
        loop free in between (the whole would hold it 10 to 100 ms), then planned as any
        other (one that asks nothing too: such a request is rare). Bytes that do not
        decode are refused as the stub refuses them."""
        try:
            info = await run_steps(convert.large_container_info(
                pod, container, ENV_SCOPE, ANNOTATION_PREFIXES, CONTAINER_KEYS))
        except DecodeError as exc:
            raise malformed("CreateContainerRequest", exc) from exc
        except NriAccelError as exc:  # more of a kind than is read: its names unread too
            self._refused(None, exc, started)
            raise
        answer = self._create(info, started)
        return answer if isinstance(answer, bytes) else await answer

    def _create(self, info: ContainerInfo, started: int) -> bytes | Awaitable[bytes]:
        """The adjustment for the container `info`, recorded and logged (or an awaitable
        of it: _once); or its refusal."""
        try:
            plan = self.engine.plan(info)
            if plan.cdi_devices and self._cdi_dropped_by:
                raise _cdi_dropped(self._cdi_dropped_by, plan.cdi_devices)
            result = adjust.encode_adjustment(plan.edits, plan.annotations,
                                              plan.cdi_devices)
            _check_size(len(result), plan)
            changed = self.engine.commit(plan)
        except NriAccelError as exc:
            self._refused(info, exc, started)
            raise
        except Exception as exc:  # a bug: the container fails with a readable reason
            self._refused(info, exc, started)
            raise InternalError(f"nri-accel internal error: {exc}") from exc
        saved = self._on_change() if changed else None  # a grant, or one it replaced
        if saved is None or self._synchronized:
            self._answered(info, plan, started)
            return result
        return self._once(saved, result, info, plan, started)

    def _answered(self, info: ContainerInfo, plan: Plan, started: int) -> None:
        """Record and log a create answered with `plan`."""
        elapsed = time.perf_counter_ns() - started
        self._created.record(OK, elapsed / 1e9)
        log.info("container_created", namespace=_shown(info.namespace),
                 pod=_shown(info.pod_name), container=_shown(info.container_name),
                 devices=[d.qualified_name for d in plan.devices],
                 granted_by={q: _shown(s) for q, s in plan.granted_by.items()},
                 **{k: v for k, v in plan.facts if plan.devices},
                 cdi_devices=list(plan.cdi_devices),
                 notes=[_shown(n, 1024) for n in plan.notes],
                 duration_us=elapsed // 1000)

    async def _once(self, saved: Awaitable[bool], result: bytes, info: ContainerInfo,
                    plan: Plan, started: int) -> bytes:
        """`result`, once `saved` (the checkpoint write of what the create changed: its
        grant, or the end of the one it replaced) is done: a plugin killed after
        answering must not restart from a checkpoint without it where no Synchronize
        will say what runs (containerd 1.7 does not synchronise a plugin it launches,
        and kills it when it stops). Where the write of a grant failed, the grant is
        released and the container refused (UNAVAILABLE): answered, it would be a grant
        the next start cannot know of (a checkpoint still holding a replaced grant only
        holds more than runs). A plugin the runtime synchronised answers
        at once: after a restart it is synchronised again, and reads the grant back from
        the container's annotations (the write, off the event loop, costs a create
        0.2-0.6 ms)."""
        if await saved or not plan.grant.holds:
            self._answered(info, plan, started)
            return result
        self.engine.release(info.container_id)
        self._on_change()
        error = StateError("its grant could not be written to the grant checkpoint (see "
                           "checkpoint_write_failed), and the runtime has not synchronised: "
                           "a restart would not know the devices are held, so they are not "
                           "granted", source="container")
        self._refused(info, error, started)
        raise error

    def _refused(self, info: ContainerInfo | None, exc: Exception, started: int) -> None:
        """Record and log a refusal (of a container whose request was not read as far
        as its names: `info` None)."""
        elapsed = time.perf_counter_ns() - started
        unexpected = not isinstance(exc, NriAccelError)
        self._created.record(ERROR if unexpected else REFUSED, elapsed / 1e9)
        names = (info.namespace, info.pod_name, info.container_name) if info else ("", "", "")
        log.warning("container_refused", namespace=_shown(names[0]),
                    pod=_shown(names[1]), container=_shown(names[2]),
                    error=_shown(str(exc), 1024), source=_shown(getattr(exc, "source", "")),
                    duration_us=elapsed // 1000, exc_info=exc if unexpected else None)

    @contextlib.contextmanager
    def _timed(self, event: str) -> Iterator[None]:
        """Record one request of `event`: OK, or ERROR when it raises."""
        started = time.perf_counter_ns()
        outcome = ERROR
        try:
            yield
            outcome = OK
        finally:
            self.requests[event].record(outcome, (time.perf_counter_ns() - started) / 1e9)

    def stop_container(self, pod: Any, container: Any) -> Any:
        return self._ended("stop_container", "StopContainerRequest", container)

    def remove_container(self, pod: Any, container: Any) -> Any:
        return self._ended("remove_container", "RemoveContainerRequest", container)

    def _ended(self, event: str, message: str, container: Any) -> Any:
        """The end of a container (`event`, of a request of `message`): its grant
        released; for a container given as its encoding, a coroutine that does so."""
        if convert.is_large(container):
            return self._end_large(event, message, container)
        with self._timed(event):
            self._released(self.engine.release(container.id))
        return None

    async def _end_large(self, event: str, message: str, container: Any) -> None:
        """The end of a container whose request was over convert.LARGE_REQUEST bytes:
        its id read a run of fields at a time (convert.ended_id), the event loop free
        in between, then its grant released."""
        with self._timed(event):
            try:
                container_id = await run_steps(convert.ended_id(container))
            except DecodeError as exc:
                raise malformed(message, exc) from exc
            self._released(self.engine.release(container_id))

    def stop_pod_sandbox(self, pod: Any) -> None:
        self._release_pod(pod)

    def remove_pod_sandbox(self, pod: Any) -> None:
        self._release_pod(pod)

    def _release_pod(self, pod: Any) -> None:
        # CRI-O sends nothing for a container whose `runc create` failed after the
        # adjustment: the pod's end is where its grant ends.
        for g in self.engine.release_pod(pod.uid, pod.id):
            self._released(g)

    def _released(self, grant: Any) -> None:
        if grant is not None:
            log.debug("grant_released", container_id=grant.container_id,
                      container=_shown(grant.name))
            self._on_change()


_VERSION = re.compile(r"v?(\d+)\.(\d+)\.(\d+)")


def drops_cdi_devices(runtime_name: str, runtime_version: str) -> bool:
    """Whether the runtime (as Configure names it) takes the CDI device names of an
    adjustment and creates the container without them. NRI's spec generator injects
    them only through the runtime's WithCDIDeviceInjector and does nothing without one
    (containerd/nri pkg/runtime-tools/generate/generate.go, InjectCDIDevices).
    containerd 2.0 sets none (internal/cri/nri/nri_api_linux.go; its fix,
    containerd/containerd#12651, was closed unmerged), nor does 1.7 before 1.7.30
    (pkg/cri/nri/nri_api_linux.go; containerd/containerd#12650), whose NRI before v0.7
    does not even know the field; 2.1 and later do, and so does CRI-O 1.36
    (server/nri-api.go). A version that does not parse is taken to apply them."""
    found = _VERSION.match(runtime_version)
    if runtime_name != "containerd" or found is None:
        return False
    version = tuple(map(int, found.groups()))
    return version < (1, 7, 30) or (2, 0) <= version[:2] < (2, 1)


def _cdi_dropped(runtime: str, names: tuple[str, ...]) -> RequestError:
    """The refusal of a grant handed to a runtime that drops CDI names: answered, the
    container would start without the devices, which nri-accel would count as held."""
    return RequestError(
        f"{runtime} ignores the CDI devices of an NRI adjustment, so "
        f"{', '.join(names[:8])}{', ...' if len(names) > 8 else ''} would not reach the "
        "container: set devices.cdi_passthrough = false (nri-accel then resolves CDI "
        "devices itself), or run containerd 1.7.30+ or 2.1+ with CDI enabled",
        source="config devices.cdi_passthrough")


def _check_size(size: int, plan: Plan) -> None:
    """Refuse an answer the runtime could not receive (an adjustment of `size` bytes,
    over the ttrpc message limit, which a huge LD_LIBRARY_PATH echoed back can reach,
    or the devices' own edits: CDI specs of thousands of mounts), naming what is most
    of it, before anything is held."""
    if size <= MAX_ADJUSTMENT_BYTES:
        return
    over = (f"the answer would be {size} bytes, over the {MAX_MESSAGE_SIZE}-byte limit of "
            "the runtime's NRI connection")
    biggest = max(plan.edits.env, key=len, default="")
    if len(biggest) * 2 > size:  # most of it
        raise RequestError(f"{over}, mostly this variable's value ({len(biggest)} bytes) "
                           "that nri-accel extends: shorten it",
                           source=f"env {biggest.partition('=')[0]}")
    edits = plan.edits
    raise RequestError(f"{over}, mostly the edits of the devices asked for "
                       f"({len(edits.device_nodes)} device nodes, {len(edits.mounts)} mounts, "
                       f"{len(edits.env)} env entries, {len(edits.hooks)} hooks): ask for "
                       "fewer devices at once", source="container")


def _shown(text: str, limit: int = 256) -> str:
    """`text` as a log field: what str.isprintable() refuses escaped (control
    characters, and bidi controls such as U+202E, zero-width ones and line separators,
    which reorder or hide text on a terminal: a console log is read there; names and
    values come from whoever wrote the pod) and cut at `limit` characters."""
    if len(text) <= limit and text.isprintable():
        return text
    return repr(text[:limit])[1:-1] + ("..." if len(text) > limit else "")


# ---- the daemon --------------------------------------------------------------------------


def main_run(args: argparse.Namespace) -> int:
    """`nri-accel run`: flags --socket, --name, --idx, --config, --log-file, --state-dir,
    --metrics-address, --inventory FILE | --root DIR. Returns the exit status."""
    preregistered = bool(os.environ.get(ENV_PLUGIN_SOCKET))
    if preregistered:  # stderr is /dev/null: even a fatal configuration error is logged
        try:
            early = logging_setup.open_log_file(args.log_file, preregistered=True)
        except OSError:  # App.from_args refuses it, said in the default file
            early = logging_setup.open_log_file(None, preregistered=True)
        logging_setup.configure(file=early)
    try:
        fd = Stub.inherited_fd()  # checked: a connected unix socket, else a ConfigError
        app = App.from_args(args, mode=DAEMON, log_file=args.log_file,
                            preregistered=preregistered)
    except NriAccelError as e:
        if preregistered:  # else logging is not set up yet: the CLI's line on stderr says it
            log.error("fatal_error", error=str(e))
        raise
    try:
        return _run(app, args, fd)
    except NriAccelError as e:
        log.error("fatal_error", error=str(e))
        raise
    finally:
        app.close()


def _run(app: App, args: argparse.Namespace, fd: int | None) -> int:
    config = app.config
    identity = resolve_identity(args.name, args.idx, argv0=sys.argv[0],  # a ConfigError
                                default_name=config.nri.name, default_idx=config.nri.idx)
    state_source = state_dir_source(args.state_dir, config.path)
    prepare_state_dir(config.state_dir, source=state_source)
    lock_state_dir(config.state_dir, source=state_source)  # held until the process exits
    inventory = app.load_inventory()
    engine = Engine(inventory, config)
    checkpoint = Checkpoint(config.state_dir)
    grants, known = checkpoint.load()
    engine.load_checkpoint(grants, known=known)
    try:  # every run writes one before it serves (see nri_accel.state)
        checkpoint.save(engine.holdings.to_json(checkpoint.boot_id))
    except OSError as e:
        raise ConfigError(f"cannot write the grant checkpoint {checkpoint.path}: "
                          f"{e.strerror or e}", source=state_source) from e
    # What start-up built (the inventory, the Engine's tables; the modules' objects were
    # frozen as the process entered, nri_accel.__main__) lives as long as the process:
    # frozen out of the collector's sight, a full collection on the event loop takes
    # some microseconds instead of 4 ms (26,000 objects on the demo node).
    gc.freeze()
    return app.run_loop(_serve(app, engine, checkpoint, identity, fd, args.socket))


async def _serve(app: App, engine: Engine, checkpoint: Checkpoint, identity: Any,
                 fd: int | None, socket_path: str | None) -> int:
    config = app.config
    writer = CheckpointWriter(checkpoint, engine.holdings.snapshot,
                              known=lambda: engine.holdings.known)
    stub = Stub(AccelPlugin(engine, writer.changed), identity,
                socket_path=socket_path or config.nri.socket, fd=fd)
    stub.install_signal_handlers()
    loop = asyncio.get_running_loop()
    tasks = [loop.create_task(_publish_status(stub, config.state_dir))]
    exits = contextlib.AsyncExitStack()
    metrics = None
    if app.metrics_address is not None:
        from nri_accel.metrics.server import MetricsServer, RunMetrics

        metrics = RunMetrics(stub.plugin.requests)  # type: ignore[attr-defined]

        def sample() -> None:
            metrics.set_runtime(connected=stub.registered.is_set(),
                                registrations=stub.registrations)
            metrics.set_devices(device_counts(engine.inventory, engine.holdings.held_keys()))

        def ready() -> str | None:
            return None if stub.registered.is_set() else (
                f"not registered with the container runtime ({stub.socket_path})")

        await exits.enter_async_context(
            MetricsServer(metrics, app.metrics_address, ready=ready, sample=sample))
    health = None
    if app.inventory_path is None:  # a discovered node: follow its devices' health
        health = HealthWatches(app.host_root(), config, engine.set_health)
        exits.push_async_callback(health.stop)
        await health.update(engine.inventory)

    async def on_refresh(inventory: Inventory) -> None:
        engine.swap_inventory(inventory)
        if metrics is not None:
            metrics.inventory_refreshed()
        if health is not None:
            await health.update(inventory)

    refresher = app.refresher(engine.inventory, on_refresh)
    if refresher is not None:
        tasks.append(loop.create_task(refresher.run()))
    try:
        return await stub.run()
    finally:
        await exits.aclose()
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        with contextlib.suppress(OSError):
            NriStatus(registered=False, plugin=stub.identity.full_name, pid=os.getpid(),
                      heartbeat=boottime()).save(config.state_dir)
        await writer.flush()
        log.info("plugin_stopped", plugin=stub.identity.full_name)


async def _publish_status(stub: Stub, state_dir: str) -> None:
    """Keep `<state dir>/nri-plugin.json` saying whether this plugin is registered with
    the runtime: written at once on a change (checked every 0.25 s) and every
    NriStatus.HEARTBEAT seconds, so the device plugin sees it alive."""
    last: tuple[bool, float] | None = None
    failed = False
    while True:
        registered = stub.registered.is_set()
        now = boottime()
        if last is None or last[0] != registered or now - last[1] >= NriStatus.HEARTBEAT:
            runtime = f"{stub.runtime.name} {stub.runtime.version}".strip()
            try:
                NriStatus(registered, runtime, stub.identity.full_name, os.getpid(),
                          now).save(state_dir)
            except OSError as e:
                if not failed:
                    log.error("state_write_failed", state_dir=state_dir,
                              error=e.strerror or str(e),
                              effect="the device plugin reports every device Unhealthy")
                failed = True
            else:
                failed = False
            last = (registered, now)
        await asyncio.sleep(0.25)
