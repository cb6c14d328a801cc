"""A fake kubelet: stands for kubelet's device manager (pkg/kubelet/cm/devicemanager).

What it does, as kubelet does (plugin/v1beta1/server.go, handler.go, client.go):
- start(): removes every socket in the device-plugin directory, then serves the
  Registration service on `<dir>/kubelet.sock` (a real grpcio server);
- Register: refuses a version other than v1beta1 or a resource name without a domain,
  then connects back to `<dir>/<endpoint>`, calls GetDevicePluginOptions and keeps a
  ListAndWatch stream open in a thread, recording every device list it receives and
  when the stream ends;
- restart(): stops, deletes every socket in the directory (the plugins' too) and
  starts again, with a new kubelet.sock.
What it does not do: admission, allocation bookkeeping, checkpoints, calling Allocate
(tests call the plugin with `client()`, as kubelet's Allocate path would).
`refuse_next` makes the next registrations fail with a status, to test retries.
drop() ends a plugin's stream as kubelet does when it loses one (a message it could
not receive, a broken connection: client.go's Run returns, handler.go's runClient
disconnects the client), and never connects again by itself. With `keeps_clients`,
it holds its client for a resource as the kubelets that deduplicate registrations do
(handler.go connectClient: a Register naming the socket of a client it holds is
answered and does nothing), until `forget_delay` seconds after that client's stream
ended (the time runClient takes to get to the disconnect).
With `disconnects_by_resource`, it hands a stream's end on as manager.go's
PluginDisconnected does, by resource name alone, `forget_delay` seconds after it: the
resource's newest connection then (the one a later Register made, if any) is marked
`stopped`, as the endpoint kubelet refuses Allocate and PreStartContainer on
(endpoint.go: "endpoint stopped"), its stream left open (the kubelets holding a list of
clients per socket path: handler.go registerClient appends, runClient disconnects the
old client, found by its socket path).
"""

from __future__ import annotations

import os
import stat
import threading
import time
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from typing import Any

import grpc

from nri_accel.deviceplugin import deviceplugin_pb2 as pb2
from nri_accel.deviceplugin import deviceplugin_pb2_grpc as pb2_grpc

WAIT = 10.0  # seconds a wait_* helper waits before failing the test
POLL = 0.02  # seconds between two looks of wait_for at its predicate


@dataclass
class PluginConnection:
    """What the fake kubelet saw of one registration."""

    request: pb2.RegisterRequest
    options: pb2.DevicePluginOptions | None = None
    lists: list[pb2.ListAndWatchResponse] = field(default_factory=list)
    ended: bool = False  # the ListAndWatch stream finished or failed
    stopped: bool = False  # PluginDisconnected marked it (see disconnects_by_resource)
    channel: grpc.Channel | None = None


class FakeKubelet(pb2_grpc.RegistrationServicer):
    """Stands for kubelet's device manager: its Registration server on kubelet.sock and
    its ListAndWatch client of each registered plugin (see the module docstring)."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self.socket = os.path.join(directory, "kubelet.sock")
        self.connections: list[PluginConnection] = []
        self.refuse_next: list[grpc.StatusCode] = []
        self.keeps_clients = False
        self.forget_delay = 0.0
        self.disconnects_by_resource = False
        self.registers = 0  # Register calls answered, those that did nothing included
        self._clients: dict[str, PluginConnection] = {}  # resource -> the one held
        self._server: grpc.Server | None = None
        self._stopping = False  # set while stop() runs: late Register calls are dropped
        self._cond = threading.Condition()
        self._threads: list[threading.Thread] = []

    # ---- lifecycle ---------------------------------------------------------------

    def start(self) -> None:
        self._remove_sockets()
        with self._cond:
            self._stopping = False
            self._clients.clear()  # a kubelet starts holding no plugin client
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
        pb2_grpc.add_RegistrationServicer_to_server(self, server)
        server.add_insecure_port(f"unix:{self.socket}")
        server.start()
        self._server = server

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._server is not None:
            self._server.stop(None).wait()
            self._server = None
        with self._cond:
            conns = list(self.connections)
        for c in conns:
            if c.channel is not None:
                c.channel.close()
        for t in self._threads:
            t.join(WAIT)

    def restart(self) -> None:
        self.stop()
        self.start()

    def _remove_sockets(self) -> None:
        for name in os.listdir(self.directory):
            path = os.path.join(self.directory, name)
            if stat.S_ISSOCK(os.lstat(path).st_mode):
                os.unlink(path)

    # ---- Registration service ----------------------------------------------------

    def Register(self, request, context):
        with self._cond:
            if self.refuse_next:
                code = self.refuse_next.pop(0)
                context.abort(code, f"refused by the fake kubelet ({code.name})")
        if request.version != "v1beta1":
            context.abort(grpc.StatusCode.UNKNOWN, f"unsupported version {request.version!r}")
        if "/" not in request.resource_name:
            context.abort(grpc.StatusCode.UNKNOWN, f"invalid resource {request.resource_name!r}")
        with self._cond:
            held = self._clients.get(request.resource_name)
            if self.keeps_clients and held is not None \
                    and held.request.endpoint == request.endpoint:
                self.registers += 1
                self._cond.notify_all()
                return pb2.Empty()
        conn = PluginConnection(request=request)
        channel = grpc.insecure_channel(f"unix:{os.path.join(self.directory, request.endpoint)}")
        conn.channel = channel
        stub = pb2_grpc.DevicePluginStub(channel)
        try:
            conn.options = stub.GetDevicePluginOptions(pb2.Empty(), timeout=WAIT)
        except grpc.RpcError as e:
            context.abort(grpc.StatusCode.UNKNOWN, f"cannot connect to plugin: {e.details()}")
        stream = stub.ListAndWatch(pb2.Empty())
        t = threading.Thread(target=self._watch, args=(conn, stream), daemon=True)
        with self._cond:
            if self._stopping:  # stop() has already closed the others: close this one too
                channel.close()
                context.abort(grpc.StatusCode.UNAVAILABLE, "kubelet is stopping")
            t.start()
            self.registers += 1
            self._clients[request.resource_name] = conn
            self.connections.append(conn)
            self._threads.append(t)
            self._cond.notify_all()
        return pb2.Empty()

    def _watch(self, conn: PluginConnection, stream: Any) -> None:
        try:
            for response in stream:
                with self._cond:
                    conn.lists.append(response)
                    self._cond.notify_all()
        except grpc.RpcError:
            pass
        with self._cond:
            conn.ended = True
            self._cond.notify_all()
        with self._cond:
            self._cond.wait_for(lambda: self._stopping, self.forget_delay)
            newest = self._clients.get(conn.request.resource_name)
            if self.disconnects_by_resource and newest is not None and not self._stopping:
                newest.stopped = True
                self._cond.notify_all()
            if newest is conn:
                del self._clients[conn.request.resource_name]

    def drop(self, conn: PluginConnection) -> None:
        """End `conn`'s ListAndWatch stream as kubelet does when it loses one (see the
        module docstring)."""
        assert conn.channel is not None
        conn.channel.close()
        self.wait_for(lambda: conn.ended, f"{conn.request.resource_name}'s stream to end")

    # ---- what tests look at ------------------------------------------------------

    def wait_for(self, predicate: Callable[[], Any], what: str, *,
                 timeout: float = WAIT, fail: bool = True) -> Any:
        """predicate()'s first true value, looked at whenever the fake kubelet records
        something and every POLL seconds (a predicate may look at the plugin's own
        state, which tells the fake kubelet nothing); after `timeout` seconds
        AssertionError, or None when not `fail`."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                value = predicate()
                if value:
                    return value
                left = deadline - time.monotonic()
                if left <= 0:
                    if not fail:
                        return None
                    raise AssertionError(f"fake kubelet: timed out waiting for {what}")
                self._cond.wait(min(left, POLL))

    def registrations(self, resource: str) -> list[PluginConnection]:
        with self._cond:
            return [c for c in self.connections if c.request.resource_name == resource]

    def wait_registered(self, resource: str, count: int = 1) -> PluginConnection:
        conns = self.wait_for(lambda: len(self.registrations(resource)) >= count and
                              self.registrations(resource), f"{resource} registration #{count}")
        return conns[count - 1]

    def wait_list(self, conn: PluginConnection,
                  predicate: Callable[[pb2.ListAndWatchResponse], bool] = lambda r: True,
                  what: str = "a device list", *, after: pb2.ListAndWatchResponse | None = None,
                  timeout: float = WAIT, fail: bool = True) -> pb2.ListAndWatchResponse | None:
        """The latest device list `predicate` accepts (only among those received after
        the list `after`, when given), waiting for one (see wait_for)."""
        def found():
            lists = conn.lists
            if after is not None:
                lists = lists[next(i for i, r in enumerate(lists) if r is after) + 1:]
            return next((r for r in reversed(lists) if predicate(r)), None)

        return self.wait_for(found, f"{conn.request.resource_name}: {what}",
                             timeout=timeout, fail=fail)

    def client(self, endpoint: str) -> tuple[grpc.Channel, pb2_grpc.DevicePluginStub]:
        channel = grpc.insecure_channel(f"unix:{os.path.join(self.directory, endpoint)}")
        return channel, pb2_grpc.DevicePluginStub(channel)
