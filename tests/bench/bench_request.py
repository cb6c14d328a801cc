"""Benchmark of Policy.request_for: annotations and env to a Request, trust policy applied.

Run: .venv/bin/python tests/bench/bench_request.py [--calls N]
Prints microseconds per call (median and best of several rounds) for typical containers;
asserts nothing. The env is a real CUDA 12.4 image's (NVIDIA_REQUIRE_CUDA with 31
alternatives, ~1.3 KB). Parsing is memoised per env and per annotation value; the
"cold" cases give every call a container not seen before: a new pod of a known image
(new env, known NVIDIA_REQUIRE_CUDA) and a new image (nothing known).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

from nri_accel.container import ContainerInfo
from nri_accel.policy import Policy

BRANDS = ("tesla", "unknown", "nvidia", "nvidiartx", "geforce", "geforcertx", "quadro",
          "quadrortx", "titan", "titanrtx")
REQUIRE_CUDA = "cuda>=12.4 " + " ".join(
    f"brand={b},driver>={d},driver<{d + 1}" for d in (470, 525, 535) for b in BRANDS)
CUDA_ENV = (
    "PATH=/usr/local/nvidia/bin:/usr/local/cuda/bin:/usr/local/sbin:/usr/local/bin:"
    "/usr/sbin:/usr/bin:/sbin:/bin",
    "NVARCH=x86_64",
    f"NVIDIA_REQUIRE_CUDA={REQUIRE_CUDA}",
    "NV_CUDA_CUDART_VERSION=12.4.127-1",
    "CUDA_VERSION=12.4.1",
    "LD_LIBRARY_PATH=/usr/local/nvidia/lib:/usr/local/nvidia/lib64",
    "NVIDIA_VISIBLE_DEVICES=all",
    "NVIDIA_DRIVER_CAPABILITIES=compute,utility",
    "NV_CUDA_LIB_VERSION=12.4.1-1",
    "NCCL_VERSION=2.21.5-1",
    "HOSTNAME=trainer-0",
    "KUBERNETES_SERVICE_HOST=10.96.0.1",
    "KUBERNETES_SERVICE_PORT=443",
)
POD_ANNOTATIONS = {
    "kubernetes.io/config.seen": "2024-05-01T10:00:00Z",
    "kubernetes.io/config.source": "api",
    "prometheus.io/scrape": "true",
}
UUID = "GPU-5fd4c5a4-1f2d-9a3b-8c1e-0123456789ab"


def container(*, pod: dict[str, str] | None = None, ctr: dict[str, str] | None = None,
              env: tuple[str, ...] = CUDA_ENV, namespace: str = "ml") -> ContainerInfo:
    return ContainerInfo(namespace, "trainer-0", "6b1c1a6e-0000-4000-8000-000000000001",
                         "main", "c0ffee", {**POD_ANNOTATIONS, **(pod or {})},
                         {"io.kubernetes.container.hash": "1a2b3c", **(ctr or {})}, env)


CASES: list[tuple[str, ContainerInfo, Policy]] = [
    ("k8s: device-plugin annotation + CUDA image env",
     container(ctr={"devices.nri-accel.io": f"nvidia.com/gpu={UUID}"}), Policy()),
    ("k8s: CUDA image env, nothing allocated (note)", container(), Policy()),
    ("k8s: CDI annotation + env narrowing",
     container(ctr={"cdi.k8s.io/nvidia-device-plugin_0": "nvidia.com/gpu=0,nvidia.com/gpu=1"},
               env=(*CUDA_ENV, "NVIDIA_VISIBLE_DEVICES=1")), Policy()),
    ("standalone: CUDA image env (all GPUs)", container(), Policy(mode="standalone")),
    ("standalone: pod annotation, 3 entries",
     container(pod={"devices.nri-accel.io/pod":
                    "nvidia.com/gpu=0-3; aws.amazon.com/neuron: 2; nvidia.com/mig=4:1,4:2"},
               env=("PATH=/usr/bin",)), Policy(mode="standalone")),
    ("standalone: Neuron env range", container(env=("AWS_NEURON_VISIBLE_DEVICES=0-15",)),
     Policy(mode="standalone")),
]


def measure(fn: Callable[[int], object], calls: int, rounds: int = 7) -> tuple[float, float]:
    """Median and best microseconds per call of fn(i) over `rounds` rounds."""
    per_call = []
    for r in range(rounds):
        base = r * calls
        start = time.perf_counter_ns()
        for i in range(base, base + calls):
            fn(i)
        per_call.append((time.perf_counter_ns() - start) / calls / 1000)
    return statistics.median(per_call), min(per_call)


def unseen(calls: int, rounds: int, *, new_image: bool) -> list[ContainerInfo]:
    """One container per call that the memo has not seen."""
    out = []
    for i in range(calls * rounds):
        env = [*CUDA_ENV, f"HOSTNAME=trainer-{i}"]
        if new_image:
            env[2] = f"NVIDIA_REQUIRE_CUDA=cuda>=12.{i} " + REQUIRE_CUDA.partition(" ")[2]
        out.append(container(ctr={"devices.nri-accel.io": f"nvidia.com/gpu=GPU-{i:08d}"},
                             env=tuple(env)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--calls", type=int, default=5000)
    args = ap.parse_args()
    print(f"Policy.request_for, {args.calls} calls x 7 rounds, microseconds per call")
    print(f"{'case':52} {'median':>8} {'best':>8}")
    for name, info, policy in CASES:
        med, best = measure(lambda _, i=info, p=policy: p.request_for(i), args.calls)
        print(f"{name:52} {med:8.1f} {best:8.1f}")
    calls = max(args.calls // 10, 1)
    for name, new_image in (("k8s: cold, new pod of a known image", False),
                            ("k8s: cold, new image", True)):
        infos = unseen(calls, 7, new_image=new_image)
        med, best = measure(lambda i, infos=infos: Policy().request_for(infos[i]), calls)
        print(f"{name:52} {med:8.1f} {best:8.1f}")


if __name__ == "__main__":
    main()
