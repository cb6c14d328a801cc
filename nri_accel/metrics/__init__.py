"""What nri-accel counts, at no import cost: the plain-Python side of its metrics.

Owns: the label values (events, outcomes, device states), the duration buckets,
RequestRecorder (the counts and durations the request handlers record on the hot
path), device_counts, and the address syntax of --metrics-address and [metrics]
address (parse_address, choose_address). Imports the standard library and
nri_accel.errors; nri_accel.inventory for type names only.

The Prometheus side, registries, exposition and the HTTP server with its probes, is
nri_accel.metrics.server, the only importer of prometheus_client. That import costs
45-90 ms (prometheus_client loads http.server, urllib and ssl), so a process imports
the server module only when metrics are on, while its handlers record into
RequestRecorders always: a record() costs well under a microsecond
(tests/bench/bench_metrics.py), and no handler needs an "are metrics on" branch.
"""

from __future__ import annotations

import re
import socket
import threading
from bisect import bisect_left
from collections.abc import Iterable
from dataclasses import dataclass, field
from operator import add
from typing import TYPE_CHECKING

from nri_accel.errors import ConfigError

if TYPE_CHECKING:
    from nri_accel.inventory import Inventory

__all__ = [
    "DEVICE_PLUGIN_EVENTS",
    "DEVICE_STATES",
    "DURATION_BUCKETS",
    "ERROR",
    "FREE",
    "HELD",
    "OK",
    "OUTCOMES",
    "REFUSED",
    "RUN_EVENTS",
    "UNHEALTHY",
    "Address",
    "RequestRecorder",
    "choose_address",
    "device_counts",
    "parse_address",
]

OK, REFUSED, ERROR = "ok", "refused", "error"
OUTCOMES = (OK, REFUSED, ERROR)
"""`outcome` label values. refused: the request was bad or cannot be satisfied
(a RequestError, an AllocationError: the container fails, nri-accel is fine);
error: nri-accel failed (an unexpected exception)."""

FREE, HELD, UNHEALTHY = "free", "held", "unhealthy"
DEVICE_STATES = (FREE, HELD, UNHEALTHY)

RUN_EVENTS = ("synchronize", "create_container", "stop_container", "remove_container")
DEVICE_PLUGIN_EVENTS = ("allocate", "get_preferred_allocation", "pre_start_container")
"""`event` label values each process exports from the start, at zero (a series that
appears only with its first request hides that request from rate())."""

DURATION_BUCKETS = (
    10e-6, 25e-6, 50e-6, 100e-6, 250e-6, 500e-6,
    1e-3, 2.5e-3, 5e-3, 10e-3, 25e-3, 50e-3, 100e-3, 250e-3, 500e-3,
    1.0, 2.0,
)
"""Seconds: 10 us (a StopContainer) .. 2 s (the runtime's default request timeout),
1-2.5-5 per decade. A CreateContainer takes some 50 us (bench_hotpath.py)."""
_BOUNDS_NS = tuple(round(seconds * 1e9) for seconds in DURATION_BUCKETS)


class RequestRecorder:
    """Counts and times the requests of one event: the series of nri_accel_requests_total
    and nri_accel_request_duration_seconds with that `event` label.

    Plain numbers under one lock rather than prometheus_client's Counter and Histogram
    children: record() is one lock, a dict increment and a C bisect, a third or less
    of what a bound Counter child's inc() plus a Histogram child's observe() cost
    (bench_metrics.py prints both), and a scrape reads one consistent snapshot (the
    count, the buckets and the sum of the same observations). Any thread may record;
    the handlers do on the event loop. One thread may also record_quick(), the lock's
    cost saved on the path of most requests."""

    @classmethod
    def for_events(cls, events: Iterable[str]) -> dict[str, RequestRecorder]:
        """A recorder per event, for a process's handlers and then its metrics."""
        return {event: cls() for event in events}

    __slots__ = ("_buckets", "_counts", "_lock", "_quick", "_quick_ns", "_sum")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(OUTCOMES, 0)
        self._buckets = [0] * (len(DURATION_BUCKETS) + 1)  # not cumulative; last: +Inf
        self._sum = 0.0
        self._quick = [0] * len(self._buckets)  # record_quick()'s, outside the lock
        self._quick_ns = 0

    def record(self, outcome: str, seconds: float) -> None:
        """One request of this event ended with `outcome` (OK, REFUSED, ERROR) after
        `seconds`. Raises KeyError for any other outcome, and records nothing then."""
        with self._lock:
            self._counts[outcome] += 1
            self._buckets[bisect_left(DURATION_BUCKETS, seconds)] += 1  # le: upper bound
            self._sum += seconds

    def record_quick(self, nanoseconds: int) -> None:
        """record(OK, nanoseconds / 1e9), by one thread only (the event loop's, for
        the containers that ask for nothing): into counts of its own, outside the lock,
        which snapshot() adds to the rest (40 % of record()'s instructions)."""
        self._quick[bisect_left(_BOUNDS_NS, nanoseconds)] += 1
        self._quick_ns += nanoseconds

    def snapshot(self) -> tuple[dict[str, int], list[int], float]:
        """(counts by outcome, count per bucket, sum of seconds), taken together; of
        record_quick()'s, the counts are copied at once (they add up to their outcome's
        share), their sum may be one request behind or ahead of them."""
        quick, quick_ns = self._quick[:], self._quick_ns
        with self._lock:
            counts, buckets, total = dict(self._counts), list(self._buckets), self._sum
        counts[OK] += sum(quick)
        return counts, list(map(add, buckets, quick)), total + quick_ns / 1e9


def device_counts(inventory: Inventory, held: Iterable[str]) -> dict[tuple[str, str], int]:
    """(kind, state) -> number of devices, for RunMetrics.set_devices. `held`: the keys
    (Device.key) running containers hold exclusively (Holdings.held_keys()). An unhealthy
    device is counted as unhealthy whether held or not. Every kind gets all three
    states, zeros included, so that a state that empties reads 0 rather than vanishing."""
    held = set(held)
    counts: dict[tuple[str, str], int] = {}
    for device in inventory.devices:
        for state in DEVICE_STATES:
            counts.setdefault((device.kind, state), 0)
        state = (UNHEALTHY if not device.healthy
                 else HELD if device.key in held else FREE)
        counts[device.kind, state] += 1
    return dict(sorted(counts.items()))


# ---- addresses ------------------------------------------------------------------------

_PORT_RE = re.compile(r"[0-9]{1,5}")
_EXAMPLES = "e.g. 127.0.0.1:9100, [::1]:9100, 0.0.0.0:9100"


@dataclass(frozen=True, slots=True)
class Address:
    """Where the metrics server listens: an IP literal and a port (0: any free one).
    `source` names where it was given (flag or config key), for error messages."""

    host: str
    port: int
    source: str = field(default="", compare=False)

    @property
    def family(self) -> socket.AddressFamily:
        return socket.AF_INET6 if ":" in self.host else socket.AF_INET

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"


def parse_address(text: str, *, source: str) -> Address:
    """HOST:PORT with HOST an IPv4 address or a bracketed IPv6 address. Raises
    ConfigError naming `source` (the flag or the config key)."""
    host, sep, port = text.strip().rpartition(":")
    if not sep:
        raise ConfigError(f"{text!r} is not HOST:PORT ({_EXAMPLES})", source=source)
    bracketed = host.startswith("[") and host.endswith("]")
    if bracketed:
        host = host[1:-1]
    elif ":" in host:
        raise ConfigError(f"{text!r}: an IPv6 address goes in brackets, as in [::1]:9100",
                          source=source)
    if not host:
        raise ConfigError(f"{text!r} names no host: give the address to listen on "
                          f"(127.0.0.1 for this node only, 0.0.0.0 for every interface)",
                          source=source)
    try:
        import ipaddress  # here: `run` without metrics never needs it

        ip = ipaddress.ip_address(host)
    except ValueError:
        raise ConfigError(f"{host!r} is not an IP address (host names are not resolved; "
                          f"{_EXAMPLES})", source=source) from None
    if bracketed and ip.version != 6:
        raise ConfigError(f"{text!r}: brackets hold an IPv6 address; write {host}:{port}",
                          source=source)
    if not _PORT_RE.fullmatch(port) or int(port) > 65535:
        raise ConfigError(f"{port!r} is not a port number (0 to 65535)", source=source)
    return Address(host, int(port), source)


def choose_address(flag: str | None, configured: str, *, config_path: str = "",
                   ) -> Address | None:
    """The address to serve on: --metrics-address when given (an empty one turns
    metrics off), else [metrics] address, else None (off)."""
    if flag is not None:
        return parse_address(flag, source="--metrics-address") if flag.strip() else None
    if configured:
        key = "metrics.address"
        return parse_address(configured, source=f"{config_path}: {key}" if config_path
                             else key)
    return None
