"""The kubelet device plugin over grpcio: `nri-accel device-plugin`.

Owns: one gRPC server per resource on a unix socket in the kubelet device-plugin
directory, registration with kubelet, re-registration when kubelet restarts, inventory
updates streamed to kubelet, clean shutdown. Imports grpc (nri_accel/deviceplugin is the
only package that does) and the generated deviceplugin_pb2/_grpc, nri_accel.deviceplugin
.resources (the pure decisions), config, errors, inventory, log; nri_accel.discover
(discovery, the Refresher) lazily, when run from the command line or with a root.

Protocol (kubelet device plugin API v1beta1): for each resource the plugin serves
DevicePlugin on `<kubelet dir>/nri-accel-<vendor>_<name>.sock`, then calls Register on
`<kubelet dir>/kubelet.sock` (version v1beta1, endpoint = the socket's file name, the
resource name, options); kubelet connects back and keeps a ListAndWatch stream open.
When kubelet restarts it deletes every socket in its directory and creates kubelet.sock
anew: a poll (one stat of kubelet.sock and of each plugin socket per interval) notices
either, serves again on a fresh socket where it was deleted and registers again.
Allocate answers only the grant annotation (and CDI device names with
devices.cdi_passthrough): the NRI plugin injects everything else.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import stat
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

import grpc

from nri_accel.app import DAEMON, App
from nri_accel.config import Config
from nri_accel.deviceplugin import deviceplugin_pb2 as pb2
from nri_accel.deviceplugin import deviceplugin_pb2_grpc as pb2_grpc
from nri_accel.deviceplugin.resources import (
    HEALTHY,
    UNHEALTHY,
    Resource,
    allocate,
    preferred_allocation,
    resources_from_inventory,
)
from nri_accel.errors import AllocationError, ConfigError
from nri_accel.inventory import Inventory
from nri_accel.log import get_logger

if TYPE_CHECKING:  # importing nri_accel.discover would load every discoverer
    from nri_accel.discover.hostroot import HostRoot

API_VERSION = "v1beta1"
KUBELET_SOCKET = "kubelet.sock"
_SUN_PATH_MAX = 107  # bytes of a unix socket path, without the terminating NUL
_MAX_RETRY_DELAY = 30.0  # seconds between registration attempts at most
_OPTIONS = pb2.DevicePluginOptions(
    pre_start_required=False, get_preferred_allocation_available=True
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


def _device_list(resource: Resource) -> pb2.ListAndWatchResponse:
    out = pb2.ListAndWatchResponse()
    for d in resource.devices:
        dev = out.devices.add(ID=d.id, health=HEALTHY if d.healthy else UNHEALTHY)
        if d.numa_node is not None:
            dev.topology.nodes.add(ID=d.numa_node)
    return out


class _Servicer(pb2_grpc.DevicePluginServicer):
    """The DevicePlugin service of one resource; reads the endpoint's current Resource."""

    def __init__(self, endpoint: _Endpoint) -> None:
        self._endpoint = endpoint

    async def GetDevicePluginOptions(self, request, context):
        return _OPTIONS

    async def ListAndWatch(self, request, context):
        async for resource in self._endpoint.watch():
            yield _device_list(resource)

    async def GetPreferredAllocation(self, request, context):
        resource = self._endpoint.resource
        out = pb2.PreferredAllocationResponse()
        for creq in request.container_requests:
            ids = preferred_allocation(resource, creq.available_deviceIDs,
                                       creq.must_include_deviceIDs, creq.allocation_size)
            out.container_responses.add(deviceIDs=ids)
        return out

    async def Allocate(self, request, context):
        resource = self._endpoint.resource
        out = pb2.AllocateResponse()
        for creq in request.container_requests:
            try:
                grant = allocate(resource, creq.devices_ids)
            except AllocationError as e:
                log.warning("allocate_refused", resource=resource.name, error=str(e))
                await context.abort(grpc.StatusCode.NOT_FOUND, str(e))
            resp = out.container_responses.add()
            resp.annotations.update(grant.annotations)
            for name in grant.cdi_devices:
                resp.cdi_devices.add(name=name)
            log.info("allocated", resource=resource.name,
                     devices=grant.annotations[resource.annotation_key],
                     cdi_devices=list(grant.cdi_devices))
        return out

    async def PreStartContainer(self, request, context):
        return pb2.PreStartContainerResponse()


class _Endpoint:
    """One resource: its gRPC server, socket and registration state."""

    def __init__(self, resource: Resource, directory: str) -> None:
        self.resource = resource
        self.path = os.path.join(directory, resource.endpoint)
        self.registered_with: _SocketId | None = None  # kubelet.sock we registered with
        self.failures = 0
        self.retry_at = 0.0
        self._server: grpc.aio.Server | None = None
        self._socket: _SocketId | None = None
        self._changed = asyncio.Event()
        self._closed = False

    async def start(self) -> None:
        if len(os.fsencode(self.path)) > _SUN_PATH_MAX:
            raise ConfigError(f"socket path {self.path!r} is longer than {_SUN_PATH_MAX} "
                              "bytes, the limit of a unix socket", source="--kubelet-dir")
        st = None
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(self.path)
        if st is not None:
            if not stat.S_ISSOCK(st.st_mode):
                raise ConfigError(f"{self.path} exists and is not a socket",
                                  source="--kubelet-dir")
            os.unlink(self.path)  # left by an earlier run
        server = grpc.aio.server()
        pb2_grpc.add_DevicePluginServicer_to_server(_Servicer(self), server)
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

    async def watch(self) -> AsyncIterator[Resource]:
        """The resource now and after each change, until the endpoint is closed."""
        sent: Resource | None = None
        while True:
            changed = self._changed
            if self.resource != sent:
                sent = self.resource
                yield sent
            if self._closed:
                return
            await changed.wait()

    async def close(self, grace: float) -> None:
        """End ListAndWatch streams (after the last change is sent), stop, remove the socket."""
        self._closed = True
        self._notify()
        await self._stop_server(grace)
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
    """Every resource of an Inventory served to kubelet, kept registered.

    Runs on one asyncio loop: run() until a stop event (or start(), tick() every poll
    interval, stop()), and update() with each new Inventory. A resource that cannot be
    served or registered is logged and retried with backoff (poll interval doubling up
    to 30 s); the others are not held back by it.
    """

    def __init__(self, inventory: Inventory, kubelet_dir: str, *, config: Config | None = None,
                 poll_interval: float = 1.0, register_timeout: float = 5.0,
                 grace: float = 1.0) -> None:
        self._inventory = inventory
        self._dir = os.path.abspath(kubelet_dir)
        self._kubelet_socket = os.path.join(self._dir, KUBELET_SOCKET)
        self._config = config if config is not None else Config()
        self._poll = poll_interval
        self._register_timeout = register_timeout
        self._grace = grace
        self._endpoints: dict[str, _Endpoint] = {}
        self._kubelet: _SocketId | None = None
        self._lock = asyncio.Lock()

    @property
    def resources(self) -> tuple[Resource, ...]:
        return tuple(ep.resource for _, ep in sorted(self._endpoints.items()))

    async def start(self) -> None:
        if not os.path.isdir(self._dir):
            raise ConfigError(f"{self._dir} is not a directory (is kubelet installed?)",
                              source="--kubelet-dir")
        await self.update(self._inventory)

    async def update(self, inventory: Inventory) -> None:
        """Serve `inventory` from now on: new resources are served and registered,
        changed ones re-sent on ListAndWatch, vanished ones emptied and closed."""
        async with self._lock:
            self._inventory = inventory
            resources, problems = resources_from_inventory(inventory, self._config)
            for p in problems:
                log.warning("device_not_advertised", device=p.source, reason=p.message)
            wanted = {r.name: r for r in resources}
            for name in sorted(set(self._endpoints) - set(wanted)):
                ep = self._endpoints.pop(name)
                ep.set_resource(Resource(name))  # an empty list: kubelet drops capacity now
                await ep.close(self._grace)
                log.info("resource_removed", resource=name)
            for name, resource in wanted.items():
                ep = self._endpoints.get(name)
                if ep is None:
                    self._endpoints[name] = _Endpoint(resource, self._dir)  # served by _check
                elif ep.set_resource(resource):
                    log.info("devices_changed", resource=name, devices=len(resource.devices),
                             unhealthy=[d.id for d in resource.devices if not d.healthy])
            await self._check()

    async def tick(self) -> None:
        """Notice a kubelet restart or a deleted socket; serve and register what needs it."""
        async with self._lock:
            await self._check()

    async def run(self, stop: asyncio.Event) -> None:
        """start(), tick() every poll interval until `stop` is set, then stop(). Setting
        `stop` interrupts a registration in progress: a kubelet that does not answer
        never delays shutdown."""
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
        while True:
            await asyncio.sleep(self._poll)
            await self.tick()

    async def stop(self) -> None:
        async with self._lock:
            endpoints = [self._endpoints.pop(n) for n in sorted(self._endpoints)]
            await asyncio.gather(*(ep.close(self._grace) for ep in endpoints))
            log.info("stopped", resources=[ep.resource.name for ep in endpoints])

    async def _check(self) -> None:
        kubelet = _socket_id(self._kubelet_socket)
        if kubelet != self._kubelet:
            if kubelet is None:
                log.warning("kubelet_absent", socket=self._kubelet_socket)
            elif self._kubelet is not None:
                log.info("kubelet_restarted", socket=self._kubelet_socket)
            self._kubelet = kubelet
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
            if kubelet is not None and ep.registered_with != kubelet:
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
        ep.failures = 0
        log.info("registered", resource=ep.resource.name, endpoint=ep.resource.endpoint)

    def _failed(self, ep: _Endpoint, now: float, event: str, error: str) -> None:
        ep.failures += 1
        delay = min(self._poll * 2 ** (ep.failures - 1), _MAX_RETRY_DELAY)
        ep.retry_at = now + delay
        log.error(event, resource=ep.resource.name, error=error, retry_in=delay)


async def serve(inventory: Inventory, kubelet_dir: str, *, stop: asyncio.Event,
                config: Config | None = None, root: HostRoot | None = None,
                poll_interval: float = 1.0) -> None:
    """Serve `inventory` to the kubelet at `kubelet_dir` until `stop` is set. With
    `root`, the node is watched (discovery.refresh_interval) and each new Inventory
    served as it comes."""
    config = config if config is not None else Config()
    plugins = DevicePlugins(inventory, kubelet_dir, config=config, poll_interval=poll_interval)
    refresh = None
    if root is not None:
        from nri_accel.discover.watch import Refresher

        refresher = Refresher(root, config, inventory, plugins.update)
        refresh = asyncio.get_running_loop().create_task(refresher.run())
    try:
        await plugins.run(stop)
    finally:
        if refresh is not None:
            refresh.cancel()
            await asyncio.wait({refresh})


def main_device_plugin(args: argparse.Namespace) -> int:
    """`nri-accel device-plugin`: flags --kubelet-dir DIR, --config FILE, --state-dir DIR,
    --metrics-address HOST:PORT, --inventory FILE | --root DIR. Serves until SIGTERM or
    SIGINT, then returns 0."""
    app = App.from_args(args, mode=DAEMON)
    inventory = app.load_inventory()
    root = None if args.inventory else app.host_root()
    return asyncio.run(_main(inventory, args.kubelet_dir, app.config, root))


async def _main(inventory: Inventory, kubelet_dir: str, config: Config,
                root: HostRoot | None) -> int:
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    await serve(inventory, kubelet_dir, stop=stop, config=config, root=root)
    return 0
