"""The kubelet device plugin over grpcio: `nri-accel device-plugin`.

Owns: one gRPC server per resource on a unix socket in the kubelet device-plugin
directory, the one-plugin-per-directory lock, registration with kubelet,
re-registration when kubelet restarts, inventory and health updates streamed to
kubelet, failing closed while the NRI side is away, the refusal of oversized requests,
the health watches' reports, the metrics of the process, clean shutdown. Imports grpc
(nri_accel/deviceplugin is the only package that does) and the generated
deviceplugin_pb2/_grpc, nri_accel.deviceplugin.resources (the pure decisions), app,
config, errors, health (the families' health watches), inventory, log, metrics (the
recorders; its server module only when metrics are on) and state (NriStatus);
nri_accel.discover (the Refresher) lazily, when run with a root.

Protocol (kubelet device plugin API v1beta1): for each resource the plugin serves
DevicePlugin on `<kubelet dir>/nri-accel-<vendor>_<name>.sock`, then calls Register on
`<kubelet dir>/kubelet.sock` (version v1beta1, endpoint = the socket's file name, the
resource name, options); kubelet connects back and keeps a ListAndWatch stream open.
When kubelet restarts it deletes every socket in its directory and creates kubelet.sock
anew: a poll (one stat of kubelet.sock and of each plugin socket per interval) notices
either, serves again on a fresh socket where it was deleted and registers again.
kubelet also loses a stream with kubelet.sock left as it was (a message it could not
receive, a connection that broke: kubernetes#131013) and never connects again by
itself: it disconnects the plugin, whose devices turn Unhealthy and whose capacity goes
after 5 minutes. So a registered resource that has had no ListAndWatch stream open for
WATCH_GRACE (10 s) registers again (`kubelet_not_watching`, with back-off) until
kubelet watches it: a Register kubelet answers but never follows with a stream (one
that came while it still held its client for the resource, which some kubelets keep
instead of connecting anew, until they handle the old stream's end) is made again.

A registration never follows the end of a stream to the same kubelet by less than
REGISTER_SETTLE (1 s): the socket served again where it was removed with kubelet.sock
unchanged, and the first registrations after waiting for the directory lock (the
other plugin's streams just ended). kubelet handles a stream's end in a goroutine of
its own (kubernetes/kubernetes pkg/kubelet/cm/devicemanager/plugin/v1beta1/handler.go,
runClient: once client.go's Run returns, disconnectClient), and what it does then is
keyed by the resource name alone (manager.go, PluginDisconnected: the resource's
endpoint of that moment is marked stopped, its devices Unhealthy). Landing after the
new registration, that teardown disconnects the new client (kubelets that hold one
client per resource: handler.go getClient(name)), or marks the new endpoint stopped
while its stream stays open (kubelets that hold a list per socket path): endpoint.go
then refuses every Allocate and PreStartContainer ("endpoint stopped"), GetCapacity
drops the resource after 5 minutes, and the plugin, watched, would never register
again. The socket keeps its name: a fresh name per registration would not help
(PluginDisconnected ignores the socket), and kubelets that hold one client per
resource refuse a Register naming another socket than the one they hold ("already
registered with a different socket path"). A new kubelet (kubelet.sock recreated)
holds no client: it is registered with at once.

One device plugin per kubelet directory: it holds an exclusive flock on the directory
itself from start to stop (DevicePlugins._lock_directory). A second one (a DaemonSet
rolling update starts the new pod while the old one still terminates) waits for it,
not ready, one log line (`kubelet_dir_busy`, the other's pid where its sockets show
it), and serves as soon as the first exits. A socket found at start is removed only
when no one accepts connections on it (a process that died left it); a live one, of a
process without the lock, is never taken over (serve_failed, retried with backoff).

Requests are bounded before any work (resources.request_size_problem: at most
MAX_CONTAINER_REQUESTS container requests, each naming at most as many IDs as the
resource advertises; INVALID_ARGUMENT), and device IDs are logged truncated
(resources.shown_ids), so no request holds the event loop or floods the log.

Allocate answers only the grant annotation (and CDI device names with
devices.cdi_passthrough, for CDI-family devices): `run` injects everything else, so no
device reaches a container without the NRI side's own checks (holdings, health, trust).
Neither DeviceSpecs nor env are answered: a DeviceSpec makes the runtime add the node
even when `run` is down, outside those checks, and kubelet merges the env of every
resource of a container by key, so a visibility variable from two resources would keep
one resource's devices, which `run` then reads as a narrowing.

Fails closed: `run` records its registration with the runtime in
`<state dir>/nri-plugin.json` (nri_accel.state.NriStatus, written every 2 s). It is
read every poll interval (1 s) and at each GetPreferredAllocation, Allocate and
PreStartContainer, on the event loop: NriStatus.load never blocks (non-blocking open,
regular files only, at most 64 KiB) and never raises. While it is absent, malformed
(anything `run` cannot have written, named in the reason), stale (10 s), from the future
or not registered:
- ListAndWatch reports every device Unhealthy, so kubelet admits no new pod asking for
  one (a pod already admitted keeps its devices: kubelet does not re-Allocate);
- Allocate fails with FAILED_PRECONDITION and the reason (kubelet fails the pod's
  admission: UnexpectedAdmissionError); so does GetPreferredAllocation, which kubelet
  asks just before;
- PreStartContainer fails the same way. The plugin registers with pre_start_required,
  so kubelet calls it for every container start, after pulling the image and right
  before the runtime's CreateContainer (kubelet's GetDeviceRunContainerOptions); a
  failure fails that start (CreateContainerConfigError) and kubelet retries it with
  backoff. This shrinks the window between Allocate and CreateContainer to the time
  between these two calls; only the runtime can close it (README, "Operating it": NRI's
  default validator with required_plugins).
Devices turn Healthy at the first poll that finds `run` registered again.

Health: a device is Unhealthy when the inventory says so (Device.healthy) or its
family's health watch does (Profile.health_monitor: NVIDIA's NVML events, when
[health] enabled and the node has GPUs). Watches run only for a discovered node (--root),
restarted when a refresh changes the family's devices (their marks start over).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import fcntl
import os
import signal
import socket
import stat
import struct
import time
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from typing import TYPE_CHECKING, Any

import grpc

from nri_accel.app import DAEMON, App
from nri_accel.config import Config, unix_socket_path_problem
from nri_accel.deviceplugin import deviceplugin_pb2 as pb2
from nri_accel.deviceplugin import deviceplugin_pb2_grpc as pb2_grpc
from nri_accel.deviceplugin.resources import (
    HEALTHY,
    UNHEALTHY,
    Resource,
    allocate,
    check_healthy,
    preferred_allocation,
    request_size_problem,
    resources_from_inventory,
    shown_ids,
)
from nri_accel.errors import AllocationError, ConfigError, NotFoundError, RequestError
from nri_accel.health import HealthWatches
from nri_accel.inventory import Inventory
from nri_accel.log import get_logger
from nri_accel.metrics import DEVICE_PLUGIN_EVENTS, ERROR, OK, REFUSED, RequestRecorder
from nri_accel.state import NriStatus, prepare_state_dir, state_dir_source

if TYPE_CHECKING:  # importing nri_accel.discover would load every discoverer
    from nri_accel.discover.hostroot import HostRoot
    from nri_accel.discover.watch import Refresher
    from nri_accel.metrics import Address

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
_MAX_RETRY_DELAY = 30.0  # seconds between registration attempts at most
# Seconds a registered resource may go without a ListAndWatch stream before it registers
# again: kubelet opens one right after Register answers.
WATCH_GRACE = 10.0
# Seconds between the end of a resource's stream to a kubelet and its next Register with
# that kubelet: time for kubelet to handle the end first (see the module docstring).
REGISTER_SETTLE = 1.0
# pre_start_required: kubelet calls PreStartContainer before each container start,
# where the plugin fails closed once more (see the module docstring).
_OPTIONS = pb2.DevicePluginOptions(
    pre_start_required=True, get_preferred_allocation_available=True
)

log = get_logger(__name__)

_SocketId = tuple[int, int]  # (inode, ctime in ns): a socket file recreated is a new one


def _socket_id(path: str) -> _SocketId | None:
    """Identity of the unix socket at `path`, None if there is none (symlinks are not)."""
    try:
        st = os.lstat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_ctime_ns) if stat.S_ISSOCK(st.st_mode) else None


def _listener(path: str) -> int | None:
    """Who listens on the unix socket at `path`: its pid (0 when not known: another pid
    namespace, or a full backlog), None when no one does (a socket left by a process
    that died refuses connections; no socket there). One non-blocking connect()."""
    s = socket.socket(socket.AF_UNIX,
                      socket.SOCK_STREAM | socket.SOCK_NONBLOCK | socket.SOCK_CLOEXEC)
    try:
        try:
            s.connect(path)
        except BlockingIOError:  # EAGAIN: listening, its backlog full
            return 0
        except OSError:
            return None
        try:
            creds = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        except OSError:
            return 0
        return struct.unpack("3i", creds)[0]
    finally:
        s.close()


def _device_list(resource: Resource, closed: bool) -> pb2.ListAndWatchResponse:
    out = pb2.ListAndWatchResponse()
    for d in resource.devices:
        healthy = d.healthy and not closed
        dev = out.devices.add(ID=d.id, health=HEALTHY if healthy else UNHEALTHY)
        if d.numa_node is not None:
            dev.topology.nodes.add(ID=d.numa_node)
    return out


_ALLOCATE_STATUS = {NotFoundError: grpc.StatusCode.NOT_FOUND,
                    AllocationError: grpc.StatusCode.FAILED_PRECONDITION}
"""The status of an Allocate refused by resources.allocate(), by its error's type (a
RequestError, over what the NRI side reads: INVALID_ARGUMENT)."""


class _Refused(Exception):
    """A request answered with an error status (recorded as refused)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class _Servicer(pb2_grpc.DevicePluginServicer):
    """The DevicePlugin service of one resource; reads the endpoint's current Resource,
    asks the DevicePlugins whether the NRI side is there, records each request."""

    def __init__(self, endpoint: _Endpoint, plugins: DevicePlugins) -> None:
        self._endpoint = endpoint
        self._plugins = plugins

    async def GetDevicePluginOptions(self, request, context):
        return _OPTIONS

    async def ListAndWatch(self, request, context):
        async for resource, closed in self._endpoint.watch():
            yield _device_list(resource, closed)

    async def GetPreferredAllocation(self, request, context):
        return await self._answer("get_preferred_allocation", context,
                                  self._preferred, request)

    async def Allocate(self, request, context):
        return await self._answer("allocate", context, self._allocate, request)

    async def PreStartContainer(self, request, context):
        return await self._answer("pre_start_container", context, self._pre_start, request)

    async def _answer(self, event: str, context: Any, handler: Any, request: Any) -> Any:
        """await handler(request) (each handler a coroutine function), recorded and with
        a refusal or a defect turned into kubelet's status."""
        started = time.perf_counter()
        recorder = self._plugins.recorders[event]
        try:
            response = await handler(request)
        except _Refused as e:
            recorder.record(REFUSED, time.perf_counter() - started)
            await context.abort(e.code, e.message)
        except Exception as e:  # a defect: kubelet gets a status that says so
            recorder.record(ERROR, time.perf_counter() - started)
            log.exception("request_failed", request=event,
                          resource=self._endpoint.resource.name)
            await context.abort(grpc.StatusCode.INTERNAL, f"nri-accel internal error: {e}")
        recorder.record(OK, time.perf_counter() - started)
        return response

    async def _preferred(self, request: Any) -> pb2.PreferredAllocationResponse:
        resource = self._endpoint.resource
        creqs = request.container_requests
        _check_size("get_preferred_allocation_refused", resource, len(creqs), (
            max(len(c.available_deviceIDs), len(c.must_include_deviceIDs)) for c in creqs))
        # kubelet's Allocate would be refused: its preference is refused first, for the
        # same reason (kubelet fails the pod's admission with either message)
        self._require_nri("get_preferred_allocation_refused", resource.name,
                          [shown_ids(c.must_include_deviceIDs) for c in creqs])
        out = pb2.PreferredAllocationResponse()
        for n, creq in enumerate(creqs):
            if n:  # the event loop free between containers: each can take a few ms
                await asyncio.sleep(0)  # (8 GPUs of 1,024 replicas, all listed: 1-4 ms)
            ids = preferred_allocation(resource, creq.available_deviceIDs,
                                       creq.must_include_deviceIDs, creq.allocation_size)
            out.container_responses.add(deviceIDs=ids)
        return out

    async def _allocate(self, request: Any) -> pb2.AllocateResponse:
        resource = self._endpoint.resource
        creqs = request.container_requests
        _check_size("allocate_refused", resource, len(creqs),
                    (len(c.devices_ids) for c in creqs))
        self._require_nri("allocate_refused", resource.name,
                          [shown_ids(c.devices_ids) for c in creqs])
        out = pb2.AllocateResponse()
        for creq in creqs:
            try:
                grant = allocate(resource, creq.devices_ids)
            except RequestError as e:
                log.warning("allocate_refused", resource=resource.name, error=str(e))
                raise _Refused(_ALLOCATE_STATUS.get(type(e), grpc.StatusCode.INVALID_ARGUMENT),
                               str(e)) from e
            resp = out.container_responses.add()
            resp.annotations.update(grant.annotations)
            for name in grant.cdi_devices:
                resp.cdi_devices.add(name=name)
            log.info("allocated", resource=resource.name,  # at most MAX_VALUE_BYTES
                     devices=grant.annotations[resource.annotation_key],
                     cdi_devices=list(grant.cdi_devices))
        return out

    async def _pre_start(self, request: Any) -> pb2.PreStartContainerResponse:
        resource = self._endpoint.resource
        self._require_nri("pre_start_refused", resource.name, shown_ids(request.devices_ids))
        try:
            for device_id in request.devices_ids:
                check_healthy(resource, device_id)  # sent so since it was allocated
        except AllocationError as e:
            log.warning("pre_start_refused", resource=resource.name, reason=str(e))
            raise _Refused(grpc.StatusCode.FAILED_PRECONDITION, str(e)) from e
        return pb2.PreStartContainerResponse()

    def _require_nri(self, event: str, resource: str, devices: list[Any]) -> None:
        """Refuse (FAILED_PRECONDITION) while the NRI side is away; `devices`, what the
        request names, is logged (shown_ids: truncated)."""
        why = self._plugins.check_nri()
        if why:
            log.warning(event, resource=resource, devices=devices, reason=why)
            raise _Refused(grpc.StatusCode.FAILED_PRECONDITION,
                           f"{resource}: {why}; nri-accel's device plugin fails closed "
                           "until `nri-accel run` is registered with the container runtime "
                           "on this node")


def advertised(resources: Iterable[Resource], nri_down: bool) -> dict[tuple[str, str], int]:
    """(resource, HEALTHY or UNHEALTHY) -> the device IDs ListAndWatch sends so: every
    one Unhealthy while the NRI side is away (the device plugin fails closed)."""
    counts = {}
    for r in resources:
        healthy = 0 if nri_down else sum(d.healthy for d in r.devices)
        counts[r.name, HEALTHY] = healthy
        counts[r.name, UNHEALTHY] = len(r.devices) - healthy
    return counts


def _check_size(event: str, resource: Resource, containers: int, id_counts: Any) -> None:
    """Refuse (INVALID_ARGUMENT, one log line) a request over the limits of
    resources.request_size_problem, before any other work."""
    problem = request_size_problem(resource, containers, id_counts)
    if problem:
        log.warning(event, resource=resource.name, error=problem)
        raise _Refused(grpc.StatusCode.INVALID_ARGUMENT, problem)


class _Endpoint:
    """One resource: its gRPC server, socket and registration state."""

    def __init__(self, resource: Resource, directory: str, plugins: DevicePlugins) -> None:
        self.resource = resource
        self.closed = plugins.nri_down
        self._plugins = plugins
        self.path = os.path.join(directory, resource.endpoint)
        self.registered_with: _SocketId | None = None  # kubelet.sock we registered with
        # Loop time since when no ListAndWatch stream is open (None: one is), looked at
        # while registered (DevicePlugins._check).
        self.unwatched_since: float | None = None
        # (kubelet.sock registered with, loop time) when the last stream ended.
        self.stream_ended: tuple[_SocketId, float] | None = None
        self.failures = 0  # registrations in a row that failed or that kubelet never watched
        self.retry_at = 0.0
        self._server: grpc.aio.Server | None = None
        self._socket: _SocketId | None = None
        self._changed = asyncio.Event()
        self._closed = False
        self._streams = 0  # ListAndWatch streams being served (watch() running)
        self._drained = asyncio.Event()  # set as the last of them ends

    async def start(self) -> None:
        why = unix_socket_path_problem(self.path)
        if why is not None:
            raise ConfigError(f"socket path {self.path!r} {why}", source="--kubelet-dir")
        st = None
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(self.path)
        if st is not None:
            if not stat.S_ISSOCK(st.st_mode):
                raise ConfigError(f"{self.path} exists and is not a socket",
                                  source="--kubelet-dir")
            pid = _listener(self.path)
            if pid is not None:  # a process without the directory lock (an older version)
                raise ConfigError(f"{self.path} is served by another process"
                                  + (f" (pid {pid})" if pid else "") + "; not taken over",
                                  source="--kubelet-dir")
            os.unlink(self.path)  # left by an earlier run that died: no one listens
        server = grpc.aio.server()
        pb2_grpc.add_DevicePluginServicer_to_server(_Servicer(self, self._plugins), server)
        try:
            server.add_insecure_port(f"unix:{self.path}")
        except RuntimeError as e:
            raise ConfigError(f"cannot listen on {self.path}: {e}", source="--kubelet-dir") from e
        await server.start()
        self._server = server
        self._socket = _socket_id(self.path)
        self.registered_with = None
        log.info("serving", resource=self.resource.name, socket=self.path,
                 devices=len(self.resource.devices))

    @property
    def serving(self) -> bool:
        return self._server is not None

    @property
    def watched(self) -> bool:
        """A ListAndWatch stream is open."""
        return self._streams > 0

    def socket_intact(self) -> bool:
        """Serving, and the socket file is still the one this endpoint created."""
        return self._socket is not None and _socket_id(self.path) == self._socket

    async def restart(self) -> None:
        """Serve on a fresh socket; streams of an earlier kubelet are cancelled."""
        await self._stop_server(grace=None)
        self._socket = None
        await self.start()

    def set_resource(self, resource: Resource) -> bool:
        """Swap in a new device list; True (and ListAndWatch re-sends) if it changed."""
        if resource == self.resource:
            return False
        self.resource = resource
        self._notify()
        return True

    def set_closed(self, closed: bool) -> None:
        """Fail closed (every device Unhealthy) or not; ListAndWatch re-sends a change."""
        if closed != self.closed:
            self.closed = closed
            self._notify()

    async def watch(self) -> AsyncIterator[tuple[Resource, bool]]:
        """(resource, closed) now and after each change, until the endpoint is closed.
        gRPC takes the next item once it has sent the one before: a stream ends after
        its last list was sent."""
        sent: tuple[Resource, bool] | None = None
        self._streams += 1
        self.unwatched_since = None
        self.failures = 0  # kubelet watches: the registration worked
        try:
            while True:
                changed = self._changed
                now = (self.resource, self.closed)
                if now != sent:
                    sent = now
                    yield sent
                    continue  # a change, or the close, may have come while it was sent
                if self._closed:
                    return
                await changed.wait()
        finally:
            self._streams -= 1
            if not self._streams:
                self._drained.set()
                self.unwatched_since = asyncio.get_running_loop().time()
                if self.registered_with is not None:
                    self.stream_ended = (self.registered_with, self.unwatched_since)

    async def close(self, grace: float) -> None:
        """End ListAndWatch streams once each has sent the last change (the emptied
        list of a vanished resource, which makes kubelet drop its capacity at once),
        waiting `grace` in all at most, the server's stop included; remove the socket."""
        self._closed = True
        self._notify()
        loop = asyncio.get_running_loop()
        deadline = loop.time() + grace
        if self._streams:
            self._drained.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._drained.wait(), grace)
        await self._stop_server(max(0.0, deadline - loop.time()))
        if self.socket_intact():
            os.unlink(self.path)
        self._socket = None

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _stop_server(self, grace: float | None) -> None:
        if self._server is not None:
            server, self._server = self._server, None
            await server.stop(grace)


class DevicePlugins:
    """Every resource of an Inventory served to kubelet, kept registered, failing closed
    while the NRI side is away (see the module docstring).

    Runs on one asyncio loop: run() until a stop event (or start(), tick() and
    check_nri() every poll interval, stop()), update() with each new Inventory and
    set_health() with each health watch's map. A resource that cannot be served or
    registered is logged and retried with backoff (poll interval doubling up to 30 s);
    the others are not held back by it. `state_dir`: where `run` records its
    registration (default: the config's state_dir). `recorders`: the request recorders
    (DEVICE_PLUGIN_EVENTS) the metrics read.
    """

    def __init__(self, inventory: Inventory, kubelet_dir: str, *, config: Config | None = None,
                 state_dir: str | None = None,
                 recorders: Mapping[str, RequestRecorder] | None = None,
                 poll_interval: float = 1.0, register_timeout: float = 5.0,
                 grace: float = 1.0, watch_grace: float = WATCH_GRACE,
                 settle: float = REGISTER_SETTLE) -> None:
        self._inventory = inventory
        self._dir = os.path.abspath(kubelet_dir)
        self._kubelet_socket = os.path.join(self._dir, KUBELET_SOCKET)
        self._config = config if config is not None else Config()
        self._state_dir = state_dir if state_dir is not None else self._config.state_dir
        self.recorders = (recorders if recorders is not None
                          else RequestRecorder.for_events(DEVICE_PLUGIN_EVENTS))
        self._poll = poll_interval
        self._register_timeout = register_timeout
        self._grace = grace
        self._watch_grace = watch_grace
        self._settle = settle
        self._handoff_at: float | None = None  # loop time the directory lock was taken over
        self._endpoints: dict[str, _Endpoint] = {}
        self._kubelet: _SocketId | None = None
        self._lock = asyncio.Lock()
        self._unhealthy: dict[str, Mapping[str, str]] = {}  # family -> key -> reason
        self._nri_why = "not checked yet"  # why the NRI side is not usable ("": it is)
        self._nri_checked = False  # check_nri() has logged the NRI side's state
        self._started = False
        self._dir_fd: int | None = None  # the kubelet directory, flocked while serving
        self._waiting = False  # for another device plugin to release the directory

    @property
    def resources(self) -> tuple[Resource, ...]:
        return tuple(ep.resource for _, ep in sorted(self._endpoints.items()))

    @property
    def nri_down(self) -> bool:
        """Failing closed: the NRI side was not usable at the last look."""
        return bool(self._nri_why)

    def check_nri(self) -> str:
        """Read the NRI side's record now: why it is not usable, "" when it is. A change
        between usable and not is applied to every resource at once, and logged: one
        line when an outage starts (its reason then: the reason's text changes during
        one, "stopped updating its state 10 s ago", "11 s ago"), one when it ends."""
        status = NriStatus.load(self._state_dir)
        why = status.why_not() if not status.usable() else ""
        if not self._nri_checked or bool(why) != bool(self._nri_why):
            if why:
                log.warning("nri_plugin_unavailable", reason=why, state_dir=self._state_dir,
                            effect="every device Unhealthy; Allocate and PreStartContainer "
                                   "refused")
            else:
                log.info("nri_plugin_available", plugin=status.plugin, runtime=status.runtime,
                         pid=status.pid)
            for ep in self._endpoints.values():
                ep.set_closed(bool(why))
        self._nri_why, self._nri_checked = why, True
        return why

    def registered(self) -> dict[str, bool]:
        """Resource name -> registered with the kubelet now listening, which watches it
        (a ListAndWatch stream is open: kubelet has the resource)."""
        return {name: ep.watched and ep.registered_with is not None
                and ep.registered_with == self._kubelet
                for name, ep in sorted(self._endpoints.items())}

    def ready(self) -> str | None:
        """None when every resource is registered with kubelet, else why not (/readyz)."""
        if self._waiting:
            return f"waiting for another device plugin serving {self._dir} to exit"
        if not self._started:
            return "not started"
        if self._kubelet is None:
            return f"no kubelet listening at {self._kubelet_socket}"
        missing = [name for name, ok in self.registered().items() if not ok]
        if missing:
            return f"not registered with kubelet, or not watched by it: {', '.join(missing)}"
        return None

    async def start(self) -> None:
        if not os.path.isdir(self._dir):
            raise ConfigError(f"{self._dir} is not a directory (is kubelet installed?)",
                              source="--kubelet-dir")
        await self._lock_directory()
        self.check_nri()
        await self.update(self._inventory)
        self._started = True

    async def _lock_directory(self) -> None:
        """Hold an exclusive flock on the kubelet directory itself (no file of its own:
        kubelet deletes every file there when it starts) from start() to stop(): one
        nri-accel device plugin per directory. Two would each delete the other's live
        sockets as stale and serve again, forever. A process holding it (the DaemonSet's
        old pod still terminating during a rolling update, a copy started by hand) is
        waited for without blocking the loop, trying every poll interval: the kernel
        drops its lock when it exits, however it exits, and this one serves at the next
        try. One log line when the wait starts (the other's pid where its sockets tell),
        one when it ends. Where flock does not work, serves with a warning."""
        if self._dir_fd is not None:
            return
        since: float | None = None
        fd = -1
        try:
            fd = os.open(self._dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            while True:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if since is None:
                        since = time.monotonic()
                        self._waiting = True
                        log.warning("kubelet_dir_busy", directory=self._dir,
                                    other_pids=self._other_pids() or "unknown",
                                    effect="another nri-accel device plugin serves this "
                                           "kubelet directory; waiting for it to exit")
                    await asyncio.sleep(self._poll)
        except OSError as e:  # not BlockingIOError: the loop handles that
            if fd >= 0:
                os.close(fd)
            log.warning("kubelet_dir_lock_failed", directory=self._dir,
                        error=e.strerror or str(e), risk="a second device plugin here "
                        "would not be noticed")
            return
        except BaseException:  # cancelled: stopped while waiting
            if fd >= 0:
                os.close(fd)
            raise
        finally:
            self._waiting = False
        self._dir_fd = fd
        if since is not None:
            self._handoff_at = asyncio.get_running_loop().time()
            log.info("kubelet_dir_acquired", directory=self._dir,
                     waited=round(time.monotonic() - since, 1))

    def _other_pids(self) -> list[int]:
        """Pids of the processes listening on nri-accel sockets in the kubelet directory
        (where their pid namespace shows them)."""
        pids = set()
        with contextlib.suppress(OSError):
            for name in os.listdir(self._dir):
                if name.startswith("nri-accel-") and name.endswith(".sock"):
                    pids.add(_listener(os.path.join(self._dir, name)) or 0)
        return sorted(pids - {0})

    async def update(self, inventory: Inventory) -> None:
        """Serve `inventory` from now on: new resources are served and registered,
        changed ones re-sent on ListAndWatch, vanished ones emptied and closed."""
        async with self._lock:
            self._inventory = inventory
            wanted = self._wanted(log_problems=True)
            for name in sorted(set(self._endpoints) - set(wanted)):
                ep = self._endpoints.pop(name)
                ep.set_resource(Resource(name))  # an empty list: kubelet drops capacity now
                await ep.close(self._grace)
                log.info("resource_removed", resource=name)
            for name, resource in wanted.items():
                ep = self._endpoints.get(name)
                if ep is None:
                    self._endpoints[name] = _Endpoint(resource, self._dir, self)  # see _check
                else:
                    self._swap(ep, resource)
            await self._check()

    def set_health(self, family: str, unhealthy: Mapping[str, str]) -> None:
        """The unhealthy devices (Device.key -> reason) `family`'s health watch reports
        now, replacing what it reported before; ListAndWatch re-sends what changed."""
        self._unhealthy[family] = dict(unhealthy)
        wanted = self._wanted(log_problems=False)
        for name, ep in self._endpoints.items():
            if name in wanted:
                self._swap(ep, wanted[name])

    def _wanted(self, *, log_problems: bool) -> dict[str, Resource]:
        unhealthy = {k: why for m in self._unhealthy.values() for k, why in m.items()}
        resources, problems = resources_from_inventory(self._inventory, self._config,
                                                       unhealthy)
        if log_problems:
            for p in problems:
                log.warning("device_not_advertised", device=p.source, reason=p.message)
        return {r.name: r for r in resources}

    @staticmethod
    def _swap(ep: _Endpoint, resource: Resource) -> None:
        if ep.set_resource(resource):
            log.info("devices_changed", resource=resource.name, devices=len(resource.devices),
                     unhealthy=[d.id for d in resource.devices if not d.healthy])

    async def tick(self) -> None:
        """Notice a kubelet restart or a deleted socket; serve and register what needs it."""
        async with self._lock:
            await self._check()

    async def run(self, stop: asyncio.Event) -> None:
        """start(), then tick() and poll the NRI side's record every poll interval
        until `stop` is set, then stop(). Setting `stop` interrupts a registration in
        progress: a kubelet that does not answer never delays shutdown, nor the NRI
        poll, which runs apart."""
        body = asyncio.ensure_future(self._serve_forever())
        stopped = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({body, stopped}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stopped.cancel()
            body.cancel()
            await asyncio.wait({body})
            await self.stop()
        if not body.cancelled() and body.exception() is not None:
            raise body.exception()  # start() failed

    async def _serve_forever(self) -> None:
        await self.start()
        nri = asyncio.ensure_future(self._poll_nri_forever())
        try:
            while True:
                await asyncio.sleep(self._poll)
                await self.tick()
        finally:
            nri.cancel()
            await asyncio.wait({nri})

    async def _poll_nri_forever(self) -> None:
        while True:
            await asyncio.sleep(self._poll)
            try:
                self.check_nri()
            except Exception:  # a defect: keep polling, the state stays as it was
                log.exception("nri_poll_failed")

    async def stop(self) -> None:
        async with self._lock:
            endpoints = [self._endpoints.pop(n) for n in sorted(self._endpoints)]
            await asyncio.gather(*(ep.close(self._grace) for ep in endpoints))
            self._started = False
            if self._dir_fd is not None:  # after the sockets are gone: the next one starts
                os.close(self._dir_fd)
                self._dir_fd = None
            log.info("stopped", resources=[ep.resource.name for ep in endpoints])

    async def _check(self) -> None:
        kubelet = _socket_id(self._kubelet_socket)
        if kubelet != self._kubelet:
            if kubelet is None:
                log.warning("kubelet_absent", socket=self._kubelet_socket)
            elif self._kubelet is not None:
                log.info("kubelet_restarted", socket=self._kubelet_socket)
            self._kubelet = kubelet
            if kubelet is not None:
                # A new kubelet is served and registered with at once, whatever back-off
                # the one before caused: a stopped kubelet leaves kubelet.sock behind
                # (devicemanager plugin/v1beta1 server.go Stop), which every registration
                # tried while the plugin is unwatched fails against.
                for ep in self._endpoints.values():
                    ep.failures, ep.retry_at = 0, 0.0
        now = asyncio.get_running_loop().time()
        to_register = []
        for name in sorted(self._endpoints):
            ep = self._endpoints[name]
            if now < ep.retry_at:
                continue
            if not ep.socket_intact():
                if ep.serving:
                    log.info("socket_removed", resource=name, socket=ep.path)
                try:
                    await ep.restart()
                except ConfigError as e:
                    self._failed(ep, now, "serve_failed", str(e))
                    continue
            if kubelet is None:
                continue
            if ep.registered_with == kubelet and self._unwatched(ep, now):
                continue
            if ep.registered_with != kubelet and not self._settling(ep, kubelet, now):
                to_register.append(ep)
        await asyncio.gather(*(self._register(ep, kubelet, now) for ep in to_register))

    async def _register(self, ep: _Endpoint, kubelet: _SocketId | None, now: float) -> None:
        request = pb2.RegisterRequest(version=API_VERSION, endpoint=ep.resource.endpoint,
                                      resource_name=ep.resource.name, options=_OPTIONS)
        try:
            async with grpc.aio.insecure_channel(f"unix:{self._kubelet_socket}") as channel:
                await pb2_grpc.RegistrationStub(channel).Register(
                    request, timeout=self._register_timeout)
        except grpc.aio.AioRpcError as e:
            self._failed(ep, now, "registration_failed", f"{e.code().name}: {e.details()}")
            return
        ep.registered_with = kubelet
        if not ep.watched:  # kubelet opens its stream right after the answer
            ep.unwatched_since = asyncio.get_running_loop().time()
        log.info("registered", resource=ep.resource.name, endpoint=ep.resource.endpoint)

    def _settling(self, ep: _Endpoint, kubelet: _SocketId, now: float) -> bool:
        """True while kubelet may still be handling the end of a stream of `ep`'s
        resource (its own, or the other plugin's before the directory lock was taken
        over): its Register waits (see the module docstring)."""
        ended = ep.stream_ended
        if ended is not None and ended[0] == kubelet and now - ended[1] < self._settle:
            return True
        return self._handoff_at is not None and now - self._handoff_at < self._settle

    def _unwatched(self, ep: _Endpoint, now: float) -> bool:
        """True, and the registration dropped to be made again after a back-off, when
        kubelet has not watched the registered `ep` for the watch grace (see the module
        docstring)."""
        since = ep.unwatched_since
        if since is None or now - since < self._watch_grace:
            return False
        ep.registered_with = None
        log.warning("kubelet_not_watching", resource=ep.resource.name,
                    seconds=round(now - since, 1), retry_in=self._retry_later(ep, now),
                    effect="kubelet drops a resource whose ListAndWatch stream ended (its "
                           "devices Unhealthy, after 5 minutes gone): registering again")
        return True

    def _failed(self, ep: _Endpoint, now: float, event: str, error: str) -> None:
        log.error(event, resource=ep.resource.name, error=error,
                  retry_in=self._retry_later(ep, now))

    def _retry_later(self, ep: _Endpoint, now: float) -> float:
        """Back off `ep`'s next try (poll interval doubling up to 30 s); the delay."""
        ep.failures += 1
        delay = min(self._poll * 2 ** (ep.failures - 1), _MAX_RETRY_DELAY)
        ep.retry_at = now + delay
        return delay


async def serve(inventory: Inventory, kubelet_dir: str, *, stop: asyncio.Event,
                config: Config | None = None, root: HostRoot | None = None,
                poll_interval: float = 1.0, metrics_address: Address | None = None,
                refresher: Callable[[Callable[[Inventory], Any]], Refresher | None]
                | None = None) -> None:
    """Serve `inventory` to the kubelet at `kubelet_dir` until `stop` is set. With
    `root` (a discovered node), the families' health watches run, and the node is
    watched (discovery.refresh_interval; `refresher(on_change)` builds the Refresher,
    by default one over `root`), each new Inventory served as it comes. With
    `metrics_address`, /metrics, /healthz and /readyz (registered with kubelet) are
    served there."""
    config = config if config is not None else Config()
    recorders = RequestRecorder.for_events(DEVICE_PLUGIN_EVENTS)
    plugins = DevicePlugins(inventory, kubelet_dir, config=config, recorders=recorders,
                            poll_interval=poll_interval)
    health = HealthWatches(root, config, plugins.set_health) if root is not None else None
    metrics = server = None
    if metrics_address is not None:
        from nri_accel.metrics.server import DevicePluginMetrics, MetricsServer

        metrics = DevicePluginMetrics(recorders)

        def sample() -> None:
            metrics.set_kubelet_registered(plugins.registered())
            metrics.set_nri_registered(not plugins.nri_down)
            metrics.set_advertised(advertised(plugins.resources, plugins.nri_down))

        server = MetricsServer(metrics, metrics_address, ready=plugins.ready, sample=sample)

    async def on_change(new: Inventory) -> None:
        if metrics is not None:
            metrics.inventory_refreshed()
        if health is not None:
            await health.update(new)
        await plugins.update(new)

    watcher = None
    if refresher is not None:
        watcher = refresher(on_change)
    elif root is not None:
        from nri_accel.discover.watch import Refresher

        watcher = Refresher(root, config, inventory, on_change)
    tasks = []
    try:
        if server is not None:
            server.start()
        if health is not None:
            await health.update(inventory)
        if watcher is not None:
            tasks.append(asyncio.get_running_loop().create_task(watcher.run()))
        await plugins.run(stop)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if health is not None:
            await health.stop()
        if server is not None:
            await server.close()


def main_device_plugin(args: argparse.Namespace) -> int:
    """`nri-accel device-plugin`: flags --kubelet-dir DIR, --config FILE, --state-dir DIR,
    --metrics-address HOST:PORT, --inventory FILE | --root DIR. Serves until SIGTERM or
    SIGINT, then returns 0."""
    app = App.from_args(args, mode=DAEMON)
    try:
        # absent is fine (`run` creates it); a file there would fail closed forever
        prepare_state_dir(app.config.state_dir, create=False,
                          source=state_dir_source(args.state_dir, app.config.path))
        inventory = app.load_inventory()
        return asyncio.run(_main(app, inventory, args.kubelet_dir))
    finally:
        app.close()


async def _main(app: App, inventory: Inventory, kubelet_dir: str) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    root = None if app.inventory_path is not None else app.host_root()
    await serve(inventory, kubelet_dir, stop=stop, config=app.config, root=root,
                metrics_address=app.metrics_address,
                refresher=lambda on_change: app.refresher(inventory, on_change))
    return 0
