"""Benchmark of the whole per-container hot path on the 8-GPU demo inventory.

Run: .venv/bin/python tests/bench/bench_hotpath.py [--calls N]
Prints microseconds per container for Engine.plan (request parse -> selection -> edits,
plus the release that follows) and for plan + the NRI ContainerAdjustment built and
serialised, for typical containers: p50, p90 and p99 of single calls (p50 is the figure
least disturbed by other load on the machine). Target: under 100 us per container for
the whole path. No I/O happens inside the timed region; asserts nothing.
The container env is a real CUDA 12.4 image's (tests/bench/bench_request.py).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType

from bench_request import CUDA_ENV

from nri_accel.config import Config, PolicyConfig
from nri_accel.container import ContainerInfo
from nri_accel.engine import Engine
from nri_accel.inventory import Inventory
from nri_accel.nri.adjust import build_adjustment

DEMO = Path(__file__).resolve().parents[2] / "nri_accel" / "demo" / "inventory.json"


def info(cid: str, *, annotations: dict[str, str] | None = None,
         pod_annotations: dict[str, str] | None = None,
         env: tuple[str, ...] = CUDA_ENV, namespace: str = "ml") -> ContainerInfo:
    return ContainerInfo(
        namespace=namespace, pod_name="trainer-0", pod_uid="0f6c1a52-4b1e-4d0a-9c1e",
        container_name="main", container_id=cid,
        pod_annotations=MappingProxyType(pod_annotations or {}),
        container_annotations=MappingProxyType(annotations or {}),
        env=env)


CASES: dict[str, Callable[[str], ContainerInfo]] = {
    "device plugin, 1 GPU, CUDA image env": lambda cid: info(
        cid, annotations={"devices.nri-accel.io": "nvidia.com/gpu=3"}),
    "count of 2 from a trusted pod annotation": lambda cid: info(
        cid, namespace="research", pod_annotations={"devices.nri-accel.io/pod":
                                                    "nvidia.com/gpu: 2"}),
    "MIG device by UUID from env (trusted ns)": lambda cid: info(
        cid, namespace="research",
        env=(*CUDA_ENV[:6], "NVIDIA_VISIBLE_DEVICES=MIG-5b2d7e9a-1f3c-5a8e-9d4b-7c0e2a6f1b98")),
    "no device (CUDA image, untrusted ns)": lambda cid: info(cid, namespace="sandbox"),
}


def measure(fn: Callable[[int], None], calls: int) -> tuple[float, float, float]:
    """(p50, p90, p99) of single calls, in microseconds."""
    for i in range(min(calls, 200)):  # warm up memos and caches
        fn(i)
    samples = []
    for i in range(calls):
        t0 = time.perf_counter_ns()
        fn(i)
        samples.append(time.perf_counter_ns() - t0)
    samples.sort()
    return (statistics.median(samples) / 1e3, samples[int(len(samples) * 0.9)] / 1e3,
            samples[int(len(samples) * 0.99)] / 1e3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=5000)
    args = parser.parse_args()
    inventory = Inventory.load(DEMO)
    config = Config(policy=PolicyConfig("kubernetes", frozenset({"research"})))
    engine = Engine(inventory, config)
    print(f"hot path on the demo inventory ({len(inventory.devices)} devices), "
          f"{args.calls} calls each; microseconds per container")
    print(f"{'case':44} {'stage':22} {'p50':>7} {'p90':>7} {'p99':>7}")
    for name, make in CASES.items():
        infos = [make(f"c{i}") for i in range(args.calls)]

        def plan(i: int, infos: list[ContainerInfo] = infos) -> None:
            engine.plan(infos[i % len(infos)])
            engine.release(infos[i % len(infos)].container_id)

        def plan_and_adjust(i: int, infos: list[ContainerInfo] = infos) -> None:
            p = engine.plan(infos[i % len(infos)])
            build_adjustment(p.edits, p.annotations, p.cdi_devices).SerializeToString()
            engine.release(infos[i % len(infos)].container_id)

        for stage, fn in (("plan (+release)", plan), ("plan + adjustment", plan_and_adjust)):
            p50, p90, p99 = measure(fn, args.calls)
            print(f"{name:44} {stage:22} {p50:7.1f} {p90:7.1f} {p99:7.1f}")


if __name__ == "__main__":
    main()
