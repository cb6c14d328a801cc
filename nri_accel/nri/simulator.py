"""A container runtime's side of NRI, in Python: for tests, the benchmark and the demo.

Owns: Simulator (listens on a unix socket like containerd's NRI, accepts plugins,
serves RegisterPlugin, configures and synchronises each plugin
and then sends the pod and container events the caller drives), PluginConn (one
connected plugin) and the make_pod / make_container helpers. Imports asyncio, the
standard library, nri_accel.ttrpc, nri_accel.log and this package's mux, stub
constants and nri_pb2.

It follows what containerd 2.3 (NRI v0.12.0, pkg/adaptation) does, so that a plugin
that works against it works against the real runtime:
- Configure goes out on conn 1 right after RegisterPlugin is accepted (or, with
  configure_first=True, before the RegisterPlugin answer, which a plugin must also
  survive); an event mask of 0 subscribes the plugin to everything; bits outside
  the valid events refuse it (known_events=LEGACY_EVENTS plays containerd 1.7,
  whose NRI v0.3-v0.6 knows events 1-11 only);
- Synchronize sends every known pod and container; a request over the 4 MiB ttrpc
  limit is retried in chunks marked `more`, scaled by the runtime's factor, and a
  plugin that does not echo `more` (or asks for updates mid-way) is dropped;
- every request carries metadata containerd-namespace-ttrpc=k8s.io and the request
  timeout as its deadline; a plugin that times out or whose connection fails is
  dropped and the event goes on without it; any other error fails the event;
- adjustments of several plugins are merged, and two adjustments of one device
  path, mount destination, env variable, annotation or CDI device are a conflict
  that fails the container, as in the runtime; validator plugins then see the
  merged adjustment and may reject it.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import socket
import time
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from google.protobuf import json_format

from nri_accel.log import get_logger
from nri_accel.nri import nri_pb2 as pb
from nri_accel.nri.mux import PLUGIN_SERVICE_CONN, RUNTIME_SERVICE_CONN, MuxProtocol
from nri_accel.nri.stub import (
    NRI_VERSION,
    PLUGIN_SERVICE,
    RUNTIME_SERVICE,
    VALID_EVENTS,
    event_bit,
    length_delimited,
    mask_events,
)
from nri_accel.ttrpc import MAX_MESSAGE_SIZE, CallContext, Code, Endpoint, TtrpcError

NAMESPACE_METADATA = (("containerd-namespace-ttrpc", "k8s.io"),)
LEGACY_EVENTS = event_bit(pb.REMOVE_CONTAINER + 1) - 1
"""Events containerd 1.7's NRI (v0.3-v0.6, Event LAST = 12) knows: 1 to 11."""
MIN_OBJECTS_PER_SYNC = 8

log = get_logger(__name__)


class SimulatorError(Exception):
    """The simulated runtime failed an event: a plugin refused it or plugins conflict."""


class PluginError(SimulatorError):
    """A plugin answered an event with an error status."""

    def __init__(self, plugin: str, method: str, code: Code, message: str) -> None:
        self.plugin, self.method, self.code, self.message = plugin, method, code, message
        super().__init__(f"plugin {plugin} failed {method}: {message}")


class PluginConn:
    """One plugin connected to the simulator."""

    def __init__(self, sim: Simulator, mux: MuxProtocol) -> None:
        self.sim = sim
        self.mux = mux
        self.name = ""
        self.idx = ""
        self.nri_version = ""
        self.events = 0
        self.registered_at: float | None = None  # loop time of RegisterPlugin
        self.ready = asyncio.get_running_loop().create_future()  # configured + synchronised
        self.closed = False
        self.client = Endpoint(mux.sender(PLUGIN_SERVICE_CONN), on_close=mux.close)
        self.server = Endpoint(
            mux.sender(RUNTIME_SERVICE_CONN),
            {RUNTIME_SERVICE: {"RegisterPlugin": self._register}},
            on_close=mux.close,
        )
        mux.attach(PLUGIN_SERVICE_CONN, self.client.data_received, self.client.connection_lost)
        mux.attach(RUNTIME_SERVICE_CONN, self.server.data_received, self.server.connection_lost)

    @property
    def full_name(self) -> str:
        return f"{self.idx}-{self.name}"

    def subscribed(self, event: int) -> bool:
        return bool(self.events & event_bit(event))

    def close(self, reason: str = "") -> None:
        if not self.closed:
            self.closed = True
            if reason:
                log.warning("plugin_dropped", plugin=self.full_name, reason=reason)
                self.sim.dropped.append((self.full_name, reason))
            self.mux.close()
        if not self.ready.done():
            self.ready.set_exception(SimulatorError(f"plugin closed: {reason or 'disconnected'}"))
            self.ready.exception()  # retrieved: nobody may be waiting

    async def call(self, method: str, request: Any, response_type: Any,
                   *, metadata: Sequence[tuple[str, str]] = NAMESPACE_METADATA,
                   timeout: float | None = None) -> Any:
        """Call the plugin's `method` with `request` (a message, or its encoding); a fatal
        failure (timeout, lost connection) drops the plugin, as containerd's NRI does
        (pkg/adaptation: isFatalError); an error the plugin answers with, whatever its
        code (UNAVAILABLE included), fails that call only."""
        payload = request if isinstance(request, bytes) else request.SerializeToString()
        try:
            raw = await self.client.call(
                PLUGIN_SERVICE, method, payload,
                timeout=self.sim.request_timeout if timeout is None else timeout,
                metadata=metadata)
        except TtrpcError as exc:
            if exc.code == Code.DEADLINE_EXCEEDED or self.client.is_closing():
                self.close(f"{method}: {exc.message}")
            raise
        return response_type.FromString(raw)

    def write_raw(self, data: bytes) -> None:
        """Send bytes on the socket as they are (malformed-input tests)."""
        self.mux.write_raw(data)

    # ---- the Runtime service (conn 2) ------------------------------------------------

    async def _register(self, ctx: CallContext, payload: bytes) -> bytes:
        req = pb.RegisterPluginRequest.FromString(payload)
        problem = _check_identity(req.plugin_name, req.plugin_idx)
        if problem:
            self.sim.loop.call_soon(self.close, problem)
            raise TtrpcError(Code.INVALID_ARGUMENT, problem)
        self.name, self.idx, self.nri_version = req.plugin_name, req.plugin_idx, req.NRI_version
        self.registered_at = self.sim.loop.time()
        log.info("plugin_registered", plugin=self.full_name, nri_version=req.NRI_version)
        if self.sim.configure_first:
            await self._setup()
        else:
            self.sim.track(self.sim.loop.create_task(self._setup()))
        return b""

    async def _setup(self) -> None:
        try:
            await self._configure()
            await self._synchronize()
        except (TtrpcError, SimulatorError) as exc:
            self.close(str(exc))
            return
        self.ready.set_result(None)
        self.sim.plugin_ready(self)

    async def _configure(self) -> None:
        sim = self.sim
        req = pb.ConfigureRequest(
            config=sim.plugin_config, runtime_name=sim.runtime_name,
            runtime_version=sim.runtime_version, NRI_version=sim.nri_version,
            registration_timeout=round(sim.registration_timeout * 1000),
            request_timeout=round(sim.request_timeout * 1000))
        rsp = await self.call("Configure", req, pb.ConfigureResponse, metadata=())
        known = sim.known_events
        events = rsp.events or known
        if events & ~known:
            raise SimulatorError(f"invalid plugin events: 0x{events & ~known:x}")
        self.events = events
        log.info("plugin_configured", plugin=self.full_name, events=mask_events(events))

    async def _synchronize(self) -> None:
        # Every pod and container is encoded once, as its SynchronizeRequest field; a
        # chunk is those bytes joined (the message's own encoding, field by field), so
        # re-chunking re-encodes nothing. Building the messages again for each try cost
        # this Python runtime seconds on 60,000 containers, which Go's does not spend.
        pods, ctrs = sync_fields(self.sim.pods.values(), self.sim.containers.values())
        per_pods, per_ctrs = len(pods), len(ctrs)
        deadline = time.monotonic() + self.sim.request_timeout
        while True:
            more = len(pods) > per_pods or len(ctrs) > per_ctrs
            req = sync_part(pods[:per_pods], ctrs[:per_ctrs], more)
            left = max(0.001, deadline - time.monotonic())
            try:
                rsp = await self.call("Synchronize", req, pb.SynchronizeResponse,
                                      metadata=(), timeout=left)
            except TtrpcError as exc:
                if exc.code != Code.RESOURCE_EXHAUSTED:
                    raise
                per_pods, per_ctrs = _smaller_chunks(per_pods, per_ctrs, len(req))
                self.sim.sync_splits += 1
                continue
            if not more:
                return
            if rsp.update or rsp.more != more:
                raise SimulatorError("plugin does not handle split sync requests")
            pods, ctrs = pods[per_pods:], ctrs[per_ctrs:]
            per_pods, per_ctrs = min(per_pods, len(pods)), min(per_ctrs, len(ctrs))


# SynchronizeRequest's fields on the wire: pods (1) and containers (2) length-delimited,
# more (3) a varint.
_SYNC_PODS, _SYNC_CONTAINERS = 1, 2
_SYNC_MORE = bytes([3 << 3, 1])  # field 3, varint: true


def sync_fields(pods: Iterable[pb.PodSandbox], containers: Iterable[pb.Container]
                ) -> tuple[list[bytes], list[bytes]]:
    """Each pod and each container encoded once, as its SynchronizeRequest field."""
    return ([length_delimited(_SYNC_PODS, p.SerializeToString()) for p in pods],
            [length_delimited(_SYNC_CONTAINERS, c.SerializeToString()) for c in containers])


def sync_part(pods: Sequence[bytes], containers: Sequence[bytes], more: bool) -> bytes:
    """A SynchronizeRequest of sync_fields() encodings: the message's own encoding."""
    return b"".join((*pods, *containers, _SYNC_MORE if more else b""))


def _smaller_chunks(pods: int, ctrs: int, size: int) -> tuple[int, int]:
    """The runtime's answer to an oversized Synchronize: scale both counts down."""
    if pods + ctrs <= MIN_OBJECTS_PER_SYNC:
        raise SimulatorError("failed to synchronize plugin with split messages")
    factor = min(MAX_MESSAGE_SIZE / size, 0.9)
    # At least one of a non-empty list per chunk: scaling a single pod down to 0 per
    # chunk would never send it (the Go runtime then loops until its deadline).
    pods, ctrs = max(int(pods * factor), min(pods, 1)), max(int(ctrs * factor), min(ctrs, 1))
    if pods + ctrs < MIN_OBJECTS_PER_SYNC:
        pods = ctrs = MIN_OBJECTS_PER_SYNC // 2
    return pods, ctrs


def _check_identity(name: str, idx: str) -> str:
    if not name or any(not (c.isascii() and (c.isalnum() or c in "-_.+")) for c in name):
        return f"invalid plugin name {name!r}"
    if len(idx) != 2 or not idx.isdigit():
        return f"invalid plugin index {idx!r}, must be 2 digits"
    return ""


class Simulator:
    """The runtime side: listen on `socket_path`, accept and drive NRI plugins.

    Keep `pods` and `containers` (id -> message) filled with what Synchronize should
    report; the event methods keep them current. Create it on the running event loop
    and use it as `async with Simulator(...)`; adopt() serves a plugin it launched.
    """

    def __init__(
        self,
        socket_path: str,
        *,
        runtime_name: str = "nri-accel-simulator",
        runtime_version: str = "v0.1.0",
        nri_version: str = NRI_VERSION,
        registration_timeout: float = 5.0,
        request_timeout: float = 2.0,
        configure_first: bool = False,
        plugin_config: str = "",
        known_events: int = VALID_EVENTS,
    ) -> None:
        self.socket_path = socket_path
        self.runtime_name = runtime_name
        self.runtime_version = runtime_version
        self.nri_version = nri_version
        self.registration_timeout = registration_timeout
        self.request_timeout = request_timeout
        self.configure_first = configure_first
        self.plugin_config = plugin_config
        self.known_events = known_events
        self.pods: dict[str, pb.PodSandbox] = {}
        self.containers: dict[str, pb.Container] = {}
        self.connections: list[PluginConn] = []
        self.sync_splits = 0  # oversized Synchronize attempts that were re-chunked
        self.dropped: list[tuple[str, str]] = []  # (plugin, reason) of plugins it dropped
        self._server: asyncio.AbstractServer | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._changed: asyncio.Condition | None = None
        self.loop = asyncio.get_running_loop()

    # ---- lifecycle -------------------------------------------------------------------

    async def start(self) -> Simulator:
        self._changed = asyncio.Condition()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)
        self._server = await self.loop.create_unix_server(self._accept, self.socket_path)
        log.info("simulator_listening", socket=self.socket_path)
        return self

    async def close(self) -> None:
        """Stop listening, disconnect every plugin and remove the socket (runtime gone)."""
        if self._server is not None:
            self._server.close()
            self._server = None
        connections = list(self.connections)
        for conn in connections:
            conn.close()
        for task in list(self._tasks):
            task.cancel()
        if self._tasks:
            await asyncio.wait(self._tasks)
        for conn in connections:  # their handlers, cancelled when the socket went
            await conn.client.closed()
            await conn.server.closed()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.socket_path)

    async def __aenter__(self) -> Simulator:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def adopt(self, sock: socket.socket) -> PluginConn:
        """Serve a plugin on a connected socket: how the runtime talks to a plugin it
        launched itself (the other end of a socketpair, the plugin's fd 3)."""
        _, mux = await self.loop.create_unix_connection(self._accept, sock=sock)
        return next(c for c in self.connections if c.mux is mux)

    def _accept(self) -> MuxProtocol:
        mux = MuxProtocol(serving=False)  # containerd's reader never stops (mux.py)
        conn = PluginConn(self, mux)
        self.connections.append(conn)
        self.track(self.loop.create_task(self._watch(conn)))
        return mux

    async def _watch(self, conn: PluginConn) -> None:
        """Registration deadline, then forget the plugin when its socket ends."""
        lost = conn.mux.lost
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(asyncio.shield(lost), self.registration_timeout)
        if not lost.done() and conn.registered_at is None:
            conn.close("plugin registration timed out")
        await lost
        conn.close()
        self.connections.remove(conn)
        await self._notify()

    def track(self, task: asyncio.Task[Any]) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def plugin_ready(self, conn: PluginConn) -> None:
        self.track(self.loop.create_task(self._notify()))

    async def _notify(self) -> None:
        assert self._changed is not None
        async with self._changed:
            self._changed.notify_all()

    @property
    def plugins(self) -> list[PluginConn]:
        """Configured, synchronised and connected plugins, in invocation order."""
        ready = [c for c in self.connections
                 if not c.closed and c.ready.done() and not c.ready.exception()]
        return sorted(ready, key=lambda c: (c.idx, c.name))

    async def wait_for(self, predicate: Callable[[Simulator], bool], timeout: float) -> None:
        """Wait until predicate(self) holds (checked whenever plugins come and go)."""
        assert self._changed is not None
        async with asyncio.timeout(timeout), self._changed:
            await self._changed.wait_for(lambda: predicate(self))

    async def wait_for_plugin(self, name: str | None = None, *, timeout: float = 5.0,
                              after: PluginConn | None = None) -> PluginConn:
        """A ready plugin (named `name`, if given; other than `after`, if given)."""

        def find(sim: Simulator) -> bool:
            return any((name is None or c.name == name) and c is not after for c in sim.plugins)

        await self.wait_for(find, timeout)
        return next(c for c in self.plugins if (name is None or c.name == name)
                    and c is not after)

    # ---- events ------------------------------------------------------------------------

    async def run_pod_sandbox(self, pod: pb.PodSandbox) -> None:
        self.pods[pod.id] = pod
        await self._broadcast(pb.RUN_POD_SANDBOX, "RunPodSandbox",
                              pb.RunPodSandboxRequest(pod=pod), pb.RunPodSandboxResponse)

    async def stop_pod_sandbox(self, pod: pb.PodSandbox) -> None:
        await self._broadcast(pb.STOP_POD_SANDBOX, "StopPodSandbox",
                              pb.StopPodSandboxRequest(pod=pod), pb.StopPodSandboxResponse)

    async def remove_pod_sandbox(self, pod: pb.PodSandbox) -> None:
        self.pods.pop(pod.id, None)
        await self._broadcast(pb.REMOVE_POD_SANDBOX, "RemovePodSandbox",
                              pb.RemovePodSandboxRequest(pod=pod), pb.RemovePodSandboxResponse)

    async def create_container(self, pod: pb.PodSandbox,
                               container: pb.Container) -> pb.CreateContainerResponse:
        """CreateContainer through every subscribed plugin; the merged response.

        Raises PluginError when a plugin refuses, SimulatorError on a conflict or a
        validator's rejection; the container is then not created.
        """
        self.pods.setdefault(pod.id, pod)
        req = pb.CreateContainerRequest(pod=pod, container=container)
        merged = pb.CreateContainerResponse()
        owners: dict[tuple[int, str], str] = {}
        consulted = []
        for conn, rsp in await self._broadcast(pb.CREATE_CONTAINER, "CreateContainer", req,
                                               pb.CreateContainerResponse):
            consulted.append(pb.PluginInstance(name=conn.name, index=conn.idx))
            _claim(owners, rsp.adjust, conn.full_name)
            merged.MergeFrom(rsp)
        await self._validate(pod, container, merged, consulted)
        created = pb.Container()
        created.CopyFrom(container)
        created.state = pb.CONTAINER_CREATED
        # the adjusted annotations are the container's from then on (containerd applies
        # them to its spec, and lists them in a later Synchronize); "-key" removes one
        for key, value in merged.adjust.annotations.items():
            if key.startswith("-"):
                created.annotations.pop(key[1:], None)
            else:
                created.annotations[key] = value
        self.containers[container.id] = created
        return merged

    async def _validate(self, pod: pb.PodSandbox, container: pb.Container,
                        merged: pb.CreateContainerResponse,
                        consulted: list[pb.PluginInstance]) -> None:
        req = pb.ValidateContainerAdjustmentRequest(
            pod=pod, container=container, adjust=merged.adjust, update=merged.update,
            plugins=consulted)
        for conn, rsp in await self._broadcast(
                pb.VALIDATE_CONTAINER_ADJUSTMENT, "ValidateContainerAdjustment", req,
                pb.ValidateContainerAdjustmentResponse):
            if rsp.reject:
                raise SimulatorError(f"validator plugin {conn.full_name} rejected the "
                                     f"adjustment: {rsp.reason}")

    async def start_container(self, pod: pb.PodSandbox, container: pb.Container) -> None:
        self._set_state(container, pb.CONTAINER_RUNNING)
        await self._broadcast(pb.START_CONTAINER, "StartContainer",
                              pb.StartContainerRequest(pod=pod, container=container),
                              pb.StartContainerResponse)

    async def update_container(self, pod: pb.PodSandbox, container: pb.Container,
                               resources: pb.LinuxResources) -> list[pb.ContainerUpdate]:
        req = pb.UpdateContainerRequest(pod=pod, container=container, linux_resources=resources)
        updates: list[pb.ContainerUpdate] = []
        for _, rsp in await self._broadcast(pb.UPDATE_CONTAINER, "UpdateContainer", req,
                                            pb.UpdateContainerResponse):
            updates.extend(rsp.update)
        return updates

    async def stop_container(self, pod: pb.PodSandbox,
                             container: pb.Container) -> list[pb.ContainerUpdate]:
        self._set_state(container, pb.CONTAINER_STOPPED)
        updates: list[pb.ContainerUpdate] = []
        for _, rsp in await self._broadcast(pb.STOP_CONTAINER, "StopContainer",
                                            pb.StopContainerRequest(pod=pod, container=container),
                                            pb.StopContainerResponse):
            updates.extend(rsp.update)
        return updates

    async def remove_container(self, pod: pb.PodSandbox, container: pb.Container) -> None:
        self.containers.pop(container.id, None)
        await self._broadcast(pb.REMOVE_CONTAINER, "RemoveContainer",
                              pb.RemoveContainerRequest(pod=pod, container=container),
                              pb.RemoveContainerResponse)

    async def state_change(self, event: int, pod: pb.PodSandbox,
                           container: pb.Container | None = None) -> None:
        """The older notification call, as runtimes before the dedicated RPCs sent it."""
        evt = pb.StateChangeEvent(event=event, pod=pod)
        if container is not None:
            evt.container.CopyFrom(container)
        await self._broadcast(event, "StateChange", evt, pb.Empty)

    async def shutdown(self) -> None:
        """Call Shutdown on every plugin (no subscription needed). The Plugin service
        defines it, but containerd's pkg/adaptation never sends it: on Stop it closes
        its listener and SIGKILLs the plugins it launched, so a plugin must not rely
        on hearing it."""
        for conn in self.plugins:
            with contextlib.suppress(TtrpcError):
                await conn.call("Shutdown", pb.Empty(), pb.Empty)

    def _set_state(self, container: pb.Container, state: int) -> None:
        known = self.containers.get(container.id)
        if known is not None:
            known.state = state

    async def _broadcast(self, event: int, method: str, request: Any,
                         response_type: Any) -> list[tuple[PluginConn, Any]]:
        results = []
        for conn in self.plugins:
            if not conn.subscribed(event):
                continue
            try:
                results.append((conn, await conn.call(method, request, response_type)))
            except TtrpcError as exc:
                if conn.closed:  # fatal for the plugin, not for the event
                    continue
                raise PluginError(conn.full_name, method, exc.code, exc.message) from exc
        return results


# Field (the api.proto enum name the runtime prints) -> the keys an adjustment claims.
_CONFLICT_KINDS = (
    (pb.Annotations, lambda a: a.annotations.keys()),
    (pb.Mounts, lambda a: (m.destination for m in a.mounts)),
    (pb.Env, lambda a: (e.key for e in a.env)),
    (pb.Devices, lambda a: (d.path for d in a.linux.devices)),
    (pb.CdiDevices, lambda a: (d.name for d in a.CDI_devices)),
)


def _claim(owners: dict[tuple[int, str], str], adjust: pb.ContainerAdjustment,
           plugin: str) -> None:
    """Record `plugin` as owner of each key it adjusts; any second claim is a conflict,
    even by the same plugin. The message is the runtime's (api.FieldOwners.Conflict):
    the new claimant first, then the owner, then the Field name and the key."""
    for field, keys in _CONFLICT_KINDS:
        for key in keys(adjust):
            other = owners.get((field, key))
            if other is not None:
                raise SimulatorError(f'plugins "{plugin}" and "{other}" both tried to set '
                                     f"{pb.Field.Name(field)} {key}")
            owners[(field, key)] = plugin


# ---- building pods and containers --------------------------------------------------------

def make_pod(spec: Mapping[str, Any]) -> pb.PodSandbox:
    """A PodSandbox from a protojson-style dict (`name`, `namespace`, `annotations`, ...).

    `id` and `uid` default to values derived from namespace/name, so the same dict
    always gives the same pod.
    """
    pod = json_format.ParseDict(dict(spec), pb.PodSandbox())
    pod.namespace = pod.namespace or "default"
    key = f"{pod.namespace}/{pod.name}"
    pod.id = pod.id or hashlib.sha256(key.encode()).hexdigest()
    pod.uid = pod.uid or str(uuid.uuid5(uuid.NAMESPACE_URL, key))
    return pod


def make_container(pod: pb.PodSandbox, spec: Mapping[str, Any]) -> pb.Container:
    """A Container of `pod` from a protojson-style dict (`name`, `env`, `annotations`, ...)."""
    ctr = json_format.ParseDict(dict(spec), pb.Container())
    ctr.pod_sandbox_id = pod.id
    ctr.id = ctr.id or hashlib.sha256(f"{pod.id}/{ctr.name}".encode()).hexdigest()
    return ctr
