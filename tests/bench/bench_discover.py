"""Benchmark of NVIDIA discovery (discover_nvidia) on the 8-GPU fake node.

Run (as root: the fake root has device nodes): .venv/bin/python tests/bench/bench_discover.py
[--rounds N]. Prints milliseconds (first call, median, p90, best) and asserts nothing.

discover_nvidia on tests/fakes/roots/a100-mig (8x A100, 7 MIG devices, NVSwitch links,
~120 driver files) through the real pynvml and the fake libnvidia-ml: every call loads
the library, inits, queries, shuts NVML down, lstats every node and resolves every file.
The first call includes dlopen of the library. Target: under 50 ms. The whole discover()
and Inventory.load are in bench_inventory.py, which reuses measure() and report().
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path


def measure(fn: Callable[[], object], rounds: int) -> list[float]:
    out = []
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        out.append((time.perf_counter() - t) * 1000)
    return out


def report(name: str, first: float, times: list[float]) -> None:
    times = sorted(times)
    p90 = times[min(len(times) - 1, int(len(times) * 0.9))]
    print(f"{name:<44} first {first:7.2f} ms   median {statistics.median(times):7.2f} ms   "
          f"p90 {p90:7.2f} ms   best {times[0]:7.2f} ms   (n={len(times)})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=50)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the fakes

    from fakes.roots import materialise

    from nri_accel.log import configure
    from nri_accel.vendors.nvidia.discover import discover_nvidia

    configure(level="warning", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="bench-discover-") as tmp:
        root = materialise("a100-mig", Path(tmp) / "node")
        first = measure(lambda: discover_nvidia(root), 1)[0]
        found = discover_nvidia(root)
        report(f"discover_nvidia a100-mig ({len(found.devices)} devices)", first,
               measure(lambda: discover_nvidia(root), args.rounds))


if __name__ == "__main__":
    main()
