"""Benchmark of the device plugin's choices: GetPreferredAllocation on large resources.

Run: .venv/bin/python tests/bench/bench_deviceplugin.py [--calls N]
Prints milliseconds per container request of resources.preferred_allocation (median and
max of N calls), as kubelet asks it: every available device ID listed, for a container
of 1, 8, 100 and all-but-one devices. The resources: 8 GPUs of 1,024 time-slicing
replicas each (the most a time-slicing config would advertise: kubelet lists 8,192 IDs),
and 512 GPUs without replicas in NVLink pairs over two NUMA nodes (topology.choose).
The server answers a request's containers one at a time, the event loop free in
between, so the max is the longest the loop is held. Asserts nothing.
"""

from __future__ import annotations

import argparse
import statistics
import time

from nri_accel.deviceplugin.resources import PluginDevice, Resource, preferred_allocation


def replicated(gpus: int, replicas: int) -> Resource:
    """`gpus` GPUs of `replicas` replicas each, named as resources_from_inventory names
    them (GPU-<n>::<replica>), all on NUMA node 0."""
    return Resource("nvidia.com/gpu", tuple(
        PluginDevice(f"GPU-{g}::{r}", f"nvidia.com/gpu=GPU-{g}::{r}", numa_node=0)
        for g in range(gpus) for r in range(replicas)), replicas=replicas)


def paired(gpus: int) -> Resource:
    """`gpus` GPUs in NVLink pairs (0-1, 2-3, ...), half on NUMA node 0, half on 1."""
    return Resource("nvidia.com/gpu", tuple(
        PluginDevice(f"GPU-{g}", f"nvidia.com/gpu=GPU-{g}", numa_node=g * 2 // gpus,
                     links=(f"GPU-{g ^ 1}",)) for g in range(gpus)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=15)
    args = parser.parse_args()
    print("GetPreferredAllocation, milliseconds per container request: median / max of "
          f"{args.calls} calls")
    for name, resource in (("8 GPUs x 1,024 replicas", replicated(8, 1024)),
                           ("512 GPUs, NVLink pairs, 2 NUMA", paired(512))):
        every = [d.id for d in resource.devices]
        cells = []
        for size in (1, 8, 100, len(every) - 1):
            times = []
            for _ in range(args.calls):
                started = time.perf_counter()
                preferred_allocation(resource, every, [], size)
                times.append((time.perf_counter() - started) * 1e3)
            cells.append(f"{size:>5}: {statistics.median(times):6.2f} / {max(times):6.2f}")
        print(f"  {name:32} ({len(every)} IDs)  " + "   ".join(cells))


if __name__ == "__main__":
    main()
