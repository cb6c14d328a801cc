"""Prometheus metrics and the liveness/readiness probes of `run` and `device-plugin`.

Owns: the metric names and help texts (RunMetrics, DevicePluginMetrics: a
CollectorRegistry each) and MetricsServer, the HTTP endpoint serving GET /metrics
(Prometheus text format, or OpenMetrics when the scraper asks for it), /healthz and
/readyz. Imports prometheus_client (its only importer: one module per foreign
boundary), asyncio, msgspec and the standard library, nri_accel.errors, nri_accel.log and
nri_accel.metrics (label values, RequestRecorder, Address). Importing it costs
45-90 ms: a process imports it only when metrics are on (see nri_accel.metrics).

Each process object gets its own CollectorRegistry, never prometheus_client's global
one, so that tests can build several and nothing else in the process leaks into the
exposition. The `_created` series prometheus_client adds to every counter and
histogram are switched off (disable_created_metrics, process-wide): they double the
series count and Prometheus' text format has no use for them. The request series
come from the process's RequestRecorders through a custom collector, read at each
scrape; the gauges are prometheus_client's own.

Threads. The HTTP server runs in threads of its own (socketserver's ThreadingMixIn,
stdlib), not on the event loop, for two reasons: a scrape renders the whole registry
(about a millisecond, bench_metrics.py), which must not delay an answer to the
runtime; and liveness has to be judged from outside the loop: a server on a stuck
loop would just not answer, while this one answers 503 and says why. Everything that
reads daemon state runs on the loop: a heartbeat task wakes every `interval`, calls
the verb's `sample()` (which copies state into gauges) and `ready()`, and publishes
an immutable snapshot; the HTTP threads read only that snapshot and the registry. A
client is bounded (it may be any pod where the address is reachable): MAX_CONNECTIONS
at a time, REQUEST_SECONDS and MAX_REQUEST_BYTES each.

- /healthz: 200 while the loop ticks; 503 when the last heartbeat is older than
  `stale_after` (the loop is blocked) or the heartbeat stopped (the loop ended).
- /readyz: 200 when healthy and the last `ready()` returned None; otherwise 503 and
  the reason (`ready()` returns it as a string: "not registered with the runtime").
- /metrics: the registry. Any other path: 404. The endpoints take no input but the
  path and tell device counts and health, nothing secret; they have no
  authentication, so bind the loopback where a local agent scrapes, and an address
  other pods reach (a pod IP, 0.0.0.0) only where a NetworkPolicy or the node's
  firewall limits who connects (DESIGN.md, trust model).

Addresses (nri_accel.metrics.parse_address) are IP literals with a port: host names
are refused, since resolving one at start is a DNS lookup that can hang, and a name
with several addresses leaves which one is bound to chance. Port 0 binds a free port
(tests); MetricsServer.address says which.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import socket
import socketserver
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from http.server import BaseHTTPRequestHandler
from itertools import accumulate
from typing import Any

from msgspec import Struct
from prometheus_client import CollectorRegistry, Counter, Gauge, disable_created_metrics
from prometheus_client.exposition import choose_encoder
from prometheus_client.metrics_core import CounterMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.utils import floatToGoString

from nri_accel.errors import ConfigError
from nri_accel.log import get_logger
from nri_accel.metrics import DURATION_BUCKETS, OUTCOMES, Address, RequestRecorder

__all__ = ["DevicePluginMetrics", "MetricsServer", "RunMetrics"]

_LE = (*map(floatToGoString, DURATION_BUCKETS), "+Inf")

log = get_logger(__name__)


# ---- the metrics ----------------------------------------------------------------------

class _RequestCollector:
    """The request series of a process's RequestRecorders (event -> recorder), built
    at each scrape from one snapshot per recorder (a prometheus_client custom
    collector)."""

    def __init__(self, recorders: Mapping[str, RequestRecorder]) -> None:
        self._recorders = recorders

    def collect(self) -> Iterator[Metric]:
        requests = CounterMetricFamily(
            "nri_accel_requests", "Requests handled, by event and outcome (ok; refused: "
            "the request was bad or cannot be satisfied; error: nri-accel failed).",
            labels=("event", "outcome"))
        duration = HistogramMetricFamily(
            "nri_accel_request_duration_seconds", "Time to answer a request, by event.",
            labels=("event",))
        for event, recorder in list(self._recorders.items()):
            counts, buckets, total = recorder.snapshot()
            for outcome in OUTCOMES:
                requests.add_metric((event, outcome), counts[outcome])
            duration.add_metric((event,), list(zip(_LE, accumulate(buckets), strict=True)),
                                total)
        yield requests
        yield duration


class _Metrics:
    """What both processes export: requests by event and inventory refreshes."""

    def __init__(self, requests: Mapping[str, RequestRecorder]) -> None:
        disable_created_metrics()
        self.registry = CollectorRegistry()
        self.registry.register(_RequestCollector(requests))
        self._refreshes = Counter(
            "nri_accel_inventory_refreshes",
            "Times the node changed and a new inventory replaced the old one.",
            registry=self.registry)

    def inventory_refreshed(self) -> None:
        """A new inventory replaced the old one (Refresher's on_change)."""
        self._refreshes.inc()

    def render(self, accept: str = "") -> tuple[bytes, str]:
        """The exposition for an HTTP Accept header: (body, content type)."""
        encode, content_type = choose_encoder(accept)
        return encode(self.registry), content_type


class RunMetrics(_Metrics):
    """The metrics of `nri-accel run`: requests (the handlers' recorders, one per
    RUN_EVENTS event), devices by state, the runtime link."""

    def __init__(self, requests: Mapping[str, RequestRecorder]) -> None:
        super().__init__(requests)
        self._devices = Gauge(
            "nri_accel_devices", "Devices of the inventory by kind and state (free, held "
            "by a running container, unhealthy).", ("kind", "state"), registry=self.registry)
        self._connected = Gauge(
            "nri_accel_runtime_connected",
            "1 while registered with the container runtime over NRI, else 0.",
            registry=self.registry)
        self._reconnects = Counter(
            "nri_accel_reconnects",
            "Registrations with the runtime after the first (runtime restarts, lost "
            "connections).", registry=self.registry)
        self._device_keys: frozenset[tuple[str, str]] = frozenset()
        self._reconnects_seen = 0

    def set_devices(self, counts: Mapping[tuple[str, str], int]) -> None:
        """Device counts by (kind, state), as nri_accel.metrics.device_counts makes
        them; the series of a kind no longer present are removed."""
        for key, n in counts.items():
            self._devices.labels(*key).set(n)
        for key in self._device_keys - counts.keys():
            self._devices.remove(*key)
        self._device_keys = frozenset(counts)

    def set_runtime(self, *, connected: bool, registrations: int) -> None:
        """The runtime link: connected now, and registrations so far (Stub.registered,
        Stub.registrations); every registration after the first counts a reconnect."""
        self._connected.set(1 if connected else 0)
        reconnects = max(0, registrations - 1)
        if reconnects > self._reconnects_seen:
            self._reconnects.inc(reconnects - self._reconnects_seen)
            self._reconnects_seen = reconnects


class DevicePluginMetrics(_Metrics):
    """The metrics of `nri-accel device-plugin`: requests (one recorder per
    DEVICE_PLUGIN_EVENTS event), kubelet registration, the devices as kubelet is told
    of them, the NRI side it depends on."""

    def __init__(self, requests: Mapping[str, RequestRecorder]) -> None:
        super().__init__(requests)
        self._kubelet = Gauge(
            "nri_accel_kubelet_registered",
            "1 while the resource is registered with kubelet and kubelet watches it (a "
            "ListAndWatch stream is open), else 0.", ("resource",),
            registry=self.registry)
        self._nri = Gauge(
            "nri_accel_nri_plugin_registered",
            "1 while `nri-accel run` on this node is registered with the container "
            "runtime (its state record says so and is fresh), else 0: at 0 the device "
            "plugin fails closed (devices Unhealthy, Allocate refused).",
            registry=self.registry)
        self._advertised = Gauge(
            "nri_accel_advertised_devices",
            "Device IDs advertised to kubelet, by resource and the health ListAndWatch "
            "sends (Healthy, Unhealthy: sick, vanished, or every one while `nri-accel "
            "run` is away).", ("resource", "health"), registry=self.registry)
        self._resources: frozenset[str] = frozenset()
        self._advertised_keys: frozenset[tuple[str, str]] = frozenset()

    def set_advertised(self, counts: Mapping[tuple[str, str], int]) -> None:
        """Device IDs by (resource, health); the series of a resource no longer served
        are removed."""
        for key, n in counts.items():
            self._advertised.labels(*key).set(n)
        for key in self._advertised_keys - counts.keys():
            self._advertised.remove(*key)
        self._advertised_keys = frozenset(counts)

    def set_nri_registered(self, registered: bool) -> None:
        self._nri.set(1 if registered else 0)

    def set_kubelet_registered(self, registered: Mapping[str, bool]) -> None:
        """Registration by resource name; the series of a resource no longer served
        are removed."""
        for resource, yes in registered.items():
            self._kubelet.labels(resource).set(1 if yes else 0)
        for resource in self._resources - registered.keys():
            self._kubelet.remove(resource)
        self._resources = frozenset(registered)


# ---- the HTTP server ------------------------------------------------------------------

class _Probe(Struct, frozen=True):
    """What the last heartbeat saw, published whole for the HTTP threads."""

    beat: float  # clock() at the heartbeat
    not_ready: str | None  # ready()'s reason, None when ready
    stopped: bool = False  # the heartbeat ended: the loop is gone or closing


class MetricsServer:
    """Serves /metrics, /healthz and /readyz for one process (see the module docstring).

    Use `async with MetricsServer(...) as server:` on the running loop, or start()
    there and `await close()`. `ready()` returns None when the process is ready, else
    why not; `sample()` copies the process's state into its gauges. Both run on the
    loop at start and then every `interval` seconds, so they must be quick and must
    not block. `stale_after`: seconds without a heartbeat after which /healthz
    answers 503. `clock` is injectable for tests.
    """

    def __init__(
        self,
        metrics: _Metrics,
        address: Address,
        *,
        ready: Callable[[], str | None],
        sample: Callable[[], None] | None = None,
        interval: float = 1.0,
        stale_after: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 0 < interval < stale_after:
            raise ValueError(f"need 0 < interval ({interval}) < stale_after ({stale_after})")
        self.metrics = metrics
        self._address = address
        self._ready = ready
        self._sample = sample
        self.interval = interval
        self.stale_after = stale_after
        self._clock = clock
        self._probe = _Probe(beat=clock(), not_ready="not started")
        self._server: _HTTPServer | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._sample_error = ""

    @property
    def address(self) -> Address:
        """The address asked for; once started, the one bound (port 0 resolved)."""
        return self._address

    async def __aenter__(self) -> MetricsServer:
        self.start()
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    def start(self) -> None:
        """Bind, take the first sample, serve. Raises ConfigError when the address
        cannot be bound (in use, not an address of this host, a privileged port)."""
        loop = asyncio.get_running_loop()
        server = _bind(self._address, self)
        self._server = server
        self._address = Address(self._address.host, server.server_address[1],
                                self._address.source)
        self._tick()
        threading.Thread(target=server.serve_forever, name=f"metrics {self._address}",
                         daemon=True).start()
        self._heartbeat = loop.create_task(self._beat(), name="metrics heartbeat")
        log.info("metrics_serving", address=str(self._address),
                 paths=["/metrics", "/healthz", "/readyz"])

    async def close(self) -> None:
        """Stop the heartbeat and the server; waits for the serving thread off the loop."""
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._heartbeat
        await asyncio.to_thread(self.shutdown)

    def shutdown(self) -> None:
        """Stop serving and close the socket (blocks until the serving thread has
        stopped, up to half a second). The heartbeat, if its loop still runs, is left
        to close()."""
        server, self._server = self._server, None
        if server is not None:
            server.shutdown()
            server.server_close()

    # ---- on the loop ------------------------------------------------------------------

    async def _beat(self) -> None:
        try:
            while True:
                await asyncio.sleep(self.interval)
                self._tick()
        finally:  # cancelled: close(), or asyncio.run() ending with the loop
            probe = self._probe
            self._probe = _Probe(probe.beat, probe.not_ready, stopped=True)

    def _tick(self) -> None:
        if self._sample is not None:
            try:
                self._sample()
            except Exception as exc:  # gauges go stale; serving and probes go on
                if str(exc) != self._sample_error:  # one line per distinct failure
                    self._sample_error = str(exc)
                    log.exception("metrics_sample_failed", error=str(exc))
            else:
                self._sample_error = ""
        try:
            not_ready = self._ready()
        except Exception as exc:
            not_ready = f"readiness check failed: {exc!r}"
        self._probe = _Probe(beat=self._clock(), not_ready=not_ready)

    # ---- in the HTTP threads ----------------------------------------------------------

    def health(self) -> tuple[int, str]:
        """(HTTP status, text) of /healthz."""
        probe = self._probe
        if probe.stopped:
            return 503, "event loop stopped"
        age = self._clock() - probe.beat
        if age > self.stale_after:
            return 503, f"event loop stalled: no heartbeat for {age:.1f} s"
        return 200, "ok"

    def readiness(self) -> tuple[int, str]:
        """(HTTP status, text) of /readyz."""
        status, text = self.health()
        if status != 200:
            return status, f"not ready: {text}"
        not_ready = self._probe.not_ready
        if not_ready is not None:
            return 503, f"not ready: {not_ready}"
        return 200, "ready"


MAX_CONNECTIONS = 64
"""Connections served at a time; one more is closed at once. A thread each: without a
bound, clients that never finish their request (a byte every few seconds) held a thread
and 6 MiB of buffered header lines each, and 40 of them took the daemon to 277 MiB."""
REQUEST_SECONDS = 5.0
"""How long a connection may take in all (the socket timeout bounds each read only)."""
MAX_REQUEST_BYTES = 16 * 1024
"""What a request may send (its line and headers; the endpoints read nothing else)."""


class _HTTPServer(socketserver.ThreadingMixIn, socketserver.TCPServer):
    """A thread per connection, MAX_CONNECTIONS at a time. Not http.server.HTTPServer,
    whose server_bind does a reverse DNS lookup of the address (socket.getfqdn) that can
    hang at start."""

    daemon_threads = True  # a scrape in progress never holds up the process's exit
    allow_reuse_address = True  # a restart binds again despite TIME_WAIT connections
    allow_reuse_port = False  # never share the port with a second instance, silently

    def __init__(self, address: Address, owner: MetricsServer) -> None:
        self.address_family = address.family
        self.owner = owner
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        super().__init__((address.host, address.port), _Handler)

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self._slots.acquire(blocking=False):
            self.shutdown_request(request)  # over the bound: closed unanswered
            return
        try:
            super().process_request(request, client_address)  # starts its thread
        except BaseException:
            self._slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._slots.release()

    def handle_error(self, request: Any, client_address: Any) -> None:
        log.warning("metrics_request_failed", client=str(client_address[0]),
                    exc_info=True)


class _Bounded:
    """A connection's reader giving at most `limit` bytes in all, then end of file (the
    headers end there: a request that long is answered on what was read)."""

    def __init__(self, raw: Any, limit: int) -> None:
        self._raw, self._left = raw, limit

    def readline(self, size: int = -1) -> bytes:
        n = self._left if size < 0 else min(size, self._left)
        line: bytes = self._raw.readline(n) if n > 0 else b""
        self._left -= len(line)
        return line

    def read(self, size: int = -1) -> bytes:
        n = self._left if size < 0 else min(size, self._left)
        data: bytes = self._raw.read(n) if n > 0 else b""
        self._left -= len(data)
        return data

    def close(self) -> None:
        self._raw.close()


def _bind(address: Address, owner: MetricsServer) -> _HTTPServer:
    try:
        return _HTTPServer(address, owner)
    except OSError as exc:
        hint = (" (is another nri-accel or exporter using it?)"
                if exc.errno == errno.EADDRINUSE else "")
        raise ConfigError(f"cannot listen on {address}: {exc.strerror or exc}{hint}",
                          source=address.source) from exc


class _Handler(BaseHTTPRequestHandler):
    server: _HTTPServer
    server_version = "nri-accel"
    sys_version = ""
    timeout = REQUEST_SECONDS  # for each read; the connection's whole: _expire

    def setup(self) -> None:
        super().setup()
        self.rfile = _Bounded(self.rfile, MAX_REQUEST_BYTES)  # type: ignore[assignment]
        self._deadline = threading.Timer(REQUEST_SECONDS, self._expire)
        self._deadline.daemon = True
        self._deadline.start()

    def finish(self) -> None:
        self._deadline.cancel()
        super().finish()

    def _expire(self) -> None:
        """The connection's time is up: its reads and writes end (EOF, EPIPE)."""
        with contextlib.suppress(OSError):
            self.connection.shutdown(socket.SHUT_RDWR)

    def do_GET(self) -> None:
        self._answer(body=True)

    def do_HEAD(self) -> None:
        self._answer(body=False)

    def _answer(self, *, body: bool) -> None:
        owner = self.server.owner
        path = self.path.partition("?")[0]
        content_type = "text/plain; charset=utf-8"
        if path == "/metrics":
            status = 200
            data, content_type = owner.metrics.render(self.headers.get("Accept", ""))
        else:
            if path == "/healthz":
                status, text = owner.health()
            elif path == "/readyz":
                status, text = owner.readiness()
            else:
                status, text = 404, "not found: /metrics, /healthz or /readyz"
            data = f"{text}\n".encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        if body:
            self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:
        """No access log: probes and scrapes come every few seconds."""
