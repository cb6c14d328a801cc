"""Benchmark of metrics recording on the hot path, and of a scrape.

Run: .venv/bin/python tests/bench/bench_metrics.py [--calls N] [--batches N]
Prints nanoseconds per call (median, p90 and best of batches of N calls each; the
loop's own overhead is included, and shown by the first line) and asserts nothing.

- record(): RequestRecorder.record, what a handler calls once per request (a count by
  outcome and a duration observation). Target: a few microseconds at most.
- record_quick(): the same for the containers that ask for nothing, from the event
  loop only, outside the lock.
- for comparison, the same with prometheus_client's own Counter and Histogram: label
  children bound once (inc() + observe()), and .labels() looked up at each call.
- render: one /metrics exposition of the `run` registry (4 events x 3 outcomes, the
  histogram, gauges for 8 GPUs and 7 MIG devices), the CPU a scrape takes in the
  server thread.
- record() while another thread scrapes /metrics over HTTP without pause: the worst
  a scraper can do to the hot path (both need the GIL).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from prometheus_client import CollectorRegistry, Counter, Histogram

from nri_accel.inventory import Inventory
from nri_accel.metrics import (
    DURATION_BUCKETS,
    OK,
    RUN_EVENTS,
    Address,
    RequestRecorder,
    device_counts,
)
from nri_accel.metrics.server import MetricsServer, RunMetrics

TESTS = Path(__file__).resolve().parents[1]
DEMO = TESTS.parent / "nri_accel" / "demo" / "inventory.json"


def per_call(fn: Callable[[], object], calls: int, batches: int) -> tuple[float, float, float]:
    """(median, p90, best) nanoseconds per call over `batches` batches of `calls` calls."""
    for _ in range(calls):  # warm up
        fn()
    out = []
    for _ in range(batches):
        t0 = time.perf_counter_ns()
        for _ in range(calls):
            fn()
        out.append((time.perf_counter_ns() - t0) / calls)
    out.sort()
    return statistics.median(out), out[int(len(out) * 0.9)], out[0]


def row(name: str, figures: tuple[float, float, float], unit: str = "ns") -> None:
    scale = 1000 if unit == "us" else 1
    median, p90, best = (f / scale for f in figures)
    print(f"{name:64} {median:9.1f} {p90:9.1f} {best:9.1f}  {unit}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=10000, help="calls per batch")
    parser.add_argument("--batches", type=int, default=50)
    args = parser.parse_args()
    sys.path.insert(0, str(TESTS))  # metrics_scrape

    from metrics_scrape import get

    from nri_accel.log import configure

    configure(level="warning", file=sys.stderr)
    requests = RequestRecorder.for_events(RUN_EVENTS)
    metrics = RunMetrics(requests)
    inventory = Inventory.load(DEMO)
    metrics.set_devices(device_counts(inventory, [inventory.devices[0].key]))
    recorder = requests["create_container"]
    native = CollectorRegistry()  # prometheus_client's own objects, for comparison
    counter = Counter("requests", "", ("event", "outcome"), registry=native)
    histogram = Histogram("duration_seconds", "", ("event",), buckets=DURATION_BUCKETS,
                          registry=native)
    count_child = counter.labels("create_container", OK)
    duration_child = histogram.labels("create_container")
    n, b = args.calls, args.batches

    def nothing() -> None:
        pass

    print(f"metrics recording, {b} batches of {n} calls; per call"
          f"{'':34} {'median':>9} {'p90':>9} {'best':>9}")
    row("an empty function call (the loop's overhead)", per_call(nothing, n, b))
    row("RequestRecorder.record(OK, 42e-6)  <- the hot-path call",
        per_call(lambda: recorder.record(OK, 42e-6), n, b))
    row("RequestRecorder.record(OK, 1.5)",
        per_call(lambda: recorder.record(OK, 1.5), n, b))
    row("RequestRecorder.record_quick(3_000)  <- a container asking nothing",
        per_call(lambda: recorder.record_quick(3_000), n, b))

    def bound_native(seconds: float) -> None:
        count_child.inc()
        duration_child.observe(seconds)

    def unbound_native(seconds: float) -> None:
        counter.labels("create_container", OK).inc()
        histogram.labels("create_container").observe(seconds)

    row("prometheus_client bound children: inc() + observe(42e-6)",
        per_call(lambda: bound_native(42e-6), n, b))
    row("prometheus_client bound children: inc() + observe(1.5)",
        per_call(lambda: bound_native(1.5), n, b))
    row("prometheus_client .labels() each call: inc() + observe(42e-6)",
        per_call(lambda: unbound_native(42e-6), n, b))
    row("render /metrics (run registry, 15 devices)",
        per_call(lambda: metrics.render(""), max(1, n // 100), b), unit="us")

    async def contended() -> tuple[float, float, float, int]:
        async with MetricsServer(metrics, Address("127.0.0.1", 0),
                                 ready=lambda: None) as server:
            address = str(server.address)
            stop = threading.Event()
            scrapes = [0]

            def scrape_forever() -> None:
                while not stop.is_set():
                    get(address, "/metrics")
                    scrapes[0] += 1

            scraper = threading.Thread(target=scrape_forever)
            scraper.start()
            try:
                figures = per_call(lambda: recorder.record(OK, 42e-6), n, b)
            finally:
                stop.set()
                await asyncio.to_thread(scraper.join)
            return (*figures, scrapes[0])

    *figures, scrapes = asyncio.run(contended())
    row(f"record() while /metrics is scraped non-stop ({scrapes} scrapes)", tuple(figures))


if __name__ == "__main__":
    main()
