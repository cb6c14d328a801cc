"""Benchmark of topology.choose: the count allocator's choice on inventories of any size.

Run: .venv/bin/python tests/bench/bench_topology.py [--calls N] [--sizes 8 64 ...]
Prints milliseconds per choose() call, median and max of N calls (each call is one
count request served on the event loop), for 8, 64, 256 and 512 devices, each topology
below and counts of 1, 2, n/8, n/2 - 1, n/2 and n - 1. Every device is free except in
the "half busy" rows (a fixed random half, as on a busy node). The max is the figure to
hold against the runtime's 2 s timeout and the few-milliseconds goal. Asserts nothing.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections.abc import Callable

from nri_accel.topology import Topology, choose

# name -> (NUMA node of each of n devices, linked positions of each device)
Shape = Callable[[int], tuple[list[int | None], list[list[int]]]]


def numa_nodes(n: int, nodes: int) -> list[int | None]:
    """Devices split into `nodes` NUMA nodes of consecutive positions."""
    return [i * nodes // n for i in range(n)]


def no_links(nodes: int) -> Shape:
    return lambda n: (numa_nodes(n, nodes), [[] for _ in range(n)])


def pairs(nodes: int) -> Shape:  # NVLink bridges: 0-1, 2-3, ...
    return lambda n: (numa_nodes(n, nodes), [[i ^ 1] if i ^ 1 < n else [] for i in range(n)])


def full_mesh(nodes: int) -> Shape:  # one NVSwitch fabric for every GPU
    return lambda n: (numa_nodes(n, nodes), [list(range(n)) for _ in range(n)])


def islands(size: int, nodes: int) -> Shape:  # one NVSwitch fabric per `size` GPUs
    return lambda n: (numa_nodes(n, nodes),
                      [list(range(i - i % size, min(i - i % size + size, n))) for i in range(n)])


def ring(nodes: int) -> Shape:  # NeuronLink
    return lambda n: (numa_nodes(n, nodes), [[(i + 1) % n] for i in range(n)])


def scattered(degree: int) -> Shape:  # no structure: each device linked to `degree` others
    def build(n: int) -> tuple[list[int | None], list[list[int]]]:
        rng = random.Random(n)
        return numa_nodes(n, 1), [rng.sample(range(n), min(degree // 2, n)) for _ in range(n)]
    return build


SHAPES: list[tuple[str, Shape, bool]] = [  # (name, shape, half busy)
    ("no links, 1 NUMA node", no_links(1), False),
    ("no links, 4 NUMA nodes", no_links(4), False),
    ("NVLink pairs, 2 NUMA nodes", pairs(2), False),
    ("NVLink pairs, 2 NUMA, half busy", pairs(2), True),
    ("NVSwitch full mesh, 1 NUMA node", full_mesh(1), False),
    ("NVSwitch islands of 8, 4 NUMA", islands(8, 4), False),
    ("ring, 1 NUMA node", ring(1), False),
    ("ring, 2 NUMA, half busy", ring(2), True),
    ("scattered links (degree ~6), 1 NUMA", scattered(6), False),
]


def counts(n: int) -> list[int]:
    return [1, 2, max(n // 8, 1), n // 2 - 1, n // 2, n - 1]


def measure(topology: Topology, free: list[int], count: int, calls: int) -> tuple[float, float]:
    """Median and max milliseconds of `calls` calls of choose()."""
    samples = []
    for _ in range(calls):
        start = time.perf_counter_ns()
        choose(topology, free, count)
        samples.append((time.perf_counter_ns() - start) / 1e6)
    return statistics.median(samples), max(samples)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=15)
    parser.add_argument("--sizes", type=int, nargs="+", default=[8, 64, 256, 512])
    args = parser.parse_args()
    print(f"topology.choose, milliseconds per call: median/max of {args.calls} calls")
    print(f"{'n':>4} {'topology':36} " + " ".join(f"{c:>11}" for c in
                                                  ("1", "2", "n/8", "n/2-1", "n/2", "n-1")))
    worst = 0.0
    for n in args.sizes:
        for name, shape, half_busy in SHAPES:
            numa, peers = shape(n)
            topology = Topology.build(numa, peers)
            free = list(range(n))
            if half_busy:
                free = sorted(random.Random(n).sample(free, n // 2))
            cells = []
            for count in counts(n):
                med, most = measure(topology, free, count, args.calls)
                worst = max(worst, most)
                cells.append(f"{med:5.2f}/{most:5.2f}")
            print(f"{n:4} {name:36} " + " ".join(f"{c:>11}" for c in cells))
    print(f"slowest call: {worst:.2f} ms")


if __name__ == "__main__":
    main()
