"""Runtimes that bring an NRI plugin into a given connection state, for the fault
matrix (test_fault_matrix.py) and the shutdown figures of bench_roundtrip.py.

Owns: WedgedRuntime (a runtime that hangs at one point of the handshake), STATES and
in_state() (the plugin brought into each state SIGTERM must handle), and
stall_and_pipeline() (a runtime that stops reading and pipelines requests).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from nri_accel.nri import mux
from nri_accel.nri import nri_pb2 as pb
from nri_accel.nri.simulator import PluginConn, Simulator, make_pod
from nri_accel.nri.stub import PLUGIN_SERVICE, RUNTIME_SERVICE
from nri_accel.ttrpc import CallContext, Endpoint, FrameType, encode_frame, ttrpc_pb2

LIVENESS = 20.0
"""Seconds after which a wait counts as hung (what is waited for takes far less)."""


async def until(predicate: Callable[[], bool], what: str) -> None:
    try:
        async with asyncio.timeout(LIVENESS):
            while not predicate():
                await asyncio.sleep(0.01)
    except TimeoutError:
        raise AssertionError(f"not within {LIVENESS} s: {what}") from None


def request_frame(stream_id: int, method: str, payload: bytes = b"") -> bytes:
    """A ttrpc request of the Plugin service, as conn 1 mux frames."""
    envelope = ttrpc_pb2.Request(service=PLUGIN_SERVICE, method=method, payload=payload,
                                 timeout_nano=2_000_000_000).SerializeToString()
    return mux.encode(mux.PLUGIN_SERVICE_CONN,
                      encode_frame(stream_id, FrameType.REQUEST, envelope))


async def stall_and_pipeline(conn: PluginConn, requests: int) -> None:
    """The runtime stops reading and pipelines `requests` requests (of a method the
    plugin does not have: each is answered at once, UNIMPLEMENTED); returns when the
    daemon reads no more (or has read everything, when nothing holds it back)."""
    conn.mux.hold_reading("runtime stalled", True)
    conn.write_raw(b"".join(request_frame(1001 + 2 * i, "NoSuchMethod") for i in range(requests)))
    last = -1
    while conn.mux.write_buffer_size not in (0, last):
        last = conn.mux.write_buffer_size
        await asyncio.sleep(0.3)  # the daemon reads ~10k requests in that time, if it reads


class WedgedRuntime:
    """A runtime that stops at one point of the NRI handshake and keeps the connection
    open: stands for a containerd that hangs there (a deadlock, a stopped process).

    `stops_at`: "register" (never answers RegisterPlugin), "configure" (answers it,
    never sends Configure) or "synchronize" (configures, sends the first chunk of a
    split Synchronize, never the rest). `reads=False`: it never reads at all.
    """

    def __init__(self, path: str, stops_at: str, *, reads: bool = True) -> None:
        self.path = path
        self.stops_at = stops_at
        self.reads = reads
        self.reached = asyncio.Event()  # set when a plugin got to `stops_at`
        self.accepted = 0
        self._server: asyncio.AbstractServer | None = None
        self._muxes: list[mux.MuxProtocol] = []
        self._endpoints: list[Endpoint] = []
        self._tasks: set[asyncio.Task[None]] = set()

    async def __aenter__(self) -> WedgedRuntime:
        loop = asyncio.get_running_loop()
        self._server = await loop.create_unix_server(self._accept, self.path)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        for m in self._muxes:
            m.close()
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for endpoint in self._endpoints:
            await endpoint.closed()
        await self._server.wait_closed()

    def _accept(self) -> mux.MuxProtocol:
        self.accepted += 1
        conn = mux.MuxProtocol(serving=False)
        client = Endpoint(conn.sender(mux.PLUGIN_SERVICE_CONN), on_close=conn.close)
        server = Endpoint(conn.sender(mux.RUNTIME_SERVICE_CONN),
                          {RUNTIME_SERVICE: {"RegisterPlugin": self._register(client)}},
                          on_close=conn.close)
        conn.attach(mux.PLUGIN_SERVICE_CONN, client.data_received, client.connection_lost)
        conn.attach(mux.RUNTIME_SERVICE_CONN, server.data_received, server.connection_lost)
        self._endpoints += (client, server)
        if not self.reads:
            conn.hold_reading("wedged", True)
            self.reached.set()
        self._muxes.append(conn)
        return conn

    def _register(self, client: Endpoint) -> Callable[[CallContext, bytes], Awaitable[bytes]]:
        async def register(ctx: CallContext, payload: bytes) -> bytes:
            if self.stops_at == "register":
                self.reached.set()
                await asyncio.Event().wait()  # never answers
            task = asyncio.get_running_loop().create_task(self._after_register(client))
            self._tasks.add(task)
            return b""

        return register

    async def _after_register(self, client: Endpoint) -> None:
        if self.stops_at == "synchronize":
            await client.call(PLUGIN_SERVICE, "Configure", pb.ConfigureRequest(
                runtime_name="wedged", request_timeout=60_000,
                registration_timeout=60_000).SerializeToString())
            pod = make_pod({"name": "p"})
            first = pb.SynchronizeRequest(pods=[pod], more=True)
            await client.call(PLUGIN_SERVICE, "Synchronize", first.SerializeToString())
        self.reached.set()


STATES = (
    "connecting",  # nothing listens yet: the daemon retries with backoff
    "waiting for the RegisterPlugin answer",
    "waiting for Configure",
    "mid split Synchronize",
    "connected to a runtime that never reads",
    "registered and idle",
    "write buffer full: the runtime stopped reading",
)
WEDGED = {  # state: (stops_at, reads)
    "waiting for the RegisterPlugin answer": ("register", True),
    "waiting for Configure": ("configure", True),
    "mid split Synchronize": ("synchronize", True),
    "connected to a runtime that never reads": ("register", False),
}


@contextlib.asynccontextmanager
async def in_state(state: str, path: str, start: Callable[[], Any],
                   retrying: Callable[[], bool]) -> AsyncIterator[Any]:
    """A runtime at `path` with the plugin `start()` starts brought into `state`;
    yields what start() returned. `retrying()` tells that the plugin has failed to
    connect (it logged runtime_unavailable)."""
    if state == "connecting":
        started = start()
        await until(retrying, "a failed connection attempt")
        yield started
    elif state in WEDGED:
        stops_at, reads = WEDGED[state]
        async with WedgedRuntime(path, stops_at, reads=reads) as runtime:
            started = start()
            await asyncio.wait_for(runtime.reached.wait(), LIVENESS)
            yield started
    else:
        async with Simulator(path) as sim:
            started = start()
            conn = await sim.wait_for_plugin(timeout=LIVENESS)
            if state.startswith("write buffer full"):
                await stall_and_pipeline(conn, 50_000)
                assert conn.mux.write_buffer_size > 0
            yield started
